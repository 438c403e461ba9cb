"""The watchdog, the straggler report and the fault hook (issue 53).

Fast: the ``XHC_FAULT_INJECT`` grammar; a single-process watchdog that expires (exit 86, stacks,
``status.json``, ``attempts.jsonl``, nothing half-written); the step timeout from the measured steps;
the straggler verdict from two ranks' times.

Slow (torchrun, 2 ranks on CPU, one module fixture, five launches): an undisturbed reference run,
then one run directory that hangs three times -- rank 1 in ``data`` at step 5, rank 0 in
``forward_backward`` at step 8, rank 1 in ``checkpoint_save`` at step 9 -- each launch ending with
status 86 on both ranks within the timeout plus a bound, and a last launch with rank 1 made three
times slower that finishes: its losses, gradient norms and final weights equal the reference bit for
bit, its straggler report names rank 1 and the reference's names nobody.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import time

import pytest

from training.run.faults import Fault, FaultSpecError, parse_faults

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------------
# fast
# ------------------------------------------------------------------------------------------------
def test_fault_grammar():
    got = parse_faults("rank=1,step=6,section=forward_backward,action=hang; "
                       "rank=0,step=*,section=data,action=sleep:0.25,attempt=2;rank=0,step=3,section=checkpoint_save,"
                       "action=enospc")
    assert got == [Fault(1, 6, "forward_backward", "hang"), Fault(0, None, "data", "sleep", 0.25, 2),
                   Fault(0, 3, "checkpoint_save", "enospc")]
    for bad, word in [("rank=1,step=2,section=data", "missing action"),
                      ("rank=1,step=2,section=fwd,action=hang", "section must be one of"),
                      ("rank=1,step=2,section=data,action=sleep", "action must be"),
                      ("rank=1,step=2,section=data,action=sleep:-1", ">= 0"),
                      ("rank=a,step=2,section=data,action=hang", "integers"),
                      ("rank=1,step=2,section=data,action=hang,color=red", "unknown")]:
        with pytest.raises(FaultSpecError, match=word):
            parse_faults(bad)


def test_fault_point_is_a_no_op_without_the_variable():
    code = ("import os; os.environ.pop('XHC_FAULT_INJECT', None)\n"
            "from training.run import faults\n"
            "assert not faults.faults_active()\n"
            "faults.fault_point('forward_backward', 1)\n"
            "assert faults._faults is None  # nothing parsed, nothing fired\n"
            "os.environ['XHC_FAULT_INJECT'] = 'rank=0,step=1,section=data,action=raise'\n"
            "faults.fault_point('data', 1)  # read at import only: a config or a later setenv cannot switch it on\n")
    env = {k: v for k, v in os.environ.items() if k != "XHC_FAULT_INJECT"}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dict(env, PYTHONPATH=REPO), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    env["XHC_FAULT_INJECT"] = "rank=0,step=1,section=data,action=raise"
    r = subprocess.run([sys.executable, "-c", "from training.run import faults; faults.fault_point('data', 2); "
                        "faults.fault_point('data', 1)"], cwd=REPO, env=dict(env, PYTHONPATH=REPO),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "RuntimeError: injected fault" in r.stderr and "fault injected at" in r.stderr


_HUNG = r'''
import sys, time
from training.run.watchdog import Watchdog, WatchdogSettings
wd = Watchdog(sys.argv[1], 0, 1, WatchdogSettings(step_s=0.6, warmup_steps=0, startup_s=30),
              status_base=lambda: {"step": 7, "latest_checkpoint": "ck/step_00000007"}, attempt=3)
wd.start()
wd.enter("forward_backward", 8)
time.sleep(0.3)
wd.enter("grad_sync")
time.sleep(0.3)
wd.enter("optimizer")
def stuck_in_the_optimizer():
    time.sleep(30)
stuck_in_the_optimizer()
'''


def test_single_rank_expiry_writes_stacks_status_and_attempt(tmp_path):
    t0 = time.time()
    r = subprocess.run([sys.executable, "-c", _HUNG, str(tmp_path)], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                       capture_output=True, text=True, timeout=60)
    took = time.time() - t0
    assert r.returncode == 86, r.stderr
    assert took < 20  # the section's 0.6 s timeout, not the 30 s sleep
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("[xhc] watchdog")]
    assert len(lines) == 1 and "hung in optimizer at step 8" in lines[0] and "status 86" in lines[0]
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["hang"]["section"] == "optimizer" and status["hang"]["step"] == 8 and status["hang"]["rank"] == 0
    assert status["failed"]["exit_code"] == 86 and status["finished"] is False and status["step"] == 7
    stacks = glob.glob(str(tmp_path / "hangs" / "rank0-*.txt"))
    assert len(stacks) == 1
    text = open(stacks[0]).read()
    assert "in stuck_in_the_optimizer" in text and "section optimizer at step 8" in text.splitlines()[1]
    attempts = [json.loads(x) for x in (tmp_path / "attempts.jsonl").read_text().splitlines()]
    assert attempts == [dict(attempts[0], attempt=3, ended="hang", exit_code=86, section="optimizer", hang_step=8)]
    leftovers = [p for p in glob.glob(str(tmp_path / "**" / "*"), recursive=True) + glob.glob(str(tmp_path / ".*"))
                 if ".tmp" in os.path.basename(p)]
    assert not leftovers


def test_step_timeout_follows_the_measured_steps():
    from training.run.watchdog import Watchdog, WatchdogSettings

    s = WatchdogSettings(step_factor=10, min_step_s=2.0, startup_s=100, warmup_steps=4, checkpoint_s=50, eval_iters=3)
    wd = Watchdog("/nonexistent", 0, 1, s, log=lambda line: None)
    for t in (9.0, 0.5, 0.3, 0.4):  # the first step (one-time costs) is left out
        assert wd.timeout_for("forward_backward") == 100  # warming up: the start-up bound
        wd.step_done(t)
    assert wd.timeout_for("forward_backward") == 10 * 0.4  # the median of 0.5, 0.3, 0.4
    assert wd.timeout_for("evaluation") == 3 * 10 * 0.4 and wd.timeout_for("checkpoint_save") == 50
    wd2 = Watchdog("/nonexistent", 0, 1, s, log=lambda line: None)
    for t in (1.0, 0.01, 0.01, 0.01):
        wd2.step_done(t)
    assert wd2.timeout_for("data") == 2.0  # at least reliability.min_step_timeout_s
    fixed = Watchdog("/nonexistent", 0, 1, WatchdogSettings(step_s=7, warmup_steps=0), log=lambda line: None)
    assert fixed.timeout_for("optimizer") == 7


def _report(times_per_rank, threshold=1.5):
    """Rank 0's report when rank r's forward_backward took times_per_rank[r] (4 steps), the others waiting."""
    from training.run.straggler import StragglerMonitor

    world = len(times_per_rank)

    def fill(mon, r):
        for step, fb in enumerate(times_per_rank[r], 1):
            mon.record(step, 1.0, {"data": 0.01, "forward_backward": fb, "optimizer": 0.02, "grad_sync": 1 - fb})

    flats = []
    for r in range(world):  # what each rank puts into the all-reduce
        mon = StragglerMonitor(4, threshold, r, world, lambda v: flats.append(v) or v)
        fill(mon, r)
        mon.report(4)
    total = [sum(col) for col in zip(*flats)]  # the all-reduce (sum)
    mon = StragglerMonitor(4, threshold, 0, world, lambda v: total)
    fill(mon, 0)
    return mon.report(4)


def test_straggler_names_the_slow_rank_and_nobody_otherwise():
    slow = _report([[0.1, 0.1, 0.5, 0.1], [0.3, 0.31, 0.29, 0.3], [0.1, 0.11, 0.1, 0.1]])
    assert slow["straggler"] == 1 and slow["slowest_rank"] == 1
    assert slow["ratio"] == pytest.approx((0.01 + 0.30 + 0.02) / (0.01 + 0.10 + 0.02), rel=1e-4)  # medians
    even = _report([[0.1, 0.1, 0.1, 0.1], [0.1, 0.12, 0.1, 0.11], [0.1, 0.1, 0.1, 0.1]])
    assert even["straggler"] is None and even["ratio"] < 1.5
