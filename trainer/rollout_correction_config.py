"""``rollout_correction:`` of ``rallyrl train``: how the loss corrects the gap between the engine that
sampled the tokens and the trainer (``trainer/rollout_correction.py`` applies it).

A preset names a combination (``PRESETS``); every field left null takes the preset's value, so one
setting picks a family member and any field overrides it. ``resolve`` gives the settings in force.
The token ratio is pi_trainer / pi_engine of each trained token (log-ratio = trainer logprob -
engine logprob); IS weights reweight a token's policy-gradient term, masks drop it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from data.config_tree import check_fields

CorrectionPreset = Literal["none", "token-tis", "seq-tis", "icepop", "seq-geo-mask", "bypass", "bypass-pg"]
CorrectionMode = Literal["decoupled", "bypass", "bypass-pg"]
WeightLevel = Literal["none", "token", "sequence"]
Bounds = list[float] | Literal["none"] | None
"""A mask's ``[lo, hi]`` on ratios (kept inside, bounds included), ``none`` (off) or null (the preset's)."""

MASKS = ("token_mask", "seq_mean_mask", "seq_geo_mask", "seq_any_token_mask")
SEQUENCE_WEIGHT_CAP = 2.0
"""The cap of sequence-level weights where ``weight_cap`` is not set."""

PRESETS: dict[str, dict] = {
    "none": {},
    "token-tis": {"weights": "token"},
    "seq-tis": {"weights": "sequence"},
    "icepop": {"token_mask": (0.5, 2.0)},
    "seq-geo-mask": {"seq_geo_mask": (0.99, 1.01)},
    "bypass": {"mode": "bypass"},
    "bypass-pg": {"mode": "bypass-pg", "weights": "token"},
}
"""Each preset's settings; what a preset leaves out is off (mode ``decoupled``, no weights, no masks)."""


@dataclass(frozen=True)
class Correction:
    """The settings in force, every one decided (what ``RolloutCorrection.resolve`` gives)."""

    mode: CorrectionMode = "decoupled"
    weights: WeightLevel = "none"
    weight_cap: float | None = None
    """None exactly when ``weights`` is ``none``."""
    token_mask: tuple[float, float] | None = None
    seq_mean_mask: tuple[float, float] | None = None
    seq_geo_mask: tuple[float, float] | None = None
    seq_any_token_mask: tuple[float, float] | None = None

    @property
    def masks(self) -> bool:
        """Whether any mask is on."""
        return any(getattr(self, name) is not None for name in MASKS)


