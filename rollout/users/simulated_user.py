"""A simulated user: a model plays the user of a conversation, with a persona and a goal.

```yaml
interaction:
  - name: user
    class_name: rollout.users.simulated_user:SimulatedUser
    config: {url: http://127.0.0.1:30000/v1, max_concurrency: 16, temperature: 0.7, max_user_turns: 5}
```

and a record's ``interaction_kwargs``: ``{name: user, persona: "a retired teacher who ...", goal:
"find out ...", max_user_turns: 3}`` (``max_user_turns`` optional). The simulator is any
OpenAI-compatible URL (``url``), a model directory run in-process (``model``; ``embedded`` or
left empty: the embedded tiny model), or, in code, any rallyrl Engine with its tokenizer:
``SimulatedUser(config, engine=engine, tokenizer=tokenizer)``. Its calls are bounded, timed and
retried as the judge's are (``rollout/users/chat_model.py``).

What the simulator sees: a system prompt made from ``system_template`` ({persona}, {goal},
{done_marker}), then the conversation as its user sees it in a chat window, roles flipped:

- the policy's ``assistant`` messages are the simulator's ``user`` messages, with their tool
  calls cut off (the text before the first ``<tool_call>``); an assistant message that was only
  tool calls is left out;
- the policy's ``user`` messages (the record's opening question and the simulator's own earlier
  replies) are the simulator's ``assistant`` messages;
- the policy's ``system`` and ``tool`` messages are left out: the user never sees the
  assistant's instructions or its tool results, only what the assistant tells it;
- neighbouring messages of one role (a reply, its tool call, the reply after it) are joined by
  a blank line, so the roles alternate.

Its reply is the next user message. A reply with the done marker (``[DONE]``) in it declares the
goal met and ends the conversation (``should_terminate``; the marker is cut from the text).
After ``max_user_turns`` replies, the next user turn ends the conversation without calling the
simulator, so every reply it wrote gets the policy's answer. An empty reply is retried as an
unparsable one. Turn scores are 0.0; ``calculate_score`` is 1.0 when the simulator declared the
goal met, else 0.0 (the simulator's own verdict: use a judge or a checker where it must be
trusted). Each turn's metadata holds the simulator's ``latency_s`` (queueing and retries
included) and ``attempts``. A simulator that still fails after its retries raises
ChatModelError: the rollout ends that request alone with an error.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from data.config_tree import build, check_fields
from rollout.users.chat_model import ChatModel, ChatModelStats, ChatSettings
from rollout.users.interactions import BaseInteraction

SYSTEM_TEMPLATE = """You are role-playing a user who is chatting with an AI assistant. Stay in character: \
never say that you are an AI, a simulator or role-playing.

Your persona: {persona}

Your goal: {goal}

