""".ci/run's stage times (``.ci/stage_times.sh``): each stage against its number recorded in
CONTRIBUTING.md ("CI stage times"; a warning over 1.2 x), and the total against the 1,500 s budget."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
bash = shutil.which("bash")
pytestmark = pytest.mark.skipif(bash is None, reason="needs bash")

TABLE = """Some text.

<!-- ci-stage-times -->
| stage | seconds | measured by |
|---|---|---|
| `install` | 100 | a run |
| `quickstart` | | not recorded yet |
| `slow` | 800 | a run |

| other | 5 | a later table is not read |
"""


def run(script: str, times_file: Path) -> str:
    r = subprocess.run([bash, "-c", f". .ci/stage_times.sh\n{script}"], cwd=ROOT, capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "CI_TIMES_FILE": str(times_file)}, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture
def times(tmp_path):
    path = tmp_path / "CONTRIBUTING.md"
    path.write_text(TABLE)
    return path


def test_recorded_numbers_are_read_from_the_marked_table_only(times):
    assert run("recorded_s install; recorded_s slow; recorded_s quickstart; recorded_s other", times).split() == \
        ["100", "800"]


def test_a_stage_more_than_20_percent_over_its_number_warns_and_is_repeated_at_the_end(times):
    out = run("check_stage install 120; check_stage slow 961; check_stage quickstart 50; budget_line 1200", times)
    lines = out.splitlines()
    warn = [ln for ln in lines if "WARNING" in ln]
    assert len(warn) == 2 and warn[0] == warn[1]  # printed at once and again after the total
    assert "stage slow took 961 s, 20 % over its recorded 800 s" in warn[0]  # 961 > 1.2 x 800 = 960
    assert "install" not in out.replace("stage install", "")  # 120 = 1.2 x 100: no warning
    assert "stage quickstart: 50 s (no recorded number" in out
    assert "[ci] total 1200 s of the 1500 s budget (300 s left)" in lines


def test_the_total_over_the_budget_says_by_how_much(times):
    assert run("budget_line 1501", times).strip() == "[ci] total 1501 s: OVER the 1500 s budget by 1 s"


def test_every_stage_ci_run_checks_has_a_row_in_contributing():
    text_run = (ROOT / ".ci" / "run").read_text()
    stages = re.findall(r"^\s*stamp ([a-z][a-z0-9-]*) ", text_run, re.M) + \
        re.findall(r"check_stage ([a-z][a-z0-9-]*) ", text_run)  # a stage timed by itself (stage 2)
    assert {"install", "fast", "slow", "py312"} <= set(stages), stages
    text = (ROOT / "CONTRIBUTING.md").read_text()
    table = text.split("<!-- ci-stage-times -->", 1)[1].split("\n\n", 1)[0]
    rows = set(re.findall(r"^\| `([a-z0-9-]+)` \|", table, re.M))
    assert set(stages) == rows, (sorted(stages), sorted(rows))
    for key in ("install", "fast", "slow", "py312"):  # the stages with a measured number
        assert run(f"recorded_s {key}", ROOT / "CONTRIBUTING.md").strip().isdigit(), key
