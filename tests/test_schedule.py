"""Learning-rate schedules (training/schedule.py; docs/math.md §6.3, §6.4, §8 #30).

Boundary values are computed by hand from the formulas in the module docstring; the scheduler is
checked on real torch param groups (per-group multipliers, weight-decay multipliers, state).
"""

from __future__ import annotations

import math

import pytest
import torch

from training.optim import OptimizerConfig
from training.schedule import (
    LRScheduler,
    ScheduleConfig,
    ScheduleConfigError,
    build_scheduler,
    lr_at,
    schedule_factor,
)

PEAK = 1e-3


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=1e-18)


def test_defaults_are_the_xhc_wsd_recipe():
    """docs/math.md §6.4 / §8 #30: 500 warmup steps, WSD, decay over the last 10 % to 0.1 × peak."""
    cfg = ScheduleConfig(total_steps=10_000)
    assert (cfg.kind, cfg.warmup_steps, cfg.decay_fraction, cfg.final_ratio) == ("wsd", 500, 0.1, 0.1)
    assert cfg.decay_steps == 1000


def test_wsd_boundaries():
    """T = 100, W = 10, D = 10 (S = 90), ρ = 0.1."""
    cfg = ScheduleConfig(kind="wsd", total_steps=100, warmup_steps=10, decay_fraction=0.1)
    expected = {
        0: 1e-4,  # (0 + 1) / 10 of the peak
        4: 5e-4,
        9: 1e-3,  # last warmup update at peak
        10: 1e-3,
        89: 1e-3,  # last stable update
        90: 1e-3 * 10**-0.1,  # 0.1 ** (1/10) = 0.79432823...
        94: 1e-3 * 10**-0.5,  # 0.1 ** (5/10) = 0.31622776...
        99: 1e-4,  # 0.1 × peak on the last update
        100: 1e-4,
        250: 1e-4,
    }
    for step, lr in expected.items():
        assert lr_at(step, cfg, PEAK) == approx(lr), step
    assert lr_at(90, cfg, PEAK) == approx(7.943282347242815e-4)


