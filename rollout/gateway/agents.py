"""Agents we do not own, run for training: an entry point ``agent(base_url, record)`` talking to the
gateway (``rollout/gateway/app.py``), one session per (prompt, sample).

```python
async def agent(base_url: str, record: dict) -> float | None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none")
    ...  # its own tools and control flow; may return the reward
```

``AgentDriver.run`` takes the place of ``rollout.loop.run_request`` for a request: it opens the
session that records into that request, calls the agent with the session's base URL and the
record (``prompt``, ``ground_truth``, ``data_source``, ``extra``, ``tools_kwargs``, indices), and
finishes the session when the agent returns (its return value, when a number, is the reward unless
one was posted), raises (``error``), or runs past ``gateway.agent_timeout_s``. A synchronous
function runs in a worker thread. The runner, the asynchronous producer and the trainer take the
finished request as they take one of the native loop.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rollout.config import RolloutConfig
from rollout.gateway.app import Gateway
from rollout.gateway.errors import GatewayError
from rollout.request import AsyncRolloutRequest, FinishReason, RequestState

AgentFn = Callable[[str, dict[str, Any]], Awaitable[Any] | Any]

COLLECT_EVERY = 64
"""Agent runs between two full garbage collections. An agent's HTTP client usually leaves reference
cycles behind (its connections, transports, tasks), holding its SSL context (about 1 MB of OpenSSL
memory, the CA bundle) until a full collection, which a rollout's heap makes rare: without these,
a training process grew by ~1 MB per run of ``data/agents/calc_openai.py`` (16.8 GB at 40 steps).
A collection takes ~70 ms during a rollout (its old objects frozen): ~1 ms per run. Every 256 runs
costs as much (more garbage each time) and lets the process grow further between collections."""


class AgentSetupError(ValueError):
    """An agent entry point that cannot be loaded or called."""


def load_agent(spec: str) -> AgentFn:
    """``"pkg.module:function"`` or ``"path/to/file.py:function"`` -> the function."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise AgentSetupError(f"agent: {spec!r} is not an entry point like 'pkg.module:function' or 'file.py:function'")
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise AgentSetupError(f"agent: {path}: no such file")
            module_name = f"rallyrl_agent_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]}"
            module = sys.modules.get(module_name)  # loaded once: the setup check and the gateway share it
            if module is None:
                module_spec = importlib.util.spec_from_file_location(module_name, path)
                assert module_spec is not None and module_spec.loader is not None
                module = importlib.util.module_from_spec(module_spec)
                sys.modules[module_name] = module
                try:
                    module_spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[module_name]
                    raise
        else:
            if str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))
            module = importlib.import_module(target)
    except AgentSetupError:
        raise
    except Exception as exc:
        raise AgentSetupError(f"agent: cannot import {target!r}: {type(exc).__name__}: {exc}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise AgentSetupError(f"agent: {target!r} has no function {name!r}")
    try:
        inspect.signature(function).bind("http://base", {})
    except (TypeError, ValueError):
        raise AgentSetupError(f"agent: {spec} must take two arguments, (base_url, record)") from None
    return function


def agent_record(request: AsyncRolloutRequest) -> dict[str, Any]:
    """What the agent is given of its record (copies: the agent may change them freely)."""
    import copy

    return {
        "prompt": copy.deepcopy(request.messages),
        "ground_truth": request.ground_truth,
        "data_source": request.data_source,
        "extra": copy.deepcopy(request.extra),
        "tools_kwargs": copy.deepcopy(request.tools_kwargs),
        "prompt_index": request.prompt_index,
        "sample_index": request.sample_index,
    }


class AgentDriver:
    """Runs an agent entry point for a request, through a session of ``gateway``."""

    def __init__(self, gateway: Gateway, agent: AgentFn, timeout_s: float):
        self.gateway, self.agent, self.timeout_s = gateway, agent, timeout_s
        self._threads: ThreadPoolExecutor | None = None  # a synchronous agent's own threads, one per run in flight
        self._runs = 0

    def _in_thread(self, url: str, record: dict[str, Any], rollout: RolloutConfig) -> asyncio.Future[Any]:
        """A synchronous agent's run on a thread of the driver's own pool, sized by the concurrency bound
        (asyncio's default pool has a handful of threads, shared with everything else)."""
        if self._threads is None:
            self._threads = ThreadPoolExecutor(max_workers=rollout.max_concurrency, thread_name_prefix="agent")
        return asyncio.get_running_loop().run_in_executor(self._threads, self.agent, url, record)

    def close(self) -> None:
        """Let the threads of a synchronous agent go (they end with their runs)."""
        if self._threads is not None:
            self._threads.shutdown(wait=False)

    async def run(self, request: AsyncRolloutRequest, rollout: RolloutConfig | None = None) -> AsyncRolloutRequest:
        """Drive ``request`` with the agent; never raises, except CancelledError (the session is then
        finished as aborted)."""
        record = agent_record(request)
        try:
            session = self.gateway.open_session(request, request.request_id, rollout)
        except GatewayError as exc:  # too many sessions open (gateway.max_sessions), or the id is taken
            request.finish(FinishReason.ERROR, f"the gateway opened no session: {exc}")
            request.transition(RequestState.COMPLETED)
            return request
        error: str | None = None
        reward: float | None = None
        try:
            url = self.gateway.base_url(session.id)
            async with asyncio.timeout(self.timeout_s):
                if inspect.iscoroutinefunction(self.agent):
                    result = await self.agent(url, record)
                else:  # a synchronous agent in a thread (an async callable object hands back its coroutine)
                    result = await self._in_thread(url, record, rollout or session.config)
                if inspect.isawaitable(result):
                    result = await result
            if isinstance(result, (int, float)) and not isinstance(result, bool) and math.isfinite(result):
                reward = float(result)
        except asyncio.CancelledError:
            await asyncio.shield(self.gateway.finish_session(session, reason=FinishReason.ABORT, error="cancelled"))
            raise
        except TimeoutError:
            error = f"the agent did not return within {self.timeout_s:g} s (gateway.agent_timeout_s)"
        except Exception as exc:
            error = f"the agent raised {type(exc).__name__}: {exc}"
        if error is not None and session.refused is not None:  # the agent gave up on a refused call
            reason, message = session.refused
            session.refused = (reason, f"{message}; {error}")  # the session ends as length or max_turns
            error = None
        done = await self.gateway.finish_session(session, error=error, reward=reward)
        self._runs += 1
        if self._runs % COLLECT_EVERY == 0:
            gc.collect()
        return done
