"""Token-in, token-out conversation building over a tokenizer's chat template.

- The prompt is rendered once, tool schemas included.
- Assistant tokens are appended exactly as the engine returned them, never re-tokenized;
  the template's glue after an assistant turn (``<|im_end|>\\n`` in ChatML) is appended
  around them with loss mask 0.
- Tool and user messages are appended by *delta rendering*: a fixed base conversation is
  rendered with and without the new messages, and only the suffix is tokenized, so a
  template that rewrites earlier turns cannot shift tokens already generated.
- ``check_consistency`` re-renders the whole conversation and diffs it with the tokens
  built turn by turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

_SENTINEL = "\u2063RALLYRL-ASSISTANT-CONTENT\u2063"
_BASE_MESSAGES = [
    {"role": "user", "content": "base user turn"},
    {"role": "assistant", "content": _SENTINEL},
]


_GENERIC_TOKENIZER_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def _same_backend(tokenizer: PreTrainedTokenizerBase, probe: str) -> Any:
    """The Rust tokenizer behind a fast tokenizer when calling it directly gives the same ids and
    text as the transformers wrapper on ``probe`` (a rendered conversation, special tokens and
    all), else None. Skipping the wrapper saves tens of microseconds a call, every turn."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        ids = tokenizer.encode(probe, add_special_tokens=False)
        same_ids = backend.encode(probe, add_special_tokens=False).ids == ids
        text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        same_text = backend.decode(ids, skip_special_tokens=False) == text
    except Exception:  # an unusual backend: keep the wrapper
        return None
    return backend if same_ids and same_text else None


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load a local tokenizer as its directory declares it (nothing is downloaded).

    transformers 5 swaps in the model type's own tokenizer class for some models (qwen2
    among them) even when ``tokenizer_config.json`` names the generic fast tokenizer, which
    rebuilds the pre-tokenizer; a directory that declares the generic class gets exactly its
    ``tokenizer.json`` here.
    """
    path = Path(path)
    config_file = path / "tokenizer_config.json"
    declared = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.is_file() else None
    if declared in _GENERIC_TOKENIZER_CLASSES and (path / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


class TemplateError(ValueError):
    """The chat template cannot be used for incremental (delta) rendering."""


@dataclass
class ConsistencyReport:
    """Re-rendered conversation versus the incremental tokens. ``diff`` is empty when ``ok``."""

    ok: bool
    expected_len: int
    actual_len: int
    first_mismatch: int | None = None
    diff: str = ""


class ChatTokenizer:
    """A tokenizer plus the tool schemas of a rollout: renders prompts, glue and deltas."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, tools: list[dict[str, Any]] | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(f"tokenizer {tokenizer.name_or_path!r} has no chat_template")
        self.tokenizer = tokenizer
        self.tools = tools or None
        self._backend = None
        base_text = self.render(_BASE_MESSAGES)
        self._backend = _same_backend(tokenizer, base_text + self.render(_BASE_MESSAGES[:1], True))
        cut = base_text.rfind(_SENTINEL)
        if cut < 0:
            raise TemplateError("the chat template does not render assistant content as given")
        close_text = base_text[cut + len(_SENTINEL) :]
        self.turn_close_ids: list[int] = self.encode(close_text)
        """What the template puts after an assistant message's content, e.g. ``<|im_end|>\\n``."""
        self._base_text = base_text
        stop = set()
        if self.turn_close_ids:
            stop.add(self.turn_close_ids[0])
        if tokenizer.eos_token_id is not None:
            stop.add(tokenizer.eos_token_id)
        self.stop_token_ids: list[int] = sorted(stop)

    # ----- rendering ------------------------------------------------------------------------

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The first prompt: the conversation so far, tools included, and the generation prompt."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def assistant_text(self, output_ids: list[int]) -> str:
        """The assistant message content for engine output (without its closing stop token)."""
        if output_ids and output_ids[-1] in self.stop_token_ids:
            output_ids = output_ids[:-1]
        return self.decode(output_ids)

    def assistant_close_ids(self, output_ids: list[int]) -> list[int]:
        """The template's glue after an assistant turn that the engine did not produce itself."""
        close = self.turn_close_ids
        if output_ids and close and output_ids[-1] == close[0]:
            return close[1:]
        return close

    def delta_ids(self, new_messages: list[dict[str, Any]]) -> list[int]:
        """Tokens of ``new_messages`` (tool or user turns) plus the next generation prompt."""
        full = self.render(_BASE_MESSAGES + new_messages, add_generation_prompt=True)
        if not full.startswith(self._base_text):
            roles = ", ".join(m["role"] for m in new_messages)
            raise TemplateError(
                f"the chat template changes earlier turns when [{roles}] messages follow an assistant "
                "turn, so they cannot be appended incrementally"
            )
        return self.encode(full[len(self._base_text) :])

    # ----- checking -------------------------------------------------------------------------

    def check_consistency(self, messages: list[dict[str, Any]], ids: list[int]) -> ConsistencyReport:
        """Re-render ``messages`` in one go and compare with ``ids`` built turn by turn.

        A conversation that ends in an assistant turn may lack the template's closing glue
        (generation stopped there), so a missing tail equal to that glue is not a difference.
        """
        ends_with_assistant = messages[-1]["role"] == "assistant"
        expected = self.encode(self.render(messages, add_generation_prompt=not ends_with_assistant))
        report = ConsistencyReport(ok=True, expected_len=len(expected), actual_len=len(ids))
        tail = expected[len(ids) :]
        allowed_tails = ([], self.turn_close_ids, self.turn_close_ids[1:]) if ends_with_assistant else ([],)
        if expected[: len(ids)] == ids and tail in allowed_tails:
            return report
        index = next(
            (i for i, (a, b) in enumerate(zip(expected, ids, strict=False)) if a != b),
            min(len(expected), len(ids)),
        )
        report.ok, report.first_mismatch = False, index
        report.diff = self._describe_mismatch(expected, ids, index)
        return report

    def _describe_mismatch(self, expected: list[int], actual: list[int], index: int, context: int = 24) -> str:
        def token(ids: list[int]) -> str:
            if index >= len(ids):
                return "<end>"
            return f"{self.tokenizer.convert_ids_to_tokens(ids[index])!r} (id {ids[index]})"

        def window(ids: list[int]) -> str:
            before = self.decode(ids[max(0, index - context) : index])
            after = self.decode(ids[index : index + context])
            return repr(before) + " | " + repr(after)

        return (
            f"token {index}: re-rendered has {token(expected)}, incremental has {token(actual)} "
            f"(lengths {len(expected)} vs {len(actual)})\n"
            f"  re-rendered: {window(expected)}\n"
            f"  incremental: {window(actual)}"
        )