Write only your next message to the assistant: short, in the first person, as this user would write it. \
Give the assistant what it asks for, a piece at a time; do not solve the task yourself. When the assistant \
has fully met your goal, thank it in one short sentence and end your message with {done_marker}. \
Never write {done_marker} before your goal is met."""
_PLACEHOLDER_RE = re.compile(r"\{(persona|goal|done_marker)\}")
_TOOL_CALL = "<tool_call>"
EMBEDDED = "embedded"
"""``model: embedded`` (or an empty ``model:``): the embedded tiny model."""


@dataclass
class SimulatedUserConfig:
    """The ``config:`` mapping of a SimulatedUser in the interaction YAML."""

    url: str | None = None
    """OpenAI-compatible URL of the simulator (``.../v1`` or its ``/chat/completions``)."""
    model: str | None = None
    """A local model directory to run in-process instead (``embedded`` or empty: the embedded tiny model)."""
    served_model: str = "default"
    """With ``url``: the ``model`` field of each request (vLLM and OpenAI check it)."""
    device: str = "auto"
    """With ``model``: where its in-process engine runs (auto, cpu, cuda, cuda:1, ...)."""
    max_concurrency: int = 16
    """Most simulator calls in flight at once; the others wait in a queue."""
    temperature: float = 0.7
    """Sampling temperature of the simulator."""
    max_tokens: int = 256
    """Most tokens of one user reply."""
    timeout_s: float = 30.0
    """Wall-clock limit of one simulator call (the rollout's ``interaction_timeout_s`` bounds the whole
    turn, retries included)."""
    max_retries: int = 3
    """Retries of a failed call (engine or HTTP error, timeout, empty reply) before the turn fails."""
    backoff_s: float = 0.5
    """First retry delay; doubles each retry, with jitter."""
    backoff_max_s: float = 8.0
    """Longest retry delay."""
    api_key: str | None = None
    """Sent as ``Authorization: Bearer`` to the URL."""
    connect_timeout_s: float = 10.0
    """Limit on opening a connection to the URL."""
    system_template: str = SYSTEM_TEMPLATE
    """The simulator's system prompt, with {persona} and {goal} (and {done_marker})."""
    max_user_turns: int = 5
    """Most user replies per conversation (a record's interaction_kwargs.max_user_turns overrides it)."""
    done_marker: str = "[DONE]"
    """What the simulator writes when its goal is met; cut from the text the policy sees."""

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("max_concurrency", "max_tokens", "max_user_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_retries < 0 or self.temperature < 0 or self.backoff_s < 0 or self.backoff_max_s < 0:
            raise ValueError("max_retries, temperature, backoff_s and backoff_max_s must be >= 0")
        if not self.done_marker.strip():
            raise ValueError("done_marker must not be empty")
        missing = [p for p in ("{persona}", "{goal}") if p not in self.system_template]
        if missing:
            raise ValueError(f"system_template must contain {' and '.join(missing)}")
        if "{done_marker}" not in self.system_template and self.done_marker not in self.system_template:
            raise ValueError("system_template must tell the simulator its done marker ({done_marker})")
        if self.url is not None and self.model is not None:
            raise ValueError(
                "url and model are both given: model is a local model directory to run in-process; "
                "the name a server serves goes in served_model"
            )

    def settings(self) -> ChatSettings:
        """How each simulator call is made."""
        return ChatSettings(
            max_concurrency=self.max_concurrency, max_tokens=self.max_tokens, temperature=self.temperature,
            timeout_s=self.timeout_s, max_retries=self.max_retries, backoff_s=self.backoff_s,
            backoff_max_s=self.backoff_max_s, model=self.served_model, api_key=self.api_key,
            connect_timeout_s=self.connect_timeout_s,
        )  # fmt: skip


def simulator_view(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The policy's conversation as its user sees it, roles flipped (see the module docstring)."""
    view: list[dict[str, str]] = []
    for message in messages:
        role = message.get("role")
        if role not in ("user", "assistant"):
            continue  # system and tool messages: the user never sees them
        text = _text(message.get("content"))
        if role == "assistant":
            text = text.split(_TOOL_CALL, 1)[0]
        text = text.strip()
        if not text:
            continue
        flipped = "assistant" if role == "user" else "user"
        if view and view[-1]["role"] == flipped:
            view[-1]["content"] += "\n\n" + text
        else:
            view.append({"role": flipped, "content": text})
    return view


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of an OpenAI content list."""
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return "" if content is None else str(content)


class SimulatedUser(BaseInteraction):
    """A user played by a model (see the module docstring). An async context manager: entering it
    opens the HTTP session (``url``) or loads and starts the in-process engine (``model``)."""

    def __init__(
        self,
        config: dict[str, Any] | SimulatedUserConfig | None = None,
        *,
        engine: Any = None,
        tokenizer: Any = None,
    ):
        if isinstance(config, SimulatedUserConfig):  # model None there: not given
            values = {k: v for k, v in asdict(config).items() if v is not None or k != "model"}
        else:
            values = dict(config or {})
        super().__init__(values)
        where = f"simulated user {self.name!r}"
        values.pop("name", None)
        self.settings = build(SimulatedUserConfig, values, f"{where}: config")
        """The validated config."""
        self.stats = ChatModelStats()
        """The simulator's calls, retries, unparsable (empty) replies and failures."""
        self.model_dir: Path | None = None
        """The model directory of an in-process simulator (``model``), loaded on entry."""
        self.chat_model: ChatModel | None = None
        """The simulator behind its bound, timeout and retries (for ``model``: once entered)."""
        self._owned_engine: Any = None
        self._where = where
        if engine is not None:
            if self.settings.url is not None or "model" in values:
                raise ValueError(f"{where}: an engine is given, so config.url and config.model must not be")
            self.chat_model = self._chat_model(engine, tokenizer)
        elif self.settings.url is not None:
            self.chat_model = self._chat_model(self.settings.url)
        elif "model" in values:
            from rollout.api import resolve_model

            model = self.settings.model
            try:
                self.model_dir = resolve_model(None if model in (None, "", EMBEDDED) else model)
            except ValueError as exc:
                raise ValueError(f"{where}: config.model: {exc}") from None
        else:
            raise ValueError(
                f"{where}: config needs url (an OpenAI-compatible server) or model (a model directory, "
                f"or '{EMBEDDED}' for the embedded tiny model)"
            )

    def __repr__(self) -> str:
        return f"SimulatedUser({self.name!r}, {self.settings.url or self.model_dir or self.chat_model!r})"

    def _chat_model(self, backend: Any, tokenizer: Any = None) -> ChatModel:
        return ChatModel(backend, self.settings.settings(), tokenizer=tokenizer, label="simulated user",
                         stats=self.stats)  # fmt: skip

    @property
    def in_flight(self) -> int:
        """Simulator calls running now."""
        return self.chat_model.in_flight if self.chat_model else 0

    @property
    def max_in_flight(self) -> int:
        """The most simulator calls that ran at once."""
        return self.chat_model.max_in_flight if self.chat_model else 0

    @property
    def queued(self) -> int:
        """Simulator calls waiting for a slot now."""
        return self.chat_model.queued if self.chat_model else 0

    async def __aenter__(self) -> SimulatedUser:
        if self.model_dir is not None and self._owned_engine is None:
            self._owned_engine, tokenizer = await asyncio.to_thread(self._load_engine)
            await self._owned_engine.__aenter__()
            self.chat_model = self._chat_model(self._owned_engine, tokenizer)
        if self.chat_model is not None:
            await self.chat_model.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self.chat_model is not None:
            await self.chat_model.__aexit__(*exc_info)
        if self._owned_engine is not None:  # a call after this finds the simulator not open
            engine, self._owned_engine, self.chat_model = self._owned_engine, None, None
            await engine.__aexit__(*exc_info)

    def _load_engine(self) -> tuple[Any, Any]:
        from rollout.engines.local import LocalEngine, LocalEngineConfig
        from rollout.tokens import load_tokenizer

        assert self.model_dir is not None
        config = LocalEngineConfig(max_batch_size=self.settings.max_concurrency, device=self.settings.device)
        return LocalEngine.from_pretrained(self.model_dir, config), load_tokenizer(self.model_dir)

    # ----- verl's BaseInteraction ---------------------------------------------------------------

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """A conversation with ``persona`` and ``goal`` (both required; ``max_user_turns`` optional)."""
        for key in ("persona", "goal"):
            value = kwargs.get(key)
            if not isinstance(value, str) or not value.strip():
                got = "it is missing" if value is None else f"got {value!r}"
                raise ValueError(f"{self._where} needs interaction_kwargs.{key} (a non-empty string): {got}")
        max_user_turns = kwargs.get("max_user_turns", self.settings.max_user_turns)
        if isinstance(max_user_turns, bool) or not isinstance(max_user_turns, int) or max_user_turns < 1:
            raise ValueError(f"{self._where}: interaction_kwargs.max_user_turns must be an integer >= 1, "
                             f"got {max_user_turns!r}")  # fmt: skip
        instance_id = instance_id or uuid.uuid4().hex
        self._instances[instance_id] = {
            "system": self.system_prompt(kwargs["persona"], kwargs["goal"]),
            "max_user_turns": max_user_turns,
            "user_turns": 0,
            "goal_met": False,
        }
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """The simulator's next user message; should_terminate when it declared the goal met or
        the user-turn limit was reached (then without calling the simulator)."""
        state = self._instances.get(instance_id)
        if state is None:
            raise RuntimeError(f"{self._where}: no conversation {instance_id!r} (start_interaction first)")
        if state["user_turns"] >= state["max_user_turns"]:
            return True, "", 0.0, {"user_turn": state["user_turns"], "goal_met": False, "stopped": "max_user_turns"}
        if self.chat_model is None:
            raise RuntimeError(f"{self._where} is not open: use it inside 'async with simulated_user:'")
        prompt = [{"role": "system", "content": state["system"]}, *simulator_view(messages)]
        reply = await self.chat_model.complete(prompt, parse=self.parse)
        text, goal_met = reply.value
        state["user_turns"] += 1
        state["goal_met"] = goal_met
        metadata = {"user_turn": state["user_turns"], "goal_met": goal_met, "latency_s": round(reply.latency_s, 6),
                    "attempts": reply.attempts}  # fmt: skip
        return goal_met, text, 0.0, metadata

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        """1.0 when the simulator declared its goal met (wrote the done marker), else 0.0."""
        return 1.0 if self._instances[instance_id]["goal_met"] else 0.0

    # ----- the prompt and the reply ------------------------------------------------------------

    def system_prompt(self, persona: str, goal: str) -> str:
        """The template filled in (braces in the persona and the goal are kept as they are)."""
        values = {"persona": persona.strip(), "goal": goal.strip(), "done_marker": self.settings.done_marker}
        return _PLACEHOLDER_RE.sub(lambda match: values[match[1]], self.settings.system_template)

    def parse(self, reply: str) -> tuple[str, bool] | None:
        """(the user's text without the done marker, whether the marker was there); None for an
        empty reply (retried)."""
        marker = self.settings.done_marker
        goal_met = marker in reply
        text = reply.replace(marker, "").strip()
        return None if not text and not goal_met else (text, goal_met)
