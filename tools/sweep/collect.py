"""Collecting a sweep: one row per arm from its run directory (metrics.jsonl, status.json)."""

from __future__ import annotations

import csv
import json
import math
import os
from typing import Dict, List, Optional, Sequence

from tools.sweep.runner import ARM_STATE, _last_error_line, _pid_alive, _read_json, _write_json
from tools.sweep.spec import Arm, Sweep

__all__ = ["COLUMNS", "CELL_COLUMNS", "read_metrics", "read_hardware", "collect_arm", "collect", "aggregate", "format_table",
           "write_table"]

COLUMNS = ("arm", "variant", "size", "N", "k", "steps", "seed", "state", "params_total", "params_activated",
           "params_hc", "flops_per_token", "tokens", "compute", "train_loss", "valid_loss", "wall_s", "cpu_s",
           "tokens_per_s", "commit", "data", "reason")
CELL_COLUMNS = ("arm", "N", "k", "steps", "params_activated", "compute", "seeds", "train_loss", "valid_loss",
                "wall_s", "cpu_s")
"""The per-arm table over seeds (:func:`aggregate`): losses as mean ± standard deviation."""


def read_metrics(path: str):
    """(train records by step, eval records by step) of a metrics.jsonl; a step replayed after a
    resume keeps its last occurrence."""
    train: Dict[int, dict] = {}
    evals: Dict[int, dict] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    r = json.loads(line)
                except ValueError:
                    continue  # a line cut by a crash
                kind = r.get("kind")
                if kind == "train":
                    train[int(r["step"])] = r
                elif kind == "eval":
                    evals[int(r["step"])] = r
                elif r.get("event") == "resume" or (kind == "event" and r.get("event") == "resume"):
                    s = int(r.get("step", 0))  # steps after this are replayed: drop the stale ones
                    for d in (train, evals):
                        for k in [k for k in d if k > s]:
                            del d[k]
    except OSError:
        pass
    return train, evals


def collect_arm(arm: Arm, tail_fraction: float = 0.1) -> dict:
    """One row of the sweep table (see :data:`COLUMNS`)."""
    row = {"arm": arm.name, "variant": arm.variant, "size": arm.size, "N": arm.n, "k": arm.k, "steps": arm.steps,
           "seed": arm.seed, "cell": arm.cell,
           "params_total": arm.params_total, "params_activated": arm.params_activated, "params_hc": arm.params_hc,
           "flops_per_token": arm.flops_per_token, "tokens": arm.tokens, "compute": arm.compute,
           "train_loss": None, "valid_loss": None, "wall_s": None, "cpu_s": None, "tokens_per_s": None, "commit": None,
           "data": _data_fingerprint(arm.run_dir), "hardware": read_hardware(os.path.join(arm.run_dir, "metrics.jsonl")),
           "reason": ""}
    status = _read_json(os.path.join(arm.run_dir, "status.json"))
    record = _read_json(os.path.join(arm.run_dir, ARM_STATE)) or {}
    row["cpu_s"] = record.get("cpu_s")
    row["commit"] = record.get("commit")
    train, evals = read_metrics(os.path.join(arm.run_dir, "metrics.jsonl"))
    if train:
        first = math.floor(arm.steps * (1 - tail_fraction))
        tail = [train[s]["loss"] for s in sorted(train) if s > first and _finite(train[s].get("loss"))]
        if not tail:
            tail = [train[max(train)]["loss"]]
        row["train_loss"] = sum(tail) / len(tail)
        dt = sum(float(r.get("step_time_s", 0.0)) for r in train.values())
        toks = sum(1 for _ in train) * (arm.tokens / arm.steps)
        row["tokens_per_s"] = toks / dt if dt > 0 else None
        times = [r["time"] for r in list(train.values()) + list(evals.values()) if "time" in r]
        row["wall_s"] = record.get("wall_s") or ((max(times) - min(times)) if times else None)
    if evals:
        first = arm.steps * (1 - tail_fraction)
        tail = [evals[s]["loss"] for s in sorted(evals) if s >= first and _finite(evals[s].get("loss"))]
        if not tail and _finite(evals[max(evals)].get("loss")):
            tail = [evals[max(evals)]["loss"]]
        row["valid_loss"] = sum(tail) / len(tail) if tail else None
    last_step = max(train) if train else 0
    if status and status.get("finished"):
        row["state"] = "finished"
    elif record.get("state") == "failed":
        row["state"] = "failed"
        row["reason"] = (f"failed (exit {record.get('returncode')}) at step {last_step}/{arm.steps}: see "
                         f"{record.get('log')}" + (f" [{_last_error_line(record['log'])}]" if record.get("log") else ""))
    elif record.get("state") == "running" and _pid_alive(record.get("pid")):
        row["state"] = "running"
        row["reason"] = f"running: step {last_step}/{arm.steps}"
    elif status or train or record:
        row["state"] = "unfinished"
        row["reason"] = (f"unfinished: step {last_step}/{arm.steps}"
                         + (f" ({status['stopped_early']})" if status and status.get("stopped_early") else "")
                         + (" (runner gone without a status: crashed or killed)" if not status and record else "")
                         + "; rerun `tools.sweep run` to resume")
    else:
        row["state"] = "not started"
        row["reason"] = "not started"
    return row


