"""The zoo's cluster recipes are laid out by the planner and cannot rot (issue 52).

Each shipped GPU recipe (``bench.plan_zoo.RECIPES``) fits its cluster, no single change of its layout (TP, PP,
VPP, CP, EP, ETP, micro-batch, recompute, HC recompute, the overlaps) plans more than 5 % faster (fast, in CI),
the best layout of ``python -m tools.plan --search`` is within 5 % of it (the whole search: the extended tier),
and its comment states the planned tokens/s, MFU, headroom and GPU-hours of its token budget that the planner
gives today (within the same 5 %)."""

import re
import warnings

import pytest

from bench.plan_zoo import (RECIPES, TOLERANCE, best_single_change, cluster_of, recipe_path, recipe_row,
                            token_budget)


def _load(name):
    from training.config import load_config
    from training.plan import GPUS, make_plan

    path = recipe_path(name)
    gpus, kind = cluster_of(path)
    cfg = load_config(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = make_plan(cfg, gpus, GPUS[kind])
    return cfg, gpus, GPUS[kind], plan


@pytest.mark.parametrize("name", RECIPES)
def test_no_single_change_plans_faster_than_the_shipped_layout(name):
    cfg, gpus, gpu, plan = _load(name)
    assert plan.fits, plan.format()
    top = best_single_change(cfg, gpus, gpu)
    assert top is not None  # some neighbour is valid and fits: the check compares something
    label, other = top
    assert other.tokens_per_s <= plan.tokens_per_s * (1 + TOLERANCE), (
        f"{name}: {label} plans {other.tokens_per_s:,.0f} tokens/s against the shipped layout's "
        f"{plan.tokens_per_s:,.0f}; re-lay it out with python -m bench.plan_zoo --recipes")


COMMENT = re.compile(r"^# planned \((?P<cmd>[^)]*)\):\n#\s+(?P<tps>[\d,]+) tokens/s, MFU (?P<mfu>[\d.]+)%, "
                     r"(?P<gib>[\d.]+) GiB of (?P<cap>[\d.]+) \(headroom (?P<head>-?[\d.]+) GiB[^)]*\); "
                     r"(?P<tokens>[\d.]+)B tokens = (?P<hours>[\d,]+) GPU-hours", re.M)


@pytest.mark.parametrize("name", RECIPES)
def test_the_comment_states_what_the_planner_gives(name):
    """The ``# planned (...)`` line: tokens/s, MFU, peak, headroom and GPU-hours as the planner gives them
    (within 5 %: the same slack as the layout), and the token count of the recipe's own budget."""
    cfg, gpus, gpu, plan = _load(name)
    with open(recipe_path(name), encoding="utf-8") as f:
        m = COMMENT.search(f.read())
    assert m, f"{name}: no '# planned (<command>): ... tokens/s, MFU ...%, ... GPU-hours' comment line"
    assert "bench.plan_zoo --recipes" in m["cmd"] and f"--gpus {gpus}" in m["cmd"]
    from training.plan import load_run_preset

    tokens = token_budget(cfg, load_run_preset(cfg))
    assert float(m["tokens"]) == pytest.approx(tokens / 1e9, abs=0.05)
    hours = tokens / plan.tokens_per_s * gpus / 3600
    gib = 2 ** 30
    for stated, planned in ((m["tps"], plan.tokens_per_s), (m["mfu"], 100 * plan.mfu), (m["gib"], plan.peak.total / gib),
                            (m["hours"], hours)):
        assert float(stated.replace(",", "")) == pytest.approx(planned, rel=TOLERANCE), (name, m.group(0))
    assert float(m["cap"]) == pytest.approx(plan.capacity / gib, abs=0.05)
    assert float(m["head"]) == pytest.approx((plan.capacity - plan.peak.total) / gib, abs=TOLERANCE * plan.capacity / gib)


@pytest.mark.slow
@pytest.mark.extended  # the whole search, ~100 s of CPU for the five recipes (CONTRIBUTING.md, "Test tiers"): run it
@pytest.mark.parametrize("name", RECIPES)  # when the planner's maths or a recipe changes; CI runs the fast checks
def test_the_shipped_layout_is_within_five_percent_of_the_search_best(name):
    row = recipe_row(name)
    assert row["fits"] and row["ratio"] is not None
    assert row["ratio"] >= 1 - TOLERANCE, (
        f"{name}: shipped {row['tokens_per_s']:,.0f} tokens/s, the search's best {row['best_tokens_per_s']:,.0f} "
        f"({' '.join(row['best_overrides'])})")
