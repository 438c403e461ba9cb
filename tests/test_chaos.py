"""The chaos run (``python -m bench.chaos``, docs/reliability.md "Chaos run").

Fast: the schedule (the same seed draws the same schedule, every kind of fault is drawn over seeds, the
rules a schedule keeps) and the verdict, fed with runs that agree and with runs that differ (one ulp of
one loss, a shifted sample, a tensor, work lost beyond one interval, a layout change beyond the
measured tolerance), so that it is seen to fail.

Slow: two short schedules under torchrun with 2 CPU ranks (gloo), each against its undisturbed run:
a disk that fills during a save, then kill -9 of a rank mid-save (bit-identical end); a rank hung in
the forward pass, the newest checkpoint corrupt and the requeue on TP = 2 (within the elastic
tolerance).  Extended: the default schedule (200 steps, 6 faults).
"""

from __future__ import annotations

import math

import pytest
import torch

from bench.chaos_schedule import (BETWEEN, FLOOR, HANG_SECTIONS, KINDS, LAYOUTS, MIN_GAP, RUNTIME, START_LAYOUT,
                                  Attempt, ChaosError, Curves, Fault, attempt_layouts, draw_schedule, format_report,
                                  judge)


# ------------------------------------------------------------------------------------------------
# The schedule
# ------------------------------------------------------------------------------------------------
def test_the_same_seed_draws_the_same_schedule_and_seeds_differ():
    assert draw_schedule(7) == draw_schedule(7)
    assert draw_schedule(7, 40, 3, 6, 10, ("hang", "layout")) == draw_schedule(7, 40, 3, 6, 10, ("hang", "layout"))
    assert len({tuple(draw_schedule(s)) for s in range(20)}) == 20


def test_every_kind_section_layout_and_moment_is_drawn_over_seeds():
    drawn = [f for seed in range(40) for f in draw_schedule(seed)]
    assert {f.kind for f in drawn} == set(KINDS)
    assert {f.section for f in drawn if f.kind == "hang"} == set(HANG_SECTIONS)
    assert {f.layout for f in drawn if f.kind == "layout"} == set(LAYOUTS)
    assert {f.moment for f in drawn if f.kind in ("sigterm", "kill_rank", "kill_launcher")} == {"step", "save"}
    assert {f.rank for f in drawn if f.kind in ("kill_rank", "hang")} == {0, 1}


@pytest.mark.parametrize("steps, faults, interval, eval_interval", [(200, 6, 20, 50), (24, 3, 6, 12), (60, 5, 8, 0)])
def test_a_schedule_keeps_its_rules(steps, faults, interval, eval_interval):
    for seed in range(60):
        s = draw_schedule(seed, steps, faults, interval, eval_interval)
        assert len(s) == faults
        runtime = [f for f in s if f.kind in RUNTIME]
        assert runtime and [f.gap for f in runtime] == list(range(1, len(runtime) + 1))
        at = [f.step for f in runtime]
        assert all(b - a >= MIN_GAP for a, b in zip(at, at[1:])), s  # in order, apart
        assert 2 <= at[0] and at[-1] <= steps - MIN_GAP, s
        for f in runtime:
            if f.kind == "disk_full" or f.moment == "save" or f.section == "checkpoint_save":
                assert f.step % interval == 0, f  # a save happens at that step
            if f.section == "evaluation":
                assert eval_interval and f.step % eval_interval == 0, f
            assert f.rank < LAYOUTS[f.layout][0], f
        layouts = attempt_layouts(s)
        assert len(layouts) == len(runtime) + 1 and layouts[0] == START_LAYOUT
        for b in (f for f in s if f.kind in BETWEEN):
            carrier = runtime[b.gap - 1]
            assert carrier.step >= 2 * interval + 2, s  # two checkpoints exist when it acts
            assert sum(g.kind == b.kind and g.gap == b.gap for g in s) == 1, s
            if b.kind == "layout":
                assert layouts[b.gap] == b.layout != layouts[b.gap - 1], s
        for i, f in enumerate(runtime):
            assert f.layout == layouts[i], s  # it strikes on the layout of its attempt


