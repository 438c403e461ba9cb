"""Running a sweep: the local executor (arms as subprocesses, resumable) and SLURM arrays."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

from training.config import load_config

from tools.sweep.spec import Arm, Sweep, SweepError

__all__ = ["ARM_STATE", "arm_finished", "run_local", "slurm_commands", "git_commit"]

ARM_STATE = "sweep_arm.json"
"""Per-arm record of the sweep runner (state, exit code, log, wall time) in the arm's run dir."""


# ================================================================================================
# Arm state
# ================================================================================================
def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def _pid_alive(pid: Optional[int]) -> bool:
    if not pid:
        return False
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError):
        return False
    return True


def arm_finished(arm: Arm) -> bool:
    st = _read_json(os.path.join(arm.run_dir, "status.json"))
    return bool(st and st.get("finished"))


def _tail_step(path: str) -> int:
    """The step of the last record of a metrics.jsonl (0 if none), reading only its end."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 4096))
            lines = f.read().decode("utf-8", "replace").strip().splitlines()
        for line in reversed(lines):
            try:
                return int(json.loads(line).get("step", 0))
            except ValueError:
                continue
    except OSError:
        pass
    return 0


def _last_error_line(log: str) -> str:
    try:
        with open(log, encoding="utf-8", errors="replace") as f:
            lines = [ln.strip() for ln in f.readlines()[-200:] if ln.strip()]
    except OSError:
        return ""
    for ln in reversed(lines):
        if ln.startswith("error:") or "Error" in ln.split(":")[0]:
            return ln[:200]
    return lines[-1][:200] if lines else ""


# ================================================================================================
# Local executor
# ================================================================================================
def git_commit() -> Optional[str]:
    """The commit of the code that runs (``<hash>`` or ``<hash>-dirty`` with uncommitted changes to
    tracked files); None outside a git checkout."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")


