"""``rallyrl gateway``: the agent gateway alone (``rollout.api.serve_gateway``), its finished sessions
written to JSONL."""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer

from data.command_options import CONFIG_HELP, ENGINE_SERVER_HELP, SET_HELP, errors_for_people, load_config
from data.console import console, fail
from rollout.config import GatewayJobConfig


def gateway_command(
    config: Path = typer.Option(None, help=CONFIG_HELP),
    set_: list[str] = typer.Option(None, "--set", help=SET_HELP),
    model: Path = typer.Option(None, help="Model directory (default: embedded); with --engine-url, its tokenizer."),
    host: str = typer.Option(None, help="Interface to bind (default 127.0.0.1, loopback)."),
    port: int = typer.Option(None, help="Port (default 8100; 0: pick a free one)."),
    out: Path = typer.Option(None, help="JSONL of finished sessions, one trajectory each (default: sessions.jsonl)."),
    sampling: str = typer.Option(None, help='"rollout": the config\'s sampling for every call (default); "request".'),
    max_sessions: int = typer.Option(None, help="Most sessions open at once (default 4096)."),
    max_turns: int = typer.Option(None, help="Most assistant turns per session."),
    max_new_tokens: int = typer.Option(None, help="Most tokens per answer."),
    max_model_len: int = typer.Option(None, help="Most tokens per conversation."),
    temperature: float = typer.Option(None, help="Sampling temperature (with --sampling rollout)."),
    reward: str = typer.Option(None, help="Reward of sessions none is posted for (data/reward_fns.py)."),
    engine_url: list[str] = typer.Option(None, help="SGLang, vLLM or `rallyrl serve` server URL; repeat for a pool."),
    engine_server: str = typer.Option(None, help=ENGINE_SERVER_HELP),
    device: str = typer.Option(None, help='Embedded engine device: "auto", "cpu" or "cuda".'),
    seed: int = typer.Option(None, help="Seed of the engine's sampling."),
    threads: int = typer.Option(None, help="torch intra-op threads."),
) -> None:
    """The agent gateway: an OpenAI-compatible endpoint that records each agent run (a session) token
    for token. POST /sessions opens one; its base URL goes to any OpenAI client; finished sessions
    are written to --out as trajectories (train on them, `rallyrl show` them)."""
    flags = {
        "model": model, "gateway.host": host, "gateway.port": port, "out": out, "gateway.sampling": sampling,
        "gateway.max_sessions": max_sessions, "rollout.max_turns": max_turns, "rollout.max_new_tokens": max_new_tokens,
        "rollout.max_model_len": max_model_len, "rollout.temperature": temperature, "reward": reward,
        "engine.urls": engine_url or None, "engine.server": engine_server, "engine.local.device": device,
        "seed": seed, "threads": threads,
    }  # fmt: skip
    from rollout.api import serve_gateway

    with errors_for_people():
        gateway_config = load_config(GatewayJobConfig, config, flags, set_)
    try:
        with errors_for_people():
            asyncio.run(serve_gateway(gateway_config, console))
    except OSError as exc:
        raise fail(f"cannot serve on {gateway_config.gateway.host}:{gateway_config.gateway.port}: "
                    f"{exc.strerror or exc}") from None  # fmt: skip
    except KeyboardInterrupt:
        console.print(f"gateway stopped; finished sessions are in {gateway_config.out}")
