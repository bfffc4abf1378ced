"""One cgroup per ``python`` tool call: ``memory_mb`` bounds the whole call (every process and the
tmpfs pages it writes), ``max_processes`` its tasks, and its CPU weight is below a normal process's.

The tool's process (``tools/sandbox_run.py``) creates the call's cgroup before starting the
supervisor and removes it after the call (``CallCgroup.remove``, in a ``finally``); the sandbox's
init process moves itself in before it sets anything else up, so the program and everything it
starts are inside, and the supervisor and the tool's process never are. Standard library only.

- cgroup v2, where our own cgroup has the memory controller enabled for its children (root on a
  v2 host, or a delegated subtree): ``memory.max``, ``memory.swap.max`` 0, ``pids.max``,
  ``cpu.weight``; the peak from ``memory.peak``, OOM kills from ``memory.events``.
- cgroup v1, where the memory hierarchy is writable under our own memory cgroup (root in many
  containers): ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes``, no swap),
  ``pids.max`` and ``cpu.shares`` under our own pids and cpu cgroups; the peak from
  ``memory.max_usage_in_bytes``, OOM kills from ``memory.oom_control``.
- elsewhere ``None``: the per-process rlimits are all there is (``memory-per-process``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import time
from dataclasses import dataclass, field

CPU_WEIGHT = 50
"""cgroup v2 ``cpu.weight`` of a call (a normal process's group has 100); v1 gets the same share of 1024."""
NAME_PREFIX = "rallyrl-sandbox-"
"""A call's cgroup is ``<our own cgroup>/rallyrl-sandbox-<run id>``, in each hierarchy it uses."""
REMOVE_TIMEOUT_S = 5.0
"""How long ``remove`` keeps killing what is left in the cgroup before it gives up (and logs)."""


def _unescape(text: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), text)


def _mounts() -> tuple[str | None, dict[str, tuple[str, str]]]:
    """(the cgroup2 mount point, {v1 controller: (mount point, root of the mount)})."""
    unified, v1 = None, {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            dash = fields.index("-")
            fstype, options = fields[dash + 1], fields[dash + 3].split(",")
            if fstype == "cgroup2" and unified is None:
                unified = _unescape(fields[4])
            elif fstype == "cgroup":
                for controller in options:
                    v1.setdefault(controller, (_unescape(fields[4]), _unescape(fields[3])))
    return unified, v1


def _own_cgroups() -> dict[str, str]:
    """{controller, or "" for the v2 hierarchy: our cgroup's path} from /proc/self/cgroup."""
    own = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                own[controller] = path
    return own


def _join(mount: str, root: str, path: str) -> str:
    if root != "/" and (path == root or path.startswith(root + "/")):
        path = path[len(root) :]
    return os.path.join(mount, path.lstrip("/"))


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


@functools.cache
def parents() -> tuple[int, dict[str, str]] | None:
    """(cgroup version, {controller: the directory calls' cgroups are made in}), or None where no
    writable memory cgroup is available. Probed once per process."""
    unified, v1 = _mounts()
    own = _own_cgroups()
    if unified and "" in own:
        parent = _join(unified, "/", own[""])
        with contextlib.suppress(OSError):
            enabled = _read(os.path.join(parent, "cgroup.subtree_control")).split()
            wanted = [c for c in ("memory", "pids", "cpu") if c not in enabled]
            available = _read(os.path.join(parent, "cgroup.controllers")).split()
            for controller in wanted:
                if controller in available:  # only possible where our cgroup holds no process (the root)
                    with contextlib.suppress(OSError):
                        _write(os.path.join(parent, "cgroup.subtree_control"), f"+{controller}")
            enabled = _read(os.path.join(parent, "cgroup.subtree_control")).split()
            if "memory" in enabled and os.access(parent, os.W_OK):
                return 2, {controller: parent for controller in ("memory", "pids", "cpu") if controller in enabled}
    found = {}
    for controller in ("memory", "pids", "cpu"):
        if controller in v1 and controller in own:
            parent = _join(*v1[controller], own[controller])
            if os.access(parent, os.W_OK):
                found[controller] = parent
    return (1, found) if "memory" in found else None


@dataclass
class CallCgroup:
    """The cgroup(s) of one call: where its processes go (``procs_files``), what it reports."""

    version: int
    dirs: dict[str, str]
    """{controller: this call's cgroup directory} (v2: the same directory for each)."""
    mechanisms: list[str] = field(default_factory=list)
    """What was set, for ``metrics["sandbox"]``: ``cgroup-v1-memory``, ``cgroup-v1-pids``, ..."""

    def procs_files(self) -> list[str]:
        return [os.path.join(path, "cgroup.procs") for path in sorted(set(self.dirs.values()))]

    def stats(self) -> dict[str, float | int | None]:
        """``memory_peak_mb`` (the call's highest memory use, tmpfs pages included) and
        ``oom_killed`` (processes the kernel killed for the memory limit); None where unknown."""
        memory = self.dirs["memory"]
        peak_file, events_file = ("memory.peak", "memory.events") if self.version == 2 else (
            "memory.max_usage_in_bytes", "memory.oom_control")  # fmt: skip
        peak = oom = None
        with contextlib.suppress(OSError, ValueError):
            peak = round(int(_read(os.path.join(memory, peak_file))) / (1 << 20), 1)
        with contextlib.suppress(OSError, ValueError):
            counts = dict(line.split() for line in _read(os.path.join(memory, events_file)).splitlines())
            oom = int(counts["oom_kill"]) if "oom_kill" in counts else None
        return {"memory_peak_mb": peak, "oom_killed": oom}

    def remove(self) -> bool:
        """SIGKILL whatever is still in the cgroup and remove it; False when it could not be removed."""
        deadline = time.monotonic() + REMOVE_TIMEOUT_S
        for path in sorted(set(self.dirs.values())):
            while os.path.isdir(path):
                with contextlib.suppress(OSError):
                    for pid in _read(os.path.join(path, "cgroup.procs")).split():
                        with contextlib.suppress(OSError):
                            os.kill(int(pid), signal.SIGKILL)
                    os.rmdir(path)
                    break
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.01)
        return True


