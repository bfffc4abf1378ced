"""Preemption (``trainer/preemption.py``): SIGTERM, SIGINT or ``checkpoint_on_signal`` stop ``rallyrl
train`` at its next safe point with a checkpoint and exit 75, and ``--resume`` then ends with the
weights of a run never stopped; a second signal stops at once; SIGTERM makes ``rallyrl rollout``
keep its finished trajectories as Ctrl-C does.

The fast tests run the trainer in this process on a tiny model and send the signal from inside a
phase; the slow ones run real ``rallyrl train`` processes, sent the signal while the test hook
``RALLYRL_TEST_PAUSE_AT`` holds them in the phase (mid-rollout, mid-update, mid-checkpoint, during a
weight sync to a real ``rallyrl serve``), and ``--resume`` them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path
from urllib.request import urlopen

import orjson
import pytest
import torch
import yaml
from safetensors.torch import load_file

from data.schema import Record
from data.tiny_model import EMBEDDED_MODEL
from rollout.runner import RolloutRunner
from rollout.serve.processes import free_port, serve_processes
from tests.conftest import ScriptedEngine, call, run_cli
from tests.servers import rallyrl_command
from tests.test_grpo import config, digit_share, run
from tests.test_interrupt_resume import interruptible, wait_for
from trainer.config import GRPOConfig
from trainer.distributed import make_accelerator
from trainer.grpo import GRPOTrainer
from trainer.preemption import PREEMPTED_EXIT_CODE, Abandoned, Preempted, Preemption, sigterm_as_ctrl_c

# ----- in this process -------------------------------------------------------------------------------


def test_checkpoint_on_signal_takes_a_signal_name_and_refuses_what_cannot_be_caught():
    assert GRPOConfig(checkpoint_on_signal="usr1").checkpoint_on_signal == "SIGUSR1"
    assert GRPOConfig(checkpoint_on_signal="SIGHUP").checkpoint_on_signal == "SIGHUP"
    with pytest.raises(ValueError, match="SIGKILL cannot be caught"):
        GRPOConfig(checkpoint_on_signal="KILL")
    with pytest.raises(ValueError, match="no signal 'SIGNOPE'"):
        GRPOConfig(checkpoint_on_signal="SIGNOPE")


async def test_a_signal_mid_rollout_cancels_its_requests_and_releases_every_tool(chat, tool):
    def script(turn: int, prompt: str, rid: str) -> str:
        return call("echo", text="x", sleep=30) if turn == 0 else "done"

    runner = RolloutRunner(ScriptedEngine(chat, script), chat, {"echo": tool}, progress=False)
    records = [Record(prompt=[{"role": "user", "content": f"q {i}"}], data_source="test") for i in range(6)]
    before = signal.getsignal(signal.SIGTERM)

    async def signal_once_all_are_in_their_tool_call() -> None:
        while tool.in_flight < 6:
            await asyncio.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    with Preemption(make_accelerator()) as preemption:
        sender = asyncio.create_task(signal_once_all_are_in_their_tool_call())
        with pytest.raises(Abandoned):
            await preemption.abandonable("rollout", runner.run(records))
        await sender
    assert tool.created == tool.released == 6
    assert preemption.stopped and preemption.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) == before  # handed back on the way out


async def test_the_first_signal_again_at_once_is_the_same_one_and_another_stops_at_once(monkeypatch):
    stops = []  # (instead of the process dying)
    monkeypatch.setattr(os, "kill", lambda pid, signum: stops.append(signum))
    monkeypatch.setattr(os, "_exit", lambda status: stops.append(status))
    with Preemption(make_accelerator(), "SIGUSR1") as preemption:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)  # as a launcher passes on what the process got itself
        assert stops == [] and preemption.signum == signal.SIGTERM
        signal.raise_signal(signal.SIGUSR1)
        assert stops == [signal.SIGUSR1, 128 + signal.SIGUSR1]


def test_sigterm_inside_sigterm_as_ctrl_c_is_a_ctrl_c_with_its_own_exit_code():
    async def main() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(30)

    with sigterm_as_ctrl_c() as terminated, pytest.raises(KeyboardInterrupt):
        asyncio.run(main())
    assert terminated.exit_code == 128 + signal.SIGTERM == 143


def signal_in(trainer: GRPOTrainer, step: int):
    """A reward function that sends SIGTERM to this process at its first call in ``step`` (1-based),
    i.e. mid-rollout: the other requests of the step are still generating."""
    sent = []

    def reward(request) -> float:
        if trainer.state.step == step - 1 and not sent:
            sent.append(os.kill(os.getpid(), signal.SIGTERM))
        return digit_share(request)

    return reward


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_model_dir):
    """Two steps never stopped: their metrics and final weights (sync, and async with max_staleness 0)."""
    runs = {}
    for name, settings in {"sync": {}, "async": {"async_rl": True, "max_staleness": 0}}.items():
        trainer = GRPOTrainer(config(tmp_path_factory.mktemp(name), tiny_model_dir, steps=2, **settings),
                              reward_fn=digit_share)  # fmt: skip
        runs[name] = run(trainer), trainer.policy_state_dict()
    return runs


def resume_and_compare(tmp_path: Path, model_dir: Path, straight, **settings) -> list[dict]:
    resumed = GRPOTrainer(config(tmp_path, model_dir, steps=2, **settings), reward_fn=digit_share)
    history = run(resumed, resume=True)
    metrics, weights = straight
    assert [m["step"] for m in history] == [1, 2]
    assert metrics[1]["train/grad_norm"] > 1e-3
    for key in ("train/loss", "train/grad_norm", "train/tokens", "rollout/reward_mean"):
        assert history[1][key] == pytest.approx(metrics[1][key], rel=1e-5, abs=1e-7), key
    mine = resumed.policy_state_dict()
    assert all(torch.allclose(weights[k], mine[k], atol=1e-6) for k in weights)
    return history


@pytest.mark.parametrize(("mode", "step"), [("sync", 2), ("async", 2), ("sync", 1)])
def test_a_signal_mid_rollout_checkpoints_the_last_step_and_resume_redoes_the_rollout(
    tmp_path, tiny_model_dir, straight, mode, step
):
    settings = {"checkpoint_every": 0, **({"async_rl": True, "max_staleness": 0} if mode == "async" else {})}
    trainer = GRPOTrainer(config(tmp_path, tiny_model_dir, steps=2, **settings))
    trainer.reward_fn = signal_in(trainer, step)
    done = step - 1
    with pytest.raises(Preempted, match=f"preempted by SIGTERM at step {done}: checkpoint in .*step-00000{done}; --"):
        run(trainer)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"step-00000{done}"]  # written for the signal
    assert not (tmp_path / "run" / "final").exists()
    state = orjson.loads((checkpoints / f"step-00000{done}" / "trainer_state.json").read_bytes())
    if mode == "async":  # the step's groups were not consumed: they are rolled out again
        assert state["streams"] == [{"mark": 2 * done, "consumed": []}]
    else:
        assert state["data_position"] == 2 * done
    resume_and_compare(tmp_path, tiny_model_dir, straight[mode], **settings)


@pytest.mark.parametrize("checkpoint_every", [0, 1])
def test_a_signal_mid_update_lets_the_step_finish_then_checkpoints_it_once(
    tmp_path, tiny_model_dir, straight, monkeypatch, checkpoint_every
):
    trainer = GRPOTrainer(config(tmp_path, tiny_model_dir, steps=2, checkpoint_every=checkpoint_every),
                          reward_fn=digit_share)  # fmt: skip
    update, save, saved = trainer.update, trainer.save_checkpoint, []

    def signalled_update(samples):
        os.kill(os.getpid(), signal.SIGTERM)
        return update(samples)

    monkeypatch.setattr(trainer, "update", signalled_update)
    monkeypatch.setattr(trainer, "save_checkpoint", lambda: saved.append(save()))
    with pytest.raises(Preempted) as stop:
        run(trainer)
    assert stop.value.step == 1 and len(saved) == 1  # due (checkpoint_every 1), or written for the signal
    assert steps_logged(tmp_path / "run") == [1]
    resume_and_compare(tmp_path, tiny_model_dir, straight["sync"], checkpoint_every=checkpoint_every)


# ----- real processes --------------------------------------------------------------------------------

TRAIN = {"prompts_per_step": 2, "samples_per_prompt": 4, "steps": 2, "filter_groups": False, "progress": False}
ASYNC = {"async_rl": True, "max_staleness": 0}  # (0: the groups a step trains are rolled out on its own weights)


def write_config(tmp_path: Path, name: str, **settings) -> tuple[Path, Path]:
    """A run's config file and its run directory."""
    run_dir, path = tmp_path / name, tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**TRAIN, "out": str(run_dir), **settings}))
    return path, run_dir


