"""The pre-training configuration: nested dataclasses loaded from YAML plus ``key=value`` overrides.

One file describes a whole run::

    model:      preset (``configs/models/<file>.yaml:<variant>``), backbone / HC overrides, recompute
    parallel:   tp, sp, ep, pp, cp (and optional dp, checked against the world size)
    data:       Megatron data prefixes, blend weights, split; or ``mock``; nothing = the embedded default
    tokenizer:  SentencePiece ``.model`` / HF folder, or ``null`` ids; vocab size of the default/mock data
    optimizer:  :class:`training.optim.OptimizerConfig` (AdamW or Muon)
    schedule:   :class:`training.schedule.ScheduleConfig` (WSD, cosine, constant, step)
    batch:      micro batch, global batch, sequence length
    checkpoint: where, how often, how many to keep, what to load
    logging:    console interval, JSONL / tensorboard / wandb, HC health, MFU peak
    run:        run directory, seed, steps, evaluation, precision, guards

:func:`load_config` reads a YAML file (or none: the defaults below are the embedded CPU default
run), applies dotted overrides such as ``optimizer.lr=1e-3 parallel.tp=2`` (values parsed as
YAML), converts every value to its field's type and validates.  Every error is a
:class:`ConfigError` whose message starts with the full dotted key, e.g.
``config key batch.global_batch_size: 30 is not a multiple of micro_batch_size × dp = 8 × 2``.

Checks that need the world size or the model preset (divisibility of heads, experts, layers and
the batch by the parallel sizes) run in :func:`validate_runtime` once torch.distributed is up.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

from configs import config_dir, packaged_configs, resolve_config
from xhc.config import KERNEL_BACKENDS
from xhc.config_base import ConfigBase, ConfigKeyError, load, set_dotted, split_override, to_plain

__all__ = [
    "BatchConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataSection",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "PretrainConfig",
    "RunConfig",
    "TokenizerConfig",
    "config_reference",
    "config_to_dict",
    "from_dict",
    "load_config",
    "parse_overrides",
    "validate_runtime",
]

DEFAULT_CONFIG = str(config_dir("pretrain") / "default-tiny.yaml")  # package data (configs/)


class ConfigError(ValueError):
    """An invalid pre-training configuration; the message starts with ``config key <dotted.key>``."""


def _err(key: str, msg: str) -> ConfigError:
    return ConfigError(f"config key {key}: {msg}")


class _Section(ConfigBase):
    """The pre-training config's flavour of :class:`xhc.config_base.ConfigBase`: values are converted
    to their fields' types, every error is a :class:`ConfigError` starting ``config key <dotted.key>``."""

    config_error: ClassVar[type] = ConfigError
    key_format: ClassVar[str] = "config key {key}: {msg}"
    coerce_values: ClassVar[bool] = True


# ================================================================================================
# Sections
# ================================================================================================
@dataclass
class ModelConfig(_Section):
    preset: str = "tiny-moe:xhc"
    """Zoo preset ``<file>:<variant>`` (``python -m tools.zoo --list``) or ``path/to/file.yaml:<variant>``."""
    backbone: Dict[str, Any] = field(default_factory=dict)
    """Overrides of the preset's backbone (TransformerConfig fields and zoo keys), e.g. ``hidden_dropout``."""
    hc: Dict[str, Any] = field(default_factory=dict)
    """Overrides of the preset's :class:`~xhc.config.HCConfig` fields, e.g. ``gram_schmidt: false``."""
    recompute: str = "none"
    """Activation recomputation: ``none``, ``selective`` (core attention) or ``full`` (uniform, 1 layer)."""
    hc_kernels: Optional[str] = None
    """Kernel backend of the HC ops (``HCConfig.kernels``): ``auto`` (on CUDA the measured faster path
    per variant, today ``compile`` for every variant (fast with ``compile_hc: true``); compile on CPU;
    the training banner prints which path runs and why),
    ``eager``, ``compile``, ``triton``, or ``liger`` (Liger-Kernel's fused mHC coefficients, for
    ``variant: mhc`` with ``sinkhorn_order: col_last`` only); null: the preset's (default ``auto``).
    docs/kernels.md."""
    hc_recompute: Optional[bool] = None
    """HC recompute: keep only each sublayer's entry state and branch output for backward and
    recompute the HC coefficients (combinable with ``recompute: selective``); null: the preset's
    (zoo key ``hc_recompute``, default false)."""
    compile_hc: bool = False
    """Wrap every HC module's read/write in ``torch.compile`` (inductor; the backbone stays eager):
    the ``compile`` backend's fused ops then run as generated kernels.  Costs compilation time in the
    first steps; ``python -m bench.throughput --backends eager,compile`` measures what it gains."""
    use_transformer_engine: Optional[bool] = None
    """Transformer Engine layer spec (null: when importable on GPU; never on CPU)."""

    def hc_overrides(self) -> Optional[dict]:
        """``hc`` with ``hc_kernels`` folded in as ``kernels`` (for :func:`models.zoo.load_preset`)."""
        hc = dict(self.hc or {})
        if self.hc_kernels is not None:
            hc["kernels"] = self.hc_kernels
        return hc or None

    def backbone_overrides(self) -> Optional[dict]:
        """``backbone`` with ``hc_recompute`` folded in as the zoo key of the same name."""
        b = dict(self.backbone or {})
        if self.hc_recompute is not None:
            b["hc_recompute"] = self.hc_recompute
        return b or None


