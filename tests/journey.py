"""Run the documentation: the fenced blocks of README.md and docs/*.md marked ``<!-- journey: NAME -->``.

A marked block is the test input, so the commands a user reads are the commands the tests run::

    <!-- journey: resume -->
    ```bash
    python -m training.pretrain run.dir=runs/my-run run.train_steps=200
    ```

* ``bash`` blocks run line by line (``\\`` continues a line, ``# ...`` is a comment); ``python``
  blocks run as one script.
* Every command runs in a fresh subprocess, in the journey's own empty working directory, with a
  clean environment: no ``XHC_*``, ``TRITON_*``, ``TORCHDYNAMO_*`` or ``PYTEST_*`` variables and no
  ``PYTHONPATH`` (the package is found as a user's install finds it).  ``python`` is this
  interpreter, a leading ``tools/env.sh`` (the venv wrapper) is dropped since we already run inside
  the venv, and console scripts (``xhc-finetune``, ...) come from the venv's ``bin``.
* A path with a ``<placeholder>`` (``runs/tiny-moe-xhc-<timestamp>``) is the one file or folder
  that matches it with the placeholder as a wildcard.
* Runs are shortened only by documented overrides that the caller appends
  (``run.train_steps=...``, ``train.max_steps=...``, ``--limit ...``).
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_BLOCK = re.compile(r"<!-- journey: (?P<name>[\w.-]+) -->\s*\n```(?P<lang>\w+)\n(?P<body>.*?)\n```", re.S)
_CLEAN_PREFIXES = ("XHC_", "TRITON_", "TORCHDYNAMO_", "PYTEST_")


@dataclass
class Block:
    name: str
    lang: str
    body: str
    where: str  # file:line

    def commands(self) -> List[List[str]]:
        """``bash`` blocks: one argv per command line (continuations joined, comments dropped)."""
        assert self.lang == "bash", f"{self.where}: journey {self.name} is a {self.lang} block"
        out, buf = [], ""
        for line in self.body.splitlines():
            if line.rstrip().endswith("\\"):
                buf += line.rstrip()[:-1] + " "
                continue
            argv = shlex.split(buf + line, comments=True)
            buf = ""
            if argv:
                out.append(argv)
        return out


def doc_blocks() -> Dict[str, Block]:
    """Every marked block of the README and docs/, by name (a name used twice is an error)."""
    found: Dict[str, Block] = {}
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for m in _BLOCK.finditer(text):
            where = f"{path.relative_to(REPO)}:{text[:m.start()].count(chr(10)) + 1}"
            name = m.group("name")
            if name in found:
                raise AssertionError(f"journey {name!r} is marked twice: {found[name].where} and {where}")
            found[name] = Block(name, m.group("lang"), m.group("body"), where)
    return found


def clean_env(home: Path) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_CLEAN_PREFIXES)}
    env.pop("PYTHONPATH", None)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["HF_HOME"] = str(home / ".hf")  # no writes to the user's cache
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Workspace:
    """An empty working directory with a clean environment, where documented commands run."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.env = clean_env(self.root)
        self.log: List[str] = []

    def resolve(self, arg: str) -> str:
        if "<" not in arg or ">" not in arg:
            return arg
        head, _, tail = arg.partition("=") if re.match(r"^[\w.]+=", arg) else ("", "", arg)
        pattern = re.sub(r"<[^>]*>", "*", tail)
        hits = sorted(glob.glob(pattern, root_dir=self.root))
        assert len(hits) == 1, f"placeholder {arg!r}: {len(hits)} matches of {pattern!r} in {self.root}: {hits}"
        return f"{head}={hits[0]}" if head else hits[0]

    def argv(self, argv: Sequence[str]) -> List[str]:
        argv = list(argv)
        if argv and argv[0] == "tools/env.sh":
            argv = argv[1:]
        if argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        elif not os.path.isabs(argv[0]):
            exe = Path(sys.executable).parent / argv[0]
            assert exe.exists(), f"{argv[0]}: not a console script of this install ({exe} missing)"
            argv[0] = str(exe)
        return [argv[0]] + [self.resolve(a) for a in argv[1:]]

    def elsewhere(self, root: Path, links: Sequence[str] = ("runs", "hf")) -> "Workspace":
        """Another working directory for the later commands of a journey: neither the checkout nor
        the parent of the runs (``runs/X`` resolves to ``<root>/runs/X`` through a symbolic link, so
        nothing next to the run directory holds the ``data/`` training used: only the run record
        finds it).  ``links``: the folders of this workspace it reaches (created if missing)."""
        other = Workspace(root)
        for name in links:
            (self.root / name).mkdir(exist_ok=True)
            (other.root / name).symlink_to(self.root / name, target_is_directory=True)
        return other

    def run(self, argv: Sequence[str], extra: Sequence[str] = (), timeout: float = 600.0,
            check: bool = True, tty: bool = False) -> subprocess.CompletedProcess:
        """``tty``: standard input is a pseudo-terminal, as in a user's shell (a question such as
        ``[y/N]`` would wait there; it shows in the output)."""
        cmd = self.argv(argv) + list(extra)
        t0 = time.perf_counter()
        stdin = subprocess.DEVNULL
        if tty:
            import pty

            master, stdin = pty.openpty()
        try:
            proc = subprocess.run(cmd, cwd=self.root, env=self.env, stdin=stdin, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"{shlex.join(cmd)}: timed out after {timeout:.0f} s\n{(e.stdout or '')[-3000:]}")
        finally:
            if tty:
                os.close(master)
                os.close(stdin)
        self.log.append(f"{time.perf_counter() - t0:7.1f} s  exit {proc.returncode}  $ {shlex.join(cmd)}")
        with open(self.root / "journey-commands.log", "a", encoding="utf-8") as f:  # wall time per command
            f.write(self.log[-1] + "\n")
        if check and proc.returncode != 0:
            raise AssertionError(f"{shlex.join(cmd)} (in {self.root}) exited {proc.returncode}:\n{proc.stdout[-5000:]}")
        return proc

    def python(self, script: str, timeout: float = 600.0, check: bool = True,
               tty: bool = False) -> subprocess.CompletedProcess:
        """Run ``script`` as a file of the workspace (a documented ``python`` block, or a check)."""
        path = self.root / f"_script_{len(self.log)}.py"
        path.write_text(script, encoding="utf-8")
        return self.run(["python", str(path)], timeout=timeout, check=check, tty=tty)


