"""Records of a step-environment task: ``--task textarena:GuessTheNumber-v0`` gives ``num`` records,
each one episode of that environment with its own seed (``seed + i``).

A record holds a short system message; the environment's first observation becomes the first user
message when the request starts (``rollout/envs/interaction.py``). Its ``interaction_kwargs`` name the
built-in environment interaction (``env``), the environment and the seed, as a verl record names its
interaction, so a file of such records (``rallyrl data prep``) runs the same way.
"""

from __future__ import annotations

from typing import Any

from data.schema import Record

ENV_FAMILIES = ("textarena", "gem", "skyrl_gym", "openenv")
"""The hubs whose environments a task may name (``rollout/envs/bindings.py`` binds each one)."""
ENV_INTERACTION = "env"
"""The name of the built-in environment interaction records refer to."""
ENV_SYSTEM_PROMPT = "You are playing a game. Each of your replies is your next move."


def is_env_task(name: str) -> bool:
    """``family:id`` names a step environment of a known family."""
    head, sep, rest = name.partition(":")
    return bool(sep and rest) and head.replace("-", "_") in ENV_FAMILIES


def make_env_records(
    spec: str, num: int, seed: int = 0, *, env_kwargs: dict[str, Any] | None = None, system_prompt: str | None = None
) -> list[Record]:
    """``num`` episodes of the environment ``spec``, seeded ``seed``, ``seed + 1``, ...."""
    records = []
    for i in range(num):
        kwargs: dict[str, Any] = {"name": ENV_INTERACTION, "env": spec, "seed": seed + i}
        if env_kwargs:
            kwargs["env_kwargs"] = dict(env_kwargs)
        records.append(
            Record(
                prompt=[{"role": "system", "content": system_prompt or ENV_SYSTEM_PROMPT}],
                data_source=spec,
                extra={"interaction_kwargs": kwargs},
                index=i,
            )
        )
    return records