def preempt(config_path: Path, pause_at: str, *flags: str, check=None, signals: tuple[int, ...] = (signal.SIGTERM,),
            launcher: tuple[str, ...] = (), processes: int = 1) -> tuple[int, str]:  # fmt: skip
    """Run ``rallyrl train`` (under ``launcher``, with ``processes`` processes) held by the test hook at
    ``pause_at`` (``phase:step``), call ``check()`` there, send ``signals`` (with a launcher: to it and
    to its processes, as SLURM signals every process of a job); its exit status and everything it
    said on stderr."""
    train = [*(launcher or rallyrl_command()), "train", "--config", str(config_path), *flags]
    env = {**os.environ, "RALLYRL_TEST_PAUSE_AT": pause_at, **({"OMP_NUM_THREADS": "1"} if launcher else {})}
    process = subprocess.Popen(train, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, preexec_fn=interruptible, env=env)  # fmt: skip
    phase, step = pause_at.split(":")
    said = []
    try:
        for line in process.stderr:  # until every process says it is paused there (their lines may mix)
            said.append(line)
            if (processes := processes - line.count(f"test pause: {phase} of step {step}")) <= 0:
                break
        else:
            raise AssertionError(f"exited ({process.wait()}) before pausing at {pause_at}:\n{''.join(said)}")
        if check is not None:
            check()
        for signum in signals:
            for pid in [process.pid, *(children(process.pid) if launcher else [])]:
                os.kill(pid, signum)
        _, rest = process.communicate(timeout=300)
    finally:
        if process.poll() is None:  # (a failed check: not left paused)
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode, "".join(said) + rest


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from ``/proc``)."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            stat = (entry / "stat").read_text()
            if entry.name.isdigit() and int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def assert_preempted(status: int, said: str, run_dir: Path, step: int, signal_name: str = "SIGTERM") -> None:
    assert status == PREEMPTED_EXIT_CODE, said[-3000:]
    checkpoint = run_dir / "checkpoints" / f"step-{step:06d}"
    assert f"preempted by {signal_name} at step {step}: checkpoint in {checkpoint}; --resume continues" in said
    assert "Traceback" not in said
    assert (checkpoint / "trainer_state.json").is_file()
    assert not list(checkpoint.parent.glob("*.partial"))
    assert not (run_dir / "final").exists()


