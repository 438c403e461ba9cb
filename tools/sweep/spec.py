"""Sweep files: a grid of ordinary pre-training runs ("arms"), resolved and validated.

A sweep file (``configs/sweeps/*.yaml``)::

    name: tiny-cpu
    base: configs/pretrain/default-tiny.yaml   # the pre-training config every arm starts from
    out_dir: runs/sweeps/tiny-cpu               # arms go to <out_dir>/arms/<arm>, tables to <out_dir>/summary
    overrides: {run.eval_interval: 0}           # dotted keys for every arm
    grid:                                       # axes: variants, sizes, steps, seeds
      variants:                                 # name -> preset (+ n, k, m, hc, overrides)
        vanilla: {preset: tiny-moe:vanilla}
        mhc-n2: {preset: tiny-moe:mhc, n: 2}
      sizes: {base: {}}                         # name -> backbone overrides (hidden_size, num_layers, ...)
      steps: [40, 80, 160]                      # token budgets, in optimizer steps
      seeds: [1234]
    executor: {parallel: 1, nproc: 1, threads: 1, slurm: {nodes: 1, sbatch_args: []}}
    fit: {loss: valid, E: shared, baselines: [vanilla, mhc-n4], bootstrap: 200}

Every arm is one ``python -m training.pretrain`` run in its own ``run.dir`` (under ``torchrun`` when
``executor.nproc`` > 1), so checkpoints, ``checkpoint.load: auto`` resume, ``metrics.jsonl`` and
``status.json`` hold per arm.  :func:`load_sweep` resolves and validates every arm before anything
starts; :func:`run_local` skips finished arms and resumes the others; :func:`collect` reads the
arm directories into one table; :func:`fit_sweep` fits the laws of :mod:`tools.sweep.fit`.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from configs import resolve_config
from training.config import ConfigError, load_config, pad_vocab_size

__all__ = ["SweepError", "Arm", "Sweep", "load_sweep", "TOP_KEYS", "GRID_AXES"]

TOP_KEYS = ("name", "description", "base", "out_dir", "overrides", "grid", "executor", "fit")
GRID_AXES = ("variants", "sizes", "steps", "seeds")
VARIANT_KEYS = ("preset", "n", "k", "m", "hc", "overrides")
EXECUTOR_KEYS = ("parallel", "nproc", "threads", "slurm")
FIT_KEYS = ("loss", "E", "baselines", "bootstrap", "compute", "target_loss", "level", "seed", "tail_fraction")


class SweepError(ValueError):
    """A bad sweep file or sweep state; the message is one line naming the file and key."""


@dataclass
class Arm:
    """One pre-training run of the grid."""

    name: str
    variant: str
    size: str
    steps: int
    seed: int
    overrides: List[str]
    run_dir: str
    family: str = "vanilla"      # HC variant ("vanilla" for none)
    n: int = 1
    k: Optional[int] = None
    m: Optional[int] = None
    params_total: int = 0
    params_activated: int = 0
    params_hc: int = 0
    flops_per_token: float = 0.0
    tokens: int = 0
    nproc: int = 1

    @property
    def compute(self) -> float:
        return self.flops_per_token * self.tokens

    @property
    def cell(self) -> str:
        """The arm's name without its seed: the runs that differ only in ``run.seed``."""
        suffix = f"-seed{self.seed}"
        return self.name[: -len(suffix)] if self.name.endswith(suffix) else self.name

    def command(self, base: Optional[str], python: str = sys.executable, port: Optional[int] = None) -> List[str]:
        """The launch command of this arm (``torchrun`` when it asks for more than one rank)."""
        args = (["--config", base] if base else []) + self.overrides
        if self.nproc > 1:
            return [python, "-m", "torch.distributed.run", "--nproc_per_node", str(self.nproc),
                    "--master_port", str(port or _free_port()), "-m", "training.pretrain"] + args
        return [python, "-m", "training.pretrain"] + args


