"""Exact re-expression of a Qwen2 (or Llama) model with a wider residual stream and wider
attention heads, zero-padded: the same function, in a shape the real engines accept.

The tiny-calc model learned with 8 heads of 16 on a residual stream of 128 (8 heads of 16
copy operands much sooner than 4 of 32). vLLM's CPU attention refuses heads under 32, and
SGLang on CPU derives the head size as ``hidden_size / num_attention_heads`` whatever the
config's ``head_dim`` says; so the shipped model has a residual stream of 256 and 8 heads of
32, half of each zero. Widening the stream from ``h`` to ``H = s * h`` and every head from
``d`` to ``D = r * d`` computes the same logits:

- the residual stream's new dimensions are zero: embeddings and every layer that writes the
  stream (``o_proj``, ``down_proj``) get zero rows, every layer that reads it zero columns;
- an RMS norm over ``H`` dimensions sees a mean square ``s`` times smaller: with ``eps / s``
  and weights divided by ``sqrt(s)`` its output is the old one, padded with zeros;
- rotary embedding pairs head dimension ``i`` with ``i + d/2`` at frequency ``theta^(-2i/d)``;
  in a head of ``D`` the pair ``(r*i, r*i + D/2)`` turns at the same frequency, so old
  dimension ``i`` moves to ``r*i`` and ``i + d/2`` to ``r*i + D/2``;
- padded query and key dimensions are zero and add nothing to a score; queries are scaled by
  ``sqrt(r)`` so that ``q.k / sqrt(D)`` equals the old ``q.k / sqrt(d)``; padded value
  dimensions are zero and meet zero columns of ``o_proj``.

Training keeps the padding at zero: every padded weight's gradient is zero (a padded
dimension only ever meets zeros on the other side of each product), and so is AdamW's step.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from data.files import atomic_directory

__all__ = ["head_dim", "pad_model", "pad_model_dir"]


def head_dim(config) -> int:
    """The attention head size of a Qwen2/Llama-style config (``head_dim`` or hidden / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _head_rows(heads: int, old: int, new: int) -> torch.Tensor:
    """Where each of ``heads * old`` projection rows goes in the padded ``heads * new`` layout."""
    ratio, half_old, half_new = new // old, old // 2, new // 2
    within = torch.arange(old)
    mapped = torch.where(within < half_old, ratio * within, ratio * (within - half_old) + half_new)
    return (torch.arange(heads)[:, None] * new + mapped[None, :]).flatten()


def _linear(old: nn.Linear, rows: torch.Tensor | None, out: int, cols: int, scale: float = 1.0) -> nn.Linear:
    """``old`` with its output rows placed at ``rows`` of ``out`` (None: the first ones) and its
    inputs as the first of ``cols`` columns; everything else zero."""
    rows = torch.arange(old.out_features) if rows is None else rows
    new = nn.Linear(cols, out, bias=old.bias is not None, dtype=old.weight.dtype, device=old.weight.device)
    new.weight.zero_()
    new.weight[rows, : old.in_features] = old.weight * scale
    if old.bias is not None:
        new.bias.zero_()
        new.bias[rows] = old.bias * scale
    return new


def _norm(norm: nn.Module, width: int, stretch: float) -> None:
    """Widen an RMS norm's weight to ``width`` (zeros after the old ones, the old divided by ``sqrt(stretch)``)."""
    weight = torch.zeros(width, dtype=norm.weight.dtype, device=norm.weight.device)
    weight[: norm.weight.numel()] = norm.weight / math.sqrt(stretch)
    norm.weight = nn.Parameter(weight)
    norm.variance_epsilon = norm.variance_epsilon / stretch


@torch.no_grad()
def pad_model(model: PreTrainedModel, hidden_size: int, new_head_dim: int) -> PreTrainedModel:
    """Widen ``model`` in place to a residual stream of ``hidden_size`` and heads of
    ``new_head_dim`` (see the module docstring); its config then says so, with ``head_dim``
    equal to ``hidden_size / num_attention_heads``. ValueError unless both are whole multiples
    of the current sizes and the heads divide the new stream evenly."""
    config = model.config
    old_hidden, old_head = config.hidden_size, head_dim(config)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if hidden_size % old_hidden or new_head_dim % old_head or old_head % 2 or hidden_size != heads * new_head_dim:
        raise ValueError(
            f"cannot pad a model of hidden size {old_hidden} and heads of {old_head} to {hidden_size} and "
            f"{new_head_dim}: each must be a whole multiple of the old size, and {heads} heads of "
            f"{new_head_dim} must fill the hidden size"
        )
    stretch = hidden_size / old_hidden
    q_rows, kv_rows = _head_rows(heads, old_head, new_head_dim), _head_rows(kv_heads, old_head, new_head_dim)
    q_scale = math.sqrt(new_head_dim / old_head)
    q_out, kv_out = heads * new_head_dim, kv_heads * new_head_dim

    embed = model.get_input_embeddings()
    weight = embed.weight.new_zeros(embed.num_embeddings, hidden_size)
    weight[:, :old_hidden] = embed.weight
    embed.weight = nn.Parameter(weight)
    embed.embedding_dim = hidden_size
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        attention.q_proj = _linear(attention.q_proj, q_rows, q_out, hidden_size, q_scale)
        attention.k_proj = _linear(attention.k_proj, kv_rows, kv_out, hidden_size)
        attention.v_proj = _linear(attention.v_proj, kv_rows, kv_out, hidden_size)
        o_old = attention.o_proj
        o_proj = nn.Linear(q_out, hidden_size, bias=o_old.bias is not None, dtype=o_old.weight.dtype)
        o_proj.weight.zero_()
        o_proj.weight[:old_hidden, q_rows] = o_old.weight
        if o_old.bias is not None:
            o_proj.bias.zero_()
            o_proj.bias[:old_hidden] = o_old.bias
        attention.o_proj = o_proj
        attention.head_dim, attention.scaling = new_head_dim, new_head_dim**-0.5
        mlp.gate_proj = _linear(mlp.gate_proj, None, mlp.gate_proj.out_features, hidden_size)
        mlp.up_proj = _linear(mlp.up_proj, None, mlp.up_proj.out_features, hidden_size)
        mlp.down_proj = _linear(mlp.down_proj, None, hidden_size, mlp.down_proj.in_features)
        _norm(layer.input_layernorm, hidden_size, stretch)
        _norm(layer.post_attention_layernorm, hidden_size, stretch)
    _norm(model.model.norm, hidden_size, stretch)

    config.hidden_size, config.head_dim = hidden_size, new_head_dim
    config.rms_norm_eps = config.rms_norm_eps / stretch
    if config.tie_word_embeddings:
        model.tie_weights()
    else:
        head = model.get_output_embeddings()
        padded = head.weight.new_zeros(head.out_features, hidden_size)
        padded[:, :old_hidden] = head.weight
        head.weight, head.in_features = nn.Parameter(padded), hidden_size
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=config).to(rotary.inv_freq.device)
    return model


def pad_model_dir(source: str | Path, target: str | Path, new_head_dim: int) -> Path:
    """Replace ``target`` with a copy of the model directory ``source`` (tokenizer and all),
    atomically, re-expressed by ``pad_model`` with heads of ``new_head_dim`` and a residual
    stream of ``heads * new_head_dim`` unless its heads have that size already or it is 0."""

    def write(partial: Path) -> None:
        shutil.copytree(source, partial, dirs_exist_ok=True)
        model = AutoModelForCausalLM.from_pretrained(source, local_files_only=True, dtype=torch.float32)
        if new_head_dim and head_dim(model.config) != new_head_dim:
            pad_model(model, model.config.num_attention_heads * new_head_dim, new_head_dim)
            model.save_pretrained(partial)
        for path in partial.iterdir():
            path.chmod(0o644)  # save_pretrained writes weights readable by their owner only

    return atomic_directory(target, write)