def test_bad_options_are_one_line_errors():
    with pytest.raises(ChaosError, match="unknown fault kind"):
        draw_schedule(1, kinds=("sigterm", "meteor"))
    with pytest.raises(ChaosError, match="needs at least one fault that ends an attempt"):
        draw_schedule(1, kinds=("corrupt", "layout"))
    with pytest.raises(ChaosError, match="steps >= 2 x interval"):
        draw_schedule(1, steps=30, interval=20)
    with pytest.raises(ChaosError, match="no room for 9 faults"):
        draw_schedule(1, steps=45, faults=9, interval=20)


def test_only_the_kinds_asked_for_are_drawn():
    for seed in range(20):
        assert {f.kind for f in draw_schedule(seed, kinds=("sigterm", "layout"))} <= {"sigterm", "layout"}


# ------------------------------------------------------------------------------------------------
# The verdict
# ------------------------------------------------------------------------------------------------
STEPS, INTERVAL = 30, 10


def _run(shift=None, tensors=None) -> Curves:
    """A run's curves: per step (loss, grad norm, lr, consumed samples, sample ids), an eval, final tensors."""
    train = {s: (3.0 / s, 1.0 / s, 1e-3, 4 * s, tuple(range(4 * (s - 1), 4 * s))) for s in range(1, STEPS + 1)}
    if shift:
        train = shift(train)
    g = torch.Generator().manual_seed(0)
    return Curves(train, {STEPS: 0.5}, tensors if tensors is not None else
                  {"w": torch.randn(4, 4, generator=g), "optimizer.adamw.exp_avg.w": torch.randn(4, 4, generator=g)})


def _schedule(kind="kill_rank", step=14, extra=()):
    return [Fault(kind=kind, step=step, gap=1, layout=START_LAYOUT, moment="step"), *extra]


def _attempts(last=15, resumed=10, unpublished=None, layout2=START_LAYOUT, problems=()):
    return [Attempt(1, START_LAYOUT, 0, last, t_last=100.0, unpublished_save=unpublished, problems=list(problems)),
            Attempt(2, layout2, resumed, STEPS)]


def test_runs_that_agree_pass():
    v = judge(_schedule(), _attempts(), _run(), _run(), STEPS, INTERVAL, median_step_s=0.1, recovered={1: 112.1})
    assert v["passed"], v["problems"]
    assert v["exact"] and v["diff"] == {"loss": 0.0, "tensors": 0.0, "tensor_key": ""}
    row = v["rows"][0]
    assert row["lost"] == "5 (<= 10)" and row["resumed"] == "10" and math.isclose(row["cost_s"], 12.0)


def _one_ulp(train, step=17):
    out = dict(train)
    loss, *rest = out[step]
    out[step] = (math.nextafter(loss, 1.0), *rest)
    return out


def test_one_ulp_of_one_loss_fails_a_run_that_kept_its_layout():
    v = judge(_schedule(), _attempts(), _run(), _run(_one_ulp), STEPS, INTERVAL)
    assert not v["passed"]
    assert any("loss differs" in p and "first step 17" in p for p in v["problems"]), v["problems"]
    assert "verdict: FAIL (seed 5)" in format_report(5, v, _attempts(), "python -m bench.chaos --seed 5")


def test_a_final_tensor_one_ulp_off_fails():
    t = _run().tensors
    t = {k: v.clone() for k, v in t.items()}
    t["w"][1, 2] = torch.nextafter(t["w"][1, 2], torch.tensor(9.0))
    v = judge(_schedule(), _attempts(), _run(), _run(tensors=t), STEPS, INTERVAL)
    assert not v["passed"] and any("bit-identical expected" in p for p in v["problems"]), v["problems"]
    t2 = {"w": t["w"]}  # a tensor missing
    v = judge(_schedule(), _attempts(), _run(), _run(tensors=t2), STEPS, INTERVAL)
    assert any("different tensors" in p for p in v["problems"]), v["problems"]