@dataclass
class Sweep:
    name: str
    path: str
    base: Optional[str]
    out_dir: str
    arms: List[Arm]
    executor: Dict[str, Any] = field(default_factory=dict)
    fit: Dict[str, Any] = field(default_factory=dict)
    flops_convention: str = "megatron"

    @property
    def summary_dir(self) -> str:
        return os.path.join(self.out_dir, "summary")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flatten(prefix: str, value: Any, out: List[str]) -> None:
    """``{a: {b: 1}}`` -> ``a.b=1`` (values as one-line YAML)."""
    import yaml

    if isinstance(value, dict) and not value and not prefix:
        return
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
        return
    text = yaml.safe_dump(value, default_flow_style=True, width=10 ** 6).strip()
    if text.endswith("\n..."):
        text = text[: -len("\n...")]
    text = text.removesuffix("...").strip()
    out.append(f"{prefix}={text}")


def _resolve_path(path: str, sweep_file: str) -> str:
    """The base pre-training config of a sweep file: as given if it exists, else a packaged one."""
    if os.path.isabs(path) or os.path.exists(path):
        return path
    return resolve_config(path, "pretrain")


def load_sweep(path: str, out_dir: Optional[str] = None, extra_overrides: Sequence[str] = ()) -> Sweep:
    """Read a sweep file and resolve + validate every arm (raises :class:`SweepError`, one line)."""
    import yaml

    from models.zoo import ZooError, load_preset
    from training.run import model_flops_per_token
    from xhc.accounting import backbone_params, hc_params_total
    from models.zoo import backbone_shape

    path = resolve_config(path, "sweeps")
    if not os.path.isfile(path):
        raise SweepError(f"sweep file {path}: not found (shipped sweeps live in configs/sweeps/)")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise SweepError(f"sweep file {path}: not valid YAML: {str(e).splitlines()[0]}") from None
    where = f"sweep file {path}"
    if not isinstance(raw, dict):
        raise SweepError(f"{where}: must hold a mapping with keys {', '.join(TOP_KEYS)}")
    for k in raw:
        if k not in TOP_KEYS:
            raise SweepError(f"{where}: unknown key {k!r}; known: {', '.join(TOP_KEYS)}")
    grid = raw.get("grid")
    if not isinstance(grid, dict) or not grid:
        raise SweepError(f"{where}: grid is missing or empty; give grid.variants and grid.steps")
    for k in grid:
        if k not in GRID_AXES:
            raise SweepError(f"{where}: unknown grid axis {k!r}; axes: {', '.join(GRID_AXES)}")
    variants = grid.get("variants")
    if not isinstance(variants, dict) or not variants:
        raise SweepError(f"{where}: grid.variants is empty; name at least one variant with its preset")
    sizes = grid.get("sizes") or {"base": {}}
    if not isinstance(sizes, dict):
        raise SweepError(f"{where}: grid.sizes must map a size name to backbone overrides, e.g. {{c96: {{hidden_size: 96}}}}")
    steps = grid.get("steps")
    if not isinstance(steps, list) or not steps or not all(isinstance(s, int) and s > 0 for s in steps):
        raise SweepError(f"{where}: grid.steps must be a non-empty list of positive step counts, got {steps!r}")
    seeds = grid.get("seeds") or [None]
    if not isinstance(seeds, list) or not all(s is None or isinstance(s, int) for s in seeds):
        raise SweepError(f"{where}: grid.seeds must be a list of integers, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise SweepError(f"{where}: grid.seeds {seeds!r} repeats a seed; list each run.seed once")
    executor = dict(raw.get("executor") or {})
    for k in executor:
        if k not in EXECUTOR_KEYS:
            raise SweepError(f"{where}: unknown executor key {k!r}; known: {', '.join(EXECUTOR_KEYS)}")
    fit = dict(raw.get("fit") or {})
    for k in fit:
        if k not in FIT_KEYS:
            raise SweepError(f"{where}: unknown fit key {k!r}; known: {', '.join(FIT_KEYS)}")
    nproc = int(executor.get("nproc", 1))
    base = raw.get("base")
    if base:
        base = os.path.abspath(_resolve_path(str(base), path))
        if not os.path.isfile(base):
            raise SweepError(f"{where}: base {raw['base']!r} not found (a configs/pretrain/*.yaml file, or null)")
    common: List[str] = []
    _flatten("", raw.get("overrides") or {}, common)
    common += list(extra_overrides)
    if executor.get("threads"):
        common.append(f"run.num_threads={int(executor['threads'])}")
    name = str(raw.get("name") or os.path.splitext(os.path.basename(path))[0])
    out = os.path.abspath(out_dir or raw.get("out_dir") or os.path.join("runs", "sweeps", name))

    arms: List[Arm] = []
    convention = None
    for vname, v in variants.items():
        if not isinstance(v, dict) or "preset" not in v:
            raise SweepError(f"{where}: grid.variants.{vname} needs a preset, e.g. {{preset: tiny-moe:xhc, n: 8}}")
        for k in v:
            if k not in VARIANT_KEYS:
                raise SweepError(f"{where}: grid.variants.{vname}: unknown key {k!r}; known: {', '.join(VARIANT_KEYS)}")
        hc = dict(v.get("hc") or {})
        for k in ("n", "k", "m"):
            if k in v:
                hc[k] = v[k]
        for sname, sv in sizes.items():
            if not isinstance(sv, dict):
                raise SweepError(f"{where}: grid.sizes.{sname} must map backbone keys to values")
            for st in steps:
                for seed in seeds:
                    arm_name = vname + (f"-{sname}" if len(sizes) > 1 else "") + f"-{st}st" + \
                        (f"-seed{seed}" if len(seeds) > 1 else "")
                    ov = [f"model.preset={v['preset']}"]
                    _flatten("model.hc", hc, ov) if hc else None
                    _flatten("model.backbone", sv, ov) if sv else None
                    ov += [*common, f"run.train_steps={st}"]
                    _flatten("", v.get("overrides") or {}, ov)
                    if seed is not None:
                        ov.append(f"run.seed={seed}")
                    run_dir = os.path.join(out, "arms", arm_name)
                    ov += [f"run.dir={run_dir}", f"run.name={arm_name}", "checkpoint.load=auto"]
                    label = f"{where}: arm {arm_name}"
                    try:
                        cfg = load_config(base, ov)
                        preset = load_preset(cfg.model.preset, backbone_overrides=cfg.model.backbone or None,
                                             hc_overrides=cfg.model.hc or None)
                    except (ConfigError, ZooError) as e:
                        raise SweepError(f"{label}: {e}") from None
                    if cfg.checkpoint.dir:
                        raise SweepError(f"{label}: checkpoint.dir must be unset in a sweep (each arm keeps its "
                                         "checkpoints in its run dir)")
                    t = cfg.tokenizer
                    vocab = t.padded_vocab_size or pad_vocab_size(t.vocab_size, t.make_vocab_size_divisible_by,
                                                                  cfg.parallel.tp)
                    seq = cfg.batch.seq_length or preset.seq_length
                    flops = model_flops_per_token(preset, seq, vocab, cfg.logging.flops_convention, preset.hc)
                    shape = dataclasses.replace(backbone_shape(preset), seq_len=int(seq), vocab=int(vocab))
                    bp = backbone_params(shape)
                    hcp = hc_params_total(preset.hc, preset.hidden_size, preset.num_layers).total \
                        if preset.hc.enabled else 0
                    h = preset.hc
                    arms.append(Arm(
                        name=arm_name, variant=vname, size=sname, steps=st, seed=cfg.run.seed, overrides=ov,
                        run_dir=run_dir, family="vanilla" if not h.enabled else h.variant,
                        n=h.n if h.enabled else 1, k=getattr(h, "k", None) if h.is_xhc else None,
                        m=getattr(h, "m", None) if h.is_xhc else None,
                        params_total=bp.total + hcp, params_activated=bp.activated + hcp, params_hc=hcp,
                        flops_per_token=flops["total"], tokens=st * cfg.batch.global_batch_size * seq, nproc=nproc))
                    convention = cfg.logging.flops_convention
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise SweepError(f"{where}: two arms have the same name; make variant and size names distinct")
    baselines = fit.get("baselines", ["vanilla"] if "vanilla" in variants else [])
    for b in baselines:
        if b not in variants:
            raise SweepError(f"{where}: fit.baselines names {b!r}, which is not a variant ({', '.join(variants)})")
    return Sweep(name=name, path=path, base=base, out_dir=out, arms=arms, executor=executor, fit=fit,
                 flops_convention=convention or "megatron")

