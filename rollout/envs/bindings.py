"""Which binding runs an environment named ``family:id`` (or a user's class by import path), and the
clear error when a family's extra is not installed.

    textarena:GuessTheNumber-v0        rollout/envs/textarena.py   pip install 'rallyrl[textarena]'
    gem:game:GuessTheNumber-v0-easy    rollout/envs/gem.py         pip install 'rallyrl[gem]'
    skyrl_gym:gsm8k_multi_turn         rollout/envs/skyrl_gym.py   pip install 'rallyrl[skyrl-gym]'
    openenv:http://127.0.0.1:8000      rollout/envs/openenv.py     pip install 'rallyrl[openenv]'
    my_pkg.envs:MyEnv                  a class with reset / step (gymnasium-style or SkyRL-style results)
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    """A hub of environments: its binding class, the module it needs and the extra that installs it."""

    binding: str
    module: str
    extra: str


FAMILIES: dict[str, Family] = {
    "textarena": Family("rollout.envs.textarena:TextArenaBinding", "textarena", "textarena"),
    "gem": Family("rollout.envs.gem:GEMBinding", "gem", "gem"),
    "skyrl_gym": Family("rollout.envs.skyrl_gym:SkyRLGymBinding", "skyrl_gym", "skyrl-gym"),
    "openenv": Family("rollout.envs.openenv:OpenEnvBinding", "openenv", "openenv"),
}
ALIASES = {"skyrl-gym": "skyrl_gym", "skyrlgym": "skyrl_gym", "gem-llm": "gem"}


class MissingExtraError(ImportError):
    """A family's package is not installed; the message names the pip command."""


def require(module: str, extra: str) -> Any:
    """Import ``module``, or a MissingExtraError that says ``pip install 'rallyrl[extra]'``."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".")[0] != module.split(".")[0]:
            raise  # the package is there but one of its own imports failed: show that
        raise MissingExtraError(
            f"the {extra} environments need the package {module!r}, which is not installed: "
            f"pip install 'rallyrl[{extra}]'"
        ) from None
    finally:  # gem calls logging.basicConfig(level=INFO) on import: the process's logging is not its to set
        root.handlers[:], root.level = handlers, level


def split_spec(spec: str) -> tuple[str | None, str]:
    """``"textarena:Wordle-v0"`` -> ``("textarena", "Wordle-v0")``; a spec whose head is no family is
    a user's class by import path: ``(None, spec)``."""
    head, sep, rest = spec.partition(":")
    family = ALIASES.get(head, head)
    if sep and family in FAMILIES:
        if not rest:
            raise ValueError(f"environment {spec!r}: give the environment after '{head}:'")
        return family, rest
    return None, spec


def binding_class(spec: str) -> tuple[type, str]:
    """The binding class of ``spec`` and the environment id it is given."""
    from tools.loading import import_class

    family, env_id = split_spec(spec)
    if family is None:
        from rollout.envs.generic import ClassBinding

        return ClassBinding, env_id
    entry = FAMILIES[family]
    require(entry.module, entry.extra)
    return import_class(entry.binding), env_id