@dataclass
class ParallelConfig(_Section):
    tp: int = 1
    """Tensor-parallel size."""
    sp: bool = False
    """Sequence parallelism (needs tp > 1)."""
    ep: int = 1
    """Expert-parallel size (divides the number of experts)."""
    etp: Optional[int] = None
    """Expert tensor-parallel size (null: Megatron's default, = tp)."""
    pp: int = 1
    """Pipeline-parallel size (divides the number of layers)."""
    vpp: Optional[int] = None
    """Virtual pipeline stages per rank (interleaved 1F1B; GPU only)."""
    cp: int = 1
    """Context-parallel size (GPU with Transformer Engine only)."""
    dp: Optional[int] = None
    """Data-parallel size; null = world / (tp·pp·cp).  If set it must equal that."""
    overlap_grad_reduce: bool = False
    """GPU: overlap the DP gradient reduce-scatter with backward."""
    overlap_param_gather: bool = False
    """GPU: overlap the distributed optimizer's parameter all-gather with the next forward (AdamW with
    Megatron's distributed optimizer only: sharded Muon gathers its updates at the end of the step)."""
    grad_reduce_in_fp32: bool = True
    """GPU: the DDP main-grad buffer and the DP reduce in fp32 (Megatron DDP ``grad_reduce_in_fp32``); false:
    in bf16 (half the gradient bytes and reduce traffic)."""
    tp_comm_overlap: bool = False
    """GPU, TP > 1 with SP and Transformer Engine: overlap the TP all-gather / reduce-scatter with the GEMMs
    (TE userbuffers, Megatron's ``tp_comm_overlap``)."""
    ep_overlap: bool = False
    """GPU, EP > 1 with the ``alltoall`` or ``flex`` dispatcher: overlap the expert all-to-all of one micro-batch
    with the compute of another (Megatron's ``overlap_moe_expert_parallel_comm``, the 1F1B A2A overlap)."""


@dataclass
class DataSection(_Section):
    prefixes: Optional[List[str]] = None
    """Megatron data prefixes (``<prefix>.bin/.idx``, from ``python -m tools.preprocess_data``); blended."""
    weights: Optional[List[float]] = None
    """Blend weights, one per prefix (null: proportional to size)."""
    split: str = "969,30,1"
    """Train/valid/test proportions of each prefix's documents."""
    per_split: Optional[Dict[str, List[str]]] = None
    """Instead of prefixes + split: ``{train: [...], valid: [...], test: [...]}``."""
    mock: bool = False
    """Megatron's synthetic mock data (ids ``1, 2, 3, ...`` per document) instead of files."""
    default_dir: str = "data/default"
    """With no prefixes and no mock: build the embedded default corpus, tokenizer and dataset here."""
    default_target_mb: Optional[float] = None
    """Size of the default corpus in MB of text (null: the data pipeline's default, 3 MB)."""
    seed: int = 1234
    """Seed of the data itself, independent of ``run.seed``: the default corpus's document order and
    the tokenizer's line sampling (recorded in their ``.meta.json``), and the order of the validation
    samples, so every run seed is evaluated on the same validation batches."""
    cache_dir: Optional[str] = None
    """Megatron's sample-index cache (null: ``<run.dir>/data_cache``)."""
    reset_position_ids: bool = False
    """Position ids restart after every EOD (also resets the xHC temporal conv at document starts)."""
    reset_attention_mask: bool = False
    """Tokens do not attend across EOD (builds a [b, 1, s, s] mask per batch)."""
    eod_mask_loss: bool = False
    """No loss on EOD tokens."""


@dataclass
class TokenizerConfig(_Section):
    path: Optional[str] = None
    """SentencePiece ``.model`` file or HF tokenizer folder (null: the default data's tokenizer)."""
    type: Optional[str] = "auto"
    """``auto`` (from ``path``), ``sentencepiece``, ``huggingface`` or ``none`` (raw token ids < vocab_size,
    Megatron's NullTokenizer; YAML ``null`` means the same)."""
    vocab_size: int = 4096
    """Vocabulary of the default data's SentencePiece model, and of raw (``type: none``) / mock ids."""
    make_vocab_size_divisible_by: int = 128
    """The embedding is padded to a multiple of this × tp (Megatron's rule)."""
    padded_vocab_size: Optional[int] = None
    """Exact embedding rows instead (e.g. 152064 for Qwen2, as in the paper); >= the tokenizer's, divisible by tp."""


@dataclass
class BatchConfig(_Section):
    micro_batch_size: int = 8
    """Sequences per micro-batch per data-parallel rank."""
    global_batch_size: int = 16
    """Sequences per optimizer step: micro_batch_size × dp × gradient-accumulation steps."""
    seq_length: Optional[int] = None
    """Tokens per sequence (null: the preset's seq_length)."""


