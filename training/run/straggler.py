"""The straggler report: every ``reliability.straggler_interval`` steps the ranks share their step and
section times (one small all-reduce) and the slowest rank is named when it is over the threshold.

A synchronous step takes as long on every rank (each waits in the gradient all-reduce for the
slowest), so the report compares each rank's own *work* per step: the time in its ``data``,
``forward_backward`` and ``optimizer`` sections (:data:`training.run.watchdog.WORK_SECTIONS`), without
the time it waited in ``grad_sync``.  Per rank and window it takes its *fastest* step (the minimum over
the window's steps, each column on its own): a rank is named only when even its best step is slow, not
for a hiccup (a page fault, a preempted core, a garbage collection) that a median of a short window
still shows; a rank that is slow only now and then is not named.  The slowest rank's ratio is to the
lower median over ranks (with 2 ranks: the other rank).

Rank 0 writes a ``straggler`` record to ``metrics.jsonl`` for every report (per-rank work and step
times, the slowest rank, its ratio, and ``straggler``: that rank when the ratio is at least
``reliability.straggler_threshold``, else null) and one log line when a rank is named;
:func:`plot_rank_times` draws ``rank_times.png`` from the records at the end of the run.

With tensor, expert or pipeline parallelism the forward and backward contain collectives too, so a
slow rank also lengthens its peers' ``forward_backward``; the ratio then understates how slow it is,
and a straggler is named only when its own part stands out.
"""

from __future__ import annotations

import os
import statistics
from typing import Callable, Dict, List, Optional

from training.run.watchdog import WORK_SECTIONS

__all__ = ["StragglerMonitor", "plot_rank_times"]

_COLUMNS = ("step_time_s", "work_s", *WORK_SECTIONS, "grad_sync")


class StragglerMonitor:
    """Collect this rank's step and section times; :meth:`report` every ``interval`` steps (all ranks).

    ``all_reduce(values) -> values``: the sum over ranks (one collective).
    """

    def __init__(self, interval: int, threshold: float, rank: int, world: int,
                 all_reduce: Callable[[List[float]], List[float]]):
        self.interval, self.threshold, self.rank, self.world = interval, threshold, rank, world
        self.all_reduce = all_reduce
        self.rows: List[List[float]] = []
        self.first_step: Optional[int] = None

    def record(self, step: int, step_time: float, sections: Dict[str, float]) -> None:
        if not self.interval:
            return
        if self.first_step is None:
            self.first_step = step
        work = sum(sections.get(s, 0.0) for s in WORK_SECTIONS)
        self.rows.append([step_time, work, *(sections.get(s, 0.0) for s in WORK_SECTIONS),
                          sections.get("grad_sync", 0.0)])

    def due(self, step: int) -> bool:
        return bool(self.interval) and step % self.interval == 0 and bool(self.rows)

    def report(self, step: int) -> Optional[dict]:
        """All ranks: share the window's medians (one all-reduce); the record (the same on every rank)."""
        if not self.rows:
            return None
        k = len(_COLUMNS)
        mine = [min(col) for col in zip(*self.rows)]
        flat = [0.0] * (k * self.world)
        flat[self.rank * k:(self.rank + 1) * k] = mine
        total = self.all_reduce(flat)
        per_rank = {c: [round(total[r * k + i], 6) for r in range(self.world)] for i, c in enumerate(_COLUMNS)}
        work = per_rank["work_s"]
        median = statistics.median_low(work)
        slowest = max(range(self.world), key=lambda r: work[r])
        ratio = work[slowest] / median if median > 0 else float("inf")
        rec = {"window": [self.first_step, step], "steps": len(self.rows), "ranks": self.world, **per_rank,
               "median_work_s": median, "slowest_rank": slowest, "ratio": round(ratio, 4),
               "threshold": self.threshold,
               "straggler": slowest if self.world > 1 and ratio >= self.threshold else None}
        self.rows, self.first_step = [], None
        return rec

    @staticmethod
    def line(step: int, rec: dict) -> str:
        r = rec["straggler"]
        parts = ", ".join(f"{s} {rec[s][r]:.3g} s" for s in WORK_SECTIONS)
        return (f"[xhc] straggler: rank {r} works {rec['work_s'][r]:.3g} s per step, {rec['ratio']:.2f}x the median "
                f"{rec['median_work_s']:.3g} s (steps {rec['window'][0]}-{rec['window'][1]}; {parts}; threshold "
                f"reliability.straggler_threshold={rec['threshold']:g})")


def plot_rank_times(records: List[dict], out_png: str, title: str = "") -> Optional[str]:
    """``rank_times.png``: each rank's work and step time per straggler report over the run; None (nothing
    written) without records or matplotlib."""
    records = [r for r in records if r.get("kind") == "straggler" and r.get("work_s")]
    if not records:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    world = len(records[0]["work_s"])
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for rank in range(world):
        ax.plot(steps, [r["work_s"][rank] if rank < len(r["work_s"]) else float("nan") for r in records],
                "o-", ms=3, lw=1.0, label=f"rank {rank}" if world <= 16 else None)
    ax.plot(steps, [r["step_time_s"][0] for r in records], "k--", lw=1.0, label="step time (rank 0)")
    for r in records:
        if r.get("straggler") is not None:
            ax.annotate(f"r{r['straggler']} {r['ratio']:.1f}x", (r["step"], r["work_s"][r["straggler"]]),
                        fontsize=7, textcoords="offset points", xytext=(2, 4))
    ax.set_xlabel("step")
    ax.set_ylabel("seconds per step (the fastest of the window)")
    ax.set_title(title or "work per rank (data + forward/backward + optimizer)")
    ax.grid(alpha=0.3)
    if world <= 16:
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png)
    plt.close(fig)
    return out_png
