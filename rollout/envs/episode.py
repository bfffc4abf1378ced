"""What the bindings of hubs that share process-wide state need: each episode's own random generators,
and NLTK kept offline while a game loads.

textarena seeds Python's global ``random`` at reset, GEM seeds NumPy's too: ``EpisodeRandom`` gives each
episode its own copy of both, swapped in under one lock for each call into the hub (``inside``), so a seed
gives the same game however many episodes run at once and the process's generators are left as they were.
The lock also means calls into these hubs run one at a time (they hold the GIL for their pure-Python work
anyway). ``offline_nltk``: ``nltk.download`` only looks on disk while a game loads; missing data is an
``EnvError`` naming it and the command that installs it.
"""

from __future__ import annotations

import contextlib
import random
import re
import threading
from collections.abc import Iterator
from typing import Any

from rollout.envs.step import EnvError

_NLTK_CATEGORIES = ("corpora", "taggers", "tokenizers", "chunkers", "models", "grammars", "misc", "sentiment")
_GLOBAL_RANDOM = threading.Lock()


class EpisodeRandom:
    """One episode's own copy of the process-wide generators (``random``, ``numpy.random``): ``active()``
    swaps it in, under one lock, for a call into a hub that seeds and draws from the global ones."""

    def __init__(self) -> None:
        import numpy as np

        self._python = random.Random().getstate()  # fresh entropy: unseeded episodes differ
        self._numpy = np.random.RandomState().get_state()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        import numpy as np

        with _GLOBAL_RANDOM:
            saved = random.getstate(), np.random.get_state()
            random.setstate(self._python)
            np.random.set_state(self._numpy)
            try:
                yield
            finally:
                self._python, self._numpy = random.getstate(), np.random.get_state()
                random.setstate(saved[0])
                np.random.set_state(saved[1])


@contextlib.contextmanager
def inside(episode_random: EpisodeRandom, env: str) -> Iterator[None]:
    """A call into a hub's game: under the one lock, with the episode's own generators, NLTK offline."""
    with episode_random.active(), offline_nltk(env):
        yield


@contextlib.contextmanager
def offline_nltk(env: str) -> Iterator[None]:
    """``nltk.download`` looks on disk only while a game loads: data that is there is used, data that is
    not is an EnvError naming it (never a download; the caller holds the global lock)."""
    try:
        import nltk
    except ImportError:
        yield
        return

    def download(info_or_id: Any = None, *args: Any, **kwargs: Any) -> bool:
        for name in [info_or_id] if isinstance(info_or_id, str) else list(info_or_id or []):
            if not _nltk_has(nltk, str(name)):
                raise EnvError(_nltk_missing(env, str(name)))
        return True

    real = nltk.download
    nltk.download = download
    try:
        yield
    except LookupError as exc:  # the data was looked up without a download call first
        found = re.search(r"Resource (\S+?) not found", re.sub(r"\x1b\[[0-9;]*m", "", str(exc)))  # nltk colours it
        raise EnvError(_nltk_missing(env, found.group(1) if found else str(exc).strip()[:200])) from None
    finally:
        nltk.download = real


def _nltk_has(nltk: Any, name: str) -> bool:
    for category in _NLTK_CATEGORIES:
        try:
            nltk.data.find(f"{category}/{name}")
            return True
        except LookupError:
            continue
    return False


def _nltk_missing(env: str, name: str) -> str:
    return (f"environment {env} needs the NLTK data {name!r}, which is not installed here, and nothing "
            f"is downloaded at run time: install it once beforehand: python -m nltk.downloader {name} "
            f"(nltk.download({name!r}))")  # fmt: skip