def create(run_id: str, memory_mb: int, max_processes: int) -> CallCgroup | None:
    """Make the call's cgroup with its limits, or None where there is no writable memory cgroup
    (or setting the memory limit failed: then nothing of it is left)."""
    found = parents()
    if found is None:
        return None
    version, parent_dirs = found
    name = NAME_PREFIX + run_id
    dirs = {controller: os.path.join(parent, name) for controller, parent in parent_dirs.items()}
    group = CallCgroup(version, {})
    limit = str(memory_mb << 20)
    try:
        for controller, path in dirs.items():
            if path not in group.dirs.values():
                os.mkdir(path, 0o755)
            group.dirs[controller] = path
        memory = dirs["memory"]
        if version == 2:
            _write(os.path.join(memory, "memory.max"), limit)
            if os.path.exists(swap := os.path.join(memory, "memory.swap.max")):
                _write(swap, "0")
        else:
            _write(os.path.join(memory, "memory.limit_in_bytes"), limit)
            if os.path.exists(swap := os.path.join(memory, "memory.memsw.limit_in_bytes")):
                _write(swap, limit)  # memory + swap: no swap
        group.mechanisms.append(f"cgroup-v{version}-memory")
    except OSError:
        group.remove()
        return None
    with contextlib.suppress(OSError, KeyError):
        _write(os.path.join(dirs["pids"], "pids.max"), str(max_processes + 1))  # + init
        group.mechanisms.append(f"cgroup-v{version}-pids")
    with contextlib.suppress(OSError, KeyError):
        weight_file, weight = ("cpu.weight", CPU_WEIGHT) if version == 2 else ("cpu.shares", CPU_WEIGHT * 1024 // 100)
        _write(os.path.join(dirs["cpu"], weight_file), str(weight))
        group.mechanisms.append(f"cgroup-v{version}-cpu")
    return group
