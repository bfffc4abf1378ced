"""Token-in, token-out conversation building over a tokenizer's chat template.

- The prompt is rendered once, tool schemas included.
- Assistant tokens are appended exactly as the engine returned them, never re-tokenized;
  the template's glue after an assistant turn (``<|im_end|>\\n`` in ChatML) is appended
  around them with loss mask 0.
- Tool and user messages are appended by *delta rendering*: a fixed base conversation is
  rendered with and without the new messages, and only the suffix is tokenized, so a
  template that rewrites earlier turns cannot shift tokens already generated.
- ``check_consistency`` re-renders the whole conversation and diffs it with the tokens
  built turn by turn. With a ``Transcript`` of the conversation (``rollout/transcript.py``),
  whose segments were checked as they were appended, the re-render is compared as text and
  re-encoded only when something differs: the same report, without tokenizing it all again.
- Rendering goes straight to the compiled template for plain ``{role, content}`` messages (the
  wrapper rebuilds every message and schema first), once that is checked to give the wrapper's
  text; the prompt is encoded segment by segment, the segments every prompt shares (system
  prompt, tool schemas) once.
- Where the template does nothing with a content but print it (or test whether it is empty),
  a conversation is rendered as the template's own text around the contents, computed once
  per shape (roles, empty contents) and checked on probe contents (``rollout/template_pieces.py``); plain
  ASCII text is encoded and decoded in Python for byte-level BPE tokenizers, checked against
  the Rust tokenizer (``rollout/ascii_tokens.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from rollout.ascii_tokens import AsciiDecoder
from rollout.content_text import ContentsAsText, ContentText
from rollout.template_pieces import (
    MAX_STRUCTURES,
    Render,
    Shape,
    TemplateError,
    around_contents,
    direct_renderer,
    joined,
    same_backend,
    shape_of,
)
from rollout.tokenizer_files import MODEL_STOP_IDS, load_tokenizer
from rollout.transcript import SegmentSplitter, Transcript, fast_encoder

__all__ = ["MODEL_STOP_IDS", "ChatTokenizer", "ConsistencyReport", "TemplateError", "load_tokenizer"]

_SENTINEL = "\u2063RALLYRL-ASSISTANT-CONTENT\u2063"
_BASE_MESSAGES = [
    {"role": "user", "content": "base user turn"},
    {"role": "assistant", "content": _SENTINEL},
]


@dataclass
class ConsistencyReport:
    """Re-rendered conversation versus the incremental tokens. ``diff`` is empty when ``ok``."""

    ok: bool
    expected_len: int
    actual_len: int
    first_mismatch: int | None = None
    diff: str = ""


def longest_token_chars(tokenizer: Any) -> int | None:
    """At most how many characters one token decodes to (its vocabulary's longest entry: byte-level and
    SentencePiece entries spell each byte or character with one), or None when it cannot be read. A text
    longer than a context times this cannot fit that context."""
    try:
        return max(map(len, tokenizer.get_vocab()), default=None)
    except Exception:
        return None


_PROBE_END = 8192
"""Characters of each end of the rendered probe conversation the backend is checked on (``same_backend``)."""


class ChatTokenizer:
    """A tokenizer plus the tool schemas of a rollout: renders prompts, glue and deltas. With
    ``content_special_tokens="text"`` the contents of system, user and tool messages are tokenized as
    text: a special token's string in one is its characters' tokens (``rollout/content_text.py``)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, tools: list[dict[str, Any]] | None = None,
                 content_special_tokens: str = "text"):  # fmt: skip
        if content_special_tokens not in ("text", "tokens"):
            raise ValueError(f"content_special_tokens must be 'text' or 'tokens', got {content_special_tokens!r}")
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(f"tokenizer {tokenizer.name_or_path!r} has no chat_template")
        self.tokenizer = tokenizer
        self.tools = tools or None
        self._backend = None
        self._encode: Callable[[str], list[int]] | None = None
        self._ascii_decode: AsciiDecoder | None = None
        self._splitter: SegmentSplitter | None = None
        self._direct: Render | None = None
        self._pieces: dict[Shape, list[str] | None] = {}  # a delta's, by the shape of its messages
        self._conversations: dict[tuple[Shape, bool], list[str] | None] = {}  # (shape, generation prompt)
        base_text = self.render(_BASE_MESSAGES)
        direct = direct_renderer(tokenizer, self.tools)
        tool_turns = [{"role": "tool", "content": " t\n"}, {"role": "tool", "content": ""}]
        probes = [(_BASE_MESSAGES, False), (_BASE_MESSAGES[:1], True),
                  ([{"role": "system", "content": "s"}, *_BASE_MESSAGES, *tool_turns], True)]  # fmt: skip
        if direct is not None and all(direct(m, g) == self.render(m, g) for m, g in probes):
            self._direct = direct
        probe = base_text + self.render(_BASE_MESSAGES[:1], True)
        if len(probe) > 2 * _PROBE_END:  # a long tool list: its ends only (the check holds the GIL in Rust)
            probe = probe[:_PROBE_END] + probe[-_PROBE_END:]
        self._backend = same_backend(tokenizer, probe)
        self._splitter = SegmentSplitter.of(self._backend)
        self._encode = None if self._backend is None else fast_encoder(self._backend)
        self._ascii_decode = None if self._backend is None else AsciiDecoder.of(self._backend)
        self._content = ContentText.of(tokenizer) if content_special_tokens == "text" else None
        cut = base_text.rfind(_SENTINEL)
        if cut < 0:
            raise TemplateError("the chat template does not render assistant content as given")
        close_text = base_text[cut + len(_SENTINEL) :]
        self.turn_close_ids: list[int] = self.encode(close_text)
        """What the template puts after an assistant message's content, e.g. ``<|im_end|>\\n``."""
        self._base_text = base_text
        written = set(self.turn_close_ids[:1])  # stop tokens the template writes itself after a turn
        if tokenizer.eos_token_id is not None:
            written.add(tokenizer.eos_token_id)
        declared = set(getattr(tokenizer, MODEL_STOP_IDS, None) or ())
        eos = {tokenizer.eos_token_id} - {None}
        self.stop_token_ids: list[int] = sorted(declared | eos if declared else written)
        """Where generation stops: the model's own stop tokens (``generation_config.json``) when it
        declares them (gpt-oss ends turns with <|return|> or <|call|>, and <|end|> only ends a
        message), else the template's turn close and EOS."""
        self._openers = self._next_message_openers(declared)
        self._stop_text = {token: self.decode([token]) for token in sorted(written | self._openers)}
        """The stop tokens a message's content leaves out (the template writes them): others, such as
        gpt-oss's <|call|>, stay in the content as the model wrote them."""
        self._close_text = close_text
        rest = self.turn_close_ids[1:]
        first = self.decode(self.turn_close_ids[:1])
        self._close_rest_text = close_text[len(first) :] if close_text.startswith(first) else self.decode(rest)
        self._close_rest_trusted = self.encode(self._close_rest_text) == rest

    # ----- rendering ------------------------------------------------------------------------

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        shape = None if self._direct is None else shape_of(messages)
        if shape is not None:
            pieces = self._conversation_pieces(shape, add_generation_prompt)
            if pieces is None:
                return self._direct(messages, add_generation_prompt)
            return joined(pieces, [message["content"] for message in messages])
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _conversation_pieces(self, shape: Shape, add_generation_prompt: bool) -> list[str] | None:
        """The template's text around the contents of a conversation of this shape, when it
        prints each content verbatim and does nothing else with it (``around_contents``); None
        where it does not (the conversation is then rendered every time)."""
        key = (shape, add_generation_prompt)
        if key not in self._conversations:
            if len(self._conversations) >= MAX_STRUCTURES:
                return None
            direct = self._direct
            self._conversations[key] = around_contents(shape, lambda messages: direct(messages, add_generation_prompt))
        return self._conversations[key]

    def encode(self, text: str) -> list[int]:
        if self._encode is not None:
            return self._encode(text)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        if self._ascii_decode is not None:
            try:
                return self._ascii_decode(ids)
            except KeyError:  # an id that is not plain ASCII on its own (or none at all)
                pass
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The first prompt: the conversation so far, tools included, and the generation prompt."""
        return self.prompt(messages)[1]

    def prompt(self, messages: list[dict[str, Any]]) -> tuple[str, list[int]]:
        """The first prompt's text and ids."""
        if self._content is not None and self._content.holds(messages):
            return self._content.render(messages, lambda masked: self.render(masked, True), self.encode)
        text = self.render(messages, add_generation_prompt=True)
        if self._splitter is not None:
            return text, self._splitter.encode(text, remember=True)
        return text, self.encode(text)

    def assistant_text(self, output_ids: list[int]) -> str:
        """The assistant message content for engine output (without a closing stop token the template writes)."""
        if output_ids and output_ids[-1] in self._stop_text:
            output_ids = output_ids[:-1]
        return self.decode(output_ids)

    def _next_message_openers(self, stops: set[int]) -> set[int]:
        """Stop tokens that open the next message (GLM-4.5 ends a turn with <|observation|> or <|user|>,
        which the template writes at the start of the tool or user message, and writes nothing after
        an assistant turn): the generated one is kept and the delta's copy dropped (``delta_after``)."""
        if self.turn_close_ids or not stops:
            return set()
        starts = []
        for message in ({"role": "tool", "content": "t"}, {"role": "user", "content": "u"}):
            try:
                starts.append(self._rendered_delta([message]))
            except TemplateError:
                continue
        return {stop for stop in stops if any(start.startswith(self.decode([stop])) for start in starts)}

    def delta_after(self, output_ids: list[int], delta: tuple[str, list[int]]) -> tuple[str, list[int]]:
        """``delta`` without its first token when the turn's generated stop token already opened it."""
        text, ids = delta
        if output_ids and ids and output_ids[-1] in self._openers and ids[0] == output_ids[-1]:
            opener = self._stop_text[ids[0]]
            cut = text[len(opener) :] if text.startswith(opener) else self.decode(ids[1:])
            return (ContentsAsText(cut) if isinstance(text, ContentsAsText) else cut), ids[1:]
        return delta

    def opens_next_message(self, token: int) -> bool:
        """Whether ``token`` is a stop token that opens the next message (``_next_message_openers``)."""
        return token in self._openers

    def closing_tails(self) -> tuple[str, ...]:
        """What a rendering of a conversation that ends with an assistant turn may have beyond its
        tokens: nothing, the template's turn close, or the close without the generated stop token."""
        return ("", self._close_text, self._close_rest_text)

    def assistant_close_ids(self, output_ids: list[int]) -> list[int]:
        """The template's glue after an assistant turn that the engine did not produce itself."""
        close = self.turn_close_ids
        if output_ids and close and output_ids[-1] == close[0]:
            return close[1:]
        return close

    def delta_ids(self, new_messages: list[dict[str, Any]]) -> list[int]:
        """Tokens of ``new_messages`` (tool or user turns) plus the next generation prompt."""
        return self.delta(new_messages)[1]

    def delta(self, new_messages: list[dict[str, Any]]) -> tuple[str, list[int]]:
        """The text and ids of ``new_messages`` plus the next generation prompt."""
        if self._content is not None and self._content.holds(new_messages):
            return self._content.render(new_messages, self._rendered_delta, self.encode)
        shape = shape_of(new_messages)
        pieces = None if shape is None else self._delta_pieces(shape)
        if pieces is None:
            text = self._rendered_delta(new_messages)
            return text, self._splitter.encode(text) if self._splitter is not None else self.encode(text)
        # the template's own text around the contents, rendered (and its segments encoded) once for this shape
        contents = [message["content"] for message in new_messages]
        text = joined(pieces, contents)
        if self._splitter is None:
            return text, self.encode(text)
        ids = self._splitter.encode_around(pieces, contents)
        return text, self._splitter.encode(text) if ids is None else ids

    def _rendered_delta(self, new_messages: list[dict[str, Any]]) -> str:
        full = self.render(_BASE_MESSAGES + new_messages, add_generation_prompt=True)
        if not full.startswith(self._base_text):
            roles = ", ".join(m["role"] for m in new_messages)
            raise TemplateError(
                f"the chat template changes earlier turns when [{roles}] messages follow an assistant "
                "turn, so they cannot be appended incrementally"
            )
        return full[len(self._base_text) :]

    def _delta_pieces(self, shape: Shape) -> list[str] | None:
        """The delta of messages of this shape as the text around their contents (``around_contents``),
        None where the template does not print contents as they are (the delta is then rendered
        every time). A TemplateError if the template rewrites history."""
        if shape not in self._pieces:
            if self._direct is None or len(self._pieces) >= MAX_STRUCTURES:
                return None
            empty = [{"role": role, "content": ""} for role, _ in shape]
            self._rendered_delta(empty)  # a TemplateError where the template rewrites history
            self._pieces[shape] = around_contents(shape, self._direct_delta)
        return self._pieces[shape]

    def _direct_delta(self, messages: list[dict[str, Any]]) -> str:
        full = self._direct(_BASE_MESSAGES + messages, True)  # type: ignore[misc]
        if not full.startswith(self._base_text):
            raise TemplateError("the chat template changes earlier turns")
        return full[len(self._base_text) :]

    # ----- the transcript: the incremental check ----------------------------------------------

    def transcript(self, prompt_text: str, prompt_ids: list[int]) -> Transcript | None:
        """A transcript that starts with the prompt (None: this tokenizer has no incremental check)."""
        if self._splitter is None:
            return None
        transcript = Transcript(self._splitter)
        transcript.append(prompt_text, prompt_ids, trusted=not isinstance(prompt_text, ContentsAsText))
        return transcript

    def add_output(self, transcript: Transcript | None, output_ids: list[int], content: str) -> None:
        """Engine tokens and their text: the message content plus the stop token it left out."""
        if transcript is not None:
            stopped = bool(output_ids) and output_ids[-1] in self._stop_text
            transcript.append(content + self._stop_text[output_ids[-1]] if stopped else content, output_ids, False)

    def add_context(self, transcript: Transcript | None, output_ids: list[int], delta: tuple[str, list[int]]) -> None:
        """The template's glue after the assistant turn (``assistant_close_ids``) and a delta."""
        if transcript is None:
            return
        close = self.assistant_close_ids(output_ids)
        if len(close) == len(self.turn_close_ids):
            close_text, trusted = self._close_text, True
        else:
            close_text, trusted = self._close_rest_text, self._close_rest_trusted
        delta_text, delta_ids = delta
        own = not isinstance(delta_text, ContentsAsText)  # (else its contents are text: checked, not trusted)
        if trusted and own and transcript.splitter.pattern.match(delta_text):  # cut at a split token: one piece
            transcript.append(close_text + delta_text, close + delta_ids, trusted=True)
        else:
            transcript.append(close_text, close, trusted)
            transcript.append(delta_text, delta_ids, trusted=own)

    # ----- checking -------------------------------------------------------------------------

    def check_consistency(
        self, messages: list[dict[str, Any]], ids: list[int], transcript: Transcript | None = None
    ) -> ConsistencyReport:
        """Re-render ``messages`` in one go and compare with ``ids`` built turn by turn.

        A conversation that ends in an assistant turn may lack the template's closing glue
        (generation stopped there), so a missing tail equal to that glue is not a difference.
        With the ``transcript`` of ``ids``, the re-render is compared as text first; it is
        re-encoded only when that, or a segment's check, fails.
        """
        ends_with_assistant = messages[-1]["role"] == "assistant"
        if ends_with_assistant and ids and ids[-1] in self._openers:  # the last turn's stop opened no message
            ids, transcript = ids[:-1], None
        rendered = self.render(messages, add_generation_prompt=not ends_with_assistant)
        if transcript is not None:
            tail = self._tail_beyond_transcript(rendered, ids, transcript, ends_with_assistant)
            if tail is not None:
                return ConsistencyReport(ok=True, expected_len=len(ids) + len(tail), actual_len=len(ids))
        if self._content is not None and self._content.holds(messages):  # (rendered again, contents masked)
            expected = self._content.render(messages, lambda m: self.render(m, not ends_with_assistant), self.encode)[1]
        else:
            expected = self.encode(rendered)
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

    def _tail_beyond_transcript(
        self, rendered: str, ids: list[int], transcript: Transcript, ends_with_assistant: bool
    ) -> list[int] | None:
        """The allowed tail when ``rendered`` is shown to encode to ``ids`` plus it without
        encoding it: the text is the transcript's and every segment checked. None: not shown."""
        if not transcript.ok or not transcript.holds(ids):
            return None
        text = "".join(transcript.parts)
        if rendered == text:
            return [] if transcript.closes() else None
        if not ends_with_assistant or not rendered.startswith(text):
            return None
        tail = rendered[len(text) :]
        for tail_text, tail_ids, trusted in (
            (self._close_text, self.turn_close_ids, True),
            (self._close_rest_text, self.turn_close_ids[1:], self._close_rest_trusted),
        ):
            if tail == tail_text and transcript.closes_after(tail_text, tail_ids, trusted):
                return tail_ids
        return None

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