def _deathsig():
    """Child setup: receive SIGTERM when the sweep runner dies (so a killed runner's arms save and
    stop instead of training on unattended)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _prepare_data(sweep: Sweep, log) -> None:
    """Build the embedded default corpus/tokenizer once before parallel arms would race for it."""
    cfg = load_config(sweep.base, sweep.arms[0].overrides)
    if not cfg.uses_default_data:
        return
    from training.data import prepare_default_data

    kw = {} if cfg.data.default_target_mb is None else {"target_mb": cfg.data.default_target_mb}
    prepare_default_data(cfg.data.default_dir, vocab_size=cfg.tokenizer.vocab_size, seed=cfg.data.seed,
                         progress=False, log=None, **kw)


def run_local(sweep: Sweep, parallel: int = 1, log=print, poll_s: float = 0.5) -> Dict[str, str]:
    """Run every unfinished arm (``parallel`` at a time); returns arm name -> final state.

    Finished arms (``status.json``: finished) are skipped; unfinished ones resume from their
    checkpoints (``checkpoint.load=auto``).  A failed arm does not stop the sweep.  SIGTERM/SIGINT
    to the runner forwards SIGTERM to the running arms (they checkpoint and exit) and stops.
    """
    import resource

    from tqdm import tqdm

    t_start = time.time()
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu0 = ru.ru_utime + ru.ru_stime
    os.makedirs(sweep.out_dir, exist_ok=True)
    states: Dict[str, str] = {}
    todo: List[Arm] = []
    for a in sweep.arms:
        if arm_finished(a):
            states[a.name] = "finished"
        else:
            todo.append(a)
    commit = git_commit()
    # seed by seed: a sweep stopped part-way has every variant and budget at its first seeds
    seed_rank = {s: i for i, s in enumerate(dict.fromkeys(a.seed for a in sweep.arms))}
    todo.sort(key=lambda a: seed_rank[a.seed])
    total_c = sum(a.compute for a in sweep.arms) or 1.0
    done_c = sum(a.compute for a in sweep.arms if states.get(a.name) == "finished")
    log(f"[sweep] {sweep.name}: {len(sweep.arms)} arms, {len(states)} already finished, {len(todo)} to run "
        f"({parallel} at a time) -> {sweep.out_dir}")
    if todo:
        _prepare_data(sweep, log)
    running: Dict[str, tuple] = {}
    failed: List[str] = []
    stop = {"sig": None}

    def on_signal(signum, _frame):
        stop["sig"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    bar = tqdm(total=100.0, initial=100.0 * done_c / total_c, unit="%", desc=f"sweep {sweep.name}",
               bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}% [{elapsed}<{remaining}{postfix}]",
               file=sys.stderr, dynamic_ncols=True, mininterval=1.0)

    def finish(arm: Arm, proc, logf, t0, record):
        rc = proc.returncode
        logf.close()
        record["wall_s"] = record.get("wall_s", 0.0) + (time.time() - t0)
        record["pid"] = None
        record["returncode"] = rc
        if rc == 0 and arm_finished(arm):
            state = "finished"
        elif rc == 0 or stop["sig"] is not None:
            state = "stopped"
        else:
            state = "failed"
        record["state"] = state
        _write_json(os.path.join(arm.run_dir, ARM_STATE), record)
        states[arm.name] = state
        if state == "failed":
            failed.append(arm.name)
            bar.write(f"[sweep] arm {arm.name} failed (exit {rc}): see {record['log']}  "
                      f"[{_last_error_line(record['log'])}]")
        elif state == "finished":
            bar.write(f"[sweep] arm {arm.name} finished in {time.time() - t0:.0f}s")

    last_shown = [None, 0.0]
    try:
        while (todo or running) and stop["sig"] is None:
            while todo and len(running) < max(1, parallel) and stop["sig"] is None:
                arm = todo.pop(0)
                os.makedirs(arm.run_dir, exist_ok=True)
                rec_path = os.path.join(arm.run_dir, ARM_STATE)
                record = _read_json(rec_path) or {}
                if record.get("overrides") and record["overrides"] != arm.overrides:
                    raise SweepError(f"arm {arm.name}: {arm.run_dir} was started with other settings; use a new "
                                     "--out-dir or delete that arm's directory")
                while _pid_alive(record.get("pid")):  # a previous runner's arm still saving: let it finish
                    time.sleep(poll_s)
                logp = os.path.join(arm.run_dir, "train.log")
                logf = open(logp, "a", encoding="utf-8")
                cmd = arm.command(sweep.base)
                logf.write(f"\n[sweep] {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n")
                logf.flush()
                env = dict(os.environ)
                if sweep.executor.get("threads"):
                    env.setdefault("OMP_NUM_THREADS", str(int(sweep.executor["threads"])))
                proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                        preexec_fn=_deathsig if sys.platform.startswith("linux") else None)
                record.update({"name": arm.name, "overrides": arm.overrides, "state": "running", "pid": proc.pid,
                               "log": logp, "command": shlex.join(cmd), "attempts": record.get("attempts", 0) + 1,
                               "commit": commit})
                _write_json(rec_path, record)
                states[arm.name] = "running"
                running[arm.name] = (arm, proc, logf, time.time(), record)
            for name in list(running):
                arm, proc, logf, t0, record = running[name]
                ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                if proc.poll() is not None:
                    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # this arm's CPU (reaped just now)
                    record["cpu_s"] = record.get("cpu_s", 0.0) + (ru1.ru_utime + ru1.ru_stime) - \
                        (ru0.ru_utime + ru0.ru_stime)
                    finish(arm, proc, logf, t0, record)
                    del running[name]
                    if states[name] == "finished":
                        done_c += arm.compute
            partial = sum(a.compute * min(1.0, _tail_step(os.path.join(a.run_dir, "metrics.jsonl")) / a.steps)
                          for a, *_ in running.values())
            n_done = sum(1 for s in states.values() if s == "finished")
            shown = (int(100.0 * (done_c + partial) / total_c), n_done, len(running), len(failed))
            if shown != last_shown[0] or time.time() - last_shown[1] > 30:
                bar.n = 100.0 * (done_c + partial) / total_c
                bar.set_postfix_str(f"arms done {n_done}/{len(sweep.arms)} running {len(running)} "
                                    f"failed {len(failed)}", refresh=False)
                bar.refresh()
                last_shown[:] = [shown, time.time()]
            if running:
                time.sleep(poll_s)
    finally:
        if running:
            for arm, proc, *_ in running.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)  # the trainer saves a checkpoint at the next step and exits
            for arm, proc, logf, t0, record in list(running.values()):
                try:
                    proc.wait(timeout=300)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                finish(arm, proc, logf, t0, record)
        bar.close()
        for s, h in old.items():
            signal.signal(s, h)
    if stop["sig"] is not None:
        log(f"[sweep] interrupted ({signal.Signals(stop['sig']).name}): rerun the same command to resume")
        return states
    n_done = sum(1 for s in states.values() if s == "finished")
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    log(f"[sweep] wall {time.time() - t_start:.0f}s, CPU of the arms run now {ru.ru_utime + ru.ru_stime - cpu0:.0f}s "
        "(user+sys; on an otherwise idle machine the wall time is about CPU / cores when parallel >= cores)")
    log(f"[sweep] {n_done}/{len(sweep.arms)} arms finished, {len(failed)} failed"
        + (": " + ", ".join(failed) + " (rerun to retry them; logs in each arm's train.log)" if failed else ""))
    return states


# ================================================================================================
# SLURM executor
# ================================================================================================
def slurm_commands(sweep: Sweep) -> List[str]:
    """Write ``<out_dir>/slurm_arms.jsonl`` (line i = the overrides of arm i) and return the sbatch
    line of one array job over the unfinished arms (``tools/slurm_pretrain.sh`` reads line
    ``SLURM_ARRAY_TASK_ID`` of ``XHC_SWEEP_ARMS``)."""
    os.makedirs(sweep.out_dir, exist_ok=True)
    todo = [a for a in sweep.arms if not arm_finished(a)]
    if not todo:
        return []
    arms_file = os.path.join(sweep.out_dir, "slurm_arms.jsonl")
    with open(arms_file + ".tmp", "w", encoding="utf-8") as f:
        for a in todo:
            f.write(json.dumps({"name": a.name, "overrides": a.overrides}) + "\n")
    os.replace(arms_file + ".tmp", arms_file)
    sl = sweep.executor.get("slurm") or {}
    extra = [str(x) for x in sl.get("sbatch_args", [])]
    nodes = int(sl.get("nodes", 1))
    import tools

    script = os.path.join(os.path.dirname(os.path.abspath(tools.__file__)), "slurm_pretrain.sh")
    cmd = (f"XHC_SWEEP_ARMS={shlex.quote(arms_file)} sbatch --array 0-{len(todo) - 1} --nodes {nodes} "
           f"--job-name {shlex.quote('sweep-' + sweep.name)} " + "".join(shlex.quote(x) + " " for x in extra)
           + f"{shlex.quote(script)} {shlex.quote(sweep.base or 'configs/pretrain/default-tiny.yaml')}")
    return [cmd]
