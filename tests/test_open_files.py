"""Room for the sockets of thousands of requests in flight (``rollout/open_files.py``): the soft limit
raised up to the hard one, a connection limit counted, and a run the hard limit cannot hold stopped
before it starts, saying how many descriptors it needs. The cases run in one process of their own,
under limits it sets (the hard limit only ever lowered)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HARD = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
TOP = 20000 if HARD == resource.RLIM_INFINITY else min(HARD, 20000)
SCRIPT = f"""
import json, resource, sys
sys.path.insert(0, {str(ROOT)!r})
from rollout.engines.sglang_http import SGLangHTTPConfig, SGLangHTTPEngine
from rollout.open_files import ensure_open_files, sockets_for

def case(soft, hard, in_flight, max_connections=0):
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    engine = SGLangHTTPEngine("http://127.0.0.1:1", SGLangHTTPConfig(max_connections=max_connections))
    try:
        return {{"soft": ensure_open_files(sockets_for(engine, in_flight))}}
    except ValueError as exc:
        return {{"error": str(exc)}}

print(json.dumps([case(1024, {TOP}, 8192), case(1024, 2048, 8192, max_connections=256), case(512, 1024, 8192)]))
"""


def test_the_soft_limit_is_raised_to_the_hard_one_a_connection_limit_counts_and_too_low_a_hard_limit_says_so():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    raised, capped, refused = json.loads(done.stdout.strip().splitlines()[-1])
    assert raised == {"soft": TOP}  # 8,192 sockets: up to the hard limit
    assert capped == {"soft": 1024}  # at most 256 connections: room enough already
    error = refused["error"]
    assert "8192 requests in flight need about" in error and "at most 1024" in error and "ulimit -n" in error