def is_pretrain(argv: Sequence[str]) -> bool:
    return "training.pretrain" in argv or os.path.basename(argv[0]) == "xhc-pretrain"


def shorten(argv: Sequence[str], train_steps: Optional[int] = None) -> List[str]:
    """The documented overrides that shorten a command (appended; later keys win)."""
    if is_pretrain(argv) and train_steps:
        return [f"run.train_steps={train_steps}"]
    if "tools.evaluate" in argv:
        return ["--limit", "5"]
    if os.path.basename(argv[0]) == "xhc-finetune":
        return ["train.max_steps=12", "train.eval_interval=6", "train.diagnostics_steps=6"]
    return []


# A check run in its own fresh process after the documented commands: the first HC call of the
# process is a forward under ``torch.no_grad()`` (the path ``generate`` and lm-eval take), then one
# under ``torch.inference_mode()``, then greedy ``generate`` (KV cache, and the xHC temporal decode
# cache) must equal an argmax loop over full re-forwards without any cache.  The prompt is the first
# candidate whose reference argmax wins by a margin far above fp32 round-off at every step, chosen
# from the reference alone, so the comparison never rests on rounding luck.
GENERATE_CHECK = r'''
import json, sys, torch
from transformers import AutoModelForCausalLM

def check(model, vocab, new=8):
    ids = torch.randint(3, vocab, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first = model(ids).logits
    with torch.inference_mode():
        again = model(ids).logits
    assert torch.isfinite(first).all() and torch.equal(first, again.clone())
    for seed in range(12):
        prompt = torch.randint(3, vocab, (1, 6), generator=torch.Generator().manual_seed(seed))
        seq, margins = prompt, []
        with torch.no_grad():
            for _ in range(new):
                last = model(seq, use_cache=False).logits[0, -1]
                top = last.topk(2).values
                margins.append(float(top[0] - top[1]))
                seq = torch.cat([seq, last.argmax().view(1, 1)], 1)
        if min(margins) > 1e-4:
            break
    assert min(margins) > 1e-4, "every candidate prompt has a near-tie in its reference argmax"
    got = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return {"generate": got.tolist(), "argmax_loop": seq.tolist(), "margin": min(margins)}

def main(paths):
    out = {}
    for path in paths:
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()
        out[path] = check(model, model.config.vocab_size)
    print("RESULT " + json.dumps(out))

if __name__ == "__main__":
    main(sys.argv[1:])
'''


def generate_check(ws: Workspace, paths: Sequence[str]) -> dict:
    """Run :data:`GENERATE_CHECK` on HF folders in a fresh process of ``ws``; returns its result."""
    import json

    script = ws.root / "_generate_check.py"
    script.write_text(GENERATE_CHECK, encoding="utf-8")
    proc = ws.run(["python", str(script), *map(str, paths)])
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])
