"""What every ``rallyrl`` command with settings shares (``cli.py`` and the commands defined beside what
they run, e.g. ``rollout/serve/command.py``): the help of the common options, bad input as one error
line, and the config tree from defaults, ``--config``, the flags given and ``--set``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from data.console import fail

CONFIG_HELP = "YAML file of config fields (`rallyrl config --show` lists them); flags override it."
SET_HELP = "Override any field, e.g. --set rollout.tool_timeout_s=5 (repeatable; the value is YAML)."
AGENT_HELP = "Agent entry point, module:function or file.py:function, run through the agent gateway."
ENGINE_SERVER_HELP = 'What serves --engine-url: "sglang" (or `rallyrl serve`), "vllm", or "auto" (ask it; default).'


DISK_FULL_EXIT = 1
"""A full disk (``data/disk_space.py``): what was written stays, and ``--resume`` goes on once there is room."""


@contextlib.contextmanager
def errors_for_people() -> Iterator[None]:
    """Bad input (config, records, tools, templates, engines) -> one line and exit 2, no stack trace;
    a full disk -> one line naming the path, the bytes needed and the free space, exit 1."""
    from data.disk_space import DiskFull
    from rollout.engines.base import EngineError

    try:
        yield
    except DiskFull as exc:
        raise fail(str(exc), DISK_FULL_EXIT) from None
    except (ValueError, EngineError) as exc:  # ConfigError, RecordError, SetupError, ... are ValueErrors
        raise fail(str(exc)) from None


def given_config(config_class: type, path: Path | None, flags: dict[str, Any], sets: list[str] | None) -> dict:
    """What the YAML file, the flags given (dotted names) and --set say, in that order of precedence."""
    from data.config_tree import given_values

    flags = {key: str(value) if isinstance(value, Path) else value for key, value in flags.items()}
    return given_values(config_class, path, flags, sets)


def load_config(config_class: type, path: Path | None, flags: dict[str, Any], sets: list[str] | None) -> Any:
    """A command's config: defaults < the YAML file < flags given < --set."""
    from data.config_tree import build

    return build(config_class, given_config(config_class, path, flags, sets))
