"""Accelerate's experiment trackers (``log_with``): each step's metrics also go to TensorBoard, Weights &
Biases, trackio or MLflow, every one writing under the run directory (``out``), none reaching the network.

- tensorboard: ``tensorboard/rallyrl/events.out.tfevents.*`` (``tensorboard --logdir runs/``);
- wandb: ``wandb/offline-run-*/run-*.wandb``, offline (``wandb sync out/wandb/offline-run-*`` uploads it);
- trackio: ``trackio/rallyrl.db`` (``TRACKIO_DIR=out/trackio trackio show``);
- mlflow: ``mlruns/``, MLflow's file store (``mlflow ui --backend-store-uri out/mlruns``).

What keeps them local is set here, in the process, before each is started: ``WANDB_MODE=offline``;
MLflow's tracking URI set to the file store (``MLFLOW_ALLOW_FILE_STORE``: MLflow 3 keeps that backend in
maintenance mode) and its telemetry off; ``TRACKIO_DIR`` under ``out`` and trackio's Space, server,
dataset, bucket and webhook variables removed. Only numbers are logged (NaN and null left out), at the
metrics' ``step``; the resolved config is the run's hyperparameters. Nothing heavy is imported here
until a tracker is wanted (the config classes import ``LogWith``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import numbers
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

Tracker = Literal["none", "tensorboard", "wandb", "trackio", "mlflow"]
LogWith = Tracker | list[Tracker]
PROJECT = "rallyrl"
"""The project (TensorBoard's folder, the W&B and trackio project, the MLflow experiment); the run is
named after ``out``'s last folder."""
TRACKIO_REMOTE = ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "TRACKIO_DATASET_ID", "TRACKIO_BUCKET_ID",
                  "TRACKIO_WEBHOOK_URL")  # fmt: skip
WHERE = {"tensorboard": f"tensorboard/{PROJECT}", "wandb": "wandb (offline)", "trackio": f"trackio/{PROJECT}.db",
         "mlflow": "mlruns"}  # fmt: skip


def tracker_names(log_with: LogWith) -> list[str]:
    """The trackers asked for, in order, without repeats and without ``none``."""
    names = [log_with] if isinstance(log_with, str) else list(log_with)
    return list(dict.fromkeys(name for name in names if name != "none"))


def accelerator_options(log_with: LogWith, out: str | Path) -> dict[str, Any]:
    """``Accelerator(**...)``'s ``log_with`` and ``project_config`` (TensorBoard's folder) for the run;
    {} without trackers. A ValueError names a tracker whose package is not installed."""
    names = tracker_names(log_with)
    if not names:
        return {}
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"log_with: {', '.join(missing)} is not installed: pip install 'rallyrl[trackers]' "
                         f"(or {' '.join(missing)})")  # fmt: skip
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS
    from accelerate.utils import ProjectConfiguration

    if unknown := [name for name in names if name not in LOGGER_TYPE_TO_CLASS]:
        raise ValueError(f"log_with: this Accelerate has no {', '.join(unknown)} tracker (1.16 has all four): "
                         "pip install -U accelerate")  # fmt: skip
    out = Path(out)
    return {"log_with": names, "project_config": ProjectConfiguration(str(out), str(out / "tensorboard"))}


def keep_local(names: list[str], out: Path) -> list[str]:
    """Set what keeps ``names`` off the network and under ``out``; notes for the console."""
    notes = []
    if "wandb" in names:
        os.environ["WANDB_MODE"] = "offline"
        os.environ["WANDB_SILENT"] = "true"
        os.environ["WANDB_CONSOLE"] = "off"  # (its capture of stdout and stderr: the console is ours)
    if "mlflow" in names:
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
        os.environ["MLFLOW_TRACKING_URI"] = (out / "mlruns").resolve().as_uri()
        import mlflow

        mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])  # (over one set earlier in this process)
    if "trackio" in names:
        for variable in TRACKIO_REMOTE:
            os.environ.pop(variable, None)
        os.environ["TRACKIO_DIR"] = str((out / "trackio").resolve())
        bound = getattr(sys.modules.get("trackio.utils"), "TRACKIO_DIR", None)  # read once, at its import
        if bound is not None and Path(bound) != Path(os.environ["TRACKIO_DIR"]):
            notes.append(f"trackio was imported before this run: it logs to {bound}")
    return notes


def flat_config(tree: dict[str, Any], prefix: str = "") -> dict[str, bool | int | float | str]:
    """A config tree as dotted keys of scalars (lists, null and the rest as text), as every tracker takes."""
    flat: dict[str, bool | int | float | str] = {}
    for key, item in tree.items():
        if isinstance(item, dict):
            flat.update(flat_config(item, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = item if isinstance(item, bool | int | float | str) else repr(item)
    return flat


@contextlib.contextmanager
def run_trackers(accelerator: Any, out: str | Path, config: dict[str, Any],
                 say: Callable[[str], None]) -> Iterator[None]:  # fmt: skip
    """The accelerator's trackers (its ``log_with``) started for the run, each finished on the way out."""
    names = [str(getattr(tracker, "value", tracker)) for tracker in getattr(accelerator, "log_with", [])]
    if not names:
        yield
        return
    out = Path(out)
    for note in keep_local(names, out):
        say(note)
    init = {
        "wandb": {"dir": str(out), "mode": "offline", "name": out.name},
        "trackio": {"name": out.name, "embed": False, "auto_log_cpu": False, "auto_log_gpu": False},
        "mlflow": {"run_name": out.name},
    }
    try:
        with contextlib.redirect_stdout(sys.stderr):  # (trackio prints; stdout stays the command's)
            accelerator.init_trackers(PROJECT, config=flat_config(config), init_kwargs=init)
    except BaseException:
        finish_trackers(accelerator, quiet=True)  # those started before the one that failed
        raise
    say("log_with: " + ", ".join(f"{name} -> {out / WHERE[name]}" for name in names))
    try:
        yield
    finally:
        finish_trackers(accelerator)


def log_to_trackers(accelerator: Any, metrics: dict[str, Any]) -> None:
    """A step's numbers to every tracker (main process), at its ``step``."""
    if not getattr(accelerator, "trackers", None):
        return
    values = {key: float(value) for key, value in metrics.items()
              if key != "step" and isinstance(value, numbers.Real) and math.isfinite(value)}  # fmt: skip
    accelerator.log(values, step=int(metrics["step"]))


def finish_trackers(accelerator: Any, quiet: bool = False) -> None:
    """Finish every tracker (its files flushed and closed) and forget them, so that ``end_training``
    does not finish them again; ``quiet``: a tracker that fails to finish (never started) is passed over."""
    with contextlib.redirect_stdout(sys.stderr):
        for tracker in accelerator.trackers:
            with contextlib.suppress(*((Exception,) if quiet else ())):
                tracker.finish()
    accelerator.trackers.clear()
