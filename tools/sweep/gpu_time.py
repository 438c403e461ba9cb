"""Time to loss: a sweep's compute multipliers in GPU-hours on a named GPU and cluster (docs/sweeps.md).

A compute multiplier M = C_b(L) / C_x(L) counts model FLOPs (docs/math.md §6.5).  A FLOP costs each variant
a different amount of GPU time: the HC streams move memory (``xhc.accounting.memory_traffic_summary``) that
the FLOP count leaves out, and their layouts differ.  With s_v the GPU-seconds variant v spends per model
FLOP on G GPUs (s_v = G / (F_v · tokens/s_v) = 1 / (MFU_v · peak)), the GPU-hours each needs for the loss L
are H_v(L) = C_v(L) · s_v / 3600 and

    M_GPU-h = H_b(L) / H_x(L) = M · s_b / s_x
            = (tokens_b(L) / tokens_x(L)) · (time per token_b / time per token_x).

s_v comes from measured tokens/s where the variant's arms logged them on that hardware (the ``setup``
record of each arm's metrics.jsonl names the GPU and the device count), else from the planner's step time
of the arm's own config on that cluster (:func:`training.plan.make_plan`: GEMMs, HC memory traffic,
communication, pipeline bubble).  Each variant is timed at its arm of the largest compute (its largest
size, where the sweep has several).  ``--laws paper`` puts [xHC]'s published L(C) (``xhc.scaling``) in
place of fits of the sweep's own runs, for a sweep that has not run yet.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Dict, List, Mapping, Optional, Sequence

from tools.sweep.spec import Arm, Sweep, SweepError

__all__ = ["VariantTime", "variant_times", "add_gpu_hours", "gpu_time_markdown", "paper_law_result",
           "hardware_matches"]

PAPER_COMPUTE = 4.0e20
"""C_b of [xHC]'s largest scaling-law run, where its multipliers are quoted (docs/math.md §6.5)."""


@dataclass
class VariantTime:
    """GPU time per model FLOP of one variant on ``gpus`` GPUs of kind ``gpu``."""

    variant: str
    arm: str
    gpu: str
    gpus: int
    flops_per_token: float
    tokens_per_s: float
    source: str
    """``planned`` (the planner's step time) or ``measured`` (the arms' logged tokens/s on this hardware)."""
    planned_tokens_per_s: Optional[float] = None
    measured_arms: int = 0
    layout: str = ""
    step_s: Optional[float] = None
    hc_memory_s: Optional[float] = None
    fits: Optional[bool] = None
    peak_tflops: float = 0.0

    @property
    def gpu_seconds_per_flop(self) -> float:
        return self.gpus / (self.flops_per_token * self.tokens_per_s)

    @property
    def seconds_per_token(self) -> float:
        """Wall seconds per token of the whole cluster (G GPUs)."""
        return 1.0 / self.tokens_per_s

    @property
    def mfu(self) -> float:
        return self.flops_per_token * self.tokens_per_s / (self.gpus * self.peak_tflops * 1e12)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(gpu_seconds_per_flop=self.gpu_seconds_per_flop, mfu=self.mfu)
        return d


def hardware_matches(hardware: Optional[Mapping], gpu: str, gpus: int) -> bool:
    """Whether an arm's logged hardware (``{"device_name", "devices"}``, collect's ``hardware`` column) is
    ``gpus`` GPUs of kind ``gpu`` (the planner's table name, e.g. ``h100``, inside the device name)."""
    if not hardware:
        return False
    name = str(hardware.get("device_name") or "").lower()
    return hardware.get("devices") == gpus and gpu.lower() in name


def _representative(arms: Sequence[Arm]) -> Arm:
    return max(arms, key=lambda a: (a.compute, a.steps))


def _plan_arm(sweep: Sweep, arm: Arm, gpus: int, gpu_kind, eff):
    from training.config import ConfigError, load_config
    from training.plan import PlanError, make_plan

    try:  # the arm's own config and layout, on a GPU (run.device stays auto: the planner takes the GPU path)
        cfg = load_config(sweep.base, [*arm.overrides, "run.device=auto"])
        return make_plan(cfg, gpus, gpu_kind, eff)
    except (ConfigError, PlanError) as e:
        raise SweepError(f"sweep file {sweep.path}: arm {arm.name} cannot be planned on {gpus}x {gpu_kind.name}: "
                         f"{e} (give --gpus the GPU count its layout and batch were made for)") from None


