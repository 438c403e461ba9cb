"""Chaos run: one training run under a seeded schedule of faults, relaunched after each like a cluster's
requeue, then compared with an undisturbed run of the same seed.

    python -m bench.chaos --seed 7                                 # 200 steps, 6 faults (a few minutes on CPU)
    python -m bench.chaos --seed 7 --steps 40 --faults 2 --interval 8
    python -m bench.chaos --seed 7 --kinds sigterm,kill_rank,layout --keep

The model is tiny-moe:xhc on mock data (vocabulary 256, padded alike at TP 1 and 2; 32 tokens, which
the xHC halo needs at TP 2 + SP; global batch 4; AdamW), trained with asynchronous saves every
``--interval`` steps under ``torchrun --nproc_per_node 2`` (CPU, gloo); ``run.seed`` is the seed.
From the seed the schedule is drawn (the same seed always draws the same schedule):

=================  ==================================================================================
``sigterm``        SIGTERM to every process group of the job (the launcher's and each worker's, what SLURM
                   sends at pre-emption), at a random moment of a step or of a save
``kill_rank``      ``kill -9`` of one rank (mid-step or mid-save)
``kill_launcher``  ``kill -9`` of torchrun (the workers get SIGTERM from the kernel, save and exit)
``hang``           one rank hangs in a random section (``XHC_FAULT_INJECT``, training.run's fault hook); the
                   watchdog must end the attempt with the retryable status 86
``disk_full``      the disk under ``checkpoint.dir`` fills up before a save (a size-limited tmpfs where this
                   process may mount one, else the hook's injected ``ENOSPC``); the run must exit 4; the
                   requeue frees the space
``corrupt``        one byte of the newest checkpoint flipped between two attempts
``layout``         the requeue comes back on another layout: DP 2, TP 2 (+ SP) or one process
=================  ==================================================================================

``corrupt`` and ``layout`` act between attempts, on the relaunch after a fault of the other kinds.  After
the last attempt the run must have finished, and it is compared with an undisturbed run of the same
seed at the starting layout:

- every attempt on the starting layout: losses, gradient norms, learning rates, data positions and
  sample ids of every step, the validation losses, and every tensor of the final checkpoint (weights
  and optimizer state, read whole) bit for bit;
- after a layout change: the data positions, sample ids and learning rates still exactly, the losses
  and the final tensors within the elastic tolerance of docs/parallelism-and-checkpoints.md ("Resuming
  on another layout"), measured as there: an undisturbed run on each other layout visited, started
  from the reference's first checkpoint, gives the largest difference the layouts' arithmetic makes;
  the chaos run may differ by twice that, and at least 1e-5.  Dropout (0.1) is on in a schedule that
  keeps the layout (the RNG restore counts) and off in one that changes it (a resume on another
  layout reseeds the RNG, so its dropout masks differ by design).
- work lost per fault: the steps trained again, ``last step before the fault - step resumed from``,
  at most one checkpoint interval; plus, where an asynchronous save was still being written when the
  fault struck (that checkpoint never became one), the steps since that save began; plus one interval
  for a corrupt newest checkpoint.  SIGTERM and a killed launcher lose nothing (the ranks save).
- each fault had its documented effect (exit statuses, status.json, the resume line).

It prints a table of the faults (where each struck, how the attempt ended, steps lost, the wall time
it cost: from the last step before the fault to the first new step after it, minus one median step),
the comparison and the verdict, and exits 1 on a failing verdict, with the command that reproduces it
(the same schedule; where exactly a signal lands within a step is up to the machine).
docs/reliability.md, "Chaos run".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

from bench.chaos_schedule import (BETWEEN, KINDS, LAYOUTS, RUNTIME, START_LAYOUT, Attempt, ChaosError, Curves,
                                  Fault, attempt_layouts, draw_schedule, format_report, judge)

MODEL = ["model.preset=tiny-moe:xhc", "data.mock=true", "tokenizer.type=none", "tokenizer.vocab_size=256",
         "batch.seq_length=32", "batch.micro_batch_size=2", "batch.global_batch_size=4", "schedule.warmup_steps=2",
         "run.num_threads=1", "run.eval_iters=1", "logging.tensorboard=false", "logging.plot=false",
         "logging.interval=1000", "logging.hc_health_interval=0", "logging.sample_ids=true",
         "checkpoint.async_save=true", "model.hc_kernels=eager"]
DROPOUT = ["model.backbone.hidden_dropout=0.1", "model.backbone.attention_dropout=0.1"]
NO_DROPOUT = ["model.backbone.hidden_dropout=0.0", "model.backbone.attention_dropout=0.0"]


# ================================================================================================
# The driver: launches, faults, relaunches
# ================================================================================================
def curves_of(run_dir: str, checkpoint: Optional[str]) -> Curves:
    from training.checkpoint import read_whole_tensors
    from training.run import read_metrics

    path = os.path.join(run_dir, "metrics.jsonl")
    train = {r["step"]: (r["loss"], r["grad_norm"], r["lr"], r["consumed_samples"], tuple(r.get("sample_ids", ())))
             for r in read_metrics(path, "train")}
    evals = {r["step"]: r["loss"] for r in read_metrics(path, "eval")}
    with warnings.catch_warnings():  # torch's reader says it reads in one process: that is the point
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return Curves(train, evals, read_whole_tensors(checkpoint) if checkpoint else None)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The watchdog's timeouts for a tiny step (~0.1 s; seconds under load): a hang ends its attempt in about
# 10 s instead of the defaults' minutes (reliability.*, docs/reliability.md "Hangs")
WATCHDOG = ["reliability.step_timeout_s=10", "reliability.timeout_warmup_steps=1", "reliability.startup_timeout_s=300",
            "reliability.checkpoint_timeout_s=30"]
EXIT_BOUND_S = 90.0  # a rank must be gone this long after a signal / kill / a failed save
LEAVE_FREE = 1 << 20  # bytes left free when the disk fills (a checkpoint of the tiny model is ~6 MiB)


@dataclasses.dataclass
class Options:
    seed: int
    steps: int = 200
    faults: int = 6
    interval: int = 20
    eval_interval: int = 50
    kinds: Tuple[str, ...] = KINDS
    work: Optional[str] = None
    keep: bool = False
    hang_wait_s: float = 180.0  # how long a hung attempt may take to end (the watchdog's timeout + exit)
    attempt_timeout_s: float = 900.0

    def command(self) -> str:
        cmd = (f"python -m bench.chaos --seed {self.seed} --steps {self.steps} --faults {self.faults} "
               f"--interval {self.interval} --eval-interval {self.eval_interval}")
        if tuple(self.kinds) != KINDS:
            cmd += f" --kinds {','.join(self.kinds)}"
        return cmd


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Tail:
    """The records a run appends to metrics.jsonl from a byte offset on (complete lines only)."""

    def __init__(self, path: str):
        self.path = path
        self.offset = os.path.getsize(path) if os.path.exists(path) else 0
        self.buf = ""
        self.records: List[dict] = []

    def read(self) -> List[dict]:
        if not os.path.exists(self.path):
            return []
        with open(self.path, encoding="utf-8") as f:
            f.seek(self.offset)
            chunk = f.read()
            self.offset = f.tell()
        self.buf += chunk
        *lines, self.buf = self.buf.split("\n")
        new = [json.loads(line) for line in lines if line.strip()]
        self.records += new
        return new


def _mount_tmpfs(path: str, mib: int) -> bool:
    """A size-limited filesystem at ``path`` (root only); False where it cannot be made."""
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", path],
                          capture_output=True).returncode == 0


def _fill(directory: str, leave: int) -> str:
    """A ballast file that leaves ``leave`` bytes free on the disk under ``directory``."""
    path = os.path.join(directory, "ballast")
    size = max(0, shutil.disk_usage(directory).free - leave)
    with open(path, "ab") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, size)
        except OSError:
            f.write(b"\0" * size)
    return path


def corrupt_newest(ck_dir: str, where: float) -> Optional[str]:
    """Flip one byte of the largest data file of the newest checkpoint; its path (None: no checkpoint)."""
    from training.checkpoint import list_checkpoints

    found = list_checkpoints(ck_dir)
    if not found:
        return None
    newest = found[-1][1]
    files = [os.path.join(newest, n) for n in os.listdir(newest) if n.endswith(".distcp")]
    data = max(files, key=os.path.getsize)
    with open(data, "r+b") as f:
        pos = int(where * (os.path.getsize(data) - 1))
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0xFF]))
    return newest


class Chaos:
    """One chaos run (:func:`run`): the reference, the attempts under faults, the noise runs, the verdict."""

    def __init__(self, opts: Options, log=print):
        self.o = opts
        self.log = log
        self.schedule = draw_schedule(opts.seed, opts.steps, opts.faults, opts.interval, opts.eval_interval,
                                      opts.kinds)
        self.layouts = attempt_layouts(self.schedule)
        self.changes_layout = len(set(self.layouts)) > 1
        self.work = opts.work or tempfile.mkdtemp(prefix=f"xhc-chaos-{opts.seed}-")
        os.makedirs(self.work, exist_ok=True)
        self.run_dir = os.path.join(self.work, "run")
        self.ck_dir = os.path.join(self.run_dir, "checkpoints")
        self.disk: Optional[str] = None  # the tmpfs mount point, when disk_full has one
        self.inject_enospc = False
        self.attempts: List[Attempt] = []
        self.records: List[List[dict]] = []  # per attempt, what it appended to metrics.jsonl
        self.noise_problems: List[str] = []

    # -- launching --------------------------------------------------------------------------------
    def overrides(self, layout: str, run_dir: str, ck_dir: Optional[str] = None, keep_last: int = 2,
                  load: Optional[str] = None) -> List[str]:
        o = self.o
        args = [*MODEL, *(NO_DROPOUT if self.changes_layout else DROPOUT), *WATCHDOG, f"run.seed={o.seed}",
                f"run.train_steps={o.steps}", f"checkpoint.interval={o.interval}",
                f"run.eval_interval={o.eval_interval}", f"checkpoint.keep_last={keep_last}", f"run.dir={run_dir}",
                *LAYOUTS[layout][1]]
        if ck_dir:
            args.append(f"checkpoint.dir={ck_dir}")
        if load:
            args.append(f"checkpoint.load={load}")
        return args

    def launch(self, layout: str, args: List[str], name: str, env: Optional[Dict[str, str]] = None):
        exit_dir = os.path.join(self.work, "exits", name)
        os.makedirs(exit_dir, exist_ok=True)
        world = LAYOUTS[layout][0]
        entry = ["-m", "bench.chaos", "worker", exit_dir, *args]
        cmd = [sys.executable, *entry] if world == 1 else \
            [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
             f"--master_port={_free_port()}", "--master_addr=127.0.0.1", *entry]
        full_env = {k: v for k, v in os.environ.items() if k not in ("XHC_FAULT_INJECT", "XHC_ATTEMPT")}
        full_env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="",  # CPU ranks, gloo
                        PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        full_env.update(env or {})
        log_path = os.path.join(self.work, "logs", f"{name}.log")
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        log = open(log_path, "w")
        proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        log.close()
        proc.log_path, proc.exit_dir, proc.world = log_path, exit_dir, world
        return proc

    def run_plain(self, layout: str, args: List[str], name: str) -> None:
        """An undisturbed run that must finish (the reference, a noise run)."""
        t0 = time.time()
        proc = self.launch(layout, args, name)
        try:
            code = proc.wait(timeout=self.o.attempt_timeout_s)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            raise RuntimeError(f"the undisturbed run {name} did not finish in {self.o.attempt_timeout_s:.0f} s "
                               f"(log {proc.log_path})") from None
        exits = _exits(proc.exit_dir)
        if code != 0 or sorted(exits.values()) != [0] * proc.world:
            errors = [line for line in _tail(proc.log_path).splitlines() if line.startswith("error:")]
            raise RuntimeError(f"the undisturbed run {name} failed (exit {code}, ranks {exits}): "
                               f"{errors[-1] if errors else 'see ' + proc.log_path}")
        self.log(f"[chaos] {name} on {layout}: {time.time() - t0:.0f} s")

    # -- one attempt -------------------------------------------------------------------------------
    def attempt(self, number: int, fault: Optional[Fault]) -> Attempt:
        layout = self.layouts[number - 1]
        att = Attempt(number=number, layout=layout)
        env = {"XHC_ATTEMPT": str(number)}
        injected = fault is not None and (fault.kind == "hang" or (fault.kind == "disk_full" and self.inject_enospc))
        if injected:
            action = "hang" if fault.kind == "hang" else "enospc"
            section = fault.section if fault.kind == "hang" else "checkpoint_save"
            env["XHC_FAULT_INJECT"] = f"rank={fault.rank},step={fault.step},section={section},action={action}"
        tail = _Tail(os.path.join(self.run_dir, "metrics.jsonl"))
        started = time.time()
        proc = self.launch(layout, self.overrides(layout, self.run_dir, self.ck_dir), f"attempt-{number}", env)
        tree: Dict[int, object] = {}
        seen_tmp = False
        fire_at: Optional[float] = None
        fired_at: Optional[float] = None
        last_scan = 0.0
        step = None
        step_times: List[float] = []
        bound = None
        while True:
            now = time.time()
            for r in tail.read():
                if r.get("kind") == "train":
                    step = r["step"]
                    att.last_step, att.t_last = step, r["time"]
                    step_times.append(r.get("step_time_s", 0.0))
                elif r.get("kind") == "resume" and not att.resumed_step:
                    att.resumed_step = att.last_step = r["step"]
            if now - last_scan > 0.2:
                _scan(proc, tree)
                last_scan = now
            code = proc.poll()
            if code is not None:
                break
            if fault is not None and not injected and fired_at is None and step is not None:
                tmp = os.path.join(self.ck_dir, f".step_{fault.step:08d}.tmp")
                saving = fault.kind == "disk_full" or fault.moment == "save"
                if saving and not seen_tmp and os.path.isdir(tmp):
                    seen_tmp = True
                    fire_at = now
                elif saving and fire_at is None and step >= fault.step + 1:
                    fire_at = now  # the save window was missed: strike now (the fault is noted as late)
                    att.notes.append(f"the save of step {fault.step} was over before it was seen: struck after it")
                elif not saving and fire_at is None and step >= fault.step:
                    median = statistics.median(step_times[-5:]) if step_times else 0.1
                    fire_at = now + fault.delay * median
                if fire_at is not None and now >= fire_at:
                    _scan(proc, tree)
                    fired_at = time.time()
                    missed = self.strike(fault, proc, tree)
                    if missed:
                        att.problems.append(missed)
                    bound = EXIT_BOUND_S
            if injected and fault.kind == "hang" and fired_at is None and step is not None and step >= fault.step - 1:
                fired_at, bound = now, self.o.hang_wait_s  # the hang strikes inside the run from here on
            if fired_at is not None and bound is not None and now - fired_at > bound:
                att.problems.append(f"the attempt did not end within {bound:.0f} s of the fault")
                _kill_tree(proc, tree)
            elif now - started > self.o.attempt_timeout_s:
                att.problems.append(f"the attempt ran over {self.o.attempt_timeout_s:.0f} s")
                _kill_tree(proc, tree)
            time.sleep(0.005)
        att.launcher_exit = code
        left = _wait_gone(tree, EXIT_BOUND_S)  # workers of a killed launcher save and exit by themselves
        if left:
            att.problems.append(f"{len(left)} process(es) of the attempt still ran {EXIT_BOUND_S:.0f} s after it "
                                f"ended (killed): {left}")
        for r in tail.read():
            if r.get("kind") == "train":
                att.last_step, att.t_last = r["step"], r["time"]
            elif r.get("kind") == "resume" and not att.resumed_step:
                att.resumed_step = att.last_step = r["step"]
        att.exits = _exits(proc.exit_dir)
        att.seconds = time.time() - started
        self.records.append(tail.records)
        if fault is not None and fired_at is None and not injected:
            att.problems.append(f"the fault never struck (the attempt ended at step {att.last_step}, exit {code})")
        att.unpublished_save = self._unpublished(att)
        self.check_outcome(fault, att, proc, started)
        return att

    def strike(self, fault: Fault, proc, tree: Dict[int, object]) -> Optional[str]:
        """Deliver ``fault`` now; what went wrong delivering it, if anything."""
        workers = _workers(proc, tree)
        if fault.kind == "sigterm":  # every process group of the job, as SLURM signals every task
            for g in {_pgid(p) for p in [proc.pid, *workers.values()]} - {None}:
                _signal_group(g, signal.SIGTERM)
        elif fault.kind == "kill_rank":
            pid = workers.get(fault.rank, proc.pid if proc.world == 1 else None)
            if pid is None:
                return f"rank {fault.rank}'s process was not found among the launcher's workers ({workers})"
            os.kill(pid, signal.SIGKILL)
        elif fault.kind == "kill_launcher":
            os.kill(proc.pid, signal.SIGKILL)
        elif fault.kind == "disk_full":
            self.ballast = _fill(self.disk, LEAVE_FREE)
        return None

    def _unpublished(self, att: Attempt) -> Optional[int]:
        from training.checkpoint import list_checkpoints

        i = self.o.interval
        newest = att.last_step // i * i
        if newest <= att.resumed_step or newest >= self.o.steps or newest == 0:
            return None
        published = {s for s, _ in list_checkpoints(self.ck_dir)}
        return None if newest in published else newest

    def check_outcome(self, fault: Optional[Fault], att: Attempt, proc, started: float) -> None:
        """Did the attempt end as the fault documents?  (problems go to ``att.problems``)"""
        from training.pretrain import SAVE_FAILED  # a failed save: partial removed, previous checkpoint kept
        from training.run import EXIT_HANG  # the watchdog's retryable exit status

        status = _status(self.run_dir, started)
        ranks = list(range(LAYOUTS[att.layout][0]))
        exits = att.exits
        said = ", ".join(f"rank {r} exit {exits[r]}" if r in exits else f"rank {r} killed/no status" for r in ranks)
        att.ended = f"{said}; launcher exit {att.launcher_exit}" if proc.world > 1 else said
        if fault is None:  # the last attempt: it must finish
            if [exits.get(r) for r in ranks] != [0] * len(ranks):
                att.problems.append(f"the last attempt did not exit 0 on every rank: {said}")
            if not status or not status.get("finished"):
                att.problems.append(f"the last attempt did not finish the run (status.json: {status})")
            return
        k = fault.kind
        if fault.saves_on_stop():
            if [exits.get(r) for r in ranks] != [0] * len(ranks):
                att.problems.append(f"expected every rank to save and exit 0: {said}")
            elif not status or "SIGTERM" not in str(status.get("stopped_early")):
                att.problems.append(f"status.json does not record the SIGTERM stop: {status}")
            from training.checkpoint import list_checkpoints

            found = list_checkpoints(self.ck_dir)
            if not found or found[-1][0] != att.last_step:
                att.problems.append(f"the newest checkpoint ({found[-1][0] if found else None}) is not the step it "
                                    f"stopped at ({att.last_step})")
        elif k in ("kill_rank", "kill_launcher"):  # kill_launcher of one process: the process
            if fault.rank in exits:
                att.problems.append(f"rank {fault.rank} was killed but reported exit {exits[fault.rank]}")
        elif k == "hang":
            hang = (status or {}).get("hang") or {}
            if exits.get(fault.rank) != EXIT_HANG:
                att.problems.append(f"expected the hung rank {fault.rank} to exit {EXIT_HANG}: {said}")
            if hang.get("rank") != fault.rank or hang.get("section") != fault.section:
                att.problems.append(f"status.json does not name rank {fault.rank} in {fault.section}: {hang or status}")
        elif k == "disk_full":
            failed = (status or {}).get("failed") or {}
            if SAVE_FAILED not in exits.values() or failed.get("exit_code") != SAVE_FAILED:
                att.problems.append(f"expected exit {SAVE_FAILED} and status.json's failed record: {said}; {failed}")

    def check_relaunch(self, att: Attempt, gap_faults: Sequence[Fault], corrupted: Optional[str]) -> None:
        """The relaunch after ``gap_faults``: it resumed past a corrupt checkpoint, resharded a layout."""
        with open(os.path.join(self.work, "logs", f"attempt-{att.number}.log"), errors="replace") as f:
            text = f.read()
        for g in gap_faults:
            if g.kind == "corrupt" and corrupted:
                if not os.path.isdir(corrupted + ".corrupt") or f"{corrupted}.corrupt" not in text:
                    att.problems.append(f"corrupt: {corrupted} was not set aside as .corrupt with a warning")
                elif f"resumed from {corrupted}:" in text:
                    att.problems.append(f"corrupt: the relaunch resumed from the corrupt {corrupted}")
            if g.kind == "layout" and "resharding checkpoint" not in text and att.resumed_step:
                att.problems.append(f"layout: the relaunch on {att.layout} did not say it resharded")

    # -- the whole run -------------------------------------------------------------------------------
    def describe(self) -> List[str]:
        out = [f"[chaos] seed {self.o.seed}: {self.o.steps} steps, a save every {self.o.interval}, "
               f"{len(self.schedule)} faults, layouts {' -> '.join(self.layouts)}; work dir {self.work}"]
        out += [f"[chaos]   {i + 1}. {f.kind}: {f.where()}" for i, f in enumerate(self.schedule)]
        return out

    def run(self) -> dict:
        from training.checkpoint import list_checkpoints

        for line in self.describe():
            self.log(line)
        ref_dir = os.path.join(self.work, "reference")
        try:
            self.run_plain(START_LAYOUT, self.overrides(START_LAYOUT, ref_dir, keep_last=10 ** 6), "reference")
        except RuntimeError as e:
            problem = str(e).splitlines()[0]
            return {"passed": False, "problems": [problem], "work": self.work, "attempts": [], "schedule": [],
                    "report": f"verdict: FAIL (seed {self.o.seed}): {problem}\nreproduce: {self.o.command()}"}
        ref_found = list_checkpoints(os.path.join(ref_dir, "checkpoints"))
        if any(f.kind == "disk_full" for f in self.schedule):
            size = _dir_bytes(ref_found[-1][1])
            mib = int(size * (6 + sum(f.kind == "corrupt" for f in self.schedule)) / 2 ** 20) + 16
            self.disk = os.path.join(self.work, "disk")
            if _mount_tmpfs(self.disk, mib):
                self.ck_dir = os.path.join(self.disk, "checkpoints")
                self.log(f"[chaos] checkpoint.dir on a {mib} MiB tmpfs ({self.disk})")
            else:
                self.disk, self.inject_enospc = None, True
                self.log("[chaos] no tmpfs can be mounted here: the full disk is the fault hook's injected ENOSPC")
        try:
            runtime = [f for f in self.schedule if f.kind in RUNTIME]
            corrupted: Dict[int, Optional[str]] = {}
            self.ballast = None
            for number in range(1, len(runtime) + 2):
                fault = runtime[number - 1] if number <= len(runtime) else None
                att = self.attempt(number, fault)
                self.attempts.append(att)
                self.log(f"[chaos] attempt {number} on {att.layout}: steps {att.resumed_step}..{att.last_step}, "
                         f"{att.ended} ({att.seconds:.0f} s)")
                if fault is None or any(p.startswith("the fault never struck") for p in att.problems):
                    break  # nothing more to learn: the verdict fails on it
                if self.ballast:
                    os.remove(self.ballast)  # the requeue finds the space freed
                    self.ballast = None
                for g in self.schedule:
                    if g.kind == "corrupt" and g.gap == number:
                        corrupted[number] = corrupt_newest(self.ck_dir, g.byte)
                        self.log(f"[chaos] flipped one byte of {corrupted[number]}")
            for att in self.attempts[1:]:
                gap = [f for f in self.schedule if f.kind in BETWEEN and f.gap == att.number - 1]
                if gap:
                    self.check_relaunch(att, gap, corrupted.get(att.number - 1))
            found = list_checkpoints(self.ck_dir)
            final = found[-1][1] if found and found[-1][0] == self.o.steps else None
            chaos = curves_of(self.run_dir, final)
        finally:
            if self.disk:
                subprocess.run(["umount", "-l", self.disk], check=False, capture_output=True)
        others = []
        for layout in sorted(set(self.layouts) - {START_LAYOUT}):
            noise_dir = os.path.join(self.work, f"noise-{layout}")
            first = os.path.join(ref_dir, "checkpoints", f"step_{self.o.interval:08d}")
            try:
                self.run_plain(layout, self.overrides(layout, noise_dir, load=first), f"noise-{layout}")
            except RuntimeError as e:
                self.noise_problems.append(str(e).splitlines()[0])
                continue
            others.append(curves_of(noise_dir, list_checkpoints(os.path.join(noise_dir, "checkpoints"))[-1][1]))
        reference = curves_of(ref_dir, ref_found[-1][1])
        times = sorted(r.get("time", 0.0) for r in _read_jsonl(os.path.join(ref_dir, "metrics.jsonl"))
                       if r.get("kind") == "train")
        median = statistics.median([b - a for a, b in zip(times, times[1:])]) if len(times) > 2 else 0.0
        verdict = judge(self.schedule, self.attempts, reference, chaos, self.o.steps, self.o.interval, others,
                        median, self._recovered())
        if self.noise_problems:
            verdict["problems"] += self.noise_problems
            verdict["passed"] = False
        verdict["report"] = format_report(self.o.seed, verdict, self.attempts, self.o.command())
        verdict["attempts"] = [dataclasses.asdict(a) for a in self.attempts]
        verdict["schedule"] = [dataclasses.asdict(f) for f in self.schedule]
        verdict["work"] = self.work
        return verdict

    def _recovered(self) -> Dict[int, float]:
        """Attempt -> when the step after its newest one was first recorded by a later attempt."""
        out = {}
        for i, att in enumerate(self.attempts):
            for later in self.records[i + 1:]:
                hit = [r["time"] for r in later if r.get("kind") == "train" and r["step"] == att.last_step + 1]
                if hit:
                    out[att.number] = hit[0]
                    break
        return out


# ------------------------------------------------------------------------------------------------
# processes
# ------------------------------------------------------------------------------------------------
def _scan(proc, tree: Dict[int, object]) -> None:
    """Remember every process under the launcher (they outlive it when it is killed)."""
    import psutil

    try:
        for p in psutil.Process(proc.pid).children(recursive=True):
            tree.setdefault(p.pid, p)
    except psutil.Error:
        pass


def _workers(proc, tree: Dict[int, object]) -> Dict[int, int]:
    """rank -> pid of the launcher's workers."""
    import psutil

    out = {}
    for pid, p in tree.items():
        try:
            if p.ppid() == proc.pid and "RANK" in p.environ():
                out[int(p.environ()["RANK"])] = pid
        except psutil.Error:
            pass
    return out


