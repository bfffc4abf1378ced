"""vLLM's OpenAI-compatible wire format as the vLLM client uses it (``vllm_http.py``): what the server
knows (``VLLMServerInfo``), the ``/v1/completions`` request by token ids and its answer, whether its
logprobs mode reports the distribution ``SamplingParams`` documents, and the checks and the
tied-LM-head view of a weight reload on CPU (the client's docstring says why)."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.engines.base import EngineError, Generation, SamplingParams
from rollout.engines.sglang_protocol import FINISH_TYPES

TOKEN_ID = re.compile(r"token_id:(-?\d+)")
LM_HEAD_FILE = "lm_head.safetensors"


@dataclass(frozen=True)
class VLLMServerInfo:
    """What the client needs to know of a vLLM server, read once."""

    model: str
    """The served model name (``/v1/models``), sent as each request's ``model``."""
    max_model_len: int
    """The server's context length: prompt plus output."""
    logprobs_mode: str | None = None
    """``--logprobs-mode`` as ``/server_info`` reports it; None without the development endpoints."""
    device: str | None = None
    """"cpu", "cuda", ... as ``/server_info`` reports it; None without the development endpoints."""
    lora_config: dict[str, Any] | None = None
    """``vllm_config.lora_config`` (None: started without ``--enable-lora``)."""
    env: dict[str, Any] | None = None
    """``vllm_env`` of ``/server_info`` (None without the development endpoints)."""
    info_failed: str | None = None
    """Why ``/server_info`` failed when the server has it but it answered a 5xx (read as if absent)."""


def completion_payload(
    input_ids: list[int], sampling: SamplingParams, request_id: str, model: str, max_tokens: int
) -> dict[str, Any]:
    """The body of one ``/v1/completions`` request by token ids, with the sampled tokens' logprobs.
    Every sampling parameter is given, so none comes from the model's ``generation_config.json``."""
    payload: dict[str, Any] = {
        "model": model,
        "prompt": input_ids,
        "max_tokens": max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else 0,  # vLLM: 0 is no cut
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "stop_token_ids": list(sampling.stop_token_ids),
        "logprobs": 0,  # the sampled token's only
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
        "add_special_tokens": False,
        "request_id": request_id,
        "n": 1,
        "stream": False,
    }
    if sampling.seed is not None:
        payload["seed"] = sampling.seed
    return payload


def engine_request_id(request_id: str) -> str:
    """vLLM's own id of the completion sent with ``request_id`` (its first and only prompt), which
    ``/abort_requests`` takes."""
    return f"cmpl-{request_id}-0"