def resume(config_path: Path, *flags: str) -> str:
    resumed = run_cli("train", "--config", str(config_path), "--resume", *flags, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return resumed.stderr


def steps_logged(run_dir: Path) -> list[int]:
    return [orjson.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def assert_same_final_weights(run_dir: Path, baseline: Path) -> None:
    """``final/`` of ``run_dir`` is that of ``baseline`` (to the resume tests' precision), which trained."""
    mine, theirs = (load_file(d / "final" / "model.safetensors") for d in (run_dir, baseline))
    assert mine.keys() == theirs.keys()
    assert all(torch.allclose(mine[k], theirs[k], atol=1e-6) for k in theirs)
    assert all(m["train/grad_norm"] > 0 for m in map(orjson.loads, (baseline / "metrics.jsonl").read_bytes().split()))


def baseline_run(tmp_path: Path, *flags: str, **settings) -> Path:
    config_path, run_dir = write_config(tmp_path, "baseline", **settings)
    done = run_cli("train", "--config", str(config_path), *flags, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def never_stopped(tmp_path_factory):
    """The run directory of a run never stopped, by mode (sync, async), made at its first use."""
    made: dict[str, Path] = {}

    def baseline(mode: str) -> Path:
        if mode not in made:
            made[mode] = baseline_run(tmp_path_factory.mktemp(mode), **(ASYNC if mode == "async" else {}))
        return made[mode]

    return baseline


@pytest.mark.slow
def test_sigterm_mid_rollout_writes_the_last_steps_checkpoint_and_resume_redoes_the_rollout(tmp_path, never_stopped):
    config_path, run_dir = write_config(tmp_path, "run", checkpoint_every=0)
    status, said = preempt(config_path, "rollout:2")
    assert_preempted(status, said, run_dir, 1)
    assert checkpoints(run_dir) == ["step-000001"] and steps_logged(run_dir) == [1]
    resume(config_path)
    assert steps_logged(run_dir) == [1, 2]
    assert_same_final_weights(run_dir, never_stopped("sync"))


@pytest.mark.slow
def test_sigterm_mid_update_finishes_the_step_whose_checkpoint_is_then_the_only_one(tmp_path, never_stopped):
    config_path, run_dir = write_config(tmp_path, "run", checkpoint_every=1)
    status, said = preempt(config_path, "update:1")
    assert_preempted(status, said, run_dir, 1)
    assert checkpoints(run_dir) == ["step-000001"] and steps_logged(run_dir) == [1]
    resume(config_path)
    assert_same_final_weights(run_dir, never_stopped("sync"))


@pytest.mark.slow
def test_sigterm_mid_checkpoint_lets_it_finish_and_writes_no_other(tmp_path, never_stopped):
    config_path, run_dir = write_config(tmp_path, "run", checkpoint_every=1)
    partial = run_dir / "checkpoints" / "step-000001.partial"

    def being_written() -> None:
        assert partial.is_dir() and not partial.with_name("step-000001").exists()

    status, said = preempt(config_path, "checkpoint:1", check=being_written)
    assert_preempted(status, said, run_dir, 1)
    assert checkpoints(run_dir) == ["step-000001"]
    resume(config_path)
    assert_same_final_weights(run_dir, never_stopped("sync"))


@pytest.mark.slow
def test_sigterm_during_a_weight_sync_to_a_server_then_resume_ends_as_a_run_never_stopped(tmp_path):
    with serve_processes(EMBEDDED_MODEL, tmp_path, 1, "--weights-dir", str(tmp_path)) as (server,):
        flags = ("--engine-url", server.url, "--weight-sync", "disk")
        baseline = baseline_run(tmp_path, *flags)
        config_path, run_dir = write_config(tmp_path, "run", checkpoint_every=0)
        status, said = preempt(config_path, "sync:1", *flags)
        assert_preempted(status, said, run_dir, 1)
        resume(config_path, *flags)
        served = orjson.loads(urlopen(f"{server.url}/get_model_info", timeout=30).read())["weight_version"]
    assert served == "2"
    assert [m["sync/weight_version"] for m in map(orjson.loads, (run_dir / "metrics.jsonl").read_bytes().split())] \
        == [1, 2]  # fmt: skip
    assert_same_final_weights(run_dir, baseline)


@pytest.mark.slow
def test_sigterm_to_async_training_stops_taking_groups_and_resume_ends_as_a_run_never_stopped(tmp_path, never_stopped):
    config_path, run_dir = write_config(tmp_path, "run", checkpoint_every=0, **ASYNC)
    status, said = preempt(config_path, "wait:2")
    assert_preempted(status, said, run_dir, 1)
    (stream,) = orjson.loads((run_dir / "checkpoints" / "step-000001" / "trainer_state.json").read_bytes())["streams"]
    assert stream == {"mark": 2, "consumed": []}  # step 1's prompts; none of those step 2 had taken
    resume(config_path)
    assert steps_logged(run_dir) == [1, 2]
    assert_same_final_weights(run_dir, never_stopped("async"))


@pytest.mark.slow
def test_a_second_signal_stops_at_once_and_resume_takes_the_last_complete_checkpoint(tmp_path, never_stopped):
    config_path, run_dir = write_config(tmp_path, "run", checkpoint_every=1)
    status, said = preempt(config_path, "checkpoint:2", "--checkpoint-on-signal", "SIGUSR1",
                           signals=(signal.SIGUSR1, signal.SIGTERM))  # fmt: skip
    assert status in (-signal.SIGUSR1, -signal.SIGTERM), said[-3000:]  # killed by the second, as it was sent
    assert "a second signal, stopping at once" in said and "preempted by" not in said
    assert checkpoints(run_dir) == ["step-000001", "step-000002.partial"]
    said = resume(config_path)
    assert f"resumed from {run_dir / 'checkpoints' / 'step-000001'} (step 1)" in said
    assert_same_final_weights(run_dir, never_stopped("sync"))


@pytest.mark.slow
def test_sigterm_to_accelerate_launch_stops_every_process_at_the_same_step(tmp_path):
    config_path, run_dir = write_config(tmp_path, "run", checkpoint_every=0)
    accelerate = shutil.which("accelerate")
    assert accelerate is not None, "the accelerate command is not installed"
    launcher = (accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                "--main_process_port", str(free_port()), "--mixed_precision", "no", "--dynamo_backend", "no",
                str(Path(__file__).resolve().parents[1] / "cli.py"))  # fmt: skip
    status, said = preempt(config_path, "update:1", launcher=launcher, processes=2)  # each: SIGTERM, and relayed
    assert status != 0  # (torchrun's own status: its SignalException, after the processes exited)
    checkpoint = run_dir / "checkpoints" / "step-000001"
    assert said.count(f"preempted by SIGTERM at step 1: checkpoint in {checkpoint}; --resume continues") == 1
    assert "a second signal" not in said
    assert checkpoints(run_dir) == ["step-000001"] and steps_logged(run_dir) == [1]
    assert orjson.loads((checkpoint / "trainer_state.json").read_bytes())["step"] == 1


@pytest.mark.slow
def test_sigterm_to_rollout_keeps_the_finished_trajectories_as_ctrl_c_does(tmp_path):
    out = tmp_path / "rollouts.jsonl"
    command = [*rallyrl_command(), "rollout", "--num-prompts", "16", "-n", "4", "--max-concurrency", "4",
               "--max-turns", "3", "--max-new-tokens", "96", "--no-progress", "--out", str(out)]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: out.exists() and out.read_bytes().count(b"\n") >= 4, 120, "trajectories")
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr[-3000:]
    finished = out.read_bytes().count(b"\n")
    assert f"interrupted: {finished} of 64 trajectories finished and are in {out}" in stderr
    assert 4 <= finished < 64
    assert run_cli("check", str(out)).returncode == 0