@dataclass
class RolloutCorrection:
    """``rollout_correction:`` the correction of the engine/trainer gap: IS weights, masks and bypass.

    The engine's logprobs differ from the trainer's under the same weights (other kernels, bf16,
    top-k/top-p cuts) and, with ``async_rl``, by staleness. ``decoupled`` (the default) keeps the
    trainer's logprobs as PPO's old policy and corrects with weights and masks on the ratio
    pi_trainer(old) / pi_engine; ``bypass`` trusts the PPO ratio against the engine instead."""

    preset: CorrectionPreset = "token-tis"
    """The family member, table in docs/training.md "Rollout correction". ``token-tis`` (today's):
    token weights capped at ``tis_cap``; ``seq-tis``: one weight per sequence; ``icepop``: tokens
    outside [0.5, 2] dropped; ``seq-geo-mask``: sequences whose geometric mean ratio leaves [0.99,
    1.01] dropped; ``bypass``: PPO clipped against the engine; ``bypass-pg``: policy gradient with
    token weights pi_trainer / pi_engine; ``none``: no correction (the metrics still come)."""
    mode: CorrectionMode | None = None
    """``decoupled``: PPO's old logprobs are the trainer's (with ``ppo_epochs`` > 1 a forward pass
    before the step computes them), the ratio of weights and masks is pi_old / pi_engine (AReaL's
    decoupled PPO). ``bypass``: the old logprobs are the engine's, so the clipped ratio pi / pi_engine
    is the correction and no pass computes old logprobs (verl's bypass; cheaper, and right when the
    gap is small); the ratio already is the weight, so a preset's weights give way and ``weights``
    set here is an error; masks act on pi / pi_engine. ``bypass-pg``: a plain policy gradient (no
    clipping) weighted by ``weights`` on pi / pi_engine, no old-logprob pass. null: the preset's."""
    weights: WeightLevel | None = None
    """IS weights on each token's policy-gradient term, truncated at ``weight_cap``: ``token``
    min(ratio, cap) per token (TIS, Yao et al. 2025: low variance, some bias); ``sequence``
    min(exp(sum of the sequence's token log-ratios), cap) on every token of it (Seq-TIS: unbiased
    per sequence before the cap, variance growing with length); ``none``. null: the preset's."""
    weight_cap: float | None = None
    """The weights' cap (> 0). null: ``tis_cap`` for token weights (tis_cap null turns a preset's
    token weights off), 2.0 for sequence weights."""
    token_mask: Bounds = None
    """IcePop (AReaL, SkyRL: [0.5, 2]): a token whose ratio is outside [lo, hi] is dropped from the
    loss. For rare tokens the two sides disagree wildly on; ``none``: off; null: the preset's."""
    seq_mean_mask: Bounds = None
    """A sequence whose arithmetic mean of token ratios is outside [lo, hi] is dropped whole (TRL's
    and SkyRL's sequence mask). ``none``: off; null: the preset's."""
    seq_geo_mask: Bounds = None
    """A sequence whose geometric mean of token ratios, exp(mean log-ratio), is outside [lo, hi] is
    dropped whole (SkyRL: [0.99, 1.01]; verl's Geo-RS): length-neutral, so long agentic
    trajectories are judged like short ones. ``none``: off; null: the preset's."""
    seq_any_token_mask: Bounds = None
    """A sequence with any token ratio outside [lo, hi] is dropped whole (a veto on catastrophic
    tokens, e.g. [1e-4, 1e4]). ``none``: off; null: the preset's."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.weight_cap is not None and not self.weight_cap > 0:
            raise ValueError(f"rollout_correction.weight_cap must be > 0 (or null), got {self.weight_cap}")
        for name in MASKS:
            bounds = getattr(self, name)
            if isinstance(bounds, list) and not (len(bounds) == 2 and 0 <= bounds[0] < bounds[1]):
                raise ValueError(f"rollout_correction.{name} must be [lo, hi] with 0 <= lo < hi "
                                 f"(or none: off), got {bounds}")  # fmt: skip

    def resolve(self, tis_cap: float | None) -> Correction:
        """The settings in force: the preset's, each field set here replacing its value; ``tis_cap``
        (``GRPOConfig``'s) caps token weights where ``weight_cap`` is not set."""
        settings = dict(PRESETS[self.preset])
        for name in ("mode", "weights", *MASKS):
            value = getattr(self, name)
            if value is not None:
                settings[name] = None if value == "none" else tuple(value) if isinstance(value, list) else value
        weights = settings.get("weights") or "none"
        cap = self.weight_cap
        if cap is None and weights != "none":
            cap = tis_cap if weights == "token" else SEQUENCE_WEIGHT_CAP
            if cap is None and self.weights == "token":
                raise ValueError("rollout_correction.weights: token needs a cap: set rollout_correction.weight_cap "
                                 "(tis_cap is null)")  # fmt: skip
            if cap is None:  # the preset's token weights, with tis_cap: null (off, as before the section)
                weights = "none"
        mode = settings.get("mode") or "decoupled"
        if mode == "bypass" and weights != "none":
            if self.weights not in (None, "none"):
                raise ValueError(f"rollout_correction.weights: {weights} with mode: bypass would count the gap twice "
                                 "(the clipped ratio pi / pi_engine already is the weight): set weights: none, or "
                                 "mode: bypass-pg for a policy gradient with weights")  # fmt: skip
            weights = "none"  # the preset's weights give way to bypass's ratio
        masks = {name: settings.get(name) for name in MASKS}
        return Correction(mode=mode, weights=weights, weight_cap=cap if weights != "none" else None, **masks)
