"""Shared pytest fixtures, and the ``cpu_gloo`` marker.

``@pytest.mark.cpu_gloo`` marks a test of the CPU/gloo path (Megatron through
:mod:`models.cpu_compat`, TP/EP/DP equivalence on CPU tensors).  On a machine without CUDA it runs
as usual.  Where CUDA is visible, :mod:`models.cpu_compat` leaves Megatron stock (GPU) in this
process, so the marked tests of a module run together in one child ``pytest`` with
``CUDA_VISIBLE_DEVICES=""`` (their torchrun workers inherit it) and each result is reported here
under its own name: the parallel-equivalence tests run on GPU machines too instead of skipping.
``XHC_CPU_GLOO_CHILD=1`` forces that route on a CPU machine (to test the mechanism).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import pytest
import torch

# Triton builds its language module once, at first import, in interpreted or compiled form
# depending on TRITON_INTERPRET at that moment.  Any test module may import Triton (directly or
# through xhc.kernels), so on a machine without CUDA the interpreter is switched on here, before
# any test module is collected; a test that needs it off sets it itself.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tests run tiny tensors: a second intra-op thread costs more (OpenMP hand-offs) than it saves,
# so this process computes on one (the fast tier ran in 112 s instead of 190 s here).  Subprocesses
# the tests start (training runs, torchrun workers, journeys) keep their own defaults.
torch.set_num_threads(1)

# No product behaviour is fixed here for the whole session: `kernels: auto` is a fixed rule (no
# probe), and a test that needs a particular backend says so in its own config.  (TRITON_INTERPRET
# above only decides how Triton builds itself; `auto` never reads it.)

# torch.compile reads TORCHDYNAMO_DISABLE at every call: a test (or a module it imports) that
# leaves it set makes every later compile test silently run eagerly, and pass for the wrong
# reason.  Entry points switch it off only while their main() runs; this guard keeps it that way.
_DYNAMO_ENV_AT_START = os.environ.get("TORCHDYNAMO_DISABLE")


@pytest.fixture(autouse=True)
def _torch_compile_stays_switched_on():
    yield
    now = os.environ.get("TORCHDYNAMO_DISABLE")
    if now != _DYNAMO_ENV_AT_START:
        if _DYNAMO_ENV_AT_START is None:
            os.environ.pop("TORCHDYNAMO_DISABLE", None)
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = _DYNAMO_ENV_AT_START
        pytest.fail(f"this test left TORCHDYNAMO_DISABLE={now!r} (was {_DYNAMO_ENV_AT_START!r}): later "
                    "torch.compile tests would silently run eagerly", pytrace=False)


_CHILD_REPORT = "XHC_CPU_GLOO_REPORT"  # set in the child: where it writes its results
_FORCE = "XHC_CPU_GLOO_CHILD"


@pytest.fixture(scope="session")
def tiny_zoo(tmp_path_factory):
    """Every tiny variant, perturbed, as a run, a checkpoint, an fp32 HF export and Megatron's logits:
    built once per session (one build for all xdist workers) and shared by test_convert_hf and
    test_inspect (``tests/tiny_zoo.py``).  Read-only."""
    from tests.tiny_zoo import shared

    return shared(tmp_path_factory)


@pytest.fixture(scope="session")
def trained_xhc(tmp_path_factory):
    """tiny-moe:xhc trained 201 steps by ``python -m training.pretrain`` (checkpoints at 100, 200 and
    201): trained once per session (one run for all xdist workers) and shared by test_convert_hf and
    test_inspect (``tests/trained_run.py``).  Read-only."""
    from tests.trained_run import shared

    return shared(tmp_path_factory)


@pytest.fixture(scope="session")
def run_torchrun():
    """``run_torchrun(script, nproc=2, args=(), timeout=180, check=True)``: launch a torchrun
    worker (see :func:`tests.dist.launch.run_torchrun`) and return the ``CompletedProcess``."""
    from tests.dist.launch import run_torchrun as _run

    return _run


# Tiers (pytest.ini, CONTRIBUTING.md): a test is marked by what it does.  The fixtures tell for two
# kinds (torchrun workers, torch.compile), and every heavy marker implies `slow`, so the fast tier
# is `-m "not slow"`.
_FIXTURE_MARKS = {"run_torchrun": "dist", "dynamo_reset": "inductor",
                  # module-scoped fixtures that train, export or install once for a whole module
                  "exported": "train", "exported_with_tokenizer": "train", "trained_run": "train", "tiny_zoo": "train",
                  "trained_xhc": "train",
                  "installed": "install", "dist2": "dist", "dist4": "dist"}
_HEAVY = ("dist", "inductor", "interp", "install", "train", "journey")


def pytest_addoption(parser):
    g = parser.getgroup("xhc")
    g.addoption("--fast-first", action="store_true",
                help="run the fast tier (not slow) first and stop before the slow tests if any fast test failed")
    g.addoption("--strict-skips", action="store_true",
                help="fail the session when a test skips that tests/skip_allowlist.txt does not list")
    g.addoption("--extended", action="store_true",
                help="also run the extended tier (tests marked `extended`: left out of CI for its time budget; "
                     "CONTRIBUTING.md, \"Test tiers\")")


# The slow tier's longest files, longest first: the sum of each file's test durations (setup
# included) in `pytest -m slow tests -n 2 --dist loadfile --durations=0` on 2026-12-07 (issue 46; a
# loaded machine, so the order counts, not the seconds).  pytest_configure below keeps xdist from
# reordering them by their number of tests.
_LONGEST_FILES = ("test_hc_kernels.py", "test_convert_hf.py", "test_reliability.py", "test_triton_aot.py",
                  "test_bad_inputs.py", "test_elastic_resume.py", "test_gpu_check.py", "test_journeys_more.py",
                  "test_pretrain_dist.py", "test_chaos.py", "test_watchdog.py", "test_rooms_move.py", "test_journeys.py",
                  "test_bench_hc_kernels.py",
                  "test_hc_kernels_model.py",
                  "test_async_checkpoint.py", "test_xhc_kernels_fused.py", "test_grouped_experts.py",
                  "test_reproducibility.py", "test_old_checkpoint.py", "test_inspect.py", "test_hc_megatron.py",
                  "test_sweep.py", "test_optim.py", "test_pretrain.py", "test_megatron_cpu.py", "test_inference.py",
                  "test_mtp.py")


def pytest_configure(config):
    # pytest-xdist >= 3.6 hands out `--dist loadfile`'s files by their number of tests (most first)
    # unless told not to: a 3-test file of several minutes (the Triton AOT compile) then starts last
    # and runs alone.  Keep the order set below (the longest files first, measured).
    if getattr(config.option, "loadscopereorder", None):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        for fixture, mark in _FIXTURE_MARKS.items():
            if fixture in names:
                item.add_marker(mark)
        if any(item.get_closest_marker(m) for m in _HEAVY) and not item.get_closest_marker("slow"):
            item.add_marker("slow")
    if not config.getoption("--extended"):  # the extended tier runs only when asked for
        left = [i for i in items if i.get_closest_marker("extended")]
        if left:
            config.hook.pytest_deselected(items=left)
            items[:] = [i for i in items if not i.get_closest_marker("extended")]
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # pytest-xdist (--dist loadfile) hands out files in collection order: the longest first, so
        # the two workers finish together instead of one running a 4-minute file alone at the end
        rank = {name: i for i, name in enumerate(_LONGEST_FILES)}
        items.sort(key=lambda it: rank.get(it.path.name, len(rank)))  # stable within a file
    if config.getoption("--fast-first"):  # stable: file order within each tier
        items[:] = [i for i in items if not i.get_closest_marker("slow")] + \
                   [i for i in items if i.get_closest_marker("slow")]


_fast_failed = []
_skipped: dict = {}  # nodeid -> reason


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.config.getoption("--fast-first") and item.get_closest_marker("slow") and _fast_failed:
        pytest.exit(f"the fast tier failed ({len(_fast_failed)} test(s), e.g. {_fast_failed[0]}): "
                    "not starting the slow tests", returncode=1)


def _record(report):
    if report.failed and "slow" not in report.keywords:
        _fast_failed.append(report.nodeid)
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skipped[report.nodeid] = reason


def _allowlist():
    import fnmatch  # noqa: F401

    path = os.path.join(os.path.dirname(__file__), "skip_allowlist.txt")
    rules = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                pattern, _, reason = line.partition("  ")
                rules.append((pattern.strip(), reason.strip()))
    return rules


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _skipped:
        return
    import fnmatch

    rules = _allowlist()
    tr = terminalreporter
    tr.write_sep("-", f"{len(_skipped)} skipped test(s)")
    unexpected = []
    for nodeid, reason in sorted(_skipped.items()):
        ok = any(fnmatch.fnmatch(nodeid, pat) for pat, _ in rules)
        tr.write_line(f"{'allowed   ' if ok else 'NOT ALLOWED'} {nodeid}: {reason}")
        if not ok:
            unexpected.append(nodeid)
    if unexpected and config.getoption("--strict-skips"):
        tr.write_line(f"[xhc] {len(unexpected)} skip(s) not on tests/skip_allowlist.txt: add the test with its "
                      "reason there, or make it run", red=True)


def pytest_sessionfinish(session, exitstatus):
    if session.config.getoption("--strict-skips") and _skipped:
        import fnmatch

        rules = _allowlist()
        if any(not any(fnmatch.fnmatch(n, p) for p, _ in rules) for n in _skipped) and session.exitstatus == 0:
            session.exitstatus = 1


def _route_to_child() -> bool:
    if os.environ.get(_CHILD_REPORT):
        return False  # this is the child
    if os.environ.get(_FORCE) == "1":
        return True
    import torch

    return torch.cuda.is_available()


_results: dict = {}  # nodeid -> {when: record}
_ran_modules: set = set()


def _run_child(session, module_path: str) -> None:
    items = [it for it in session.items if it.get_closest_marker("cpu_gloo") and str(it.path) == module_path]
    fd, report = tempfile.mkstemp(prefix="cpu-gloo-", suffix=".jsonl")
    os.close(fd)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", **{_CHILD_REPORT: report})
    env.pop(_FORCE, None)
    root = str(session.config.rootpath)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *[it.nodeid for it in items]]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    with open(report, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            _results.setdefault(r["nodeid"], {})[r["when"]] = r
    os.unlink(report)
    for it in items:  # a child that died reports nothing for the rest: fail them with its output
        if not _results.get(it.nodeid):
            _results[it.nodeid] = {"call": {
                "outcome": "failed", "duration": 0.0,
                "longrepr": f"no result from the CUDA-hidden child pytest (exit {proc.returncode}):\n"
                            f"{proc.stdout[-4000:]}{proc.stderr[-4000:]}"}}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if not item.get_closest_marker("cpu_gloo") or not _route_to_child():
        return None
    from _pytest.reports import TestReport

    module = str(item.path)
    if module not in _ran_modules:
        _ran_modules.add(module)
        _run_child(item.session, module)
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    recs = _results.get(item.nodeid, {})
    keywords = {k: 1 for k in item.keywords}
    for when in ("setup", "call", "teardown"):
        r = recs.get(when)
        if r is None:
            if when == "call" and recs.get("setup", {}).get("outcome") != "passed":
                continue  # setup failed or skipped: no call phase
            r = {"outcome": "passed", "longrepr": None, "duration": 0.0}
        longrepr = r.get("longrepr")
        if r["outcome"] == "skipped" and isinstance(longrepr, list):
            longrepr = tuple(longrepr)
        now = time.time()
        rep = TestReport(item.nodeid, item.location, keywords, r["outcome"], longrepr, when,
                         duration=r.get("duration", 0.0), start=now, stop=now)
        item.ihook.pytest_runtest_logreport(report=rep)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def pytest_runtest_logreport(report):
    _record(report)
    path = os.environ.get(_CHILD_REPORT)
    if not path:
        return
    longrepr = None
    if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        longrepr = list(report.longrepr)
    elif report.failed:
        longrepr = str(report.longrepr)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                            "longrepr": longrepr, "duration": report.duration}) + "\n")