@dataclass
class CheckpointConfig(_Section):
    dir: Optional[str] = None
    """Checkpoint root (null: ``<run.dir>/checkpoints``); on a multi-node run a shared filesystem."""
    interval: Optional[int] = 100
    """Save every K steps (null or 0: only at the end / on a signal)."""
    keep_last: int = 2
    """Keep the newest K checkpoints; older ones are deleted after a successful save."""
    load: Optional[str] = "auto"
    """``auto``: resume from the newest checkpoint under ``dir`` if any; ``none``; or a checkpoint path."""
    load_optimizer: bool = True
    """Restore optimizer and scheduler state (false: fresh optimizer on loaded weights)."""
    load_rng: bool = True
    """Restore python/numpy/torch and Megatron RNG-tracker states (per rank: on a changed layout they
    are reseeded instead, see ``reshard``)."""
    reshard: str = "auto"
    """A checkpoint saved on another parallel layout (world size, tp, pp, ep, cp, vpp): ``auto``
    resumes on this one (weights, optimizer state, scheduler and data position are carried over; the
    RNG streams are reseeded; losses continue within floating-point tolerance) with one log line
    naming both layouts; ``never`` refuses it (exactness guaranteed: relaunch with the saved layout)."""
    save_final: bool = True
    """Save when training finishes."""
    save_on_signal: bool = True
    """On SIGTERM (SLURM preemption, torchrun shutdown) or SIGUSR1: save at the next step boundary, exit 0."""
    async_save: bool = False
    """Write checkpoints in the background.  The step that saves only plans the save and snapshots
    the state (pinned host memory on GPU, a copy on CPU); a thread writes the files while training
    goes on, and the checkpoint becomes ``step_*`` (manifest, verification, pruning) only once every
    rank's write has finished.  At most one save is in flight: the next save, a stop and the end of
    training wait for it.  Off by default: on CPU the writer competes with training for the same
    cores, and on GPU it has not been measured yet (docs/reliability.md, "Asynchronous saves")."""
    checksum: str = "auto"
    """Manifest hashes: ``all`` files, ``metadata`` only, ``none`` (sizes only), ``auto`` (all below 2 GiB)."""
    optimizer_sharding: str = "dp_reshardable"
    """How Megatron's distributed optimizer (GPU AdamW) lays out its state in a checkpoint, as
    Megatron-LM: ``dp_reshardable`` (every rank writes its own shard, no gathering; the DP size may
    change) or ``fully_reshardable`` (gathered on DP rank 0 at save; any TP/PP/DP layout may load it).
    A checkpoint is always loaded in the layout it was saved with (its manifest records it)."""


@dataclass
class LoggingConfig(_Section):
    interval: int = 10
    """Console line every K steps (the JSONL and tensorboard get every step)."""
    jsonl: bool = True
    """``<run.dir>/metrics.jsonl``: one JSON object per step / evaluation."""
    tensorboard: bool = True
    """``<run.dir>/tensorboard`` event files."""
    wandb: bool = False
    """Weights & Biases (only if ``wandb`` is installed)."""
    wandb_project: str = "xhc"
    """Weights & Biases project."""
    wandb_entity: Optional[str] = None
    """Weights & Biases entity (team or user; null: your default)."""
    hc_health_interval: Optional[int] = None
    """Record hyper-connection health (H_res distance from I, router load, Amax gain) every K steps
    (0: off; null: every ``interval`` steps).  Other steps do no health work and no host syncs."""
    sample_ids: bool = False
    """Write the global sample indices of every step (gathered over all ranks) into its
    ``metrics.jsonl`` record as ``sample_ids``: to check the data order, e.g. that a resume on another
    layout reads the samples the uninterrupted run would have read (one gather per step)."""

    @property
    def hc_health_every(self) -> int:
        """The resolved health interval (0: off)."""
        return self.interval if self.hc_health_interval is None else self.hc_health_interval
    peak_tflops: Optional[float] = None
    """Peak dense TFLOP/s per device for MFU (null: bf16 tensor-core peak of known GPUs; 1.0 nominal on CPU)."""
    flops_convention: str = "megatron"
    """Backbone FLOPs convention for MFU (:data:`xhc.accounting.FLOPS_CONVENTIONS`)."""
    plot: bool = True
    """Save ``loss.png`` at the end (needs matplotlib; skipped with a note otherwise)."""