def read_hardware(path: str) -> Optional[dict]:
    """``{"device_name", "devices"}`` from the ``setup`` records of a metrics.jsonl (training writes one per
    start); None without one, and None where the starts ran on different hardware (a resume elsewhere: the
    logged tokens/s then mix two machines)."""
    seen = set()
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if '"setup"' not in line:
                    continue
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                if r.get("kind") == "setup":
                    seen.add((str(r.get("device_name")), r.get("devices")))
    except OSError:
        return None
    if len(seen) != 1:
        return None
    name, devices = seen.pop()
    return {"device_name": name, "devices": devices}


def _data_fingerprint(run_dir: str):
    """What the arm trained on, by content (training.run.run_record: tokenizer and data hashes); None for
    an arm not started, or run before run records."""
    from training.run import RecordError, read_run_record

    try:
        record = read_run_record(run_dir) if os.path.isdir(run_dir) else None
    except RecordError:
        return None
    return record.fingerprint if record is not None else None


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def collect(sweep: Sweep) -> List[dict]:
    tail = float(sweep.fit.get("tail_fraction", 0.1))
    return [collect_arm(a, tail) for a in sweep.arms]


def _mean_std(xs: List[float]):
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def aggregate(rows: List[dict]) -> List[dict]:
    """One row per arm over its seeds (same variant, size and budget): each loss as mean and sample
    standard deviation (``<col>_mean``, ``<col>_std``, over the finished seeds), ``seeds``: finished
    seeds / all seeds, ``wall_s`` and ``cpu_s`` summed."""
    cells: Dict[str, List[dict]] = {}
    for r in rows:
        cells.setdefault(r.get("cell") or r["arm"], []).append(r)
    out = []
    for name, rs in cells.items():
        done = [r for r in rs if r["state"] == "finished"]
        first = rs[0]
        c = {"arm": name, **{k: first.get(k) for k in ("variant", "size", "N", "k", "steps", "params_total",
                                                      "params_activated", "params_hc", "flops_per_token", "tokens",
                                                      "compute")},
             "seeds": f"{len(done)}/{len(rs)}", "n_seeds": len(done), "seed_list": [r["seed"] for r in done]}
        for col in ("train_loss", "valid_loss"):
            m, s = _mean_std([r[col] for r in done if _finite(r.get(col))])
            c[f"{col}_mean"], c[f"{col}_std"] = m, s
            c[col] = (m, s)
        for col in ("wall_s", "cpu_s"):
            vals = [r[col] for r in rs if _finite(r.get(col))]
            c[col] = sum(vals) if vals else None
        out.append(c)
    return out


def _fmt(v, col: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, tuple):  # (mean, std)
        m, s = v
        if m is None:
            return "-"
        return f"{m:.4f}" + (f" ± {s:.4f}" if s is not None else "")
    if col in ("params_total", "params_activated", "params_hc", "tokens"):
        return _si(v)
    if col in ("flops_per_token", "compute"):
        return f"{v:.3g}"
    if col in ("train_loss", "valid_loss"):
        return f"{v:.4f}"
    if col in ("wall_s", "cpu_s"):
        return f"{v:.0f}"
    if col == "commit":
        return str(v)[:12]
    if col == "tokens_per_s":
        return f"{v:.0f}"
    return str(v)


def _si(x: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:g}"


def format_table(rows: List[dict], columns: Sequence[str], markdown: bool = False) -> str:
    cells = [[_fmt(r.get(c), c) for c in columns] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells])
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)]
    out = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    out += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(out)


def write_table(sweep: Sweep, rows: List[dict]) -> Dict[str, str]:
    """``arms.csv`` and ``arms.json`` under ``<out_dir>/summary``."""
    os.makedirs(sweep.summary_dir, exist_ok=True)
    paths = {"csv": os.path.join(sweep.summary_dir, "arms.csv"), "json": os.path.join(sweep.summary_dir, "arms.json")}
    with open(paths["csv"] + ".tmp", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(COLUMNS))
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c) for c in COLUMNS})
    os.replace(paths["csv"] + ".tmp", paths["csv"])
    cells = aggregate(rows)
    paths["cells_csv"] = os.path.join(sweep.summary_dir, "arms_over_seeds.csv")
    fields = [k for k in cells[0] if k not in ("train_loss", "valid_loss", "seed_list")] if cells else []
    with open(paths["cells_csv"] + ".tmp", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for c in cells:
            w.writerow(c)
    os.replace(paths["cells_csv"] + ".tmp", paths["cells_csv"])
    _write_json(paths["json"], {"sweep": sweep.name, "flops_convention": sweep.flops_convention, "arms": rows,
                                "arms_over_seeds": [{k: v for k, v in c.items() if k not in ("train_loss", "valid_loss")}
                                                    for c in cells]})
    return paths
