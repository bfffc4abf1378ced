"""``rallyrl serve``: the command's options and the embedded engine it serves (``app.py`` serves it)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import typer

from data.command_options import CONFIG_HELP, SET_HELP, errors_for_people, load_config
from data.console import console, fail
from rollout.config import ServeConfig


def serve_command(
    config: Path = typer.Option(None, help=CONFIG_HELP),
    set_: list[str] = typer.Option(None, "--set", help=SET_HELP),
    model: Path = typer.Option(None, help="Model directory to serve (default: the embedded model)."),
    host: str = typer.Option(None, help="Interface to bind (default 127.0.0.1, loopback)."),
    port: int = typer.Option(None, help="Port (default 30000; 0: pick a free one and print it)."),
    max_batch_size: int = typer.Option(None, help="Most sequences decoded together (default 256)."),
    max_model_len: int = typer.Option(None, help="Context limit (default: the model's)."),
    device: str = typer.Option(None, help='"auto", "cpu" or "cuda".'),
    seed: int = typer.Option(None, help="Seed of the sampling generator."),
    served_model_name: str = typer.Option(None, help="Model name in the OpenAI API."),
    tool_parser: str = typer.Option(None, help="Tool-call parser of /v1/chat/completions (default qwen25)."),
    reasoning_parser: str = typer.Option(None, help="Reasoning parser of /v1/chat/completions (default none)."),
    api_key: str = typer.Option(None, help="Require 'Authorization: Bearer KEY' (but on /health); not empty."),
    weights_dir: list[Path] = typer.Option(None, help="Also load weights from under this directory (repeat); "
                                           "default: runs/ here and the served model's own."),
    weight_peer: list[str] = typer.Option(None, help="Also take weights broadcast from a trainer at this address "
                                          "(an IP or CIDR network; repeat) when not bound to loopback."),
    fault_error_rate: float = typer.Option(None, help="Testing: share of /generate calls answered HTTP 500."),
    fault_hang_rate: float = typer.Option(None, help="Testing: share of /generate calls held open unanswered."),
    fault_drop_rate: float = typer.Option(None, help="Testing: share of /generate calls reset mid-response."),
    fault_seed: int = typer.Option(None, help="Seed of the fault draws (the same calls fail in every run)."),
    threads: int = typer.Option(None, help="torch intra-op threads."),
) -> None:
    """Serve a model with the embedded engine behind SGLang's HTTP API (and OpenAI's).
    The --fault-* options make a share of /generate calls fail, to test clients (GET /fault_stats counts them)."""
    flags = {
        "model": model, "host": host, "port": port, "engine.max_batch_size": max_batch_size,
        "engine.max_model_len": max_model_len, "engine.device": device, "seed": seed,
        "served_model_name": served_model_name, "tool_parser": tool_parser,
        "reasoning_parser": reasoning_parser, "api_key": api_key,
        "faults.error_rate": fault_error_rate, "faults.hang_rate": fault_hang_rate,
        "faults.drop_rate": fault_drop_rate, "faults.seed": fault_seed, "threads": threads,
        "weights_dirs": ["runs", *map(str, weights_dir)] if weights_dir else None,
        "weight_peers": list(weight_peer) if weight_peer else None,
    }  # fmt: skip
    with errors_for_people():
        serve_config = load_config(ServeConfig, config, flags, set_)
    try:
        with errors_for_people():
            asyncio.run(serve_embedded(serve_config))
    except OSError as exc:  # the port is taken, the address cannot be bound
        raise fail(f"cannot serve on {serve_config.host}:{serve_config.port}: {exc.strerror or exc}") from None
    except KeyboardInterrupt:
        console.print("server stopped")


async def serve_embedded(config: ServeConfig) -> None:
    """Serve ``config.model`` with the embedded engine until cancelled (the address printed once bound)."""
    from rollout.api import resolve_model, set_threads

    model_dir = resolve_model(config.model)  # a bad model or a taken port fails before torch loads
    check_port_free(config.host, config.port)
    from rollout.engines.local import LocalEngine
    from rollout.serve.app import serve
    from rollout.serve.guard import is_loopback
    from rollout.tokens import load_tokenizer

    set_threads(config.threads)
    config = dataclasses.replace(config, model=str(model_dir.resolve()))
    engine_config = config.engine
    if engine_config.seed is None:
        engine_config = dataclasses.replace(engine_config, seed=config.seed)
    ready = asyncio.Event()
    async with LocalEngine.from_pretrained(model_dir, engine_config) as engine:
        task = asyncio.create_task(serve(engine, load_tokenizer(model_dir), config, ready))
        await asyncio.wait([task, asyncio.create_task(ready.wait())], return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # raises the bind error
        console.print(f"serving {model_dir} on http://{config.host}:{config.port}", highlight=False)
        if not is_loopback(config.host) and not config.api_key:
            console.print(f"warning: {config.host} is not loopback and there is no --api-key: anyone who reaches "
                          "this port can generate and load weights", highlight=False)  # fmt: skip
        faults = config.faults
        if faults is not None:
            console.print(f"injecting faults into /generate: {faults.error_rate:.1%} errors, {faults.hang_rate:.1%} "
                          f"hangs, {faults.drop_rate:.1%} drops (seed {faults.seed})", highlight=False)  # fmt: skip
        await task


def check_port_free(host: str, port: int) -> None:
    """Raise the ``OSError`` binding ``host:port`` would raise once the model is loaded (a port another
    process listens on), before loading it; port 0 is always free. The server's own bind still decides."""
    if port == 0:
        return
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is no reason
        probe.bind((host, port))
