"""Pre-training metrics: FLOPs/MFU accounting, and one logger for console, JSONL, tensorboard and wandb.

- :func:`model_flops_per_token`: training FLOPs per token of the backbone (a named convention of
  :func:`xhc.accounting.vanilla_flops_per_token`) plus the hyper-connections' F_HC
  (:func:`xhc.accounting.training_flops_per_token`, docs/math.md §5.2).
- :func:`peak_tflops`: the per-device peak used for MFU: ``logging.peak_tflops`` if set, else
  the dense bf16 tensor-core peak of a known GPU, else a *nominal* 1 TFLOP/s for a CPU process
  (so CPU MFU is a relative number only; the console says so).
- :class:`MetricsLogger`: rank 0 writes ``metrics.jsonl`` (one JSON object per record, ``kind``
  = ``train`` / ``eval`` / ``event``), tensorboard scalars (``train/loss``, ``hc/amax_gain_fwd``,
  ...), optional wandb, and the console lines; :func:`plot_losses` draws ``loss.png`` from the
  JSONL when matplotlib is importable.
- A resumed run appends to the same ``metrics.jsonl`` after a ``resume`` record (``step``: the
  checkpoint's step, ``checkpoint``: its path; ``rollback: true`` after a non-finite rollback).
  :func:`read_metrics` / :func:`dedupe_resumed` drop the records of the abandoned timeline (steps
  after the resume point written before it), so plots and collectors see each step once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["MetricsLogger", "dedupe_resumed", "format_duration", "model_flops_per_token", "peak_tflops", "plot_losses",
           "read_jsonl", "read_metrics"]

# Dense bf16 tensor-core peak per device, TFLOP/s (vendor data sheets, without sparsity).
GPU_PEAK_TFLOPS = (
    ("GB200", 2500.0), ("B200", 2250.0), ("B100", 1750.0), ("H200", 989.0), ("H100 PCIe", 756.0),
    ("H100", 989.0), ("H800", 989.0), ("GH200", 989.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0),
    ("L40", 181.0), ("A6000", 155.0), ("A10", 125.0), ("L4", 121.0), ("V100", 125.0),
)
CPU_NOMINAL_TFLOPS = 1.0


def peak_tflops(configured: Optional[float], cuda: bool) -> Tuple[float, str]:
    """(peak TFLOP/s per device, a note on where it came from)."""
    if configured:
        return float(configured), "logging.peak_tflops"
    if cuda:
        import torch

        name = torch.cuda.get_device_name()
        for key, value in GPU_PEAK_TFLOPS:
            if key in name:
                return value, f"{name} bf16 dense peak"
        return 989.0, f"unknown GPU {name!r}: assumed H100 bf16 peak; set logging.peak_tflops"
    return CPU_NOMINAL_TFLOPS, f"nominal {CPU_NOMINAL_TFLOPS:g} TFLOP/s per CPU process, not a measured peak"


def model_flops_per_token(preset, seq_length: int, vocab_size: int, convention: str = "megatron",
                          hc=None) -> Dict[str, float]:
    """``{"backbone", "hc", "total"}`` training FLOPs per token (forward + backward).

    ``hc``: the HCConfig actually used (default: the preset's).  The HC part is the documented F_HC =
    6·P_HC·L (§5.2); Sinkhorn iterations and element-wise mixing are not counted.  With multi-token
    prediction (backbone ``mtp_num_layers``) the depths are included (:func:`models.mtp.mtp_counts`)
    and ``"mtp"`` holds their share.
    """
    from models.zoo import backbone_shape
    from xhc.accounting import training_flops_per_token, vanilla_flops_per_token

    shape = dataclasses.replace(backbone_shape(preset), seq_len=int(seq_length), vocab=int(vocab_size))
    backbone = float(vanilla_flops_per_token(shape, convention))
    hc = hc if hc is not None else preset.hc
    f_hc = float(training_flops_per_token(hc, preset.hidden_size, preset.num_layers).f_hc) if hc.enabled else 0.0
    depths = int(preset.backbone.get("mtp_num_layers") or 0)
    if not depths:
        return {"backbone": backbone, "hc": f_hc, "total": backbone + f_hc}
    from models.mtp import mtp_counts  # multi-token prediction depths: their layers, maps and output GEMMs

    m = mtp_counts(shape, hc, depths, convention)
    backbone, f_hc = backbone + m["flops_backbone"], f_hc + m["flops_hc"]
    return {"backbone": backbone, "hc": f_hc, "total": backbone + f_hc,
            "mtp": m["flops_backbone"] + m["flops_hc"]}


def format_duration(seconds: float) -> str:
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def _si(x: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:.1f}"


def _scalar_items(prefix: str, d: Dict[str, Any]):
    """Flatten nested dicts and short lists into ``prefix/key`` scalars for tensorboard."""
    for k, v in d.items():
        key = f"{prefix}/{k}" if prefix else k
        if isinstance(v, dict):
            yield from _scalar_items(key, v)
        elif isinstance(v, (list, tuple)):
            if len(v) <= 64 and all(isinstance(x, (int, float)) for x in v):
                for i, x in enumerate(v):
                    yield f"{key}/{i}", float(x)
        elif isinstance(v, bool):
            yield key, float(v)
        elif isinstance(v, (int, float)) and math.isfinite(float(v)):
            yield key, float(v)


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # "nan" / "inf": JSON has no literal for them
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


class MetricsLogger:
    """Console + ``metrics.jsonl`` + tensorboard + optional wandb; inactive on ranks other than 0.

    Args:
        run_dir: where ``metrics.jsonl`` goes.
        enabled: this rank writes (rank 0).
        jsonl / tensorboard_dir / wandb: sinks (``tensorboard_dir=None`` disables tensorboard).
        print_fn: console output.
    """

    def __init__(self, run_dir: str, enabled: bool = True, jsonl: bool = True, tensorboard_dir: Optional[str] = None,
                 wandb: Optional[dict] = None, print_fn=print):
        self.enabled = enabled
        self.print = print_fn if enabled else (lambda *a, **k: None)
        self.jsonl_path = os.path.join(run_dir, "metrics.jsonl") if jsonl else None
        self.tensorboard_dir = tensorboard_dir
        self._jsonl = None
        self._tb = None
        self._wandb = None
        self.notes: List[str] = []
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if self.jsonl_path:
            self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(tensorboard_dir)
            except Exception as e:  # tensorboard missing or broken: keep training
                self.tensorboard_dir = None
                self.notes.append(f"tensorboard disabled ({type(e).__name__}: {e})")
        if wandb is not None:
            try:
                import wandb as _wandb
            except ImportError:
                self.notes.append("logging.wandb is true but wandb is not installed (pip install wandb): skipped")
            else:
                self._wandb = _wandb.init(**wandb)

    # ----------------------------------------------------------------------------------------
    def write(self, kind: str, step: int, metrics: Dict[str, Any]) -> None:
        """One record to the JSONL, tensorboard (``<kind>/<key>``, ``hc/...`` kept as is) and wandb."""
        if not self.enabled:
            return
        record = {"kind": kind, "step": int(step), "time": round(time.time(), 3), **metrics}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(_json_safe(record)) + "\n")
            self._jsonl.flush()
        scalars = {}
        for key, value in _scalar_items("", metrics):
            tag = key if key.startswith(("hc/", "hc_")) else f"{kind}/{key}"
            scalars[tag] = value
        if self._tb is not None:
            for tag, value in scalars.items():
                self._tb.add_scalar(tag, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def event(self, step: int, message: str, **fields: Any) -> None:
        """A notable event (skipped step, checkpoint, resume) to the console and the JSONL."""
        self.print(message)
        self.write("event", step, {"message": message, **fields})

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    # ----------------------------------------------------------------------------------------
    @staticmethod
    def train_line(step: int, total: int, m: Dict[str, Any], eta: Optional[float] = None) -> str:
        parts = [f"step {step:>{len(str(total))}}/{total}", f"loss {m['loss']:.4f}", f"lr {m['lr']:.2e}",
                 f"gnorm {m['grad_norm']:.3f}", f"{_si(m['tokens_per_s'])} tok/s"]
        if m.get("mfu") is not None:
            parts.append(f"MFU {100 * m['mfu']:.2f}%")
        parts.append(f"{m['step_time_s']:.2f} s/step")
        hc = m.get("hc") or {}
        if "h_res_identity_distance" in hc:
            parts.append(f"|H-I| {hc['h_res_identity_distance']:.3f}")
        if "amax_gain_fwd" in hc:
            parts.append(f"amax {hc['amax_gain_fwd']:.3f}/{hc['amax_gain_bwd']:.3f}")
        if "router_load_min" in hc:
            parts.append(f"load {hc['router_load_min']:.2f}-{hc['router_load_max']:.2f}")
        if m.get("skipped_steps"):
            parts.append(f"skipped {m['skipped_steps']}")
        if eta is not None:
            parts.append(f"eta {format_duration(eta)}")
        return " | ".join(parts)


def read_jsonl(path: str) -> List[dict]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                out.append(json.loads(line))
    return out


def dedupe_resumed(records: List[dict]) -> List[dict]:
    """The records of one consistent timeline: at each ``resume`` record (step ``s``), the earlier
    ``train`` / ``eval`` records of steps after ``s`` are dropped (they were replayed from step ``s``);
    then, per (kind, step), the last record wins.  Other kinds (events, resumes) are kept in order."""
    out: List[dict] = []
    for r in records:
        if r.get("kind") == "resume":
            s = r.get("step", 0)
            out = [x for x in out if x.get("kind") not in ("train", "eval") or x.get("step", 0) <= s]
        out.append(r)
    last = {}
    for i, r in enumerate(out):
        if r.get("kind") in ("train", "eval"):
            last[(r["kind"], r.get("step"))] = i
    return [r for i, r in enumerate(out)
            if r.get("kind") not in ("train", "eval") or last[(r["kind"], r.get("step"))] == i]


def read_metrics(path: str, kind: Optional[str] = None) -> List[dict]:
    """``metrics.jsonl`` de-duplicated across resumes (:func:`dedupe_resumed`), optionally one ``kind``."""
    records = dedupe_resumed(read_jsonl(path))
    return [r for r in records if kind is None or r.get("kind") == kind]


def plot_losses(jsonl_path: str, out_png: str, title: str = "") -> Optional[str]:
    """``loss.png``: training loss per step and validation loss per evaluation.

    Returns ``out_png``, or None (with nothing written) when matplotlib is not importable.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    records = read_metrics(jsonl_path)  # one record per step across resumes
    train, val = {}, {}
    for r in records:
        if r.get("kind") == "train" and isinstance(r.get("loss"), (int, float)):
            train[r["step"]] = r["loss"]
        elif r.get("kind") == "eval" and isinstance(r.get("loss"), (int, float)):
            val[r["step"]] = r["loss"]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    if train:
        xs = sorted(train)
        ax.plot(xs, [train[x] for x in xs], lw=1.0, label="train loss")
    if val:
        xs = sorted(val)
        ax.plot(xs, [val[x] for x in xs], "o-", lw=1.5, ms=4, label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title or os.path.basename(os.path.dirname(os.path.abspath(jsonl_path))))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return out_png
