"""A chat template's text around message contents, so that ``ChatTokenizer`` (``rollout/tokens.py``)
can render a conversation without running the template: where the template does nothing with a
content but print it (or test whether it is empty), the text around the contents depends on the
conversation's shape alone (roles, empty contents), computed once per shape and checked on probe
contents. Also the direct call of the compiled template (``direct_renderer``) and of the Rust
tokenizer (``same_backend``) where they give what the transformers wrappers give."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import PreTrainedTokenizerBase

_CONTENT = "\u2063RALLYRL-CONTENT-{}\u2063"
_PROBE_CONTENTS = (
    "", " ", "x", "  two words \n", '\n<tool_call>{"a": [1, "b"]}</tool_call>\n', "<tool_response>", "</think>",
    "a\tb\r", "&<>\"'\\", "{{ x }} {% y %}", "\u65e5\u672c \U0001f600", "None", "0",
)  # fmt: skip
"""Contents a template must put in verbatim before the text around contents is reused."""
_FULL_PROBES = tuple(content for content in _PROBE_CONTENTS if content)


def same_backend(tokenizer: PreTrainedTokenizerBase, probe: str) -> Any:
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


Render = Any  # (messages, add_generation_prompt) -> str

MAX_STRUCTURES = 1024
"""Conversation shapes whose template pieces are kept (past that, new shapes are rendered every time)."""


def direct_renderer(tokenizer: PreTrainedTokenizerBase, tools: list[dict[str, Any]] | None) -> Render | None:
    """The compiled chat template called as ``apply_chat_template`` calls it, for plain messages;
    None where the wrapper must be kept (the check is in ``ChatTokenizer.__init__``)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template, _plain_template_data

        compiled = _compile_jinja_template(tokenizer.get_chat_template(None, tools))
        plain_tools = _plain_template_data(tools)
        kwargs = _plain_template_data(dict(tokenizer.special_tokens_map))
    except Exception:  # another transformers: keep the wrapper
        return None

    def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return compiled.render(
            messages=messages, tools=plain_tools, documents=None, add_generation_prompt=add_generation_prompt, **kwargs
        )

    return render


class _Watched(str):
    """A message content that notes whether the template did anything with it but print it or
    test whether it is empty: any other test, comparison, filter or method call on it sets its
    ``read`` (concatenation does not)."""

    read = False

    def __bool__(self) -> bool:  # ``{% if content %}``: the pieces are kept per emptiness of each content
        return str.__len__(self) > 0


def _watch(name: str) -> Any:
    method = getattr(str, name)

    def watched(self: _Watched, *args: Any, **kwargs: Any) -> Any:
        object.__setattr__(self, "read", True)
        return method(self, *args, **kwargs)

    return watched


_UNWATCHED = {"__str__", "__repr__", "__add__", "__new__", "__init__", "__getattribute__", "__setattr__", "__class__",
              "__init_subclass__", "__subclasshook__", "__getnewargs__", "__reduce__", "__reduce_ex__", "__sizeof__",
              "__dir__", "__doc__"}  # fmt: skip
"""What printing, concatenating and building the content use: not a look at what it holds."""
for _name in dir(str):
    if _name not in _UNWATCHED and callable(getattr(str, _name)):
        setattr(_Watched, _name, _watch(_name))


Shape = tuple[tuple[str, bool], ...]
"""A conversation's roles, and whether each content is empty: what template pieces are kept by."""


def shape_of(messages: list[dict[str, Any]]) -> Shape | None:
    """The shape of plain messages (only ``role`` and ``content`` strings: what the wrapper would pass
    to the template unchanged); None for any other."""
    shape = []
    for message in messages:
        if type(message) is not dict or len(message) != 2:
            return None
        role, content = message.get("role"), message.get("content")
        if type(role) is not str or type(content) is not str:
            return None
        shape.append((role, not content))
    return tuple(shape)


def joined(pieces: list[str], contents: list[str]) -> str:
    """Template pieces with the contents between them: ``pieces[0] + contents[0] + pieces[1] + ...``."""
    text = pieces[0]
    for content, piece in zip(contents, pieces[1:], strict=True):
        text += content + piece
    return text


class TemplateError(ValueError):
    """The chat template cannot be used for incremental (delta) rendering."""


def around_contents(shape: Shape, text_of: Callable[[list[dict[str, Any]]], str]) -> list[str] | None:
    """The text ``text_of`` gives around the contents of messages of this shape (roles, and which
    contents are empty), one piece more than messages, when it puts each content in verbatim and
    does nothing else with it: nothing but a test for emptiness touches a content (``_Watched``),
    each appears once, and probe contents (``_PROBE_CONTENTS``) come out as the pieces say. Then
    its output depends on the shape alone, and joining the pieces with the contents is
    rendering. None where any of that fails."""
    sentinels = ["" if empty else _CONTENT.format(i) for i, (_, empty) in enumerate(shape)]
    try:
        text = text_of([{"role": r, "content": c} for (r, _), c in zip(shape, sentinels, strict=True)])
        watched = [_Watched(c) for c in sentinels]
        if text_of([{"role": r, "content": c} for (r, _), c in zip(shape, watched, strict=True)]) != text:
            return None
    except TemplateError:
        return None
    if any(content.read for content in watched):
        return None
    pieces = []
    for sentinel in sentinels:
        if not sentinel:  # an empty content: anywhere will do
            pieces.append("")
            continue
        before, found, text = text.partition(sentinel)
        if not found or sentinel in text:
            return None
        pieces.append(before)
    pieces.append(text)
    for i in range(len(_FULL_PROBES)):
        contents = ["" if e else _FULL_PROBES[(i + k) % len(_FULL_PROBES)] for k, (_, e) in enumerate(shape)]
        probe = [{"role": r, "content": c} for (r, _), c in zip(shape, contents, strict=True)]
        try:
            expected = text_of(probe)
        except TemplateError:
            return None
        if expected != joined(pieces, contents):
            return None
    return pieces

