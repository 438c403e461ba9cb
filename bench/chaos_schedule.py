"""The chaos run's schedule and verdict (``python -m bench.chaos``): pure functions of a seed and of what
the runs wrote, so that tests can draw schedules and feed the verdict runs that differ.

- :func:`draw_schedule`: the faults of a seed, in the order they strike (:class:`Fault`);
- :func:`judge`: the verdict from the attempts (:class:`Attempt`), the undisturbed run and the chaos run
  (:class:`Curves`), and the undisturbed runs on the other layouts visited (the elastic tolerance);
- :func:`format_report`: the table the command prints.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Dict, List, Optional, Sequence, Tuple

RUNTIME = ("sigterm", "kill_rank", "kill_launcher", "hang", "disk_full")  # end an attempt
BETWEEN = ("corrupt", "layout")  # act on the relaunch after a fault that ended an attempt
KINDS = RUNTIME + BETWEEN
LAYOUTS = {"dp2": (2, []), "tp2": (2, ["parallel.tp=2", "parallel.sp=true"]), "single": (1, [])}
START_LAYOUT = "dp2"
HANG_SECTIONS = ("data", "forward_backward", "optimizer", "checkpoint_save", "evaluation")
MIN_GAP = 5  # steps between two faults: the next strikes after the previous one's recovery
FLOOR = 1e-5  # the elastic tolerance's floor (docs/parallelism-and-checkpoints.md)


class ChaosError(RuntimeError):
    """Bad options (one line: the option and the fix)."""


# ================================================================================================
# The schedule
# ================================================================================================
@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    step: int  # runtime faults: the step it strikes at (after it / in it); between faults: its gap's step
    gap: int  # the attempt it ends (runtime) or whose relaunch it changes (between), 1-based
    layout: str  # runtime: the layout it strikes on; layout: the layout of the relaunch
    moment: str = ""  # sigterm / kill_*: "step" (a random moment of the step after `step`) or "save"
    delay: float = 0.0  # moment "step": the fraction of a step to wait after step `step` was recorded
    rank: int = 0  # kill_rank, hang, disk_full (injected): which rank
    section: str = ""  # hang: the section
    byte: float = 0.0  # corrupt: where in the largest data file (fraction of its size)

    def saves_on_stop(self) -> bool:
        """SIGTERM, or a killed torchrun (its workers get SIGTERM): every rank saves and exits 0, nothing is
        lost.  With one process there is no launcher: killing it is a ``kill -9`` of the only rank."""
        return self.kind == "sigterm" or (self.kind == "kill_launcher" and LAYOUTS[self.layout][0] > 1)

    def where(self) -> str:
        if self.kind == "corrupt":
            return "newest checkpoint, before the relaunch"
        if self.kind == "layout":
            return f"relaunch on {self.layout}"
        if self.kind == "hang":
            return f"step {self.step}, rank {self.rank}, {self.section}"
        if self.kind == "disk_full":
            return f"save of step {self.step}"
        who = f"rank {self.rank}, " if self.kind == "kill_rank" else \
            "the one process (no launcher), " if self.kind == "kill_launcher" and not self.saves_on_stop() else ""
        return f"{who}{'mid-step after step' if self.moment == 'step' else 'mid-save of step'} {self.step}"


def _snap(kind: str, moment: str, section: str, step: int, interval: int, eval_interval: int, steps: int) -> int:
    """The step a fault of this kind may strike at, at or after ``step`` (a save or an evaluation step)."""
    every = interval if kind == "disk_full" or moment == "save" or section == "checkpoint_save" else \
        eval_interval if section == "evaluation" else 1
    snapped = -(-step // every) * every
    return snapped if snapped < steps else -1


def draw_schedule(seed: int, steps: int = 200, faults: int = 6, interval: int = 20, eval_interval: int = 50,
                  kinds: Sequence[str] = KINDS) -> List[Fault]:
    """The faults of seed ``seed``, in the order they strike (a pure function of its arguments).

    Each fault that ends an attempt (:data:`RUNTIME`) strikes at its own step, at least
    :data:`MIN_GAP` steps after the previous one; ``corrupt`` and ``layout`` ride on the relaunch after
    one of them, at most one of each per relaunch, and only after a fault late enough that two
    checkpoints exist (step >= 2 intervals + 2).
    """
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ChaosError(f"--kinds: unknown fault kind(s) {', '.join(unknown)}; choose from {', '.join(KINDS)}")
    runtime_kinds = [k for k in KINDS if k in kinds and k in RUNTIME]
    if not runtime_kinds:
        raise ChaosError(f"--kinds: needs at least one fault that ends an attempt ({', '.join(RUNTIME)}); "
                         "corrupt and layout act on the relaunch after one")
    if faults < 1 or interval < 1 or steps < 2 * interval + MIN_GAP:
        raise ChaosError(f"--steps {steps} --interval {interval} --faults {faults}: need faults >= 1 and steps >= "
                         f"2 x interval + {MIN_GAP}")
    sections = [s for s in HANG_SECTIONS if s != "evaluation" or eval_interval]
    need_ck = 2 * interval + 2
    lo, hi = 2, steps - MIN_GAP
    rng = random.Random(seed)
    for _ in range(200):  # kinds, details, then steps; drawn again (from the same stream) where they do not fit
        found = _draw_once(rng, kinds, runtime_kinds, faults, sections, lo, hi, need_ck, interval, eval_interval, steps)
        if found is not None:
            runtime, snapped, taken = found
            break
    else:
        raise ChaosError(f"--steps {steps}: no room for {faults} faults {MIN_GAP} steps apart with checkpoint "
                         f"interval {interval} (corrupt and layout need a fault after step {need_ck}): raise --steps, "
                         "lower --faults or --interval")
    out: List[Fault] = []
    layout = START_LAYOUT
    for i, (r, s) in enumerate(zip(runtime, snapped)):
        world = LAYOUTS[layout][0]
        out.append(Fault(kind=r["kind"], step=s, gap=i + 1, layout=layout, moment=r["moment"], delay=r["delay"],
                         rank=rng.randrange(world), section=r["section"]))
        if "corrupt" in taken[i]:
            out.append(Fault(kind="corrupt", step=s, gap=i + 1, layout=layout, byte=round(rng.random(), 4)))
        if "layout" in taken[i]:
            layout = rng.choice([x for x in LAYOUTS if x != layout])
            out.append(Fault(kind="layout", step=s, gap=i + 1, layout=layout))
    return out


def _draw_once(rng: random.Random, kinds, runtime_kinds, faults: int, sections, lo: int, hi: int, need_ck: int,
               interval: int, eval_interval: int, steps: int):
    """One try of :func:`draw_schedule`: (runtime faults, their steps, the between faults of each), or None."""
    picked = [rng.choice([k for k in KINDS if k in kinds]) for _ in range(faults)]
    if not any(k in RUNTIME for k in picked):
        picked[0] = rng.choice(runtime_kinds)
    for b in BETWEEN:  # at most one of each per relaunch
        while picked.count(b) > sum(k in RUNTIME for k in picked):
            picked[picked.index(b)] = rng.choice(runtime_kinds)
    runtime = []
    for k in picked:
        if k in RUNTIME:
            moment = rng.choice(("step", "save")) if k in ("sigterm", "kill_rank", "kill_launcher") else ""
            runtime.append({"kind": k, "moment": moment, "delay": round(rng.random(), 3),
                            "section": rng.choice(sections) if k == "hang" else ""})
    between = [k for k in picked if k in BETWEEN]
    if hi - lo + 1 < len(runtime):
        return None
    for _ in range(100):
        cand = sorted(rng.sample(range(lo, hi + 1), len(runtime)))
        snapped = [_snap(r["kind"], r["moment"], r["section"], s, interval, eval_interval, steps)
                   for r, s in zip(runtime, cand)]
        if min(snapped) < 0 or any(b - a < MIN_GAP for a, b in zip(snapped, snapped[1:])) or snapped[-1] > hi:
            continue
        taken: Dict[int, set] = {i: set() for i in range(len(runtime))}
        for b in between:
            eligible = [i for i, s in enumerate(snapped) if s >= need_ck and b not in taken[i]]
            if not eligible:
                break
            taken[rng.choice(eligible)].add(b)
        else:
            return runtime, snapped, taken
    return None


def attempt_layouts(schedule: Sequence[Fault]) -> List[str]:
    """The layout of each attempt (1 + the number of faults that end one)."""
    layouts = [START_LAYOUT]
    for f in schedule:
        if f.kind in RUNTIME:
            layouts.append(layouts[-1])
        elif f.kind == "layout":
            layouts[-1] = f.layout
    return layouts


# ================================================================================================
# The verdict (pure: fed with what the runs wrote)
# ================================================================================================
@dataclasses.dataclass
class Attempt:
    """One launch, as the driver saw it."""
    number: int
    layout: str
    resumed_step: int = 0  # the step it resumed from (0: a fresh start)
    last_step: int = 0  # the newest step it trained (its resumed step if none)
    t_last: Optional[float] = None  # the time its newest step was recorded
    unpublished_save: Optional[int] = None  # an interval save it began that never became a checkpoint
    exits: Dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> exit status (what ranks reported)
    launcher_exit: Optional[int] = None
    ended: str = ""  # how it ended, in words
    problems: List[str] = dataclasses.field(default_factory=list)  # what the driver saw go wrong
    notes: List[str] = dataclasses.field(default_factory=list)  # worth saying, not a failure
    seconds: float = 0.0


@dataclasses.dataclass
class Curves:
    """What a run wrote: per step (loss, grad norm, lr, consumed samples, sample ids), evals, final tensors."""
    train: Dict[int, tuple]
    evals: Dict[int, float]
    tensors: Optional[Dict[str, "object"]] = None


def _max_diff(a: Dict[str, "object"], b: Dict[str, "object"]) -> Tuple[float, str, List[str]]:
    """Largest |a - b| over every tensor, the key where it is, and the keys not in both (or of another shape)."""
    import torch

    odd = sorted(set(a) ^ set(b)) + [k for k in a if k in b and a[k].shape != b[k].shape]
    worst, where = 0.0, ""
    for k in a:
        if k in b and a[k].shape == b[k].shape and not torch.equal(a[k], b[k]):
            d = float((a[k].double() - b[k].double()).abs().max())
            if d > worst or not where:
                worst, where = d, k
    return worst, where, odd


def tolerance(reference: Curves, others: Sequence[Curves], from_step: int) -> Tuple[float, float, float]:
    """(loss tolerance, loss noise, tensor noise): the loss tolerance is twice the largest loss difference an
    undisturbed run on another layout makes after ``from_step``, and at least :data:`FLOOR`; the tensor
    noise (their largest final-tensor difference) is reported beside the chaos run's."""
    loss_noise = tensor_noise = 0.0
    for o in others:
        common = [s for s in reference.train if s > from_step and s in o.train]
        loss_noise = max([loss_noise] + [abs(reference.train[s][0] - o.train[s][0]) for s in common])
        if reference.tensors is not None and o.tensors is not None:
            tensor_noise = max(tensor_noise, _max_diff(reference.tensors, o.tensors)[0])
    return max(2 * loss_noise, FLOOR), loss_noise, tensor_noise


