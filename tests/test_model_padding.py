"""The exact re-expression of a model with a wider residual stream and wider heads
(``data/model_padding.py``): the same logits, padding that training keeps at zero, the
shipped model in a shape both real engines accept, and its export by ``pad_model_dir``."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from data.model_padding import head_dim, pad_model, pad_model_dir
from data.tiny_model import EMBEDDED_MODEL, TinyModelConfig, build_char_tokenizer, build_tiny_model, char_vocab
from rollout.tokens import load_tokenizer

SMALL = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                        initializer_range=0.2)  # fmt: skip


@pytest.fixture(scope="module")
def small():
    return build_tiny_model(build_char_tokenizer(), SMALL)


def logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits, -1)


@pytest.mark.parametrize(("hidden", "head"), [(128, 32), (256, 64), (64, 16)])
def test_padding_gives_the_same_logprobs(small, hidden, head):
    ids = torch.randint(4, 105, (2, 96), generator=torch.Generator().manual_seed(0))
    padded = pad_model(copy.deepcopy(small), hidden, head).eval()
    assert (padded.config.hidden_size, head_dim(padded.config)) == (hidden, head)
    assert padded.model.layers[0].self_attn.q_proj.weight.shape == (4 * head, hidden)
    assert torch.allclose(logprobs(padded, ids), logprobs(small.eval(), ids), atol=2e-5)


def test_training_keeps_the_padding_at_zero(small):
    ones = copy.deepcopy(small)
    with torch.no_grad():
        for parameter in ones.parameters():
            parameter.fill_(1.0)
    padding = {name: p == 0 for name, p in pad_model(ones, 128, 32).named_parameters()}  # where the zeros go
    padded = pad_model(copy.deepcopy(small), 128, 32).train()
    optimizer = torch.optim.AdamW(padded.parameters(), lr=1e-2, weight_decay=0.1)
    ids = torch.randint(4, 105, (2, 64), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        padded(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, parameter in padded.named_parameters():
        assert bool((parameter[padding[name]] == 0).all()), f"{name}: padding moved"
    assert padded.model.embed_tokens.weight[:, 64:].abs().max() == 0


@pytest.mark.parametrize(("hidden", "head"), [(96, 32), (128, 24), (128, 8), (256, 32)])
def test_sizes_that_are_not_whole_multiples_or_do_not_fill_the_stream_are_refused(small, hidden, head):
    with pytest.raises(ValueError, match="cannot pad"):
        pad_model(copy.deepcopy(small), hidden, head)


def test_pad_model_dir_exports_tokenizer_and_all_and_leaves_a_padded_model_as_it_is(small, tmp_path):
    source = tmp_path / "trained"
    small.save_pretrained(source)
    build_char_tokenizer().save_pretrained(source)
    target = pad_model_dir(source, tmp_path / "shipped", 32)
    config = json.loads((target / "config.json").read_text())
    assert (config["hidden_size"], config["head_dim"], config["num_attention_heads"]) == (128, 32, 4)
    assert (target / "tokenizer.json").is_file() and not (tmp_path / "shipped.partial").exists()
    ids = torch.randint(4, 105, (1, 48), generator=torch.Generator().manual_seed(2))
    reloaded = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    assert torch.allclose(logprobs(reloaded, ids), logprobs(small.eval(), ids), atol=2e-5)
    again = pad_model_dir(target, tmp_path / "again", 32)  # already that shape: copied unchanged
    assert (again / "model.safetensors").read_bytes() == (target / "model.safetensors").read_bytes()


def test_the_shipped_model_has_a_shape_sglang_and_vllm_accept_on_a_cpu():
    config = json.loads((EMBEDDED_MODEL / "config.json").read_text())
    # SGLang on a CPU takes hidden / heads as the head size; vLLM's CPU attention wants 32, 64, ...
    assert config["hidden_size"] == config["num_attention_heads"] * config["head_dim"]
    assert config["head_dim"] in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32)
    trained = sum(int((p != 0).sum()) for p in model.parameters())
    assert 1_000_000 <= trained <= 1_200_000  # the padding adds no weights that are not zero


def test_every_loader_reads_the_shipped_tokenizer_the_same_way():
    """transformers 5 gives any qwen2 directory a Qwen2Tokenizer whatever tokenizer_config says
    (SGLang and vLLM load it that way): the shipped one is one, so the ids are the same."""
    chars = "".join(char_vocab()[8:])  # newline, tab, space, then printable ASCII
    text = chars + '<|im_start|>user\n2 + 3 =<|im_end|>\n<tool_call>{"a": 1}</tool_call>'
    auto = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    assert type(auto).__name__ == "Qwen2Tokenizer"
    ids = build_char_tokenizer().encode(text, add_special_tokens=False)
    assert load_tokenizer(EMBEDDED_MODEL).encode(text, add_special_tokens=False) == ids
    assert auto.encode(text, add_special_tokens=False) == ids
    assert ids[: len(chars)] == list(range(8, 8 + len(chars)))  # one token a character, none dropped
    assert ids[len(chars)] == 1 and 4 in ids and 5 in ids  # <|im_start|>, <tool_call>, </tool_call> whole
    assert auto.decode(ids) == text
