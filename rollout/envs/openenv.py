"""OpenEnv environments as the other side of the conversation: ``openenv:<url>`` or ``openenv:<import path>``.

    openenv:http://127.0.0.1:8000            a running OpenEnv server (``create_app``'s ``/ws`` sessions)
    openenv:my_pkg.envs:MyEnv                an Environment class (or an app, or a function returning one)
                                             that rallyrl serves itself on loopback (``tools/openenv_server.py``)

Each episode is one WebSocket session of openenv's own ``GenericEnvClient``: ``reset`` opens it (with the
record's seed), each assistant turn is one ``step``, ``close`` ends it. The action is built from the
assistant's text: ``{action_field: text, **action_extra}``. ``action_field`` defaults to the action's one
required string field in the server's ``/schema`` (``message`` in openenv's echo and TextArena environments),
else ``message``. The observation's text is ``observation_field`` when given, else the observation's only
string field, else its fields as JSON. Reward and done are the step result's (no reward counts 0).

env_kwargs: ``action_field``, ``observation_field``, ``action_extra`` (constant action fields),
``reset_kwargs`` (more arguments of ``reset``), ``connect_timeout_s`` (10), ``message_timeout_s`` (60); for
a server rallyrl starts: ``start_timeout_s`` (60), ``action_cls`` / ``observation_cls`` (import paths, when
they cannot be read off the class) and ``max_sessions`` (concurrent episodes; 256 for an environment with
``SUPPORTS_CONCURRENT_SESSIONS``, else 1).

Servers rallyrl starts live until ``OpenEnvBinding.shutdown()`` (the interaction's exit) or the process's
exit; one that dies is started again for the next episode, while the episodes it carried end with an error
that says how it ended and shows the end of its log.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import orjson

from rollout.envs.step import Step, observation_text
from tools.openenv_server import LocalServer, died, is_url, local_server, stop_local_servers

SKIPPED_FIELDS = {"metadata", "done", "reward"}
"""Fields of actions and observations that are never the text: openenv's own bookkeeping."""
DEFAULT_ACTION_FIELD = "message"

_schemas: dict[str, dict[str, Any]] = {}
_schemas_lock = threading.Lock()