def test_the_data_order_and_every_step_are_checked():
    def shifted(train):
        out = dict(train)
        out[21] = (*out[21][:4], tuple(i + 1 for i in out[21][4]))
        return out

    v = judge(_schedule(), _attempts(), _run(), _run(shifted), STEPS, INTERVAL)
    assert any("sample ids differ" in p and "first step 21" in p for p in v["problems"]), v["problems"]
    v = judge(_schedule(), _attempts(), _run(), _run(lambda t: {s: r for s, r in t.items() if s != 30}),
              STEPS, INTERVAL)
    assert any("chaos run recorded steps 1..29" in p for p in v["problems"]), v["problems"]


def test_work_lost_is_at_most_one_interval_per_fault():
    # kill -9 at step 25: resumed from 10 (15 steps lost) fails; with the save of step 20 still being
    # written when it struck, 10 + 5 steps are allowed
    args = (_run(), _run(), STEPS, INTERVAL)
    v = judge(_schedule(step=25), _attempts(last=25, resumed=10), *args)
    assert not v["passed"] and any("15 steps lost" in p and "allowed 10" in p for p in v["problems"]), v["problems"]
    assert judge(_schedule(step=25), _attempts(last=25, resumed=10, unpublished=20), *args)["passed"]
    # SIGTERM: the ranks save where they stop: one step lost is a failure
    v = judge(_schedule("sigterm"), _attempts(last=15, resumed=14), *args)
    assert any("1 steps lost" in p and "allowed 0" in p for p in v["problems"]), v["problems"]
    assert judge(_schedule("sigterm"), _attempts(last=15, resumed=15), *args)["passed"]
    # a corrupt newest checkpoint at the relaunch costs one interval more
    corrupt = [Fault(kind="corrupt", step=14, gap=1, layout=START_LAYOUT)]
    assert judge(_schedule("sigterm", extra=corrupt), _attempts(last=15, resumed=10), *args)["passed"]
    v = judge(_schedule("kill_rank", 25, corrupt), _attempts(last=25, resumed=0), *args)
    assert any("25 steps lost" in p and "allowed 20" in p for p in v["problems"]), v["problems"]


def test_what_the_driver_saw_go_wrong_fails_the_verdict():
    v = judge(_schedule(), _attempts(problems=["the attempt did not end within 90 s of the fault"]),
              _run(), _run(), STEPS, INTERVAL)
    assert not v["passed"] and "did not end within 90 s" in v["problems"][0]
    v = judge(_schedule(), _attempts()[:1], _run(), _run(), STEPS, INTERVAL)
    assert any("1 attempts for 1 faults" in p for p in v["problems"]), v["problems"]


def _off(by, first=11):
    """A run whose losses (and final tensors) are off by ``by`` from step ``first`` on."""
    run = _run(lambda t: {s: ((r[0] + by if s >= first else r[0]), *r[1:]) for s, r in t.items()})
    run.tensors = {k: v + by for k, v in run.tensors.items()}
    return run


def test_a_layout_change_is_held_to_twice_the_measured_layout_noise():
    layout = [Fault(kind="layout", step=14, gap=1, layout="tp2")]
    sched = _schedule(extra=layout)
    att = _attempts(layout2="tp2")
    noise = _off(1e-4)  # an undisturbed run on TP 2 differs by 1e-4: the tolerance is 2e-4
    v = judge(sched, att, _run(), _off(1.5e-4), STEPS, INTERVAL, [noise])
    assert v["passed"] and not v["exact"], v["problems"]
    assert math.isclose(v["tolerance"]["loss"], 2e-4, rel_tol=1e-6) and v["tolerance"]["loss_noise"] > 0
    assert math.isclose(v["diff"]["tensors"], 1.5e-4, rel_tol=1e-3)  # reported, not bounded
    v = judge(sched, att, _run(), _off(3e-4), STEPS, INTERVAL, [noise])
    assert any("over the elastic tolerance" in p for p in v["problems"]), v["problems"]
    # the validation losses too
    evals_off = _run()
    evals_off.evals = {STEPS: 0.5 + 3e-4}
    v = judge(sched, att, _run(), evals_off, STEPS, INTERVAL, [noise])
    assert any("validation losses differ" in p for p in v["problems"]), v["problems"]
    # layouts that agree to the bit leave the floor, 1e-5
    v = judge(sched, att, _run(), _off(2e-5), STEPS, INTERVAL, [_run()])
    assert v["tolerance"]["loss"] == FLOOR and not v["passed"]
    # no run on the other layout measured the noise: no verdict but a failing one
    v = judge(sched, att, _run(), _run(), STEPS, INTERVAL, [])
    assert any("no undisturbed run on another layout" in p for p in v["problems"]), v["problems"]
    # exact numbers still: the learning rate of a step, the set of final tensors
    v = judge(sched, att, _run(), _run(lambda t: {**t, 22: (*t[22][:2], 2e-3, *t[22][3:])}), STEPS, INTERVAL, [noise])
    assert any("learning rate differ" in p for p in v["problems"]), v["problems"]
    v = judge(sched, att, _run(), _run(tensors={"w": _run().tensors["w"]}), STEPS, INTERVAL, [noise])
    assert any("different tensors" in p for p in v["problems"]), v["problems"]