@dataclass
class RunConfig(_Section):
    name: Optional[str] = None
    """Run name (null: the preset name, ``:`` replaced by ``-``)."""
    dir: Optional[str] = None
    """Run directory (null: ``runs/<name>-<timestamp>``).  Reuse one to resume."""
    seed: int = 1234
    """Seed of the initialisation, dropout and training-data order only (Megatron's: + 100 × pipeline
    rank); the data and the validation set follow ``data.seed``."""
    train_steps: int = 300
    """Optimizer steps (global batches)."""
    eval_interval: int = 50
    """Validation every K steps, at the start of a fresh run and at the end (0: only at the end)."""
    eval_iters: int = 4
    """Global batches of validation data per evaluation (0: no validation)."""
    device: str = "auto"
    """``auto`` (cuda if available), ``cuda`` or ``cpu``."""
    precision: str = "auto"
    """``auto`` (bf16 on GPU, fp32 on CPU), ``bf16`` (GPU), ``fp32``."""
    max_skipped_steps: int = 10
    """Abort after this many steps skipped for a non-finite loss or gradient."""
    on_nonfinite: str = "abort"
    """Non-finite parameters or validation loss (checked before every save, and on a non-finite loss):
    ``abort`` (exit 3, nothing saved, the last good checkpoint kept) or ``rollback`` (reload the last good
    checkpoint and skip the data window since it; at most ``run.max_rollbacks`` times)."""
    max_rollbacks: int = 3
    """Rollbacks allowed per process with ``run.on_nonfinite=rollback`` before aborting."""
    num_threads: Optional[int] = None
    """CPU: torch intra-op threads per process (null: torch's default; torchrun sets OMP_NUM_THREADS)."""
    exit_at_step: Optional[int] = None
    """Save a checkpoint and exit after this step (a planned interruption)."""
    exit_after_minutes: Optional[float] = None
    """Save a checkpoint and exit once this much wall time has passed (e.g. before a SLURM time limit)."""
    dist_timeout_minutes: float = 30.0
    """Timeout of every collective."""


@dataclass
class ReliabilityConfig(_Section):
    watchdog: bool = True
    """A watchdog thread per rank: a section (start-up, data, forward-backward, gradient sync, optimizer, save or
    load, evaluation) that makes no progress for its timeout ends the run with exit status 86 (retryable), the
    hung rank's stacks in ``<run.dir>/hangs/`` and the verdict in ``status.json`` (docs/reliability.md, "Hangs")."""
    startup_timeout_s: float = 900.0
    """Timeout of the start-up (and of the first ``timeout_warmup_steps`` steps and the end of the run)."""
    step_timeout_s: Optional[float] = None
    """Timeout of each section of a training step once warmed up (null: ``step_timeout_factor`` times the median
    step time of the warm-up steps, at least ``min_step_timeout_s``)."""
    step_timeout_factor: float = 20.0
    """The automatic step timeout in median step times."""
    min_step_timeout_s: float = 120.0
    """The automatic step timeout is at least this long."""
    checkpoint_timeout_s: float = 1800.0
    """Timeout of a checkpoint save (and of a load, unless ``load_timeout_s`` is set)."""
    load_timeout_s: Optional[float] = None
    """Timeout of a checkpoint load (null: ``checkpoint_timeout_s``)."""
    eval_timeout_s: Optional[float] = None
    """Timeout of an evaluation (null: the step timeout times ``run.eval_iters``)."""
    timeout_warmup_steps: int = 5
    """Steps timed under ``startup_timeout_s`` before the step timeout applies (their median, the first step left
    out, sets the automatic one)."""
    straggler_interval: int = 100
    """Every K steps the ranks share their step and section times (one small all-reduce) and ``metrics.jsonl`` gets a
    ``straggler`` record (0: off)."""
    straggler_threshold: float = 1.5
    """A rank whose own work per step (data + forward/backward + optimizer) is this many times the median over ranks
    is named in the log and the record."""


def _optimizer_default():
    from training.optim import OptimizerConfig

    return OptimizerConfig(name="adamw", lr=3e-3, min_lr=None, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-15,
                           clip_grad=1.0)


def _schedule_default():
    from training.schedule import ScheduleConfig

    # total_steps follows run.train_steps unless a config sets it (see load_config)
    return ScheduleConfig(kind="wsd", warmup_steps=20, total_steps=RunConfig.train_steps, decay_fraction=0.2)