def compare(reference: Curves, run: Curves, steps: int, exact: bool,
            tol_loss: float = 0.0) -> Tuple[List[str], Dict[str, object]]:
    """Problems (empty: the run matches) and the measured differences.

    ``exact``: every number bit for bit, the final tensors included.  Else (the layout changed) the data
    positions, sample ids and learning rates exactly, the training and validation losses within
    ``tol_loss``; the final tensors must be the same set, their largest difference is reported, not held
    to a bound: the documented elastic tolerance is on losses, and a MoE run's weights move by discrete
    steps on another layout's rounding (an expert-bias update of +-rate, a token routed to another
    expert) that no rounding bound covers."""
    problems: List[str] = []
    want = list(range(1, steps + 1))
    if sorted(reference.train) != want:
        problems.append(f"the undisturbed run recorded steps {_span(reference.train)}, not 1..{steps}")
    if sorted(run.train) != want:
        problems.append(f"the chaos run recorded steps {_span(run.train)}, not 1..{steps}")
    common = [s for s in want if s in reference.train and s in run.train]
    worst_loss = max([0.0] + [abs(run.train[s][0] - reference.train[s][0]) for s in common])
    for what, i in (("consumed samples", 3), ("sample ids", 4), ("learning rate", 2)):
        bad = [s for s in common if run.train[s][i] != reference.train[s][i]]
        if bad:
            problems.append(f"{what} differ from the undisturbed run at {len(bad)} step(s), first step {bad[0]}")
    if exact:
        for what, i in (("loss", 0), ("gradient norm", 1)):
            bad = [s for s in common if run.train[s][i] != reference.train[s][i]]
            if bad:
                s = bad[0]
                problems.append(f"{what} differs from the undisturbed run at {len(bad)} step(s), first step {s}: "
                                f"{run.train[s][i]!r} vs {reference.train[s][i]!r}")
        if run.evals != reference.evals:
            problems.append(f"validation losses differ: {run.evals} vs {reference.evals}")
    else:
        if worst_loss > tol_loss:
            s = max(common, key=lambda s: abs(run.train[s][0] - reference.train[s][0]))
            problems.append(f"loss differs by {worst_loss:.3g} at step {s}, over the elastic tolerance {tol_loss:.3g}")
        if sorted(run.evals) != sorted(reference.evals):
            problems.append(f"validation at steps {sorted(run.evals)}, the undisturbed run's at "
                            f"{sorted(reference.evals)}")
        else:
            bad = {s: abs(run.evals[s] - reference.evals[s]) for s in run.evals
                   if abs(run.evals[s] - reference.evals[s]) > tol_loss}
            if bad:
                problems.append(f"validation losses differ by more than the elastic tolerance {tol_loss:.3g}: {bad}")
    worst_tensor, where = 0.0, ""
    if reference.tensors is None or run.tensors is None:
        problems.append("no final checkpoint to compare")
    else:
        worst_tensor, where, odd = _max_diff(reference.tensors, run.tensors)
        if odd:
            problems.append(f"the final checkpoints hold different tensors: {odd[:3]}")
        if exact and worst_tensor > 0:
            problems.append(f"final weights/optimizer state differ by up to {worst_tensor:.3g} ({where}): "
                            "bit-identical expected")
    return problems, {"loss": worst_loss, "tensors": worst_tensor, "tensor_key": where}