def test_the_report_holds_the_table_and_the_command_that_reproduces_a_failure():
    sched = _schedule(extra=[Fault(kind="corrupt", step=14, gap=1, layout=START_LAYOUT)])
    att = _attempts()
    ok = judge(sched, att, _run(), _run(), STEPS, INTERVAL)
    text = format_report(3, ok, att, "python -m bench.chaos --seed 3")
    assert "| 1 | kill_rank" in text and "| 2 | corrupt" in text and "verdict: PASS (seed 3)" in text
    assert "reproduce" not in text
    bad = judge(sched, att, _run(), _run(_one_ulp), STEPS, INTERVAL)
    text = format_report(3, bad, att, "python -m bench.chaos --seed 3 --steps 30")
    assert text.splitlines()[-1] == "reproduce: python -m bench.chaos --seed 3 --steps 30"


# ------------------------------------------------------------------------------------------------
# The driver's pieces (no process started)
# ------------------------------------------------------------------------------------------------
def test_bad_options_end_the_command_with_one_line_and_status_2(capsys):
    from bench.chaos import main

    assert main(["--seed", "1", "--kinds", "sigterm,meteor"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: --kinds: unknown fault kind(s) meteor")


def test_the_command_that_reproduces_names_every_option():
    from bench.chaos import Options

    assert Options(seed=4).command() == "python -m bench.chaos --seed 4 --steps 200 --faults 6 --interval 20 " \
                                        "--eval-interval 50"
    cmd = Options(seed=4, steps=24, faults=3, interval=6, eval_interval=12, kinds=("hang", "layout")).command()
    assert cmd.endswith("--steps 24 --faults 3 --interval 6 --eval-interval 12 --kinds hang,layout")


def test_the_metrics_tail_reads_complete_records_only(tmp_path):
    from bench.chaos import _Tail

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1}\n')
    tail = _Tail(str(path))  # starts at the end: an earlier attempt's records are not this one's
    with open(path, "a") as f:
        f.write('{"kind": "train", "step": 2}\n{"kind": "tr')
    assert [r["step"] for r in tail.read()] == [2]
    with open(path, "a") as f:
        f.write('ain", "step": 3}\n')
    assert [r["step"] for r in tail.read()] == [3] and len(tail.records) == 2


def test_corrupt_newest_flips_one_byte_of_the_newest_checkpoints_largest_file(tmp_path):
    from bench.chaos import corrupt_newest

    ck = tmp_path / "checkpoints"
    for step in (10, 20):
        d = ck / f"step_{step:08d}"
        d.mkdir(parents=True)
        (d / "__0_0.distcp").write_bytes(bytes(range(200)))
        (d / "__1_0.distcp").write_bytes(bytes(50))
    (ck / ".step_00000030.tmp").mkdir()  # a partial save is not a checkpoint
    assert corrupt_newest(str(ck), 0.5) == str(ck / "step_00000020")
    data = (ck / "step_00000020" / "__0_0.distcp").read_bytes()
    assert [i for i in range(200) if data[i] != i] == [99] and data[99] == 99 ^ 0xFF
    assert (ck / "step_00000010" / "__0_0.distcp").read_bytes() == bytes(range(200))
    assert corrupt_newest(str(tmp_path / "none"), 0.5) is None


def test_the_worker_records_its_rank_exit_status(tmp_path, monkeypatch):
    import os

    import training.pretrain
    from bench.chaos import worker

    seen = []
    monkeypatch.setattr(training.pretrain, "main", lambda argv: seen.append(argv) or 4)
    monkeypatch.setenv("RANK", "1")
    real_exit = os._exit
    assert worker([str(tmp_path), "run.train_steps=3"]) == 4
    assert seen == [["run.train_steps=3"]] and (tmp_path / "rank1.exit").read_text() == "4\n"
    assert os._exit is real_exit  # the hook (for the watchdog's exit) is gone with the run


# ------------------------------------------------------------------------------------------------
# Chaos runs (2 CPU ranks under torchrun)
# ------------------------------------------------------------------------------------------------
def _chaos(seed, kinds, tmp_path, steps=24, faults=3):
    from bench.chaos import Options, run

    opts = Options(seed=seed, steps=steps, faults=faults, interval=6, eval_interval=12, kinds=tuple(kinds),
                   work=str(tmp_path / "chaos"))
    verdict = run(opts, log=print)
    print(verdict["report"])
    return verdict


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.train
def test_a_full_disk_and_a_killed_rank_end_bit_identical(tmp_path):
    """The disk full when the save of step 12 begins (exit 4, the space freed for the requeue), then
    kill -9 of rank 0 while the save of step 18 is written (SIGTERM and a killed torchrun: the extended
    tier's schedule, and tests/test_reliability.py one at a time)."""
    v = _chaos(35, ("sigterm", "kill_rank", "disk_full"), tmp_path, faults=2)
    assert [r["fault"] for r in v["rows"]] == ["disk_full", "kill_rank"]
    assert v["passed"], v["report"]
    assert v["exact"] and v["diff"]["loss"] == v["diff"]["tensors"] == 0.0 and len(v["attempts"]) == 3
    assert v["attempts"][0]["exits"] == {0: 4, 1: 4} and 0 not in v["attempts"][1]["exits"]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.train
@pytest.mark.extended  # ~110 s (it also runs the other layouts undisturbed for the tolerance): CI's budget
def test_a_hang_a_corrupt_checkpoint_and_a_new_layout_end_within_the_elastic_tolerance(tmp_path):
    """A rank hung in the forward pass (the watchdog ends the attempt, status 86); the newest checkpoint
    is corrupt and the requeue comes back on TP = 2 + SP.  (Extended tier: in CI the hang is
    tests/test_watchdog.py's, the layout change tests/test_elastic_resume.py's, the corrupt checkpoint
    tests/test_reliability.py's, and the chaos driver runs seed 35.)"""
    v = _chaos(39, ("kill_rank", "hang", "corrupt", "layout"), tmp_path)
    assert [r["fault"] for r in v["rows"]] == ["hang", "corrupt", "layout"]
    assert v["passed"], v["report"]
    assert not v["exact"] and [a["layout"] for a in v["attempts"]] == ["dp2", "tp2"]
    assert v["attempts"][0]["exits"] == {0: 86, 1: 86}
    assert v["diff"]["loss"] <= v["tolerance"]["loss"] and v["tolerance"]["loss"] >= FLOOR


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.train
@pytest.mark.extended
def test_the_default_schedule(tmp_path):
    """The command's own schedule: 200 steps, 6 faults (seed 34: the disk full twice, torchrun killed
    mid-save, the requeue on TP = 2 + SP, SIGTERM mid-save, rank 0 killed mid-save)."""
    from bench.chaos import Options, run

    v = run(Options(seed=34, work=str(tmp_path / "chaos")))
    print(v["report"])
    assert v["passed"], v["report"]
    assert len(v["rows"]) == 6 and len(v["attempts"]) == sum(r["fault"] in RUNTIME for r in v["rows"]) + 1
