"""No shell script of the repository pipes into a reader that exits early while ``pipefail`` is on.

``printf … | grep -q x`` under ``set -o pipefail``: ``grep -q`` exits at its first match, the writer
may then die of SIGPIPE, and the pipeline fails although it matched (``bench/gpu_check.sh`` refused a
valid ``--steps train`` that way, at random).  The same holds for ``head``, ``grep -m`` and a ``sed``
or ``awk`` program that quits.  Test membership in bash itself, or use a reader that reads to the end
(``sed -n 1p``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", ".venv-compat", "runs", "data", "node_modules"}

# a pipe (not `||`) into a reader that may stop reading before its writer is done
EARLY_EXIT = re.compile(r"(?<![|])\|(?![|])\s*(?:"
                        r"grep\b[^|;]*\s(?:-[A-Za-z]*[qm]|--quiet|--silent|--max-count)"
                        r"|head\b"
                        r"|sed\b[^|]*['\"][^'\"]*(?<![A-Za-z])q(?![A-Za-z])"
                        r"|awk\b[^|]*\bexit\b)")


def shell_scripts():
    found = [ROOT / ".ci" / "run"]
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]  # venvs, runs and data are not ours to walk
        found += [Path(top) / f for f in files if f.endswith(".sh")]
    return sorted(p for p in found if p.is_file())


def early_exit_pipes(text: str):
    """``(line number, line)`` of every pipe into an early-exiting reader, comments left out."""
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        code = line.split(" #", 1)[0]
        if code.lstrip().startswith("#"):
            continue
        if EARLY_EXIT.search(code):
            hits.append((n, line.strip()))
    return hits


@pytest.mark.parametrize("line", [
    """printf '%s\\n' "${NAMES[@]}" | grep -qx "$s" || exit 2""",
    'head="$(scontrol show hostnames "$L" | head -n 1)"',
    "cat log | grep -m1 FAIL",
    "seq 100 | sed '3q'",
    "seq 100 | awk 'NR==2 {print; exit}'",
])
def test_the_check_finds_each_early_exit_reader(line):
    assert early_exit_pipes(line), line


@pytest.mark.parametrize("line", [
    'known "$s" || { echo "error" >&2; exit 2; }',
    'head="$(scontrol show hostnames "$L" | sed -n 1p)"',
    'grep -qE "^FAIL " "$out" || SUMMARY+=("FAIL")',  # grep reads a file, no pipe
    'ENV_LINE=$(python - 2>&1 | tail -1)',
    "df -Pk . | awk 'NR==2 {print $4}'",
])
def test_the_check_passes_readers_that_read_to_the_end(line):
    assert not early_exit_pipes(line), line


def test_no_script_pipes_into_an_early_exiting_reader_under_pipefail():
    scripts = shell_scripts()
    assert ROOT / "bench" / "gpu_check.sh" in scripts and ROOT / ".ci" / "run" in scripts
    bad = [f"{p.relative_to(ROOT)}:{n}: {line}" for p in scripts
           if "pipefail" in (text := p.read_text(encoding="utf-8")) for n, line in early_exit_pipes(text)]
    assert not bad, ("under `set -o pipefail` these pipelines can fail at random (the writer dies of SIGPIPE "
                     "when the reader exits early); test in bash or read to the end (sed -n 1p):\n"
                     + "\n".join(bad))