def _span(train: Dict[int, tuple]) -> str:
    return f"{min(train)}..{max(train)} ({len(train)} steps)" if train else "none"


def allowed_loss(fault: Fault, attempt: Attempt, corrupt: bool, interval: int) -> int:
    """Steps a runtime fault may cost (module docstring): none for a signal the ranks save on, else one
    interval plus the steps of a save still in flight; one interval more when the newest checkpoint was
    corrupt at the relaunch."""
    base = 0 if fault.saves_on_stop() else interval
    if not fault.saves_on_stop() and attempt.unpublished_save is not None:
        base += max(0, attempt.last_step - attempt.unpublished_save)
    return base + (interval if corrupt else 0)


def judge(schedule: Sequence[Fault], attempts: Sequence[Attempt], reference: Curves, run: Curves, steps: int,
          interval: int, others: Sequence[Curves] = (), median_step_s: float = 0.0,
          recovered: Optional[Dict[int, float]] = None) -> dict:
    """The verdict: ``{"passed", "rows", "problems", "diff", "tolerance", "exact", "lost"}``.

    ``attempts``: one per launch, in order; ``recovered``: for attempt a, the time the step after its
    newest one was first recorded after it ended (for the time each fault cost)."""
    problems: List[str] = []
    runtime = [f for f in schedule if f.kind in RUNTIME]
    if len(attempts) != len(runtime) + 1:
        problems.append(f"{len(attempts)} attempts for {len(runtime)} faults that end one: "
                        f"expected {len(runtime) + 1}")
    rows = []
    total_lost = 0
    for f in schedule:
        a = f.gap - 1
        att = attempts[a] if a < len(attempts) else None
        nxt = attempts[a + 1] if a + 1 < len(attempts) else None
        row = {"fault": f.kind, "where": f.where(), "attempt": f.gap, "ended": "", "resumed": "", "lost": "",
               "cost_s": None, "ok": True}
        if f.kind in RUNTIME and att is not None:
            row["ended"] = att.ended
            for p in att.problems:
                problems.append(f"fault {f.kind} ({f.where()}): {p}")
                row["ok"] = False
            if nxt is not None:
                corrupt = any(g.kind == "corrupt" and g.gap == f.gap for g in schedule)
                lost = att.last_step - nxt.resumed_step
                allowed = allowed_loss(f, att, corrupt, interval)
                total_lost += max(lost, 0)
                row["resumed"] = str(nxt.resumed_step)
                row["lost"] = f"{lost} (<= {allowed})"
                if lost > allowed or lost < 0:
                    problems.append(f"fault {f.kind} ({f.where()}): {lost} steps lost (step {att.last_step} -> "
                                    f"resumed from {nxt.resumed_step}), allowed {allowed}")
                    row["ok"] = False
                t1 = (recovered or {}).get(att.number)
                if att.t_last is not None and t1 is not None:
                    row["cost_s"] = max(0.0, t1 - att.t_last - median_step_s)
        elif f.kind in BETWEEN and nxt is not None:
            row["ended"] = "(between attempts)"
            row["resumed"] = str(nxt.resumed_step)
            for p in nxt.problems:
                if p.startswith(f.kind + ":"):
                    problems.append(f"fault {f.kind} ({f.where()}): {p}")
                    row["ok"] = False
        rows.append(row)
    last = attempts[-1] if attempts else None
    if last is not None:
        for p in last.problems:
            if not any(p in q for q in problems):
                problems.append(f"attempt {last.number}: {p}")
    exact = all(a.layout == START_LAYOUT for a in attempts)
    from_step = min([a.resumed_step for a in attempts if a.layout != START_LAYOUT] or [0])
    tol_loss, noise_loss, noise_tensor = (0.0, 0.0, 0.0) if exact else tolerance(reference, others, from_step)
    if not exact and not others:
        problems.append("the layout changed but no undisturbed run on another layout measured the tolerance")
    found, diff = compare(reference, run, steps, exact, tol_loss)
    problems += found
    return {"passed": not problems, "rows": rows, "problems": problems, "diff": diff, "exact": exact,
            "tolerance": {"loss": tol_loss, "loss_noise": noise_loss, "tensor_noise": noise_tensor},
            "lost": total_lost}


