"""Open files for thousands of requests in flight: each request to a server holds a socket, so a
rollout of N requests in flight needs about N file descriptors more than the process has open.

``ensure_open_files`` raises the process's soft limit (``RLIMIT_NOFILE``) as far as its hard limit
allows, before the first request; where even the hard limit is too low, it stops the run before it
starts with an error that says how many are needed and how to get them.
"""

from __future__ import annotations

import os
import resource
from typing import Any

HEADROOM = 256
"""Descriptors kept free beyond the sockets: log and output files, pipes of tool subprocesses, imports."""


def open_now() -> int:
    """File descriptors this process has open (``/proc/self/fd``; 0 where it cannot be read)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def sockets_for(engine: Any, in_flight: int) -> int:
    """Sockets ``in_flight`` requests hold on ``engine``: one each on an HTTP engine or pool (at most its
    servers' connection limits), none in process."""
    count = getattr(engine, "sockets_for", None)
    return count(in_flight) if callable(count) else 0


def ensure_open_files(sockets: int) -> int:
    """Make room for ``sockets`` more open files (plus ``HEADROOM``): the soft limit raised where it is
    lower, up to the hard limit; a ValueError saying how many are needed where the hard limit is lower.
    Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if sockets == 0:
        return soft
    needed = open_now() + sockets + HEADROOM
    if needed <= soft:
        return soft
    if hard != resource.RLIM_INFINITY and needed > hard:
        raise ValueError(
            f"{sockets} requests in flight need about {needed} open files (a socket each, and what the process "
            f"has open), but this process may open at most {hard} (its hard limit, `ulimit -Hn`). Raise it "
            f"(`ulimit -n {needed}` as root, LimitNOFILE={needed} in a systemd unit, nofile in "
            "/etc/security/limits.conf), or lower max_concurrency, or cap engine.http.max_connections"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed if hard == resource.RLIM_INFINITY else hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