@dataclass
class PretrainConfig(_Section):
    """Everything about one pre-training run.  Defaults = the embedded CPU default run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataSection = field(default_factory=DataSection)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    optimizer: Any = field(default_factory=_optimizer_default)
    schedule: Any = field(default_factory=_schedule_default)
    batch: BatchConfig = field(default_factory=BatchConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run: RunConfig = field(default_factory=RunConfig)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)

    # ---- derived helpers ----------------------------------------------------------------------
    @property
    def uses_default_data(self) -> bool:
        d = self.data
        return not d.mock and not d.prefixes and not d.per_split


SECTION_TYPES = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "data": DataSection,
    "tokenizer": TokenizerConfig,
    "optimizer": None,  # training.optim.OptimizerConfig (imported lazily)
    "schedule": None,  # training.schedule.ScheduleConfig
    "batch": BatchConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "run": RunConfig,
    "reliability": ReliabilityConfig,
}


def _section_type(name: str):
    if name == "optimizer":
        from training.optim import OptimizerConfig

        return OptimizerConfig
    if name == "schedule":
        from training.schedule import ScheduleConfig

        return ScheduleConfig
    return SECTION_TYPES[name]


# ================================================================================================
# Typed loading: xhc.config_base (one strict loader for every config dataclass)
# ================================================================================================
def from_dict(cls, data: Optional[dict], prefix: str = "", base: Any = None):
    """An instance of dataclass ``cls`` from ``data``; unknown keys raise naming ``prefix.key``.

    Fields missing from ``data`` keep ``base``'s values (default: ``cls()``'s).  Sections load from
    nested mappings (:func:`xhc.config_base.load`); values are converted to their fields' types.
    """
    return load(cls, data, prefix, base=base, root=cls if issubclass(cls, _Section) else PretrainConfig)


config_to_dict = to_plain  # plain nested dict (YAML/JSON-safe) of a config dataclass


# ================================================================================================
# Loading
# ================================================================================================
def parse_overrides(items: Sequence[str], example: str = "optimizer.lr=1e-3", error: type = ConfigError,
                    strict: bool = False) -> List[Tuple[str, Any]]:
    """``["optimizer.lr=1e-3", "parallel.tp=2"]`` -> ``[("optimizer.lr", 0.001), ("parallel.tp", 2)]``.

    The one parser of ``section.key=value`` overrides (pre-training and finetuning): values are YAML;
    one that is not valid YAML is kept as text, or with ``strict`` is an ``error``.  ``example`` is
    the override the error messages show."""
    import yaml

    out = []
    for item in items:
        try:
            key, text = split_override(item, example=example)
        except ValueError as e:
            raise error(str(e)) from None
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            if strict:
                raise error(f"override {item!r}: the value is not valid YAML") from None
            value = text
        out.append((key, value))
    return out


def _apply_override(raw: dict, key: str, value: Any) -> None:
    try:
        set_dotted(raw, key, value, sections=list(SECTION_TYPES))
    except ConfigKeyError as e:
        raise _err(e.key, e.msg) from None


def read_yaml(path: str) -> dict:
    import yaml

    path = resolve_config(path, "pretrain")
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: file not found; give a YAML path or a packaged config: "
                          f"{', '.join(packaged_configs('pretrain'))}")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: must hold a mapping of sections ({', '.join(SECTION_TYPES)})")
    return data


def _scale_default_warmup(schedule) -> List[str]:
    """Scale the built-in warmup with the run length (the user set neither): one log line, or none."""
    from training.schedule import scaled_warmup

    ref = _schedule_default()
    if schedule.total_steps == ref.total_steps or schedule.kind == "constant":
        return []
    w = scaled_warmup(schedule, ref.warmup_steps, ref.total_steps)
    if w == schedule.warmup_steps:
        return []
    schedule.warmup_steps = w
    return [f"schedule.warmup_steps not set: scaled with the run length to {w} "
            f"({ref.warmup_steps} per {ref.total_steps} steps; set schedule.warmup_steps to choose)"]


def load_config(path: Optional[str] = None, overrides: Sequence[str] = (), validate: bool = True) -> PretrainConfig:
    """The config of ``path`` (None: the built-in default run) with ``overrides``, validated."""
    raw = read_yaml(path) if path else {}
    for key, value in parse_overrides(overrides):
        _apply_override(raw, key, value)
    for sec in raw:
        if sec not in SECTION_TYPES:
            raise _err(str(sec), f"unknown section; sections: {', '.join(SECTION_TYPES)}")
    cfg = from_dict(PretrainConfig, raw)
    notes: List[str] = []
    sched_raw = raw.get("schedule") or {}
    if "total_steps" not in sched_raw:
        cfg.schedule.total_steps = cfg.run.train_steps  # the schedule spans the run unless told otherwise
        if "warmup_steps" not in sched_raw:
            notes += _scale_default_warmup(cfg.schedule)
    cfg.__dict__["notes"] = notes  # log lines for the trainer; not a config key
    if validate:
        validate_config(cfg)
    return cfg


# ================================================================================================
# Validation (static: no world size, no model)
# ================================================================================================
def _choice(key: str, value: Any, allowed: Sequence[Any]) -> None:
    if value not in allowed:
        raise _err(key, f"{value!r} is not one of {', '.join(map(str, allowed))}")


def _positive(key: str, value: Optional[float], allow_none: bool = False, allow_zero: bool = False) -> None:
    if value is None:
        if allow_none:
            return
        raise _err(key, "must be set")
    if value < 0 or (value == 0 and not allow_zero):
        raise _err(key, f"{value!r} must be {'>= 0' if allow_zero else '> 0'}")


def validate_config(cfg: PretrainConfig) -> None:
    """Checks that need neither the world size nor the model.  Raises :class:`ConfigError`."""
    m, p, d, t, b, c, lg, r = (cfg.model, cfg.parallel, cfg.data, cfg.tokenizer, cfg.batch, cfg.checkpoint,
                               cfg.logging, cfg.run)
    # ---- model
    if ":" not in m.preset:
        raise _err("model.preset", f"{m.preset!r} must be '<file>:<variant>', e.g. tiny-moe:xhc "
                   "(list them with `python -m tools.zoo --list`)")
    _choice("model.recompute", m.recompute, ("none", "selective", "full"))
    if m.hc_kernels is not None:
        _choice("model.hc_kernels", m.hc_kernels, KERNEL_BACKENDS)
    if not isinstance(m.compile_hc, bool):
        raise _err("model.compile_hc", f"{m.compile_hc!r} must be true or false")
    if m.hc_recompute is not None and not isinstance(m.hc_recompute, bool):
        raise _err("model.hc_recompute", f"{m.hc_recompute!r} must be true or false")
    # multi-token prediction (models/mtp.py): Megatron's TransformerConfig names, given as backbone overrides
    depths = (m.backbone or {}).get("mtp_num_layers")
    if depths is not None and (isinstance(depths, bool) or not isinstance(depths, int) or depths < 1):
        raise _err("model.backbone.mtp_num_layers", f"{depths!r} must be an integer >= 1 (the MTP depths), or "
                   "null for no multi-token prediction")
    lam = (m.backbone or {}).get("mtp_loss_scaling_factor")
    if lam is not None and (isinstance(lam, bool) or not isinstance(lam, (int, float)) or not lam >= 0):
        raise _err("model.backbone.mtp_loss_scaling_factor", f"{lam!r} must be a number >= 0 (the weight λ of "
                   "the MTP losses: loss = main + λ/D · Σ depth losses)")
    if m.hc:
        from xhc.config import HCConfig

        names = {f.name for f in dataclasses.fields(HCConfig)}
        for k in m.hc:
            if k not in names:
                raise _err(f"model.hc.{k}", f"unknown HCConfig field; known: {', '.join(sorted(names))}")
    # ---- parallel
    for name in ("tp", "ep", "pp", "cp"):
        _positive(f"parallel.{name}", getattr(p, name))
    _positive("parallel.etp", p.etp, allow_none=True)
    _positive("parallel.dp", p.dp, allow_none=True)
    if p.sp and p.tp == 1:
        raise _err("parallel.sp", "sequence parallelism needs parallel.tp > 1 (set sp: false or tp >= 2)")
    if p.tp_comm_overlap and not (p.tp > 1 and p.sp and cfg.model.use_transformer_engine is not False):
        raise _err("parallel.tp_comm_overlap", "true needs parallel.tp > 1, parallel.sp: true and Transformer Engine "
                   "(model.use_transformer_engine not false): set parallel.tp_comm_overlap=false")
    if p.ep_overlap and (p.ep == 1 or (p.pp > 1 and not p.vpp) or cfg.model.recompute == "full"):
        raise _err("parallel.ep_overlap", "true needs parallel.ep > 1, parallel.vpp when parallel.pp > 1, and no "
                   "full recompute (Megatron's overlap_moe_expert_parallel_comm): set parallel.ep_overlap=false")
    if p.vpp is not None:
        _positive("parallel.vpp", p.vpp)
        if p.pp == 1:
            raise _err("parallel.vpp", "virtual pipeline stages need parallel.pp > 1")
    # ---- data / tokenizer
    if d.mock and (d.prefixes or d.per_split):
        raise _err("data.mock", "mock data and data.prefixes/per_split are exclusive; drop one")
    if d.prefixes and d.per_split:
        raise _err("data.per_split", "give either data.prefixes (+ split) or data.per_split, not both")
    if d.weights is not None:
        if not d.prefixes:
            raise _err("data.weights", "blend weights need data.prefixes")
        if len(d.weights) != len(d.prefixes):
            raise _err("data.weights", f"{len(d.weights)} weights for {len(d.prefixes)} prefixes; give one per prefix")
        if any(w < 0 for w in d.weights) or sum(d.weights) <= 0:
            raise _err("data.weights", f"{d.weights} must be >= 0 with a positive sum")
    try:
        from training.data import parse_split

        parse_split(d.split)
    except ValueError as e:
        raise _err("data.split", str(e)) from None
    if d.per_split is not None:
        bad = sorted(set(d.per_split) - {"train", "valid", "test"})
        if bad:
            raise _err("data.per_split", f"keys {bad} are not splits; use train, valid, test")
    _positive("data.default_target_mb", d.default_target_mb, allow_none=True)
    if t.type is None:
        t.type = "none"
    _choice("tokenizer.type", t.type, ("auto", "sentencepiece", "huggingface", "none"))
    _positive("tokenizer.vocab_size", t.vocab_size)
    if t.vocab_size < 2:
        raise _err("tokenizer.vocab_size", f"{t.vocab_size} must be >= 2")
    _positive("tokenizer.make_vocab_size_divisible_by", t.make_vocab_size_divisible_by)
    _positive("tokenizer.padded_vocab_size", t.padded_vocab_size, allow_none=True)
    if t.padded_vocab_size is not None and t.padded_vocab_size % p.tp:
        raise _err("tokenizer.padded_vocab_size", f"{t.padded_vocab_size} is not divisible by parallel.tp={p.tp}")
    if t.type == "none" and not (d.mock or d.prefixes or d.per_split):
        raise _err("tokenizer.type", "raw ids (none) need data.mock or data.prefixes (the default data has its own "
                   "tokenizer)")
    if t.type in ("sentencepiece", "huggingface") and not t.path and not cfg.uses_default_data:
        raise _err("tokenizer.path", f"tokenizer.type={t.type} needs tokenizer.path")
    if (d.prefixes or d.per_split) and not t.path and t.type != "none":
        raise _err("tokenizer.path", "data.prefixes need the tokenizer they were made with (tokenizer.path), "
                   "or tokenizer.type: none for raw ids")
    # ---- batch
    _positive("batch.micro_batch_size", b.micro_batch_size)
    _positive("batch.global_batch_size", b.global_batch_size)
    _positive("batch.seq_length", b.seq_length, allow_none=True)
    if b.global_batch_size % b.micro_batch_size:
        raise _err("batch.global_batch_size", f"{b.global_batch_size} is not a multiple of batch.micro_batch_size="
                   f"{b.micro_batch_size}")
    # ---- checkpoint
    _positive("checkpoint.interval", c.interval, allow_none=True, allow_zero=True)
    _positive("checkpoint.keep_last", c.keep_last)
    _choice("checkpoint.checksum", c.checksum, ("auto", "all", "metadata", "none"))
    _choice("checkpoint.optimizer_sharding", c.optimizer_sharding, ("dp_reshardable", "fully_reshardable"))
    _choice("checkpoint.reshard", c.reshard, ("auto", "never"))
    if c.load is not None and c.load not in ("auto", "none") and not os.path.exists(c.load):
        raise _err("checkpoint.load", f"{c.load!r} does not exist; use auto, none, or a checkpoint directory")
    # ---- logging
    _positive("logging.interval", lg.interval)
    _positive("logging.hc_health_interval", lg.hc_health_interval, allow_zero=True, allow_none=True)
    _positive("logging.peak_tflops", lg.peak_tflops, allow_none=True)
    from xhc.accounting import FLOPS_CONVENTIONS

    _choice("logging.flops_convention", lg.flops_convention, tuple(FLOPS_CONVENTIONS))
    # ---- run
    _positive("run.train_steps", r.train_steps)
    _positive("run.eval_interval", r.eval_interval, allow_zero=True)
    _positive("run.eval_iters", r.eval_iters, allow_zero=True)
    _choice("run.device", r.device, ("auto", "cuda", "cpu"))
    _choice("run.precision", r.precision, ("auto", "bf16", "fp32"))
    _positive("run.max_skipped_steps", r.max_skipped_steps, allow_zero=True)
    _choice("run.on_nonfinite", r.on_nonfinite, ("abort", "rollback"))
    _positive("run.max_rollbacks", r.max_rollbacks, allow_zero=True)
    _positive("run.num_threads", r.num_threads, allow_none=True)
    _positive("run.exit_at_step", r.exit_at_step, allow_none=True)
    _positive("run.exit_after_minutes", r.exit_after_minutes, allow_none=True)
    _positive("run.dist_timeout_minutes", r.dist_timeout_minutes)
    rl = cfg.reliability  # the watchdog and the straggler report (docs/reliability.md, "Hangs")
    for key in ("startup_timeout_s", "step_timeout_factor", "min_step_timeout_s", "checkpoint_timeout_s",
                "straggler_threshold"):
        _positive(f"reliability.{key}", getattr(rl, key))
    _positive("reliability.step_timeout_s", rl.step_timeout_s, allow_none=True)
    _positive("reliability.eval_timeout_s", rl.eval_timeout_s, allow_none=True)
    _positive("reliability.load_timeout_s", rl.load_timeout_s, allow_none=True)
    _positive("reliability.timeout_warmup_steps", rl.timeout_warmup_steps, allow_zero=True)
    _positive("reliability.straggler_interval", rl.straggler_interval, allow_zero=True)
    if r.name is not None and (not r.name or "/" in r.name):
        raise _err("run.name", f"{r.name!r} must be a non-empty name without '/'")
    # ---- optimizer / schedule: their own validation, re-labelled with the section
    for sec in ("optimizer", "schedule"):
        obj = getattr(cfg, sec)
        check = getattr(obj, "validate", None)
        if callable(check):
            try:
                check()
            except ValueError as e:
                msg = str(e)
                if msg.startswith("config key"):
                    raise ConfigError(msg) from None
                raise ConfigError(f"config key {msg}" if msg.startswith(f"{sec}.") else f"config key {sec}: {msg}") from None
    o = cfg.optimizer
    if p.overlap_param_gather and (getattr(o, "name", "adamw") != "adamw"
                                   or getattr(o, "use_distributed_optimizer", None) is False):
        why = ("sharded Muon all-gathers the updated parameters at the end of its step"
               if getattr(o, "name", "adamw") != "adamw" else "optimizer.use_distributed_optimizer is false")
        raise _err("parallel.overlap_param_gather", "true needs Megatron's distributed optimizer (AdamW) and "
                   f"{why}: set parallel.overlap_param_gather=false")


# ================================================================================================
# Validation against the world and the model
# ================================================================================================
def validate_runtime(cfg: PretrainConfig, world_size: int, preset=None, cuda: Optional[bool] = None) -> int:
    """Checks against the world size, the device and the model preset.  Returns the DP size."""
    p, b = cfg.parallel, cfg.batch
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if cfg.run.device == "cuda" and not cuda:
        raise _err("run.device", "cuda requested but torch.cuda.is_available() is False (use auto or cpu)")
    gpu = cuda and cfg.run.device != "cpu"
    if cfg.run.device == "cpu" and cuda:
        raise _err("run.device", "cpu on a machine with CUDA is not supported (Megatron then expects CUDA); "
                   "hide the GPUs with CUDA_VISIBLE_DEVICES=''")
    if not gpu:
        if cfg.run.precision == "bf16":
            raise _err("run.precision", "bf16 needs CUDA (CPU runs train in fp32); use auto or fp32")
        if p.cp > 1:
            raise _err("parallel.cp", "context parallelism needs CUDA and Transformer Engine attention")
        if p.vpp is not None:
            raise _err("parallel.vpp", "the interleaved pipeline schedule needs CUDA (CPU pipelines run GPipe)")
        for key in ("tp_comm_overlap", "ep_overlap"):
            if getattr(p, key):
                raise _err(f"parallel.{key}", "the overlap needs CUDA (TE userbuffers / CUDA streams): set it false")
    model_par = p.tp * p.pp * p.cp
    if world_size % model_par:
        raise _err("parallel", f"world size {world_size} is not divisible by tp·pp·cp = {p.tp}·{p.pp}·{p.cp}")
    dp = world_size // model_par
    if p.dp is not None and p.dp != dp:
        raise _err("parallel.dp", f"{p.dp} but world size {world_size} / (tp·pp·cp = {model_par}) = {dp}")
    etp = p.etp or p.tp
    if (world_size // p.pp) % (p.ep * etp):
        raise _err("parallel.ep", f"ep·etp = {p.ep}·{etp} must divide the {world_size // p.pp} ranks of a pipeline stage")
    per_step = b.micro_batch_size * dp
    if b.global_batch_size % per_step:
        raise _err("batch.global_batch_size", f"{b.global_batch_size} is not a multiple of micro_batch_size × dp = "
                   f"{b.micro_batch_size} × {dp}")
    if preset is not None:
        bb = preset.backbone
        seq = b.seq_length or preset.seq_length
        L = preset.num_layers
        if L % p.pp:
            raise _err("parallel.pp", f"{p.pp} does not divide the preset's {L} layers")
        if p.vpp and (L // p.pp) % p.vpp:
            raise _err("parallel.vpp", f"{p.vpp} does not divide the {L // p.pp} layers per pipeline stage")
        heads = int(bb["num_attention_heads"])
        groups = int(bb.get("num_query_groups") or heads)
        if heads % p.tp or groups % p.tp:
            raise _err("parallel.tp", f"{p.tp} must divide num_attention_heads={heads} and num_query_groups={groups}")
        experts = int(bb.get("num_moe_experts") or 0)
        if experts and experts % p.ep:
            raise _err("parallel.ep", f"{p.ep} does not divide num_moe_experts={experts}")
        if not experts and p.ep > 1:
            raise _err("parallel.ep", f"{p.ep} > 1 but the preset has no experts")
        dispatcher = bb.get("moe_token_dispatcher_type") or "allgather"
        if p.ep_overlap and dispatcher not in ("alltoall", "flex"):
            raise _err("parallel.ep_overlap", f"true needs the alltoall or flex dispatcher, the preset has "
                       f"moe_token_dispatcher_type={dispatcher!r}: set parallel.ep_overlap=false")
        div = p.cp * (p.tp if p.sp else 1) * (2 if p.cp > 1 else 1)
        if seq % div:
            raise _err("batch.seq_length", f"{seq} is not divisible by {div} (cp{'·tp' if p.sp else ''}"
                       f"{'·2' if p.cp > 1 else ''} for sequence/context parallelism)")
        hc = preset.hc
        if hc.variant == "xhc_flash4" and p.pp > 1 and (L // p.pp) % 2:
            raise _err("parallel.pp", f"xHC-Flash-4sub windows span two layers; {L // p.pp} layers per stage is odd")
        if p.pp > 1 and p.vpp and hc.enabled and hc.n > 1:
            pass  # the interleaved schedule exchanges shapes (variable_seq_lengths), see models.pipeline
    return dp


def pad_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary: the next multiple of ``divisible_by · tp``."""
    mult = divisible_by * tp
    return int(math.ceil(vocab / mult) * mult)


