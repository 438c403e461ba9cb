"""Learning-rate schedules (docs/math.md §6.3, §6.4, §8 #30): pure functions and a tiny scheduler.

Every schedule is a *factor* ``f(s) ∈ [0, 1]`` of the peak learning rate, where ``s`` is the
number of optimiser updates already applied (the first update uses ``s = 0``).  With warmup length
``W``, total length ``T`` and floor ratio ``ρ`` (``min_lr_ratio``):

=============  ===============================================================================
warmup         ``f(s) = (s + 1) / W`` for ``s < W`` (all kinds; the last warmup update is at peak)
``constant``   ``f(s) = 1`` after warmup
``wsd``        warmup–stable–decay ([xHC]): ``1`` until the decay starts at ``S = T − D`` with
               ``D = round(decay_fraction · T)``; then exponential decay
               ``f(s) = ρ ** ((s − S + 1) / D)``, reaching ``ρ`` (default 0.1) at the last update
               ``s = T − 1``
``cosine``     ``f(s) = ρ + (1 − ρ) · (1 + cos(π p)) / 2`` with ``p = (s − W + 1) / (T − W)``,
               reaching ``ρ`` at ``s = T − 1``
``step``       [mHC] step decay: ``1``, then ``factors[i]`` (of the peak, not cumulative) from
               update ``round(milestones[i] · T)`` on; default ×0.316 at 80 %, ×0.1 at 90 %
=============  ===============================================================================

For ``s ≥ T`` every schedule holds its final value.  :class:`LRScheduler` writes
``lr = peak · lr_mult · f(s)`` into each optimiser param group (``peak`` is the group's
``max_lr`` when it has one, as Megatron's groups do, else the scheduler's) and, when given a
weight decay, ``weight_decay = wd · wd_mult`` (Megatron's groups carry ``wd_mult`` and rely on
the scheduler to apply it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

from xhc.config_base import ConfigBase

__all__ = [
    "KINDS",
    "LRScheduler",
    "ScheduleConfig",
    "ScheduleConfigError",
    "build_scheduler",
    "cosine_factor",
    "lr_at",
    "scaled_warmup",
    "schedule_factor",
    "step_decay_factor",
    "warmup_factor",
    "wsd_factor",
]

KINDS = ("wsd", "cosine", "constant", "step")
DEFAULT_MIN_LR_RATIO = {"wsd": 0.1, "cosine": 0.1}


class ScheduleConfigError(ValueError):
    """A schedule setting is invalid (the message names the key, e.g. ``schedule.kind``)."""


def _err(key: str, value: Any, fix: str) -> ScheduleConfigError:
    return ScheduleConfigError(f"schedule.{key}={value!r} is invalid: {fix}")


@dataclass
class ScheduleConfig(ConfigBase):
    """Learning-rate schedule.  Defaults: the [xHC] WSD recipe (500 warmup steps, decay to
    0.1 × peak over the last 10 % of training, docs/math.md §6.4 and §8 #30)."""

    kind: str = "wsd"
    """``wsd`` | ``cosine`` | ``constant`` | ``step``."""
    total_steps: int = 0
    """T, the number of optimiser updates of the run (required by ``wsd``, ``cosine``, ``step``)."""
    warmup_steps: int = 500
    """W, linear warmup length (0 = start at peak)."""
    decay_fraction: float = 0.1
    """``wsd``: the decay phase is the last ``round(decay_fraction · T)`` updates."""
    min_lr_ratio: Optional[float] = None
    """ρ: final LR / peak for ``wsd`` (default 0.1) and ``cosine`` (default 0.1)."""
    step_milestones: Tuple[float, ...] = (0.8, 0.9)
    """``step``: fractions of T at which the LR drops."""
    step_factors: Tuple[float, ...] = (0.316, 0.1)
    """``step``: LR / peak from each milestone on ([mHC]: 0.316 at 80 %, 0.1 at 90 %)."""

    def __post_init__(self):
        self.step_milestones = tuple(self.step_milestones)
        self.step_factors = tuple(self.step_factors)
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ScheduleConfigError` on the first invalid key."""
        if self.kind not in KINDS:
            raise _err("kind", self.kind, f"allowed values are {', '.join(KINDS)}")
        for key in ("total_steps", "warmup_steps"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise _err(key, v, "must be an integer >= 0")
        if self.kind != "constant" and self.total_steps < 1:
            raise _err("total_steps", self.total_steps, f"kind {self.kind!r} needs the run length (an integer >= 1)")
        if self.kind != "constant" and self.warmup_steps > self.total_steps:
            raise _err("warmup_steps", self.warmup_steps, f"must be <= total_steps = {self.total_steps}")
        if not isinstance(self.decay_fraction, (int, float)) or not 0 < self.decay_fraction <= 1:
            raise _err("decay_fraction", self.decay_fraction, "must lie in (0, 1]")
        if self.kind == "wsd":
            if self.decay_steps < 1:
                raise _err("decay_fraction", self.decay_fraction,
                           f"gives 0 decay steps for total_steps = {self.total_steps}; raise it or total_steps")
            if self.warmup_steps > self.total_steps - self.decay_steps:
                raise _err("warmup_steps", self.warmup_steps,
                           f"overlaps the decay phase (the last {self.decay_steps} of {self.total_steps} steps); "
                           f"set it to at most {self.total_steps - self.decay_steps}")
        if self.min_lr_ratio is not None and (
            not isinstance(self.min_lr_ratio, (int, float)) or not 0 <= self.min_lr_ratio <= 1
        ):
            raise _err("min_lr_ratio", self.min_lr_ratio, "must lie in [0, 1]")
        if self.kind == "wsd" and self.min_lr_ratio == 0:
            raise _err("min_lr_ratio", 0, "wsd decays exponentially and needs a ratio > 0 (the paper uses 0.1)")
        if len(self.step_milestones) != len(self.step_factors):
            raise _err("step_factors", self.step_factors,
                       f"needs one factor per milestone ({len(self.step_milestones)} milestones)")
        ms = self.step_milestones
        if any(not isinstance(m, (int, float)) or not 0 < m <= 1 for m in ms) or list(ms) != sorted(ms):
            raise _err("step_milestones", ms, "must be increasing fractions in (0, 1], e.g. [0.8, 0.9]")
        if any(not isinstance(f, (int, float)) or not 0 <= f <= 1 for f in self.step_factors):
            raise _err("step_factors", self.step_factors, "must be LR/peak ratios in [0, 1], e.g. [0.316, 0.1]")

    # ------------------------------------------------------------------------------------------
    def max_warmup(self) -> int:
        """The longest warmup this schedule accepts: ``T − D`` for ``wsd``, ``T`` otherwise."""
        return self.total_steps - self.decay_steps if self.kind == "wsd" else self.total_steps

    @property
    def decay_steps(self) -> int:
        """D, the length of the WSD decay phase."""
        return int(round(self.decay_fraction * self.total_steps))

    @property
    def final_ratio(self) -> float:
        """ρ with the kind's default filled in."""
        if self.min_lr_ratio is not None:
            return float(self.min_lr_ratio)
        return DEFAULT_MIN_LR_RATIO.get(self.kind, 1.0)

    # from_dict (an unknown key is an error naming it), to_dict, replace (validated): ConfigBase
    config_error: ClassVar[type] = ScheduleConfigError
    key_format: ClassVar[str] = "schedule.{key}: {msg}"
    unknown_key_format: ClassVar[str] = "schedule.{name} is not a schedule setting; known: {known}"


def scaled_warmup(cfg: ScheduleConfig, reference_warmup: int, reference_total: int) -> int:
    """A warmup for ``cfg.total_steps`` in the same proportion as ``reference_warmup`` is to
    ``reference_total``: ``round(W_ref · T / T_ref)``, capped at :meth:`ScheduleConfig.max_warmup`
    (so a short run's warmup never overlaps its decay) and at least 1 when that allows it."""
    w = int(round(reference_warmup * cfg.total_steps / reference_total))
    return max(0, min(max(w, 1), cfg.max_warmup()))


# ----------------------------------------------------------------------------------------------
# Pure schedule functions.  `step` = number of updates already applied.
# ----------------------------------------------------------------------------------------------
def warmup_factor(step: int, warmup_steps: int) -> float:
    """``(step + 1) / W`` during warmup, 1 afterwards (and always 1 when ``W = 0``)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return 1.0


def wsd_factor(step: int, total_steps: int, decay_steps: int, final_ratio: float) -> float:
    """Stable-then-exponential-decay part of WSD: 1 before ``S = T − D``, then
    ``final_ratio ** ((step − S + 1) / D)``, held at ``final_ratio`` from the last update on."""
    start = total_steps - decay_steps
    if step < start:
        return 1.0
    progress = min(step - start + 1, decay_steps) / decay_steps
    return final_ratio**progress


def cosine_factor(step: int, warmup_steps: int, total_steps: int, final_ratio: float) -> float:
    """Cosine from 1 (end of warmup) to ``final_ratio`` (last update ``T − 1``)."""
    span = total_steps - warmup_steps
    if span <= 0:
        return final_ratio
    progress = min(max(step - warmup_steps + 1, 0), span) / span
    return final_ratio + (1.0 - final_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def step_decay_factor(step: int, total_steps: int, milestones: Sequence[float], factors: Sequence[float]) -> float:
    """[mHC] step decay: ``factors[i]`` from update ``round(milestones[i] · T)`` on, else 1."""
    out = 1.0
    for m, f in zip(milestones, factors):
        if step >= int(round(m * total_steps)):
            out = f
    return out


def schedule_factor(step: int, cfg: ScheduleConfig) -> float:
    """LR / peak before update number ``step`` (0-based) under ``cfg``."""
    if step < 0:
        raise ValueError(f"schedule step must be >= 0, got {step}")
    w = warmup_factor(step, cfg.warmup_steps)
    if step < cfg.warmup_steps or cfg.kind == "constant":
        return w
    if cfg.kind == "wsd":
        return wsd_factor(step, cfg.total_steps, cfg.decay_steps, cfg.final_ratio)
    if cfg.kind == "cosine":
        return cosine_factor(step, cfg.warmup_steps, cfg.total_steps, cfg.final_ratio)
    return step_decay_factor(step, cfg.total_steps, cfg.step_milestones, cfg.step_factors)


def lr_at(step: int, cfg: ScheduleConfig, peak_lr: float) -> float:
    """The learning rate of update ``step`` for peak ``peak_lr``."""
    return peak_lr * schedule_factor(step, cfg)


# ----------------------------------------------------------------------------------------------
class LRScheduler:
    """Sets ``lr`` (and optionally ``weight_decay``) on an optimiser's param groups.

    ``optimizer``: anything with ``param_groups`` (a torch optimiser, Megatron's optimisers,
    :class:`training.optim.TrainOptimizer`).  The LR of update ``s`` is written at construction
    (``s = 0``) and by every :meth:`step` — call it once after each *applied* update (not after
    a skipped one), as Megatron does.  Per group: ``lr = peak · lr_mult · f(s)`` with
    ``peak = group.get("max_lr", peak_lr)``, and, if ``weight_decay`` is not None,
    ``group["weight_decay"] = weight_decay · wd_mult``.
    """

    def __init__(self, optimizer, cfg: ScheduleConfig, peak_lr: float, weight_decay: Optional[float] = None,
                 last_step: int = 0):
        if not isinstance(peak_lr, (int, float)) or not peak_lr > 0:
            raise ScheduleConfigError(f"LRScheduler: peak_lr={peak_lr!r} must be a number > 0")
        self.optimizer = optimizer
        self.cfg = cfg
        self.peak_lr = float(peak_lr)
        self.weight_decay = weight_decay
        self.num_steps = int(last_step)
        self.apply()

    def factor(self) -> float:
        return schedule_factor(self.num_steps, self.cfg)

    def get_lr(self) -> float:
        """The LR of the next update for a group with the default peak and ``lr_mult = 1``."""
        return lr_at(self.num_steps, self.cfg, self.peak_lr)

    def get_last_lr(self) -> List[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def apply(self) -> None:
        f = self.factor()
        for g in self.optimizer.param_groups:
            g["lr"] = g.get("max_lr", self.peak_lr) * g.get("lr_mult", 1.0) * f
            if self.weight_decay is not None:
                g["weight_decay"] = self.weight_decay * g.get("wd_mult", 1.0)

    def step(self, increment: int = 1) -> None:
        self.num_steps += int(increment)
        self.apply()

    def state_dict(self) -> Dict[str, Any]:
        """``num_steps`` (restored) and the config and peak (informational)."""
        return {"num_steps": self.num_steps, "peak_lr": self.peak_lr, "config": self.cfg.to_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore the step count and re-apply the LR.  The schedule itself comes from the current
        config, so a resumed run may change e.g. ``total_steps`` deliberately."""
        self.num_steps = int(state["num_steps"])
        self.apply()


def build_scheduler(optimizer, sched_cfg: ScheduleConfig, opt_cfg) -> LRScheduler:
    """:class:`LRScheduler` with the optimiser config's peak LR and weight decay.

    ``opt_cfg.min_lr`` (if set) gives the floor ratio ``min_lr / lr`` unless the schedule sets
    ``min_lr_ratio`` itself (setting both to different values is an error).
    """
    min_lr = getattr(opt_cfg, "min_lr", None)
    if min_lr is not None:
        ratio = min_lr / opt_cfg.lr
        if sched_cfg.min_lr_ratio is None:
            sched_cfg = sched_cfg.replace(min_lr_ratio=ratio)
        elif not math.isclose(sched_cfg.min_lr_ratio, ratio, rel_tol=1e-9, abs_tol=1e-12):
            raise ScheduleConfigError(
                f"schedule.min_lr_ratio={sched_cfg.min_lr_ratio} disagrees with optimizer.min_lr / optimizer.lr "
                f"= {ratio:.6g}; set only one of them")
    return LRScheduler(optimizer, sched_cfg, peak_lr=opt_cfg.lr, weight_decay=opt_cfg.weight_decay)