def _pgid(pid: int) -> Optional[int]:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _signal_group(pgid: int, sig) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _kill_tree(proc, tree: Optional[Dict[int, object]] = None) -> None:
    for pid in [proc.pid, *(tree or {})]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def _wait_gone(tree: Dict[int, object], timeout: float) -> List[int]:
    """Wait for the processes of ``tree`` to end; SIGKILL and return those still running after ``timeout``."""
    import psutil

    procs = [p for p in tree.values()]
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    return [p.pid for p in alive]


def _exits(exit_dir: str) -> Dict[int, int]:
    out = {}
    for name in os.listdir(exit_dir):
        if name.startswith("rank") and name.endswith(".exit"):
            with open(os.path.join(exit_dir, name)) as f:
                out[int(name[4:-5])] = int(f.read().strip())
    return out


def _status(run_dir: str, since: float) -> Optional[dict]:
    """status.json when written after ``since`` (an attempt killed before writing it leaves an older one)."""
    path = os.path.join(run_dir, "status.json")
    if not os.path.exists(path) or os.path.getmtime(path) < since:
        return None
    with open(path) as f:
        return json.load(f)


def _read_jsonl(path: str) -> List[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _tail(path: str, n: int = 3000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-n:]


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(b, n)) for b, _, files in os.walk(path) for n in files)