class OpenEnvBinding:
    """One episode of an OpenEnv environment, over one WebSocket session."""

    def __init__(
        self,
        env_id: str,
        *,
        action_field: str | None = None,
        observation_field: str | None = None,
        action_extra: dict[str, Any] | None = None,
        reset_kwargs: dict[str, Any] | None = None,
        connect_timeout_s: float = 10.0,
        message_timeout_s: float = 60.0,
        start_timeout_s: float = 60.0,
        action_cls: str | None = None,
        observation_cls: str | None = None,
        max_sessions: int | None = None,
    ):
        from openenv.core.generic_client import GenericEnvClient

        self.spec = f"openenv:{env_id}"
        self.server: LocalServer | None = None
        if is_url(env_id):
            given = [k for k, v in {"action_cls": action_cls, "observation_cls": observation_cls,
                                    "max_sessions": max_sessions}.items() if v is not None]  # fmt: skip
            if given:
                raise ValueError(f"environment {self.spec}: {', '.join(given)} only apply to a server rallyrl starts")
            self.url = env_id.rstrip("/")
        else:
            self.server = local_server(env_id, "env", start_timeout_s, action_cls=action_cls,
                                       observation_cls=observation_cls, max_sessions=max_sessions)  # fmt: skip
            self.url = self.server.url
        self.action_field = _action_field(_schema(self.url), self.spec, action_field)
        self.observation_field = observation_field
        self.action_extra = dict(action_extra or {})
        self.reset_kwargs = dict(reset_kwargs or {})
        self.client = GenericEnvClient(
            base_url=self.url, connect_timeout_s=connect_timeout_s, message_timeout_s=message_timeout_s
        )

    @classmethod
    def shutdown(cls) -> None:
        """Stop the servers rallyrl started for OpenEnv environments (blocking; a later episode starts them again)."""
        stop_local_servers("env")

    async def reset(self, seed: int | None, messages: list[dict[str, Any]]) -> str:
        kwargs = dict(self.reset_kwargs)
        if seed is not None:
            kwargs["seed"] = seed
        result = await self._call(self.client.reset(**kwargs))
        return self._text(result.observation)

    async def step(self, action: str) -> Step:
        result = await self._call(self.client.step({**self.action_extra, self.action_field: action}))
        info = result.metadata if isinstance(result.metadata, dict) else {}
        return Step(self._text(result.observation), float(result.reward or 0.0), bool(result.done), False, dict(info))

    async def close(self) -> None:
        await self.client.close()

    # ----- reading the server's answers ---------------------------------------------------------------

    def _text(self, observation: Any) -> str:
        """The observation's text: ``observation_field``, else its only string field, else its fields as JSON."""
        if not isinstance(observation, dict):
            return _as_text(observation)
        if self.observation_field is not None:
            if self.observation_field not in observation:
                raise ValueError(
                    f"observation_field {self.observation_field!r} is not in the observation "
                    f"(its fields: {', '.join(sorted(observation)) or 'none'})"
                )
            return _as_text(observation[self.observation_field])
        fields = {k: v for k, v in observation.items() if k not in SKIPPED_FIELDS}
        texts = [v for v in fields.values() if isinstance(v, str)]
        if len(texts) == 1:
            return texts[0]
        if len(fields) == 1:
            return _as_text(next(iter(fields.values())))
        return orjson.dumps(fields, default=str, option=orjson.OPT_SORT_KEYS).decode()

    async def _call(self, call: Any) -> Any:
        """Await a client call; a failure says what became of a server rallyrl started, or what to change."""
        try:
            return await call
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self.server is not None and await died(self.server, exc):
                raise ConnectionError(f"{self.server.describe()} ({type(exc).__name__}: {exc})") from exc
            if "CAPACITY_REACHED" in str(exc):
                raise RuntimeError(
                    f"{exc}; the server at {self.url} holds too few sessions for the requests in flight: raise its "
                    "max_concurrent_envs (env_kwargs max_sessions for a server rallyrl starts) or lower max_concurrency"
                ) from exc
            raise


def _schema(url: str) -> dict[str, Any]:
    """The server's ``/schema`` (action, observation, state), read once per server; {} without one."""
    with _schemas_lock:
        if url in _schemas:
            return _schemas[url]
    try:
        response = httpx.get(f"{url}/schema", timeout=10.0, trust_env=False)
        schema = response.json() if response.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        schema = {}
    with _schemas_lock:
        _schemas[url] = schema if isinstance(schema, dict) else {}
        return _schemas[url]


def _action_field(schema: dict[str, Any], spec: str, given: str | None) -> str:
    """The action field the assistant's text fills: ``given`` (checked against the schema), else the action's
    one required string field (or its one string field); ``message`` when the server publishes no schema."""
    action = schema.get("action")
    if not isinstance(action, dict) or not isinstance(action.get("properties"), dict):
        return given or DEFAULT_ACTION_FIELD
    properties = {k: v for k, v in action["properties"].items() if k not in SKIPPED_FIELDS}
    title = action.get("title", "Action")
    if given is not None:
        if given not in properties:
            raise ValueError(f"environment {spec}: action_field {given!r} is not a field of its action ({title}: "
                             f"{', '.join(properties) or 'none'})")  # fmt: skip
        return given
    strings = [k for k, v in properties.items() if isinstance(v, dict) and v.get("type") == "string"]
    required = [k for k in strings if k in (action.get("required") or ())]
    for candidates in (required, strings):
        if len(candidates) == 1:
            return candidates[0]
    if DEFAULT_ACTION_FIELD in strings:
        return DEFAULT_ACTION_FIELD
    raise ValueError(
        f"environment {spec}: its action ({title}) has the fields {', '.join(properties) or 'none'}; name the one "
        "the assistant's text fills with env_kwargs action_field (and constant values of the others with action_extra)"
    )


def _as_text(value: Any) -> str:
    """An observation field as text: as ``observation_text`` reads it, else as JSON (a typed server's fields
    are JSON already)."""
    try:
        return observation_text(value)
    except TypeError:
        return orjson.dumps(value, default=str, option=orjson.OPT_SORT_KEYS).decode()
