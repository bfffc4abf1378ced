"""The wire format of ``/update_weights_from_tensor`` (SGLang's, which rallyrl serve takes too).

A payload is a list of ``(name, tensor)`` pickled and base64-encoded, one per tensor-parallel rank of
the server (``serialized_named_tensors``). CUDA tensors pickle as CUDA IPC handles (torch's
``ForkingPickler`` reductions: the server maps the trainer's memory, nothing is copied between
processes); CPU tensors pickle by value (their bytes). SGLang reads payloads with an allow-list
unpickler; rallyrl serve reads them with a smaller one (``load_named_tensors``): only the globals a
list of named tensors needs, by value or by CUDA handle, and a storage's bytes through
``torch.load(weights_only=True)``.

The body of one request is written in pieces (``payload_chunks``) so that a bucket's base64 text is
never copied into a second, larger string.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from collections.abc import Iterator, Sequence
from typing import Any

import orjson
import torch

BASE64_CHUNK = 3 * 2**20
"""Bytes of pickle encoded at a time (a multiple of 3: the pieces join into one valid base64 text)."""


def pickle_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> bytes:
    """``named`` pickled for another process on this machine: CUDA tensors by IPC handle, CPU tensors
    by value (each needs a storage of its own: a view would carry its whole storage)."""
    if any(tensor.is_cuda for _, tensor in named):
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401  (registers the CUDA reductions on ForkingPickler)

        buffer = io.BytesIO()
        ForkingPickler(buffer, 4).dump(list(named))  # (its __init__ takes no keywords)
        return buffer.getvalue()
    own = [(name, t if t.untyped_storage().nbytes() == t.nbytes and t.is_contiguous() else t.clone())
           for name, t in named]  # fmt: skip
    return pickle.dumps(own, protocol=4)


def payload_chunks(pickled: bytes, copies: int, fields: dict[str, Any]) -> Iterator[bytes]:
    """A JSON body ``{"serialized_named_tensors": [<base64 of pickled> x copies], **fields}`` in pieces."""
    yield b'{"serialized_named_tensors":['
    view = memoryview(pickled)
    for copy in range(copies):
        yield b',"' if copy else b'"'
        for start in range(0, len(view), BASE64_CHUNK):
            yield base64.b64encode(view[start : start + BASE64_CHUNK])
        yield b'"'
    yield b"]"
    for key, value in fields.items():
        yield b"," + orjson.dumps(key) + b":" + orjson.dumps(value)
    yield b"}"


# ----- the server's side -------------------------------------------------------------------------


class TensorPayloadError(ValueError):
    """A payload that is not a list of named tensors this server can read."""


def _storage_from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


_ALLOWED = {
    ("builtins", "list"), ("builtins", "tuple"), ("builtins", "str"), ("builtins", "int"), ("builtins", "bool"),
    ("collections", "OrderedDict"), ("torch", "Size"), ("torch", "device"), ("torch", "dtype"),
    ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor"),
    ("torch._tensor", "_rebuild_from_type_v2"), ("torch", "Tensor"), ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"), ("torch", "UntypedStorage"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    *(("torch", name) for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "int8",
                                   "bool", "float8_e4m3fn", "float8_e5m2")),
}  # fmt: skip
"""What a list of named tensors by value or by CUDA handle needs, and nothing that runs other code."""


class _NamedTensorsUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _storage_from_bytes
        if (module, name) in _ALLOWED:
            if module == "torch.multiprocessing.reductions":
                import torch.multiprocessing  # noqa: F401
            return super().find_class(module, name)
        raise TensorPayloadError(f"a weight payload may not name {module}.{name}")


def load_named_tensors(payload: object, where: str) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of one base64 payload; TensorPayloadError naming ``where`` when it is not one."""
    if not isinstance(payload, str):
        raise TensorPayloadError(f"{where}: expected a base64 string")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise TensorPayloadError(f"{where}: not valid base64") from None
    try:
        named = _NamedTensorsUnpickler(io.BytesIO(raw)).load()
    except TensorPayloadError as exc:
        raise TensorPayloadError(f"{where}: {exc}") from None
    except Exception as exc:  # a truncated or corrupt pickle, a CUDA handle that does not open
        problem = f"{type(exc).__name__}: {exc}"
        raise TensorPayloadError(f"{where}: not a pickled list of named tensors ({problem})") from None
    if not isinstance(named, list) or not all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)
        for item in named
    ):
        raise TensorPayloadError(f"{where}: expected a list of (name, tensor) pairs")
    return named