# ================================================================================================
# Command line
# ================================================================================================
def worker(argv: Sequence[str]) -> int:
    """One rank of an attempt: ``xhc-pretrain`` with ``argv[1:]``; its exit status goes to
    ``<argv[0]>/rank<R>.exit`` (also when the process ends through ``os._exit``, as the watchdog's exit
    does), so the driver sees every rank's status where torchrun reports only its own."""
    exit_dir, overrides = argv[0], list(argv[1:])
    path = os.path.join(exit_dir, f"rank{os.environ.get('RANK', '0')}.exit")

    def record(code) -> None:
        with open(path + ".tmp", "w") as f:
            f.write(f"{int(code) if isinstance(code, int) else 1}\n")
        os.replace(path + ".tmp", path)

    real_exit = os._exit

    def _exit(code):
        try:
            record(code)
        finally:
            real_exit(code)

    os._exit = _exit
    try:
        from training.pretrain import main as pretrain

        code = pretrain(overrides)
    except BaseException:
        record(1)
        raise
    finally:
        os._exit = real_exit
    record(code)
    return code


def run(opts: Options, log=print) -> dict:
    """Run the chaos run of ``opts``; the verdict (``report``: the printed table)."""
    chaos = Chaos(opts, log)
    verdict = chaos.run()
    if verdict["passed"] and not opts.keep and not opts.work:
        shutil.rmtree(chaos.work, ignore_errors=True)
    return verdict


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "worker":
        return worker(argv[1:])
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, required=True, help="draws the schedule; also run.seed")
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--faults", type=int, default=6, help="faults drawn (default 6)")
    p.add_argument("--interval", type=int, default=20, help="checkpoint.interval (default 20)")
    p.add_argument("--eval-interval", type=int, default=50, help="run.eval_interval (default 50; 0: at the end only)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"fault kinds to draw from (default all: {','.join(KINDS)})")
    p.add_argument("--work", help="work directory (default: a new temporary one, removed when the verdict passes)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--hang-wait", type=float, default=180.0,
                   help="seconds a hung attempt may take to end before the driver kills it (default 180)")
    p.add_argument("--json", help="also write the verdict (without tensors) to this JSON file")
    a = p.parse_args(argv)
    from tools._cli import run_main

    def body() -> int:
        opts = Options(seed=a.seed, steps=a.steps, faults=a.faults, interval=a.interval, eval_interval=a.eval_interval,
                       kinds=tuple(k.strip() for k in a.kinds.split(",") if k.strip()), work=a.work, keep=a.keep,
                       hang_wait_s=a.hang_wait)
        verdict = run(opts)
        print(verdict["report"], flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({k: v for k, v in verdict.items() if k != "report"}, f, indent=1, default=str)
        return 0 if verdict["passed"] else 1

    return run_main(body, ChaosError)


if __name__ == "__main__":
    sys.exit(main())