def format_report(seed: int, verdict: dict, attempts: Sequence[Attempt], command: str) -> str:
    """The table of faults, the comparison and the verdict."""
    head = ("#", "fault", "where", "attempt ended", "resumed from", "steps lost", "time cost (s)", "ok")
    body = [(str(i + 1), r["fault"], r["where"], r["ended"], r["resumed"], r["lost"],
             "" if r["cost_s"] is None else f"{r['cost_s']:.1f}", "yes" if r["ok"] else "NO")
            for i, r in enumerate(verdict["rows"])]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    out = [f"chaos run, seed {seed}: {len(verdict['rows'])} faults, {len(attempts)} attempts "
           f"({' -> '.join(a.layout for a in attempts)})", line(head), line(["-" * w for w in widths])]
    out += [line(b) for b in body]
    d, t = verdict["diff"], verdict["tolerance"]
    if verdict["exact"]:
        out.append(f"compared with the undisturbed run: every attempt on {START_LAYOUT}, bit-identical expected; "
                   f"max |dloss| {d['loss']:.3g}, max |dtensor| {d['tensors']:.3g}")
    else:
        out.append(f"compared with the undisturbed run: the layout changed; max |dloss| {d['loss']:.3g} "
                   f"(tolerance {t['loss']:.3g}: other layouts differ by up to {t['loss_noise']:.3g}); final "
                   f"tensors differ by up to {d['tensors']:.3g} ({d.get('tensor_key') or '-'}; reported, not bounded; "
                   f"undisturbed runs on the other layouts: {t['tensor_noise']:.3g})")
    out += [f"note (attempt {a.number}): {n}" for a in attempts for n in a.notes]
    out.append(f"steps lost in all: {verdict['lost']}; wall time {sum(a.seconds for a in attempts):.0f} s in attempts")
    if verdict["passed"]:
        out.append(f"verdict: PASS (seed {seed})")
    else:
        out.append(f"verdict: FAIL (seed {seed})")
        out += [f"  - {p}" for p in verdict["problems"]]
        out.append(f"reproduce: {command}")
    return "\n".join(out)
