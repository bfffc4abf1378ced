"""``chunked_logprobs`` (``trainer/logprobs.py``): token logprobs, entropy and gradients through the
LM head in chunks equal the unchunked computation's, whatever the chunk size, with nothing of the
size of the logits kept for backward."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from trainer.logprobs import chunked_logprobs, unchunked_logprobs
from trainer.losses import entropy_from_logits, token_logprobs

TEMPERATURE = 0.7
"""The rollout temperature of every test here: logits are divided by it, in both computations."""

pytestmark = pytest.mark.usefixtures("one_thread")


# ----- chunked_logprobs, the function ------------------------------------------------------------


def head_inputs(count: int, dtype: torch.dtype, bias: bool, seed: int = 0) -> dict[str, Any]:
    """Hidden states [count, 16], a head [37, 16] (+ bias [37]) and targets, all leaves."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(count, 16, generator=generator, dtype=dtype).requires_grad_()
    weight = (torch.randn(37, 16, generator=generator, dtype=dtype) * 0.7).requires_grad_()
    head_bias = (torch.randn(37, generator=generator, dtype=dtype) * 0.5).requires_grad_() if bias else None
    targets = torch.randint(0, 37, (count,), generator=generator)
    return {"hidden": hidden, "weight": weight, "bias": head_bias, "targets": targets}


def values_and_gradients(function: Any, inputs: dict[str, Any], **kwargs: Any) -> dict[str, torch.Tensor]:
    """Logprobs, entropy, and the gradients of a weighted sum of the logprobs (weights of both
    signs, as advantages give) with respect to hidden, weight and bias."""
    leaves = {name: t for name, t in inputs.items() if name != "targets" and t is not None}
    logprobs, entropy = function(inputs["hidden"], inputs["weight"], inputs["targets"], bias=inputs["bias"],
                                 temperature=TEMPERATURE, with_entropy=True, **kwargs)  # fmt: skip
    upstream = torch.linspace(-1.0, 1.5, logprobs.shape[0])
    grads = torch.autograd.grad((logprobs * upstream).sum(), list(leaves.values()), allow_unused=True)
    gradients = {f"d_{name}": grad for name, grad in zip(leaves, grads, strict=True)}
    return {"logprobs": logprobs.detach(), "entropy": entropy, **gradients}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("chunk", [1, 3, 7, 64], ids=lambda c: f"chunk{c}")
def test_chunked_logprobs_entropy_and_gradients_equal_the_unchunked_reference(chunk, bias, dtype):
    inputs = head_inputs(7, dtype, bias)  # M = 7: chunks of 1, 3 (the last shorter), all of it, more than it
    got = values_and_gradients(chunked_logprobs, inputs, chunk_tokens=chunk)
    want = values_and_gradients(unchunked_logprobs, inputs)
    assert got.keys() == want.keys() and got["logprobs"].dtype == got["entropy"].dtype == torch.float32
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_the_unchunked_reference_is_todays_full_logits_computation():
    inputs = head_inputs(9, torch.float32, bias=True)
    logprobs, entropy = unchunked_logprobs(inputs["hidden"], inputs["weight"], inputs["targets"],
                                           bias=inputs["bias"], temperature=TEMPERATURE, with_entropy=True)  # fmt: skip
    logits = (inputs["hidden"] @ inputs["weight"].T + inputs["bias"]) / TEMPERATURE
    torch.testing.assert_close(logprobs, token_logprobs(logits[None], inputs["targets"][None])[0])
    torch.testing.assert_close(entropy, entropy_from_logits(logits[None])[0])


def test_without_a_gradient_path_the_values_are_the_same():
    inputs = head_inputs(10, torch.float32, bias=True)
    with_grad = values_and_gradients(chunked_logprobs, inputs, chunk_tokens=4)
    with torch.no_grad():
        logprobs, entropy = chunked_logprobs(inputs["hidden"], inputs["weight"], inputs["targets"],
                                             bias=inputs["bias"], temperature=TEMPERATURE, chunk_tokens=4,
                                             with_entropy=True)  # fmt: skip
    assert not logprobs.requires_grad
    torch.testing.assert_close(logprobs, with_grad["logprobs"], rtol=0, atol=0)
    torch.testing.assert_close(entropy, with_grad["entropy"], rtol=0, atol=0)


def test_the_entropy_is_computed_only_when_asked_and_never_carries_a_gradient():
    inputs = head_inputs(5, torch.float32, bias=False)
    logprobs, entropy = chunked_logprobs(inputs["hidden"], inputs["weight"], inputs["targets"], chunk_tokens=2)
    assert entropy is None and logprobs.requires_grad
    _, entropy = chunked_logprobs(inputs["hidden"], inputs["weight"], inputs["targets"], chunk_tokens=2,
                                  with_entropy=True)  # fmt: skip
    assert entropy.shape == (5,) and not entropy.requires_grad


def test_no_trained_tokens_give_empty_logprobs_and_zero_gradients():
    inputs = head_inputs(0, torch.float32, bias=True)
    got = values_and_gradients(chunked_logprobs, inputs, chunk_tokens=3)
    assert got["logprobs"].shape == got["entropy"].shape == (0,)
    assert got["d_hidden"].shape == (0, 16)
    for name in ("d_weight", "d_bias"):
        assert got[name] is None or not got[name].any(), name


def test_vocabulary_entries_at_minus_infinity_get_no_probability_and_no_nan():
    inputs = head_inputs(6, torch.float32, bias=True)
    with torch.no_grad():
        inputs["bias"][::3] = -torch.inf  # e.g. a vocabulary padded for the matmul, masked out
    inputs["targets"][inputs["targets"] % 3 == 0] += 1  # targets among the allowed entries
    got = values_and_gradients(chunked_logprobs, inputs, chunk_tokens=4)
    want = values_and_gradients(unchunked_logprobs, inputs)
    for name, value in want.items():
        assert torch.isfinite(got[name]).all(), name
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_no_logits_tensor_is_kept_for_backward():
    inputs = head_inputs(12, torch.float32, bias=True)  # vocabulary 37
    saved: list[tuple[int, ...]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs, _ = chunked_logprobs(inputs["hidden"], inputs["weight"], inputs["targets"], bias=inputs["bias"],
                                       chunk_tokens=4, with_entropy=True)  # fmt: skip
    assert saved and not [shape for shape in saved if len(shape) == 2 and shape[1] == 37]  # [rows, vocabulary]
    logprobs.sum().backward()  # the recomputation in backward works from what was kept
    assert inputs["weight"].grad.shape == (37, 16)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"chunk_tokens": -1}, "chunk_tokens must be >= 0"),
        ({"targets": torch.zeros(4, dtype=torch.long)}, r"expected hidden \[M, H\] and targets \[M\]"),
    ],
)
def test_bad_arguments_are_value_errors(kwargs, message):
    inputs = head_inputs(3, torch.float32, bias=False)
    arguments = {"hidden": inputs["hidden"], "weight": inputs["weight"], "targets": inputs["targets"], **kwargs}
    with pytest.raises(ValueError, match=message):
        chunked_logprobs(**arguments)