def test_cosine_boundaries():
    """T = 100, W = 10, ρ = 0.1: p = (s − 9) / 90."""
    cfg = ScheduleConfig(kind="cosine", total_steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(9, cfg, PEAK) == approx(1e-3)
    assert lr_at(10, cfg, PEAK) == approx(1e-3 * (0.1 + 0.9 * (1 + math.cos(math.pi / 90)) / 2))
    assert lr_at(10, cfg, PEAK) == pytest.approx(9.997259e-4, rel=1e-6)  # cos 2° = 0.99939083
    assert lr_at(54, cfg, PEAK) == approx(1e-3 * 0.55)  # halfway: ρ + (1 − ρ)/2
    assert lr_at(99, cfg, PEAK) == approx(1e-4)
    assert lr_at(500, cfg, PEAK) == approx(1e-4)
    # to zero
    zero = cfg.replace(min_lr_ratio=0.0)
    assert lr_at(99, zero, PEAK) == approx(0.0)
    assert lr_at(54, zero, PEAK) == approx(5e-4)


def test_step_decay_of_the_mhc_paper():
    """[mHC]: ×0.316 of the peak from 80 % of training, ×0.1 from 90 % (factors of the peak)."""
    cfg = ScheduleConfig(kind="step", total_steps=100, warmup_steps=10)
    for step, f in {9: 1.0, 10: 1.0, 79: 1.0, 80: 0.316, 89: 0.316, 90: 0.1, 99: 0.1, 120: 0.1}.items():
        assert schedule_factor(step, cfg) == approx(f), step
    # the mHC 3B run: 30k steps, 2000 warmup
    cfg = ScheduleConfig(kind="step", total_steps=30_000, warmup_steps=2000)
    assert schedule_factor(0, cfg) == approx(1 / 2000)
    assert schedule_factor(23_999, cfg) == 1.0 and schedule_factor(24_000, cfg) == approx(0.316)
    assert schedule_factor(27_000, cfg) == approx(0.1)


def test_constant_and_no_warmup():
    cfg = ScheduleConfig(kind="constant", warmup_steps=4)
    assert [schedule_factor(s, cfg) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cfg = ScheduleConfig(kind="wsd", total_steps=10, warmup_steps=0, decay_fraction=0.2)
    assert schedule_factor(0, cfg) == 1.0  # W = 0: the first update is at peak
    assert schedule_factor(8, cfg) == approx(10**-0.5) and schedule_factor(9, cfg) == approx(0.1)


@pytest.mark.parametrize("kind", ["wsd", "cosine", "step", "constant"])
def test_monotone_warmup_then_non_increasing(kind):
    cfg = ScheduleConfig(kind=kind, total_steps=200, warmup_steps=20, decay_fraction=0.3)
    f = [schedule_factor(s, cfg) for s in range(260)]
    assert all(b > a for a, b in zip(f[:20], f[1:20])), "warmup must increase strictly"
    assert f[19] == 1.0
    assert all(b <= a for a, b in zip(f[19:], f[20:])), "after warmup the LR never increases"
    assert all(0 <= x <= 1 for x in f)
    if kind in ("wsd", "cosine"):
        assert f[199] == approx(0.1) and f[259] == approx(0.1)


def _optimizer():
    a, b, c = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    return torch.optim.AdamW([
        {"params": [a], "lr_mult": 1.0, "wd_mult": 1.0},
        {"params": [b], "lr_mult": 0.5, "wd_mult": 0.0},  # e.g. a separate finetuning LR
        {"params": [c], "max_lr": 4e-3},  # Megatron-style per-group peak
    ], lr=123.0, weight_decay=0.5)


def test_scheduler_sets_lr_and_weight_decay_per_group():
    opt = _optimizer()
    sched = LRScheduler(opt, ScheduleConfig(kind="wsd", total_steps=100, warmup_steps=10), peak_lr=PEAK,
                        weight_decay=0.1)
    # construction applies update 0
    assert [g["lr"] for g in opt.param_groups] == [approx(1e-4), approx(5e-5), approx(4e-4)]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0, 0.1]
    for _ in range(95):
        sched.step()
    assert sched.num_steps == 95
    f = 10**-0.6  # 0.1 ** (6/10)
    assert [g["lr"] for g in opt.param_groups] == [approx(1e-3 * f), approx(0.5e-3 * f), approx(4e-3 * f)]
    assert sched.get_lr() == approx(1e-3 * f)
    # without a weight decay the scheduler leaves it alone
    opt2 = _optimizer()
    LRScheduler(opt2, ScheduleConfig(kind="constant"), peak_lr=PEAK)
    assert [g["weight_decay"] for g in opt2.param_groups] == [0.5, 0.5, 0.5]


def test_scheduler_state_round_trip():
    cfg = ScheduleConfig(kind="cosine", total_steps=50, warmup_steps=5)
    a = LRScheduler(_optimizer(), cfg, peak_lr=PEAK, weight_decay=0.1)
    for _ in range(17):
        a.step()
    state = a.state_dict()
    b = LRScheduler(_optimizer(), cfg, peak_lr=PEAK, weight_decay=0.1)
    assert b.get_last_lr() != a.get_last_lr()
    b.load_state_dict(state)
    assert b.num_steps == 17 and b.get_last_lr() == a.get_last_lr()
    for _ in range(40):
        a.step()
        b.step()
        assert b.get_last_lr() == a.get_last_lr()


def test_build_scheduler_uses_the_optimizer_config():
    opt = _optimizer()
    ocfg = OptimizerConfig(lr=2e-3, min_lr=2e-4, weight_decay=0.05)
    sched = build_scheduler(opt, ScheduleConfig(kind="cosine", total_steps=20, warmup_steps=0), ocfg)
    assert sched.cfg.min_lr_ratio == approx(0.1)
    for _ in range(19):
        sched.step()
    assert opt.param_groups[0]["lr"] == approx(2e-4)
    assert opt.param_groups[0]["weight_decay"] == 0.05
    with pytest.raises(ScheduleConfigError, match=r"schedule\.min_lr_ratio.*optimizer\.min_lr"):
        build_scheduler(opt, ScheduleConfig(kind="cosine", total_steps=20, min_lr_ratio=0.5, warmup_steps=0), ocfg)


@pytest.mark.parametrize("kwargs, key", [
    (dict(kind="linear", total_steps=10), "kind"),
    (dict(kind="wsd", total_steps=0), "total_steps"),
    (dict(kind="cosine", total_steps=10, warmup_steps=11), "warmup_steps"),
    (dict(kind="wsd", total_steps=100, warmup_steps=95, decay_fraction=0.1), "warmup_steps"),
    (dict(kind="wsd", total_steps=4, warmup_steps=0, decay_fraction=0.1), "decay_fraction"),
    (dict(kind="wsd", total_steps=10, warmup_steps=0, decay_fraction=1.5), "decay_fraction"),
    (dict(kind="wsd", total_steps=10, warmup_steps=0, min_lr_ratio=0.0), "min_lr_ratio"),
    (dict(kind="cosine", total_steps=10, warmup_steps=0, min_lr_ratio=1.5), "min_lr_ratio"),
    (dict(kind="step", total_steps=10, warmup_steps=0, step_factors=(0.3,)), "step_factors"),
    (dict(kind="step", total_steps=10, warmup_steps=0, step_milestones=(0.9, 0.8)), "step_milestones"),
    (dict(kind="constant", warmup_steps=-1), "warmup_steps"),
])
def test_config_errors_name_the_key(kwargs, key):
    with pytest.raises(ScheduleConfigError) as e:
        ScheduleConfig(**kwargs)
    msg = str(e.value)
    assert msg.startswith(f"schedule.{key}=") and "\n" not in msg


def test_from_dict_rejects_unknown_keys():
    assert ScheduleConfig.from_dict({"kind": "cosine", "total_steps": 10, "warmup_steps": 1}).kind == "cosine"
    with pytest.raises(ScheduleConfigError, match=r"schedule\.warmup is not a schedule setting"):
        ScheduleConfig.from_dict({"warmup": 3})
    with pytest.raises(ValueError, match="step must be >= 0"):
        schedule_factor(-1, ScheduleConfig(kind="constant"))


def test_scaled_warmup_keeps_the_proportion_and_fits_the_run():
    from training.schedule import ScheduleConfig, scaled_warmup

    # 20 warmup updates per 300 -> 40 per 600, 100 per 1500 (proportional)
    assert scaled_warmup(ScheduleConfig(kind="wsd", total_steps=600, warmup_steps=0, decay_fraction=0.2), 20, 300) == 40
    assert scaled_warmup(ScheduleConfig(kind="cosine", total_steps=1500, warmup_steps=0), 20, 300) == 100
    # a short WSD run: never into the decay phase (T − D = 8 − 2 = 6), at least one warmup update
    short = ScheduleConfig(kind="wsd", total_steps=8, warmup_steps=0, decay_fraction=0.2)
    assert scaled_warmup(short, 300, 300) == 6
    assert scaled_warmup(short, 1, 300) == 1
