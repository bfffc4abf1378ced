"""The collapse warning: a run whose policy starts to break down is told so once, with the likely cause.

Read from the step metrics alone (``CollapseRules`` holds every bound). A signal's *early level* is
its median over the run's first ``early_steps`` steps (3). A step *collapses* when one of these holds
on it and on the step before (``patience``: 2 steps in a row, after the early steps), checked in this
order, the first that holds naming the cause:

1. **tool-call format breaking**: ``rollout/malformed_call_share`` at least 0.20 and at least 3x its
   level at the first step, the start model's own (not the early median: a format that breaks from
   the first update on rises within the early steps; the run that prompted this: 5 % -> 42 % in 5
   updates at lr 5e-4, KL off; reproduced at lr 2e-3 without warmup: 2 % -> 43 % in one update);
2. **tool calls failing**: ``rollout/tool_error_share`` at least 0.20 and at least 3x its level at the
   first step;
3. **entropy collapse**: ``train/entropy`` under 0.1x its early level;
4. **gradient spikes**: ``train/grad_norm_ratio`` (the step's gradient norm over the median of the
   previous 10 steps') at least 5;
5. **reward collapse**: ``rollout/accuracy`` (``rollout/reward_mean`` where nothing is graded) at most
   0.1x its best step before, that best being at least 0.1.

``CollapseWatch`` adds ``train/grad_norm_ratio`` and ``train/collapse_warning`` (0 before the warning,
1 from its step on) to each step's metrics and returns the warning the first time, once per run (a
resumed run reads the flag back and stays quiet).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GRAD_NORM_RATIO = "train/grad_norm_ratio"
COLLAPSE_WARNING = "train/collapse_warning"


@dataclass(frozen=True)
class CollapseRules:
    """The bounds of the collapse definition (module docstring); the defaults are the documented ones."""

    early_steps: int = 3
    """Steps whose median is a signal's early level."""
    patience: int = 2
    """Consecutive steps a condition must hold on (one noisy step is not a collapse)."""
    share_floor: float = 0.20
    """Malformed-call and tool-error shares: the least share that can be a collapse ..."""
    share_factor: float = 3.0
    """... and how many times its early level it must be."""
    entropy_fraction: float = 0.1
    """Entropy under this fraction of its early level."""
    grad_ratio_bound: float = 5.0
    """``train/grad_norm_ratio`` at or above this."""
    grad_ratio_window: int = 10
    """Previous steps whose median gradient norm is the ratio's denominator (at least 3 needed)."""
    reward_fraction: float = 0.1
    """Accuracy (or reward) at most this fraction of its best step before ..."""
    reward_best_floor: float = 0.1
    """... that best being at least this."""


@dataclass(frozen=True)
class Collapse:
    """A collapse found at ``step``: ``cause`` (format, tool_errors, entropy, grad_spikes, reward) and the
    warning to print."""

    step: int
    cause: str
    message: str


TITLES = {"format": "tool-call format breaking", "tool_errors": "tool calls failing", "entropy": "entropy collapse",
          "grad_spikes": "gradient spikes", "reward": "reward collapse"}  # fmt: skip
HINTS = {
    "format": "the updates are pulling the policy off its tool-call format: lower lr, warm it up over more "
    "steps (warmup_steps), add a KL term to the initial policy (kl_beta > 0), fewer ppo_epochs, or resume from a "
    "checkpoint from before it began",
    "tool_errors": "the calls are read but fail: see the tool messages of the last rollouts (rallyrl show) and "
    "the tool's schema; lower lr if the calls worked at the start",
    "entropy": "the policy is collapsing onto a few tokens: raise eps_high (clip-higher), lower lr, add kl_beta, "
    "or sample at a higher temperature",
    "grad_spikes": "the gradient norm spikes: lower lr or max_grad_norm, look for very long or truncated samples "
    "in the steps, tighten tis_cap for stale tokens",
    "reward": "the reward fell with no other signal past its bound: read the last steps' rollouts (rallyrl show), "
    "lower lr, add kl_beta, or resume from an earlier checkpoint",
}
"""What each cause likely means and what to try."""


def value(metrics: dict[str, Any], key: str) -> float | None:
    """A metric as a finite float; None where it is missing, null or NaN."""
    raw = metrics.get(key)
    if raw is None or isinstance(raw, str):
        return None
    number = float(raw)
    return number if math.isfinite(number) else None


def grad_norm_ratio(history: list[dict[str, Any]], norm: float | None, window: int = 10) -> float:
    """``norm`` over the median gradient norm of the last ``window`` steps of ``history`` that updated;
    NaN with fewer than 3 of them, or for a step that did not update."""
    updated = [m for m in history[-window:] if not m.get("train/skipped_update")]
    previous = [n for m in updated if (n := value(m, "train/grad_norm"))]
    if norm is None or norm <= 0 or len(previous) < 3:
        return math.nan
    return norm / statistics.median(previous)


def _series(history: list[dict[str, Any]], key: str) -> list[float | None]:
    return [value(m, key) for m in history]


def _early(values: list[float | None], steps: int) -> float | None:
    known = [v for v in values[:steps] if v is not None]
    return statistics.median(known) if known else None