# ================================================================================================
# Reference (``python -m training.pretrain --help-config``; the README's table)
# ================================================================================================
def _field_docs(cls) -> Dict[str, str]:
    """Attribute docstrings (the string literal under each field) of a dataclass, from its source."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant) \
                    and isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def config_reference(markdown: bool = True) -> str:
    """Every key with its default and description, section by section."""
    cfg = PretrainConfig()
    out = []
    for sec in SECTION_TYPES:
        cls = _section_type(sec)
        obj = getattr(cfg, sec)
        docs = _field_docs(cls)
        out.append(f"### `{sec}`" if markdown else f"[{sec}]")
        if markdown:
            out += ["", "| key | default | meaning |", "|---|---|---|"]
        for f in dataclasses.fields(cls):
            default = getattr(obj, f.name)
            if isinstance(default, tuple):
                default = list(default)
            text = docs.get(f.name, "")
            if markdown:
                text = re.sub(r":\w+:`~?(?:[\w.]+\.)?([\w]+)`", r"`\1`", text).replace("``", "`")
                out.append(f"| `{sec}.{f.name}` | `{default!r}` | {text.replace('|', '/')} |")
            else:
                out.append(f"  {sec}.{f.name} = {default!r}" + (f"\n      {text}" if text else ""))
        out.append("")
    return "\n".join(out)