def parse_completion(body: Any, where: str, weight_version: int) -> Generation:
    """A ``Generation`` from one ``/v1/completions`` response; ``where`` (server and rid) is named
    in the EngineError raised for a malformed one. Every token gets ``weight_version``."""
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise EngineError(f"{where}: expected a completion with one choice, got {str(body)[:200]}")
    choice = choices[0]
    finish = choice.get("finish_reason")
    if finish not in FINISH_TYPES:
        raise EngineError(f"{where}: finish_reason {finish!r} is not stop, length or abort")
    output_ids = choice.get("token_ids")
    if not isinstance(output_ids, list) or not all(isinstance(t, int) for t in output_ids):
        raise EngineError(f"{where}: choices[0].token_ids must be a list of token ids (vLLM >= 0.10.2 has them)")
    logprobs = choice.get("logprobs") or {}
    tokens, values = logprobs.get("tokens"), logprobs.get("token_logprobs")
    if not isinstance(tokens, list) or not isinstance(values, list):
        raise EngineError(f"{where}: choices[0].logprobs has no tokens and token_logprobs (was logprobs sent?)")
    if not len(tokens) == len(values) == len(output_ids):
        raise EngineError(
            f"{where}: {len(values)} token_logprobs and {len(tokens)} tokens for {len(output_ids)} token_ids"
        )
    for i, (token, value, token_id) in enumerate(zip(tokens, values, output_ids, strict=True)):
        match = TOKEN_ID.fullmatch(token) if isinstance(token, str) else None
        if match is None or int(match.group(1)) != token_id:
            raise EngineError(f"{where}: logprobs.tokens[{i}] {token!r} does not match token_ids[{i}] {token_id}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise EngineError(f"{where}: logprobs.token_logprobs[{i}] is {value!r}, not a number")
    stop_reason = choice.get("stop_reason")
    if finish == "stop" and isinstance(stop_reason, int) and output_ids[-1:] != [stop_reason]:
        raise EngineError(f"{where}: stopped on token {stop_reason}, which does not end token_ids")
    usage = body.get("usage") or {}
    meta = {
        "id": body.get("id"),
        "stop_reason": stop_reason,
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
    }
    return Generation(output_ids, [float(v) for v in values], finish, weight_version, meta=meta)


def logprobs_problem(mode: str | None, sampling: SamplingParams) -> str | None:
    """Why a server with ``--logprobs-mode mode`` would return logprobs of another distribution than
    ``SamplingParams`` documents (temperature-scaled, before the top-p/top-k cut) for ``sampling``;
    None when they are right, or when the mode is unknown."""
    greedy = sampling.temperature == 0  # vLLM: the unscaled distribution, as the other engines
    cut = sampling.top_p < 1 or sampling.top_k > 0
    if mode is None or greedy:
        return None
    if mode == "processed_logprobs":
        if cut:
            return (
                f"vLLM renormalises its processed_logprobs over the top-p/top-k cut (top_p={sampling.top_p}, "
                f"top_k={sampling.top_k}): sample with top_p=1 and top_k=-1 on vLLM, or use SGLang"
            )
        return None
    if mode == "raw_logprobs":
        if sampling.temperature != 1:
            return (
                f"its raw_logprobs ignore the temperature ({sampling.temperature:g}): restart it with "
                "--logprobs-mode processed_logprobs"
            )
        return None
    return f"--logprobs-mode {mode} returns logits, not logprobs: restart it with --logprobs-mode processed_logprobs"


def tied_lm_head_view(model_dir: Path) -> Path | None:
    """When the checkpoint at ``model_dir`` has input embeddings but no ``lm_head.weight`` (it ties
    them), a new temporary directory beside it (or in the system's temporary directory) of links to
    its files plus ``lm_head.safetensors``, a copy of the embeddings (a sharded checkpoint's index
    gets the entry); the caller removes it. None when nothing is tied. ``model_dir`` is not changed."""
    import json
    import tempfile

    from safetensors import safe_open
    from safetensors.torch import save_file

    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    if index is not None:
        where = dict(index.get("weight_map", {}))
    else:
        where = {}
        for file in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                where.update(dict.fromkeys(f.keys(), file.name))
    embeddings = [name for name in where if name.endswith("embed_tokens.weight")]
    if "lm_head.weight" in where or len(embeddings) != 1:
        return None
    try:
        view = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.vllm-", dir=model_dir.parent))
    except OSError:  # a read-only parent
        view = Path(tempfile.mkdtemp(prefix=f"{model_dir.name}.vllm-"))
    try:
        for file in model_dir.iterdir():
            if file.is_file() and file != index_path:
                (view / file.name).symlink_to(file.resolve())
        with safe_open(str(model_dir / where[embeddings[0]]), framework="pt") as f:
            tensor = f.get_tensor(embeddings[0])
        save_file({"lm_head.weight": tensor.contiguous()}, str(view / LM_HEAD_FILE), metadata={"format": "pt"})
        if index is not None:
            index["weight_map"]["lm_head.weight"] = LM_HEAD_FILE
            (view / index_path.name).write_text(json.dumps(index, indent=2))
    except BaseException:
        shutil.rmtree(view, ignore_errors=True)
        raise
    return view


def check_model_dir(model_path: str) -> None:
    """EngineError unless ``model_path`` is a directory holding safetensors (checked here because a
    failed ``reload_weights`` kills vLLM's engine)."""
    path = Path(model_path)
    if not path.is_dir() or not any(path.glob("*.safetensors")):
        raise EngineError(
            f"{model_path}: not a model directory with .safetensors files; vLLM's engine dies when a reload "
            "fails, so nothing was sent"
        )