def _share(history: list[dict[str, Any]], key: str, what: str, rules: CollapseRules) -> str | None:
    values = _series(history, key)
    early = next((v for v in values if v is not None), None)  # the start model's own share (see the docstring)
    bound = None if early is None else max(rules.share_floor, rules.share_factor * early)
    window = values[-rules.patience :]
    if bound is None or not all(v is not None and v >= bound for v in window):
        return None
    over = value(history[-1], "step") or len(history)
    return f"{what} {early:.0%} -> {window[-1]:.0%} over {over - rules.early_steps:.0f} steps ({key})"


def _entropy(history: list[dict[str, Any]], rules: CollapseRules) -> str | None:
    values = _series(history, "train/entropy")
    early = _early(values, rules.early_steps)
    window = values[-rules.patience :]
    if not early or not all(v is not None and v < rules.entropy_fraction * early for v in window):
        return None
    return f"train/entropy {early:.3g} -> {window[-1]:.3g} (under {rules.entropy_fraction:g}x its early level)"


def _grad_spikes(history: list[dict[str, Any]], rules: CollapseRules) -> str | None:
    window = _series(history, GRAD_NORM_RATIO)[-rules.patience :]
    if not all(v is not None and v >= rules.grad_ratio_bound for v in window):
        return None
    ratios = ", ".join(f"{v:.1f}x" for v in window if v is not None)
    return f"{GRAD_NORM_RATIO} {ratios} the median of the steps before (bound {rules.grad_ratio_bound:g}x)"


def score_key(metrics: dict[str, Any]) -> str:
    """``rollout/accuracy`` where the step's rollouts were graded, else ``rollout/reward_mean``."""
    return "rollout/accuracy" if value(metrics, "rollout/accuracy") is not None else "rollout/reward_mean"


def _reward(history: list[dict[str, Any]], rules: CollapseRules) -> str | None:
    key = score_key(history[-1])
    values = _series(history, key)
    before = [v for v in values[: -rules.patience] if v is not None]
    window = values[-rules.patience :]
    best = max(before, default=None)
    if best is None or best < rules.reward_best_floor:
        return None
    if not all(v is not None and v <= rules.reward_fraction * best for v in window):
        return None
    return f"{key} {best:.3g} (best step) -> {window[-1]:.3g}"


def find_collapse(history: list[dict[str, Any]], rules: CollapseRules = CollapseRules()) -> Collapse | None:
    """Whether the last step of ``history`` collapses (module docstring); the first cause that holds."""
    if len(history) < rules.early_steps + rules.patience:
        return None
    checks: list[tuple[str, Callable[[], str | None]]] = [
        ("format", lambda: _share(history, "rollout/malformed_call_share", "malformed tool calls", rules)),
        ("tool_errors", lambda: _share(history, "rollout/tool_error_share", "tool calls failing", rules)),
        ("entropy", lambda: _entropy(history, rules)),
        ("grad_spikes", lambda: _grad_spikes(history, rules)),
        ("reward", lambda: _reward(history, rules)),
    ]
    for cause, check in checks:
        evidence = check()
        if evidence is None:
            continue
        step = int(value(history[-1], "step") or len(history))
        score = "" if cause == "reward" else _score_change(history)
        message = f"collapse warning at step {step}: {TITLES[cause]}: {evidence}{score}. Likely: {HINTS[cause]}."
        return Collapse(step, cause, message)
    return None


def _score_change(history: list[dict[str, Any]]) -> str:
    """``; rollout/accuracy 0.31 -> 0.02``: the score from the first step to the last, where known."""
    key = score_key(history[-1])
    first, last = value(history[0], key), value(history[-1], key)
    return "" if first is None or last is None else f"; {key} {first:.3g} -> {last:.3g}"


def first_collapse(history: list[dict[str, Any]], rules: CollapseRules = CollapseRules()) -> Collapse | None:
    """The first step of a finished run's ``history`` that collapses (``rallyrl show`` of a metrics file)."""
    for end in range(rules.early_steps + rules.patience, len(history) + 1):
        if (found := find_collapse(history[:end], rules)) is not None:
            return found
    return None


class CollapseWatch:
    """Watches a run's steps: adds ``train/grad_norm_ratio`` and ``train/collapse_warning`` to each and
    returns the collapse warning the first time one is found."""

    def __init__(self, rules: CollapseRules = CollapseRules()) -> None:
        self.rules = rules
        self.history: list[dict[str, Any]] = []
        self.warned = False

    def replay(self, history: list[dict[str, Any]]) -> None:
        """The steps a resumed run logged before (their flag says whether it warned already)."""
        self.history = list(history)
        self.warned = any(value(m, COLLAPSE_WARNING) for m in history)

    def observe(self, metrics: dict[str, Any]) -> str | None:
        """Add the two metrics to ``metrics`` (in place); the warning when the run collapses first here."""
        norm = None if metrics.get("train/skipped_update") else value(metrics, "train/grad_norm")
        metrics[GRAD_NORM_RATIO] = grad_norm_ratio(self.history, norm, self.rules.grad_ratio_window)
        self.history.append(metrics)
        found = None if self.warned else find_collapse(self.history, self.rules)
        self.warned = self.warned or found is not None
        metrics[COLLAPSE_WARNING] = float(self.warned)
        return None if found is None else found.message
