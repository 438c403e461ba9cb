"""A per-rank watchdog with sections: a hung rank is named, with its stacks, within its section's timeout.

The trainer marks what each rank is doing (:meth:`Watchdog.enter`, a tuple assignment): ``startup``,
``data``, ``forward_backward``, ``grad_sync`` (the gradient and loss all-reduces: where a rank waits
for a late peer), ``optimizer``, ``step_boundary`` (logging, the stop agreement, the background save's
poll), ``checkpoint_save``, ``checkpoint_load``, ``evaluation``, ``finish``.  A thread per rank wakes
every ``poll_s`` and

- writes a heartbeat (wall time, step, section, whether the main thread waits inside
  ``torch.distributed``) to the launcher's TCP store (``MASTER_ADDR:MASTER_PORT``, a client of its own);
- checks whether another rank announced a hang (one key in that store);
- checks its own section against the section's timeout (:meth:`Watchdog.timeout_for`,
  ``reliability.*``: fixed bounds for start-up, saves and loads; for the step's sections a multiple
  of the median step time measured after warm-up, or ``reliability.step_timeout_s``).

On expiry the rank decides who hung, from the heartbeats: a rank whose heartbeat is stale (stopped by
SIGSTOP, or stuck where Python cannot run), else a rank whose main thread is *not* waiting in a
collective (the earliest step and section start first), else itself.  The first rank to decide
announces the verdict in the store; every rank then

- writes its Python stacks (``faulthandler``, every thread) to ``<run.dir>/hangs/rank<R>-<time>.txt``,
  a header naming the hung rank, host, section and step (written to a temporary name, then renamed);
- the hung rank (or, when it cannot run, the rank that announced it) records the verdict in
  ``status.json`` (``"hang": {...}``, ``"failed": {..., "exit_code": 86}``) and one line in
  ``attempts.jsonl``, both atomically, and removes a partial checkpoint directory;
- prints one line naming the hung rank, host, section and step, and exits with :data:`EXIT_HANG`
  (86), which ``tools/slurm_pretrain.sh`` requeues.  The hung rank waits (at most ``2 · poll_s + 2``
  s) until the others have written their stacks, so torchrun's teardown finds them done.

A rank stuck in a collective therefore leaves within its own section's timeout plus about two polls,
whether or not the hung rank can still run.  See docs/reliability.md, "Hangs".
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from training.run.faults import fault_point

__all__ = ["EXIT_HANG", "SECTIONS", "Watchdog", "WatchdogSettings", "append_attempt", "count_attempts", "hang_retry"]

EXIT_HANG = 86
"""Exit status of a rank whose watchdog expired (its own section, or a peer's announced hang): retryable."""

SECTIONS = ("startup", "data", "forward_backward", "grad_sync", "optimizer", "step_boundary", "checkpoint_save",
            "checkpoint_load", "evaluation", "finish")
STEP_SECTIONS = ("data", "forward_backward", "grad_sync", "optimizer", "step_boundary")
WORK_SECTIONS = ("data", "forward_backward", "optimizer")  # a rank's own work per step (the straggler report)
ATTEMPTS = "attempts.jsonl"
_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")


@dataclass
class WatchdogSettings:
    """The resolved ``reliability.*`` timeouts (seconds)."""

    enabled: bool = True
    startup_s: float = 900.0
    checkpoint_s: float = 1800.0
    load_s: Optional[float] = None  # None: checkpoint_s
    step_s: Optional[float] = None  # None: factor x the median step time after warm-up, at least min_step_s
    step_factor: float = 20.0
    min_step_s: float = 120.0
    eval_s: Optional[float] = None  # None: the step timeout x eval_iters
    warmup_steps: int = 5
    eval_iters: int = 1

    @classmethod
    def from_config(cls, cfg) -> "WatchdogSettings":
        r = cfg.reliability
        return cls(enabled=r.watchdog, startup_s=r.startup_timeout_s, checkpoint_s=r.checkpoint_timeout_s,
                   load_s=r.load_timeout_s,
                   step_s=r.step_timeout_s, step_factor=r.step_timeout_factor, min_step_s=r.min_step_timeout_s,
                   eval_s=r.eval_timeout_s, warmup_steps=r.timeout_warmup_steps, eval_iters=cfg.run.eval_iters)

    def shortest(self) -> float:
        return min(x for x in (self.startup_s, self.checkpoint_s, self.load_s, self.step_s or self.min_step_s,
                               self.eval_s or self.startup_s) if x)


def count_attempts(run_dir: str) -> int:
    """Lines in ``<run.dir>/attempts.jsonl`` (launch attempts that ended and said how)."""
    try:
        with open(os.path.join(run_dir, ATTEMPTS), encoding="utf-8") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def append_attempt(run_dir: str, record: dict) -> None:
    """One line in ``<run.dir>/attempts.jsonl`` (one ``write`` of an ``O_APPEND`` file: never half a line
    among whole ones); the file keeps its newest 100 lines."""
    path = os.path.join(run_dir, ATTEMPTS)
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
        if len(lines) > 100:  # a short history: rewrite atomically
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(lines[-100:])
            os.replace(tmp, path)
    except OSError:
        pass


def _write_json_atomic(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _open_store(timeout_s: float):
    """A client of the launcher's TCP store (torchrun's agent store, or rank 0's under srun), or None."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        import datetime

        from torch.distributed import TCPStore

        return TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                        wait_for_workers=False)
    except Exception:  # noqa: BLE001 - no store, no heartbeats: the own section timeouts still hold
        return None


class Watchdog:
    """The watchdog of one rank (see the module docstring).

    ``status_base()``: the ``status.json`` content the trainer would write now (where the run stands);
    ``cleanup()``: remove partial checkpoint directories; both called from the watchdog's thread on expiry.
    """

    def __init__(self, run_dir: str, rank: int, world: int, settings: WatchdogSettings, *,
                 attempt: int = 1, status_base: Optional[Callable[[], dict]] = None,
                 cleanup: Optional[Callable[[], None]] = None, log: Callable[[str], None] = None,
                 info: Optional[Callable[[str], None]] = None, poll_s: Optional[float] = None):
        self.run_dir, self.rank, self.world, self.settings = run_dir, rank, world, settings
        self.attempt = attempt
        self.status_base, self.cleanup = status_base, cleanup
        self.log = log or (lambda line: (sys.stderr.write(line + "\n"), sys.stderr.flush()))  # expiry lines
        self.info = info or (lambda line: None)  # the timeout chosen after warm-up (rank 0's log)
        self.host = socket.gethostname()
        self.poll_s = poll_s or min(5.0, max(0.1, settings.shortest() / 10))
        self.stale_s = max(3 * self.poll_s, 1.0)
        now = time.perf_counter()
        self._state: Tuple[str, int, float] = ("startup", 0, now)  # (section, step, perf_counter at entry)
        self._wall0 = time.time() - now  # wall time = _wall0 + perf_counter()
        self.section_seconds: Dict[str, float] = {}  # time per section since the last take_section_times()
        self.step_times: List[float] = []
        self.steps_done = 0
        self.auto_step_s: Optional[float] = None
        self._stop = threading.Event()
        self._expired = threading.Lock()
        self.expiring = False
        self._thread: Optional[threading.Thread] = None
        self._store = None
        self._main_ident = threading.main_thread().ident
        prefix = "/".join(os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
                                                          "TORCHELASTIC_RESTART_COUNT"))
        self._key = f"xhc_watchdog/{prefix}/{attempt}"

    # ------------------------------------------------------------------------------------------
    # The main thread's marks (cheap: a tuple assignment and a dict update)
    # ------------------------------------------------------------------------------------------
    def enter(self, section: str, step: Optional[int] = None) -> str:
        """This rank is now in ``section`` (of ``step``; default: the current one); the previous section."""
        now = time.perf_counter()
        prev, prev_step, t0 = self._state
        self.section_seconds[prev] = self.section_seconds.get(prev, 0.0) + (now - t0)
        self._state = (section, prev_step if step is None else step, now)
        return prev

    @contextlib.contextmanager
    def during(self, section: str, step: Optional[int] = None, fault: bool = True) -> Iterator[None]:
        """``with watchdog.during("evaluation", step):``: the block is ``section`` (and its fault point
        fires first, unless ``fault=False``); the previous section again after it."""
        prev = self.enter(section, step)
        try:
            if fault:
                fault_point(section, self._state[1])
            yield
        finally:
            self.enter(prev)

    @property
    def section(self) -> str:
        return self._state[0]

    def take_section_times(self) -> Dict[str, float]:
        """Seconds per section since the last call (the current section counted up to now)."""
        self.enter(self._state[0])
        out, self.section_seconds = self.section_seconds, {}
        return out

    def step_done(self, seconds: float) -> None:
        """A training step finished in ``seconds``: after ``warmup_steps`` steps the step timeout is set."""
        self.steps_done += 1
        s = self.settings
        if self.steps_done <= s.warmup_steps + 1:
            if self.steps_done > 1:  # the first step pays one-time costs
                self.step_times.append(seconds)
            if self.steps_done == max(2, s.warmup_steps) and self.step_times:
                median = statistics.median(self.step_times)
                self.auto_step_s = max(s.min_step_s, s.step_factor * median)
                if s.enabled:
                    t = self.step_timeout()
                    how = ("reliability.step_timeout_s" if s.step_s else
                           f"{s.step_factor:g} x the median step {median:.3g} s, at least "
                           f"reliability.min_step_timeout_s={s.min_step_s:g}")
                    if self.rank == 0:
                        self.info(f"[xhc] watchdog: a step's sections time out after {t:.3g} s ({how}); "
                                 f"saves and loads after {s.checkpoint_s:g} s")

    def step_timeout(self) -> Optional[float]:
        """The step sections' timeout once warmed up (None before: the start-up bound applies)."""
        s = self.settings
        if self.steps_done < s.warmup_steps:
            return None
        return s.step_s or self.auto_step_s or s.startup_s

    def timeout_for(self, section: str) -> float:
        s = self.settings
        if section == "checkpoint_load":
            return s.load_s or s.checkpoint_s
        if section == "checkpoint_save":
            return s.checkpoint_s
        if section in ("startup", "finish"):
            return s.startup_s
        step = self.step_timeout()
        if section == "evaluation":
            return s.eval_s or (step * max(1, s.eval_iters) if step else s.startup_s)
        return step or s.startup_s

    # ------------------------------------------------------------------------------------------
    # The thread
    # ------------------------------------------------------------------------------------------
    def start(self) -> None:
        if not self.settings.enabled or self._thread is not None:
            return
        if self.world > 1:
            self._store = _open_store(max(5.0, 4 * self.poll_s))
        self._thread = threading.Thread(target=self._run, name="xhc-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread() and not self.expiring:
            self._thread.join(timeout=self.poll_s + 5)
        self._thread = None

    def _run(self) -> None:
        store_errors = 0
        while not self._stop.wait(self.poll_s):
            section, step, t0 = self._state
            if self._store is not None and store_errors < 3:
                try:
                    self._store.set(f"{self._key}/hb/{self.rank}", json.dumps(self._heartbeat()))
                    if self._store.check([f"{self._key}/hang"]):
                        verdict = json.loads(self._store.get(f"{self._key}/hang"))
                        self._expire(section, step, time.perf_counter() - t0, verdict=verdict)
                    store_errors = 0
                except Exception:  # noqa: BLE001 - the store went away (the end of the run, or rank 0's host)
                    store_errors += 1
            elapsed = time.perf_counter() - t0
            if self._state[2] == t0 and elapsed > self.timeout_for(section):
                self._expire(section, step, elapsed)

    def _in_collective(self) -> bool:
        frame = sys._current_frames().get(self._main_ident)
        while frame is not None:
            if frame.f_code.co_filename.endswith(_C10D):
                return True
            frame = frame.f_back
        return False

    def _heartbeat(self) -> dict:
        section, step, t0 = self._state
        return {"rank": self.rank, "host": self.host, "pid": os.getpid(), "t": time.time(), "section": section,
                "step": step, "since": self._wall0 + t0, "in_collective": self._in_collective()}

    # ------------------------------------------------------------------------------------------
    # Expiry
    # ------------------------------------------------------------------------------------------
    def _peers(self) -> Dict[int, dict]:
        if self._store is None:
            return {}
        keys = [f"{self._key}/hb/{r}" for r in range(self.world) if r != self.rank]
        try:
            present = [k for k in keys if self._store.check([k])]
            return {int(k.rsplit("/", 1)[1]): json.loads(self._store.get(k)) for k in present}
        except Exception:  # noqa: BLE001
            return {}

    def _blame(self, me: dict) -> dict:
        """The verdict: which rank hung, where, and why this rank thinks so."""
        now = time.time()
        peers = self._peers()
        stale = sorted(r for r, hb in peers.items() if now - hb["t"] > self.stale_s)
        missing = sorted(set(range(self.world)) - set(peers) - {self.rank}) if self._store is not None else []
        if stale:
            hb = peers[stale[0]]
            return dict(hb, stale_s=round(now - hb["t"], 3),
                        why=f"no heartbeat for {now - hb['t']:.1f} s (stopped, or stuck where Python cannot run)")
        working = [hb for hb in [me, *peers.values()] if not hb["in_collective"]]
        if working:
            hb = min(working, key=lambda h: (h["step"], h["since"], h["rank"]))
            why = "not waiting in a collective" if hb["rank"] != self.rank or any(
                p["in_collective"] for p in peers.values()) else "its section timed out"
            return dict(hb, why=why)
        if missing:
            return {"rank": missing[0], "host": None, "section": None, "step": me["step"], "since": None,
                    "why": "never sent a heartbeat"}
        hb = min([me, *peers.values()], key=lambda h: (h["step"], h["since"], h["rank"]))
        return dict(hb, why="every rank waits in a collective (mismatched collectives?)")

    def _expire(self, section: str, step: int, elapsed: float, verdict: Optional[dict] = None) -> None:
        if not self._expired.acquire(blocking=False):
            return
        self.expiring = True
        try:
            self._expire_locked(section, step, elapsed, verdict)
        finally:
            os._exit(EXIT_HANG)

    def _expire_locked(self, section: str, step: int, elapsed: float, verdict: Optional[dict]) -> None:
        timeout = self.timeout_for(section)
        me = self._heartbeat()
        if verdict is None:
            verdict = self._blame(me)
            verdict.update(timeout_s=timeout, detected_by=self.rank, elapsed_s=round(elapsed, 3))
            if self._store is not None:
                try:  # the first rank to decide announces; the others follow its verdict
                    stored = self._store.compare_set(f"{self._key}/hang", "", json.dumps(verdict))
                    verdict = json.loads(stored)
                except Exception:  # noqa: BLE001
                    pass
        culprit = int(verdict["rank"])
        if culprit == self.rank and self._store is not None:
            try:  # the others wait for this before they leave (their leaving breaks this rank's collectives)
                self._store.set(f"{self._key}/seen", str(self.rank))
            except Exception:  # noqa: BLE001
                pass
        stamp = time.strftime("%Y%m%d-%H%M%S")
        stacks = self._write_stacks(stamp, me, verdict, elapsed, timeout)
        writer = (culprit == self.rank) or ("stale_s" in verdict and verdict.get("detected_by") == self.rank) or \
            self._store is None
        where = (f"rank {culprit} (host {verdict.get('host')}) hung in {verdict.get('section')} at step "
                 f"{verdict.get('step')}")
        if writer:
            record = {"rank": culprit, "host": verdict.get("host"), "section": verdict.get("section"),
                      "step": verdict.get("step"), "timeout_s": verdict.get("timeout_s", timeout),
                      "why": verdict.get("why"), "detected_by": verdict.get("detected_by"),
                      "stacks": os.path.relpath(stacks, self.run_dir) if stacks else None, "time": time.time()}
            self._record(record, where)
            if self.cleanup is not None:
                try:
                    self.cleanup()
                except Exception:  # noqa: BLE001
                    pass
        if culprit == self.rank:
            line = (f"[xhc] watchdog: {where}: no progress for {elapsed:.1f} s (timeout {timeout:.3g} s); stacks "
                    f"{stacks}; exiting with status {EXIT_HANG} (retryable: rerun to resume from the last "
                    f"verified checkpoint)")
        else:
            line = (f"[xhc] watchdog: rank {self.rank} leaves ({section} at step {step} for {elapsed:.1f} s): "
                    f"{where} ({verdict.get('why')}); stacks {stacks}; exiting with status {EXIT_HANG}")
        if self._store is not None:
            deadline = time.time() + 2 * self.poll_s + 2
            try:
                if culprit == self.rank:  # let the others write their stacks before the launcher tears down
                    while time.time() < deadline and self._store.add(f"{self._key}/left", 0) < self.world - 1:
                        time.sleep(min(0.05, self.poll_s))
                else:
                    self._store.add(f"{self._key}/left", 1)
                    if "stale_s" not in verdict:  # a hung rank that still runs records the verdict: wait for it
                        while time.time() < deadline and not self._store.check([f"{self._key}/seen"]):
                            time.sleep(min(0.05, self.poll_s))
            except Exception:  # noqa: BLE001
                pass
        self.log(f"{line} (exit at unix {time.time():.3f})")

    def _write_stacks(self, stamp: str, me: dict, verdict: dict, elapsed: float, timeout: float) -> Optional[str]:
        d = os.path.join(self.run_dir, "hangs")
        final = os.path.join(d, f"rank{self.rank}-{stamp}.txt")
        tmp = os.path.join(d, f".rank{self.rank}-{stamp}.txt.tmp")
        try:
            os.makedirs(d, exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(f"# xhc watchdog: rank {self.rank} on host {self.host}, pid {os.getpid()}, at "
                        f"{time.strftime('%Y-%m-%dT%H:%M:%S')} (unix {time.time():.3f})\n"
                        f"# this rank: section {me['section']} at step {me['step']} for {elapsed:.1f} s (timeout "
                        f"{timeout:.3g} s), {'waiting in a collective' if me['in_collective'] else 'working'}\n"
                        f"# hung: rank {verdict['rank']} (host {verdict.get('host')}) in section "
                        f"{verdict.get('section')} at step {verdict.get('step')}: {verdict.get('why')}\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            return final
        except OSError:
            return None

    def _record(self, hang: dict, where: str) -> None:
        status = {}
        if self.status_base is not None:
            try:
                status = self.status_base()
            except Exception:  # noqa: BLE001 - where the run stands is best effort; the verdict is not
                status = {}
        error = f"watchdog: {where}"
        status.update(finished=False, hang=hang, failed={"error": error, "exit_code": EXIT_HANG})
        try:
            _write_json_atomic(os.path.join(self.run_dir, "status.json"), status)
        except OSError:
            pass
        try:
            append_attempt(self.run_dir, {"attempt": self.attempt, "ended": "hang", "exit_code": EXIT_HANG,
                                          "step": status.get("step"), "rank": hang["rank"], "host": hang["host"],
                                          "section": hang["section"], "hang_step": hang["step"],
                                          "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
        except OSError:
            pass

    def absorb_failure(self, error: Optional[BaseException] = None) -> None:
        """The main thread failed: when a hang was announced (e.g. a collective broke because the hung rank
        or its peers left), end as the watchdog does (status 86) instead of with a traceback; else return.

        Waits (at most two polls and a second) for an announcement only when ``error`` looks like a broken
        collective (gloo, NCCL, a reset connection); any other error returns at once."""
        if self.expiring:
            while True:  # the watchdog thread is writing its records and exits the process
                time.sleep(1.0)
        if self._thread is None or self._store is None:
            return
        text = f"{type(error).__name__}: {error}" if error is not None else ""
        broken = any(w in text for w in ("gloo", "NCCL", "Connection", "connection", "DistBackendError", "peer"))
        deadline = time.time() + (2 * self.poll_s + 1 if broken else 0)
        while True:
            try:
                if self._store.check([f"{self._key}/hang"]):
                    verdict = json.loads(self._store.get(f"{self._key}/hang"))
                    section, step, t0 = self._state
                    self._expire(section, step, time.perf_counter() - t0, verdict=verdict)
            except Exception:  # noqa: BLE001
                return
            if self.expiring:
                while True:
                    time.sleep(1.0)
            if time.time() >= deadline:
                return
            time.sleep(min(0.1, self.poll_s))


def hang_retry(run_dir: str, exit_status: int, since: float, max_retries: int = 3) -> Tuple[bool, str]:
    """For ``tools/slurm_pretrain.sh``: did this launch end in a hang, and should the job be requeued?

    A hang: exit status :data:`EXIT_HANG`, or a ``status.json`` hang recorded at or after ``since`` (the
    launch's start, unix time: a launcher such as torchrun reports a status of its own).  Requeue while
    the hangs in a row at the end of ``attempts.jsonl`` are at most ``max_retries``.  Returns (requeue,
    one line saying why); (False, "") when the launch did not hang.
    """
    hang = None
    try:
        with open(os.path.join(run_dir, "status.json"), encoding="utf-8") as f:
            hang = json.load(f).get("hang")
    except (OSError, ValueError):
        pass
    if hang is not None and float(hang.get("time") or 0) < since:
        hang = None  # an earlier launch's
    if exit_status != EXIT_HANG and hang is None:
        return False, ""
    in_a_row = 0
    try:
        with open(os.path.join(run_dir, ATTEMPTS), encoding="utf-8") as f:
            ended = [json.loads(line).get("ended") for line in f if line.strip()]
    except (OSError, ValueError):
        ended = []
    for e in reversed(ended):
        if e != "hang":
            break
        in_a_row += 1
    in_a_row = max(in_a_row, 1)
    where = (f"rank {hang.get('rank')} (host {hang.get('host')}) hung in {hang.get('section')} at step "
             f"{hang.get('step')}" if hang else f"a rank's watchdog expired (exit {EXIT_HANG})")
    if in_a_row > max_retries:
        return False, f"{where}; {in_a_row} hangs in a row (XHC_MAX_HANG_RETRIES={max_retries}): not requeueing"
    return True, f"{where} (hang {in_a_row} in a row, at most {max_retries}): requeueing to resume"