def variant_times(sweep: Sweep, rows: Sequence[dict], gpu: str, gpus: Optional[int] = None, eff=None,
                  variants: Optional[Sequence[str]] = None, log=print) -> Dict[str, VariantTime]:
    """:class:`VariantTime` per variant of ``sweep`` (``variants``: only these) on ``gpus`` GPUs of kind
    ``gpu`` (default: the sweep's ``executor.nproc``).  Measured tokens/s of the variant's finished arms at its
    representative size, where they logged this hardware, take precedence over the plan."""
    from training.plan import GPUS, Efficiencies

    if gpu not in GPUS:
        raise SweepError(f"--gpu {gpu!r} is not in the planner's GPU table; use one of {', '.join(GPUS)}")
    kind = GPUS[gpu]
    eff = eff or Efficiencies()
    by_var: Dict[str, List[Arm]] = {}
    for a in sweep.arms:
        by_var.setdefault(a.variant, []).append(a)
    out: Dict[str, VariantTime] = {}
    for v, arms in by_var.items():
        if variants is not None and v not in variants:
            continue
        rep = _representative(arms)
        g = int(gpus or rep.nproc)
        measured = [r for r in rows if r.get("variant") == v and r.get("size") == rep.size
                    and r.get("state") == "finished" and _pos(r.get("tokens_per_s"))
                    and hardware_matches(r.get("hardware"), gpu, g)]
        try:
            plan = _plan_arm(sweep, rep, g, kind, eff)
        except SweepError:
            if not measured:
                raise
            plan = None
        vt = VariantTime(variant=v, arm=rep.cell, gpu=gpu, gpus=g, flops_per_token=rep.flops_per_token,
                         tokens_per_s=math.nan, source="planned", peak_tflops=kind.bf16_tflops)
        if plan is not None:
            vt.planned_tokens_per_s = plan.tokens_per_s
            vt.layout, vt.step_s, vt.hc_memory_s, vt.fits = (plan.lay.describe(), plan.time.total,
                                                             plan.time.hc_memory, plan.fits)
            vt.tokens_per_s = plan.tokens_per_s
            if plan.fits is False:
                log(f"[fit] warning: {rep.cell} does not fit {g}x {gpu} as configured ({plan.peak.total / 2 ** 30:.1f} "
                    f"GiB on the most loaded rank); its planned time is that of a layout that cannot run")
        if measured:
            # GPU-seconds per FLOP averaged over the arms (each arm's tokens/s is its own FLOPs per token's)
            s = sum(g / (r["flops_per_token"] * r["tokens_per_s"]) for r in measured) / len(measured)
            vt.tokens_per_s = g / (vt.flops_per_token * s)
            vt.source, vt.measured_arms = "measured", len(measured)
        out[v] = vt
    return out


