"""Where ``/update_weights_from_disk`` may read: regular ``*.safetensors`` files under the directories
the operator named at start (``ServeConfig.weights_dirs`` and the served model's own), every path
resolved first, so that ``..`` and symlinks cannot lead out of them; FIFOs, devices and sockets are
refused before anything opens them (a FIFO would block the reader forever). Loading runs on a worker
thread with a deadline (``ServeConfig.weight_load_timeout_s``)."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file


class WeightPathError(ValueError):
    """A path the server will not load from (the message says why and how to allow it)."""


def weight_roots(dirs: list[str], model_dir: str) -> list[Path]:
    """The directories loads may come from, resolved (relative ones from the working directory)."""
    return [Path(d).expanduser().resolve() for d in [*dirs, model_dir]]


def weight_files(model_path: str, roots: list[Path]) -> list[Path]:
    """The ``*.safetensors`` files of ``model_path`` (a model directory or one file), each a regular
    file under one of ``roots`` once every link is followed; a ``WeightPathError`` otherwise."""
    try:
        path = Path(model_path).expanduser().resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        raise WeightPathError(f"{model_path}: {getattr(exc, 'strerror', None) or exc}") from None
    _check_under(path, model_path, roots)
    files = [path] if not path.is_dir() else sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightPathError(f"{model_path}: no *.safetensors files (save the model with save_pretrained or "
                              "safetensors)")  # fmt: skip
    checked = []
    for file in files:
        real = file.resolve(strict=True)
        _check_under(real, str(file), roots)
        mode = real.stat().st_mode
        if not stat.S_ISREG(mode):
            raise WeightPathError(f"{file}: not a regular file (a FIFO, device or socket is never read)")
        checked.append(real)
    return checked


def _check_under(path: Path, given: str, roots: list[Path]) -> None:
    if not any(path == root or path.is_relative_to(root) for root in roots):
        allowed = ", ".join(str(r) for r in roots)
        raise WeightPathError(f"{given}: outside the directories this server loads weights from ({allowed}); "
                              "start it with --weights-dir DIR to allow another")  # fmt: skip


def load_weight_files(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of ``files``; a file that is not safetensors is a ``WeightPathError`` naming it."""
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state_dict.update(load_file(str(file)))
        except SafetensorError as exc:
            raise WeightPathError(f"{file}: not a safetensors file ({exc})") from None
    return state_dict


async def load_weights(model_path: str, roots: list[Path], timeout_s: float) -> dict[str, torch.Tensor]:
    """Check ``model_path`` and load its weights on a worker thread, within ``timeout_s``."""
    files = await asyncio.to_thread(weight_files, model_path, roots)
    try:
        return await asyncio.wait_for(asyncio.to_thread(load_weight_files, files), timeout_s)
    except TimeoutError:
        raise WeightPathError(f"{model_path}: reading the weights took over {timeout_s:g} s "
                              "(weight_load_timeout_s)") from None  # fmt: skip