def _pos(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def add_gpu_hours(result: dict, fits: Mapping, times: Mapping[str, VariantTime], significance=None) -> dict:
    """Add the GPU-hour side to every compute multiplier of ``result`` (``fit_sweep``'s): ``gpu_hours`` =
    {multiplier, interval, significance, baseline, variant (GPU-hours to the loss), loss} and
    ``result["gpu_time"]`` (the per-variant times).  ``fits``: variant -> object with ``.fit`` (a
    ``xhc.scaling.ScalingFit``) or a ScalingFit; ``significance(lo, hi, null)``: how an interval is judged
    (``tools.sweep.fit.significance``).  The ratio s_b / s_x is exact (no bootstrap), so the GPU-hour
    interval is the FLOP interval times it."""

    def law(v):
        f = fits[v]
        return getattr(f, "fit", f)

    for m in result.get("multipliers", []):
        b, x = m["baseline"], m["variant"]
        if b not in times or x not in times:
            continue
        at = m["at"]
        L = law(b).loss(at["compute"]) if "compute" in at else at["loss"]
        c_b = at["compute"] if "compute" in at else _compute_for(law(b), L)
        mult = m["multiplier"]
        c_x = c_b / mult if _pos(mult) else math.nan
        ratio = times[b].gpu_seconds_per_flop / times[x].gpu_seconds_per_flop
        lo, hi = m.get("interval") or [math.nan, math.nan]
        iv = [lo * ratio, hi * ratio]
        m["gpu_hours"] = {"multiplier": mult * ratio, "interval": iv,
                          "significance": significance(iv[0], iv[1], 1.0) if significance else None,
                          "seconds_per_flop_ratio": ratio, "loss": L,
                          "baseline": c_b * times[b].gpu_seconds_per_flop / 3600.0,
                          "variant": c_x * times[x].gpu_seconds_per_flop / 3600.0}
    some = next(iter(times.values()), None)
    result["gpu_time"] = {"gpu": some.gpu if some else None, "gpus": some.gpus if some else None,
                          "variants": {v: t.as_dict() for v, t in times.items()}}
    return result


def _compute_for(fit, loss: float) -> float:
    if loss <= fit.E:
        return math.nan
    return (fit.A / (loss - fit.E)) ** (1.0 / fit.alpha)


def _fmt_iv(x, iv, fmt="{:.3f}") -> str:
    lo, hi = iv
    if not (_pos(lo) or lo == 0) or not math.isfinite(hi):
        return fmt.format(x)
    return f"{fmt.format(x)} [{fmt.format(lo)}, {fmt.format(hi)}]"


def gpu_time_markdown(result: dict) -> str:
    """The GPU-time tables of a result that :func:`add_gpu_hours` annotated ('' if none)."""
    gt = result.get("gpu_time")
    if not gt:
        return ""
    out = [f"Time to loss on {gt['gpus']}x {gt['gpu']} (GPU-seconds per model FLOP of each variant: measured tokens/s "
           "where its arms logged this hardware, else the planner's step time of its arm's config, HC memory "
           "traffic included):", "",
           "| variant | arm | source | layout | tokens/s | MFU | HC memory share of step | GPU-s per PFLOP |",
           "|---|---|---|---|---|---|---|---|"]
    for v, t in gt["variants"].items():
        hc = (f"{t['hc_memory_s'] / t['step_s']:.1%}" if t.get("step_s") and t.get("hc_memory_s") is not None
              else "-")
        src = t["source"] + (f" ({t['measured_arms']} arms; planned {t['planned_tokens_per_s']:,.0f})"
                             if t["source"] == "measured" and t.get("planned_tokens_per_s") else "")
        out.append(f"| {v} | {t['arm']} | {src} | {t['layout'] or '-'} | {t['tokens_per_s']:,.0f} | {t['mfu']:.1%} | "
                   f"{hc} | {t['gpu_seconds_per_flop'] * 1e15:.4g} |")
    rows = [m for m in result.get("multipliers", []) if "gpu_hours" in m]
    if rows:
        out += ["", "| baseline | variant | FLOP multiplier | GPU-hour multiplier | difference (GPU-hours) | "
                "GPU-hours to the loss (baseline / variant) | loss |", "|---|---|---|---|---|---|---|"]
        for m in rows:
            g = m["gpu_hours"]
            sig = {"within noise": "within noise", "significant": "**significant**"}.get(g["significance"], "-")
            out.append(f"| {m['baseline']} | {m['variant']} | {_fmt_iv(m['multiplier'], m.get('interval') or [math.nan] * 2)} "
                       f"| {_fmt_iv(g['multiplier'], g['interval'])} | {sig} | {g['baseline']:,.0f} / {g['variant']:,.0f} "
                       f"| {g['loss']:.4f} |")
        out.append("")
        for m in rows:
            g = m["gpu_hours"]
            out.append(f"{m['baseline']} needs {m['multiplier']:.3f}x the compute of {m['variant']} for loss "
                       f"{g['loss']:.4f}: {g['multiplier']:.3f}x its GPU-hours on {gt['gpus']}x {gt['gpu']} "
                       f"({g['baseline']:,.0f} vs {g['variant']:,.0f} GPU-hours).")
    return "\n".join(out)


def paper_law_result(sweep: Sweep, compute: Optional[float] = None) -> tuple:
    """([xHC]'s published laws mapped onto the sweep's variants, a result with their compute multipliers).

    ``xhc.scaling.PAPER_FITS``: vanilla, mHC N = 4, xHC N = 16, k = 4 (docs/math.md §6.5); each goes to the
    sweep variant of that family and N (and k), the first such.  Multipliers relative to xHC at C_b =
    ``compute`` (default: the sweep's ``fit.compute``, else 4.0e20, the paper's largest run), no interval."""
    from xhc.scaling import PAPER_FITS

    want = {"vanilla": lambda a: a.family == "vanilla",
            "mhc": lambda a: a.family == "mhc" and a.n == 4,
            "xhc": lambda a: a.family == "xhc" and a.n == 16 and a.k == 4}
    mapped: Dict[str, object] = {}
    names: Dict[str, str] = {}
    for paper, ok in want.items():
        arm = next((a for a in sweep.arms if ok(a)), None)
        if arm is not None:
            mapped[arm.variant] = PAPER_FITS[paper]
            names[paper] = arm.variant
    if "xhc" not in names or len(names) < 2:
        raise SweepError(f"sweep file {sweep.path}: --laws paper needs an xHC N = 16, k = 4 variant and a vanilla or "
                         f"mHC N = 4 variant (the published laws' methods); found {', '.join(names) or 'none'}")
    c = float(compute or sweep.fit.get("compute") or PAPER_COMPUTE)
    x = names["xhc"]
    mults = []
    for paper in ("vanilla", "mhc"):
        if paper not in names:
            continue
        b = names[paper]
        fb, fx = mapped[b], mapped[x]
        L = fb.loss(c)
        mults.append({"baseline": b, "variant": x, "at": {"compute": c}, "multiplier": c / fx.compute_for(L),
                      "interval": [math.nan, math.nan], "significance": "undetermined", "law": paper})
    return mapped, {"sweep": sweep.name, "laws": "paper", "multipliers": mults,
                    "law_source": "[xHC] published L(C) = E + A·C^(−α), E = 0.72 (docs/math.md §6.5; xhc.scaling.PAPER_FITS)"}
