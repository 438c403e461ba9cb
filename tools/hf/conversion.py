"""Megatron ``dist_checkpointing`` checkpoints of the zoo <-> Hugging Face folders: the body of
``xhc-convert`` (:mod:`tools.convert_checkpoint`).  It reads and writes training checkpoints, so it
lives on the tools floor; the Hugging Face model code it writes (the parameter mapping, the remote
code) stays in :mod:`models.hf.export`.

``to_hf``: reads a checkpoint saved under any TP / SP / EP / PP / VPP layout by loading it,
through Megatron's ``dist_checkpointing.load`` (which reshards), into the sharded state dict of a
single-rank (TP = EP = PP = 1) model built on the ``meta`` device.  It streams: one group of
tensors at a time (the embedding, each decoder layer, the final norm + LM head) is materialised,
converted (:mod:`models.hf.export.mapping`) and appended to the current output shard, so memory
holds at most one layer's tensors plus one shard.

``from_hf``: the reverse, into a ``dist_checkpointing`` checkpoint (``training.checkpoint``
layout, with manifest) of the single-rank model.  ``dist_checkpointing`` checkpoints carry global
shapes, so training resumes from it under any TP / EP / PP (``checkpoint.load_optimizer=false
checkpoint.load_rng=false``).  With ``to_variant`` a vanilla model is *upcycled*: the backbone is
copied and every hyper-connection tensor keeps its initial value, for which the hyper-connection
model computes exactly the vanilla model (docs/conversion.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import tempfile
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from models.hf.export import mapping as M
from models.zoo import CONFIG_DIR, ModelPreset, ZooError, _read_yaml, build_model, build_transformer_config, load_preset
from tools.hf.errors import ConversionError
from tools.hf.model_card import hc_speed_lines, write_model_card  # noqa: F401 (re-exported)
from tools.hf.remote_code import EXPORT_KERNELS, NOT_SHIPPED, REMOTE_DIR, export_remote_code  # noqa: F401 (re-exported)
from xhc.config import XHC_FAMILY, HCConfig, HCConfigError
from xhc.head import LearnedHead
from xhc.hyper_connection import HyperConnection, logit
from xhc.xhc import PostMapping, ReadMapping, ResMapping

MODEL_TYPE_REMOTE = "xhc_moe"
SAFE_INDEX = "model.safetensors.index.json"


# ================================================================================================
# Sources
# ================================================================================================
@dataclasses.dataclass
class Source:
    """A training checkpoint and what the run says about it."""

    checkpoint: str
    run_dir: Optional[str]
    run_config: dict
    preset_name: str
    backbone_overrides: dict
    hc_overrides: dict
    tokenizer_override: Optional[str] = None
    """``--tokenizer PATH``: a copy of the recorded tokenizer (same hash), or the tokenizer of a run
    made before run records."""
    _tokenizer: Optional[Tuple[Optional[str]]] = dataclasses.field(default=None, repr=False)

    @property
    def record(self):
        """The run record (training.run.run_record) of the checkpoint, else of its run directory; None for
        a run made before records existed."""
        from training.run import read_run_record

        return read_run_record(self.checkpoint)


def resolve_source(run: Optional[str] = None, checkpoint: Optional[str] = None,
                   tokenizer: Optional[str] = None) -> Source:
    """``--run runs/X`` (its newest checkpoint) or ``--checkpoint runs/X/checkpoints/step_N``;
    ``tokenizer``: ``--tokenizer PATH``."""
    import yaml

    from training.checkpoint import CheckpointError, list_checkpoints, verify_checkpoint

    if (run is None) == (checkpoint is None):
        raise ConversionError("give exactly one of --run runs/X or --checkpoint runs/X/checkpoints/step_N")
    if run is not None:
        if not os.path.isdir(run):
            raise ConversionError(f"--run {run}: no such directory")
        found = list_checkpoints(os.path.join(run, "checkpoints"))
        if not found:
            raise ConversionError(f"--run {run}: no finished checkpoint under {os.path.join(run, 'checkpoints')}")
        checkpoint, run_dir = found[-1][1], run
    else:
        if not os.path.isdir(checkpoint):
            raise ConversionError(f"--checkpoint {checkpoint}: no such directory")
        run_dir = os.path.dirname(os.path.dirname(os.path.abspath(checkpoint)))
    try:
        body = verify_checkpoint(checkpoint)
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    cfg_path = os.path.join(run_dir, "config.yaml")
    cfg = {}
    if os.path.isfile(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            cfg = yaml.safe_load(f) or {}
    model = cfg.get("model") or {}
    preset = model.get("preset") or body.get("preset")
    if not preset:
        raise ConversionError(f"checkpoint {checkpoint}: no model preset (neither {cfg_path} nor manifest.json names one)")
    return Source(checkpoint=os.path.abspath(checkpoint), run_dir=run_dir if os.path.isfile(cfg_path) else None,
                  run_config=cfg, preset_name=preset, backbone_overrides=model.get("backbone") or {},
                  hc_overrides=model.get("hc") or {}, tokenizer_override=tokenizer)


MTP_KEYS = ("mtp_num_layers", "mtp_loss_scaling_factor")


def effective_preset(src: Source):
    """The preset with the run's overrides and the optimizer-dependent HC defaults training applied."""
    import yaml

    from training.optim import hc_defaults_for_optimizer

    # The main model only: multi-token prediction depths (models/mtp.py) are a training device with
    # no transformers counterpart; their weights stay in the checkpoint (docs/conversion.md).
    backbone = {k: v for k, v in (src.backbone_overrides or {}).items() if k not in MTP_KEYS}
    try:
        preset = load_preset(src.preset_name, backbone_overrides=backbone or None,
                             hc_overrides=src.hc_overrides or None)
    except ZooError as e:
        raise ConversionError(str(e)) from None
    explicit = set(src.hc_overrides)
    try:
        with open(preset.source, encoding="utf-8") as f:
            explicit |= set(((yaml.safe_load(f) or {}).get("variants") or {}).get(src.preset_name.rsplit(":", 1)[1]) or {})
    except (OSError, TypeError, AttributeError):
        pass
    opt = (src.run_config.get("optimizer") or {}).get("name", "adamw")
    preset.hc = hc_defaults_for_optimizer(preset.hc, opt, explicit)
    return preset


# ================================================================================================
# The single-rank Megatron model (meta device) and streaming reads
# ================================================================================================
@contextlib.contextmanager
def single_rank():
    """Megatron's parallel state for one process (TP = PP = EP = 1), torn down afterwards."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from models.parallel import destroy_parallel, initialize_parallel

    if dist.is_initialized() and dist.get_world_size() == 1 and ps.model_parallel_is_initialized():
        yield  # the caller's single-rank state (e.g. a test process): reuse it
        return
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ConversionError("the converter runs on one process: run it with python, not torchrun")
    fresh = not dist.is_initialized()
    initialize_parallel()
    try:
        yield
    finally:
        destroy_parallel(destroy_process_group=fresh)


def build_single_rank_model(preset, vocab_size: int, seq_length: int, device: str = "meta"):
    """``GPTModel`` of the preset with TP = EP = PP = 1 on ``device`` (``meta``: no memory)."""
    cfg = build_transformer_config(preset, cpu=True, perform_initialization=device != "meta",
                                   params_dtype=torch.float32)
    with torch.device(device):
        model = build_model(preset, cfg, use_transformer_engine=False, vocab_size=vocab_size, seq_length=seq_length)
    return model


def checkpoint_shapes(checkpoint: str) -> Dict[str, Tuple[int, ...]]:
    """Global shapes of the checkpoint's tensors (from its metadata: nothing is read)."""
    from megatron.core import dist_checkpointing

    try:
        meta = dist_checkpointing.load_tensors_metadata(checkpoint)
    except Exception as e:
        raise ConversionError(f"checkpoint {checkpoint}: unreadable dist_checkpointing metadata ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return {k: tuple(v.global_shape if hasattr(v, "global_shape") else v.shape) for k, v in meta.items()}


def vocab_size_of(checkpoint: str) -> int:
    shapes = checkpoint_shapes(checkpoint)
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if key in shapes:
            return int(shapes[key][0])
    raise ConversionError(f"checkpoint {checkpoint}: holds no embedding.word_embeddings.weight: not a GPT checkpoint")


def materialise(entry):
    """A *copy* of a sharded-state-dict entry with real (empty, CPU) storage, or None for non-tensor
    state.  The model's own entries stay on ``meta``: giving them the storage would keep every loaded
    group alive through the model's sharded state dict (memory growing by one layer per layer)."""
    import copy

    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(entry, (ShardedTensor, ShardedTensorFactory)):
        entry = copy.copy(entry)
        entry.data = torch.empty(entry.data.shape, dtype=entry.data.dtype, device="cpu")
        return entry
    return None


def stream_checkpoint(model, checkpoint: str, progress: bool = True) -> Iterator[Tuple[str, Dict[str, torch.Tensor]]]:
    """Yield ``(group, {megatron name: tensor})`` for the embedding, each layer and the head,
    loading only that group's tensors from the checkpoint (``dist_checkpointing`` reshards)."""
    from megatron.core import dist_checkpointing

    full = model.sharded_state_dict()
    groups: Dict[str, dict] = {}
    for name, entry in full.items():
        groups.setdefault(M.group_of(name), {})[name] = entry
    order = M.sort_groups(groups)
    bar = _progress(order, "read + convert", progress)
    for g in bar:
        part = {}
        for name, entry in groups[g].items():
            e = materialise(entry)
            if e is not None:
                part[name] = e
        try:
            loaded = dist_checkpointing.load(part, checkpoint)
        except Exception as e:
            raise ConversionError(f"checkpoint {checkpoint}: cannot read {g} ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}); is it a checkpoint of this preset?") from None
        out = {k: v for k, v in loaded.items() if torch.is_tensor(v)}
        del part, loaded
        yield g, out
        del out  # not held while the next group loads


def _progress(items, desc: str, enabled: bool):
    if not enabled:
        return items
    try:
        from tqdm import tqdm

        return tqdm(items, desc=desc, unit="group", leave=False)
    except ImportError:  # pragma: no cover
        return items


# ================================================================================================
# Hugging Face side: config, shards, remote code
# ================================================================================================
def native_mismatches(backbone: dict) -> List[str]:
    """Why the backbone is not exactly ``Glm4MoeForCausalLM`` (empty: it is)."""
    b = backbone
    why = []
    checks = [
        (b.get("normalization", "LayerNorm") == "RMSNorm", "normalization must be RMSNorm"),
        (bool(b.get("gated_linear_unit")) and b.get("activation", "silu") == "silu", "MLP must be SwiGLU"),
        (b.get("add_bias_linear", True) is False, "linear layers must have no bias"),
        (b.get("position_embedding_type", "rope") == "rope", "position embedding must be RoPE"),
        (not b.get("rotary_interleaved", False), "RoPE must use the rotate-half layout"),
        (float(b.get("rotary_percent", 1.0)) == 1.0, "RoPE must rotate the whole head (rotary_percent=1)"),
        (bool(b.get("num_moe_experts")), "must be an MoE model"),
        (b.get("moe_router_score_function", "softmax") == "sigmoid", "router scores must be sigmoid"),
        (not b.get("moe_router_pre_softmax", False), "moe_router_pre_softmax must be false"),
        (not b.get("moe_router_num_groups"), "group-limited routing is not supported"),
        (not b.get("moe_shared_expert_gate", False), "the shared expert must not be gated"),
    ]
    why += [msg for ok, msg in checks if not ok]
    shared, ffn = b.get("moe_shared_expert_intermediate_size"), b.get("moe_ffn_hidden_size")
    if not shared or not ffn or int(shared) % int(ffn):
        why.append("the shared expert size must be a positive multiple of moe_ffn_hidden_size")
    return why


def hf_config_kwargs(preset, vocab_size: int, seq_length: int) -> dict:
    """``Glm4MoeConfig`` keyword arguments for the preset's backbone."""
    b = preset.backbone
    why = native_mismatches(b)
    if why:
        raise ConversionError(f"preset {preset.name}: the backbone has no transformers counterpart: {'; '.join(why)}")
    arch = M.arch_of(b)
    topk = int(b["moe_router_topk"])
    return dict(
        vocab_size=int(vocab_size), hidden_size=int(b["hidden_size"]), intermediate_size=int(b["ffn_hidden_size"]),
        num_hidden_layers=int(b["num_layers"]), num_attention_heads=arch["heads"], num_key_value_heads=arch["groups"],
        head_dim=arch["head_dim"], hidden_act="silu", max_position_embeddings=int(seq_length),
        initializer_range=float(b.get("init_method_std", 0.02)), rms_norm_eps=float(b.get("layernorm_epsilon", 1e-5)),
        tie_word_embeddings=not b.get("untie_embeddings", True),
        rope_parameters={"rope_type": "default", "rope_theta": float(b.get("rotary_base", 10000)),
                         "partial_rotary_factor": 1.0},
        attention_bias=False, attention_dropout=0.0, moe_intermediate_size=int(b["moe_ffn_hidden_size"]),
        num_experts_per_tok=topk,
        n_shared_experts=int(b["moe_shared_expert_intermediate_size"]) // int(b["moe_ffn_hidden_size"]),
        n_routed_experts=arch["num_experts"], routed_scaling_factor=float(b.get("moe_router_topk_scaling_factor") or 1.0),
        n_group=1, topk_group=1, first_k_dense_replace=int(b.get("first_dense_layers", 0)),
        norm_topk_prob=topk > 1,  # Megatron renormalises sigmoid scores over the selected experts when k > 1
        use_qk_norm=bool(b.get("qk_layernorm", False)), num_nextn_predict_layers=0,
    )


class ShardWriter:
    """Appends tensors to ``model-0000X-of-0000Y.safetensors`` files of at most ``max_bytes``."""

    def __init__(self, out_dir: str, max_bytes: int):
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.buf: Dict[str, torch.Tensor] = {}
        self.buf_bytes = 0
        self.files: List[Tuple[str, List[str]]] = []
        self.total = 0
        self.peak_buffer = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.buf and self.buf_bytes + nbytes > self.max_bytes:
            self.flush()
        self.buf[name] = t.contiguous()
        self.buf_bytes += nbytes
        self.total += nbytes
        self.peak_buffer = max(self.peak_buffer, self.buf_bytes)

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.buf:
            return
        tmp = os.path.join(self.out_dir, f".shard-{len(self.files):05d}.tmp")
        save_file(self.buf, tmp, metadata={"format": "pt"})
        self.files.append((tmp, list(self.buf)))
        self.buf, self.buf_bytes = {}, 0

    def finish(self) -> List[str]:
        self.flush()
        n = len(self.files)
        weight_map, names = {}, []
        for i, (tmp, keys) in enumerate(self.files):
            name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, os.path.join(self.out_dir, name))
            names.append(name)
            weight_map.update({k: name for k in keys})
        if n > 1:
            with open(os.path.join(self.out_dir, SAFE_INDEX), "w", encoding="utf-8") as f:
                json.dump({"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))},
                          f, indent=2)
        return names


def parse_size(text) -> int:
    """``5GB``, ``500MB``, ``100KB`` or bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(text), re.I)
    if not m:
        raise ConversionError(f"--max-shard-size {text!r}: use e.g. 5GB, 500MB or a number of bytes")
    unit = (m.group(2) or "B").upper().replace("I", "")
    return int(float(m.group(1)) * {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}[unit])


@contextlib.contextmanager
def staged_output(out_dir: str, overwrite: bool):
    """Write into ``<out>.tmp-*`` and rename at the end: a failed export never touches ``out_dir``."""
    if os.path.exists(out_dir) and not overwrite:
        raise ConversionError(f"--output {out_dir} already exists: choose another folder or pass --overwrite")
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.tmp-", dir=parent)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(out_dir):
        old = tmp + ".old"
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)


# ================================================================================================
# to-hf
# ================================================================================================
@dataclasses.dataclass
class ExportReport:
    output: str
    native: bool
    architecture: str
    files: List[str]
    parameters: int
    hc_parameters: int
    seconds: float
    bytes_written: int
    max_group_bytes: int = 0
    """The largest group of checkpoint tensors held at once (fp32 as loaded)."""
    max_shard_buffer_bytes: int = 0


def to_hf(src: Source, out_dir: str, dtype: str = "bf16", max_shard_size="5GB", overwrite: bool = False,
          progress: bool = True, log: Callable[[str], None] = print) -> ExportReport:
    """Export ``src`` to a Hugging Face folder (see the module docstring)."""
    t0 = time.perf_counter()
    if dtype not in ("bf16", "fp32"):
        raise ConversionError(f"--dtype {dtype!r}: use bf16 or fp32")
    preset = effective_preset(src)
    source_tokenizer(src, log)  # a missing or changed tokenizer stops here, before any tensor is read
    vocab = vocab_size_of(src.checkpoint)
    batch = src.run_config.get("batch") or {}
    seq = int(batch.get("seq_length") or preset.seq_length)
    kwargs = hf_config_kwargs(preset, vocab, seq)
    native = not preset.hc.enabled
    arch = M.arch_of(preset.backbone)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    limit = parse_size(max_shard_size)
    n_params = n_hc = max_group = 0
    with staged_output(out_dir, overwrite) as tmp:
        writer = ShardWriter(tmp, limit)
        with single_rank():
            model = build_single_rank_model(preset, vocab, seq)
            for _g, tensors in stream_checkpoint(model, src.checkpoint, progress):
                max_group = max(max_group, sum(t.numel() * t.element_size() for t in tensors.values()))
                for name, t in M.megatron_to_hf(tensors, arch, fused_experts=not native).items():
                    n_params += t.numel()
                    if M.is_hc_name(name):
                        n_hc += t.numel()
                    writer.add(name, t.float() if M.keep_fp32(name) else t.to(torch_dtype))
                del tensors
        files = writer.finish()
        info = _training_info(src)
        write_hf_metadata(tmp, preset, kwargs, native, dtype, info, src)
        files += export_remote_code(tmp) if not native else []
        files += export_tokenizer(src, tmp, log, model_max_length=seq)
        write_model_card(tmp, preset, native, info, n_params, n_hc, dtype, src)
    secs = time.perf_counter() - t0
    return ExportReport(out_dir, native, "Glm4MoeForCausalLM" if native else "XHCMoeForCausalLM (remote code)",
                        sorted(os.listdir(out_dir)), n_params, n_hc, secs, writer.total, max_group, writer.peak_buffer)


def estimate_memory(preset, vocab_size: int, seq_length: int, dtype: str = "bf16", max_shard_size="5GB") -> dict:
    """What :func:`to_hf` holds at most for ``preset``, from a ``meta``-device model (nothing allocated).

    Per group (embedding, each layer, head): its fp32 tensors as loaded plus their converted copy
    (``dtype``); plus one output shard.  Returns the sizes in bytes and the largest group's name.
    """
    out_bytes = 2 if dtype == "bf16" else 4
    with single_rank():
        model = build_single_rank_model(preset, vocab_size, seq_length)
        groups: Dict[str, int] = {}
        for name, entry in model.sharded_state_dict().items():
            data = getattr(entry, "data", None)
            if torch.is_tensor(data):
                groups[M.group_of(name)] = groups.get(M.group_of(name), 0) + data.numel()
    worst = max(groups, key=groups.get)
    shard = parse_size(max_shard_size)
    total = sum(groups.values())
    return {"parameters": total, "groups": len(groups), "largest_group": worst,
            "largest_group_fp32_bytes": groups[worst] * 4,
            "peak_bytes": groups[worst] * (4 + out_bytes) + min(shard, total * out_bytes),
            "full_model_fp32_bytes": total * 4, "per_layer_fp32_bytes": {g: n * 4 for g, n in groups.items()}}


def _training_info(src: Source) -> dict:
    """Step, tokens seen and the last losses of the run (manifest.json, metrics.jsonl)."""
    from training.checkpoint import verify_checkpoint

    body = verify_checkpoint(src.checkpoint, hashes=False)
    step = int(body.get("step", 0))
    seq = int((src.run_config.get("batch") or {}).get("seq_length") or 0)
    info = {"step": step, "consumed_samples": body.get("consumed_samples"), "parallel": body.get("parallel"),
            "world_size": body.get("world_size")}
    if seq and body.get("consumed_samples") is not None:
        info["tokens_seen"] = int(body["consumed_samples"]) * seq
    if src.run_dir and os.path.isfile(os.path.join(src.run_dir, "metrics.jsonl")):
        last_train = last_eval = None
        with open(os.path.join(src.run_dir, "metrics.jsonl"), encoding="utf-8") as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                if r.get("step", 0) > step:
                    continue
                if r.get("kind") == "train" and "loss" in r:
                    last_train = r
                elif r.get("kind") == "eval" and "loss" in r:
                    last_eval = r
        info["train_loss"] = last_train and last_train["loss"]
        info["valid_loss"] = last_eval and last_eval["loss"]
        if last_train and "consumed_tokens" in last_train:
            info["tokens_seen"] = last_train["consumed_tokens"]
    return info


def write_hf_metadata(out_dir: str, preset, kwargs: dict, native: bool, dtype: str, info: dict, src) -> None:
    from transformers import GenerationConfig

    xhc_meta = {"preset": preset.name, "backbone": dict(preset.backbone), "hc": preset.hc.to_dict(),
                "training": info}
    eos = _eos_id(src)
    if native:
        from transformers import Glm4MoeConfig

        cfg = Glm4MoeConfig(**kwargs, eos_token_id=eos)
    else:
        import importlib.util

        spec = importlib.util.spec_from_file_location("_xhc_cfg", os.path.join(REMOTE_DIR, "configuration_xhc_moe.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        # the exported model's HC maths runs on the eager reference functions (EXPORT_KERNELS)
        cfg = mod.XHCMoeConfig(hc=dict(preset.hc.to_dict(), kernels=EXPORT_KERNELS), **kwargs, eos_token_id=eos)
        cfg.auto_map = {"AutoConfig": "configuration_xhc_moe.XHCMoeConfig",
                        "AutoModel": "modeling_xhc_moe.XHCMoeModel",
                        "AutoModelForCausalLM": "modeling_xhc_moe.XHCMoeForCausalLM"}
        cfg.architectures = ["XHCMoeForCausalLM"]
    if native:
        cfg.architectures = ["Glm4MoeForCausalLM"]
    cfg.dtype = "bfloat16" if dtype == "bf16" else "float32"
    cfg.xhc = _jsonable(xhc_meta)
    cfg.save_pretrained(out_dir)
    GenerationConfig(eos_token_id=eos, do_sample=False).save_pretrained(out_dir)


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=str))


def source_tokenizer(src: Source, log: Optional[Callable[[str], None]] = None,
                     tool: str = "xhc-convert") -> Optional[str]:
    """The tokenizer ``src`` trained with: the run record's (checked: missing or changed gives the
    one-line :class:`ConversionError`), ``--tokenizer PATH`` (checked against the record), or for a
    run made before records the lookup next to the run directory, with a one-line note.  None: the
    run has no tokenizer (mock data / raw ids).  Resolved once per source."""
    from training.run import RecordError

    if src._tokenizer is not None:
        return src._tokenizer[0]
    log = log or print
    try:
        record = src.record
        if record is not None:
            path = record.tokenizer(src.tokenizer_override)
        elif src.tokenizer_override is not None:
            if not os.path.exists(src.tokenizer_override):
                raise ConversionError(f"--tokenizer {src.tokenizer_override}: no such file or folder")
            path = os.path.abspath(src.tokenizer_override)
            log(f"[{tool}] note: {src.checkpoint} has no run record (made before run records): "
                f"tokenizer {path} from --tokenizer")
        else:
            path = _lookup_tokenizer_path(src)
            cfg = src.run_config
            none = ((cfg.get("tokenizer") or {}).get("type") == "none"
                    or (cfg.get("data") or {}).get("mock") and not (cfg.get("tokenizer") or {}).get("path"))
            log(f"[{tool}] note: {src.checkpoint} has no run record (made before run records): tokenizer "
                + (f"found by lookup at {path}" if path else "none by its config.yaml (mock data / raw ids)" if none
                   else "not found by lookup (pass --tokenizer PATH)"))
    except RecordError as e:
        raise ConversionError(str(e)) from None
    src._tokenizer = (path,)
    return path


def _lookup_tokenizer_path(src: Source) -> Optional[str]:
    """Runs made before run records: the tokenizer ``config.yaml`` names, or the default data's next
    to the run directory (runs/<name> in the checkout that trained it), never the working directory's."""
    tok = (src.run_config.get("tokenizer") or {})
    if tok.get("type") == "none":
        return None
    path = tok.get("path")
    data = src.run_config.get("data") or {}
    implicit = False  # the default corpus's tokenizer: where that run built it, never the working directory's
    if not path and not data.get("prefixes") and not data.get("mock") and not data.get("per_split"):
        path = os.path.join(data.get("default_dir") or "data/default", "tokenizer.model")
        implicit = not data.get("default_dir") or data.get("default_dir") == "data/default"
    if implicit and not src.run_dir:
        return None
    if path and not os.path.isabs(path) and src.run_dir and (implicit or not os.path.exists(path)):
        for base in (os.path.dirname(os.path.abspath(src.run_dir)), os.path.dirname(os.path.dirname(os.path.abspath(src.run_dir)))):
            if os.path.exists(os.path.join(base, path)):
                return os.path.join(base, path)
        if implicit:
            return None
    return path if path and os.path.exists(path) else None


def _eos_id(src: Source) -> Optional[int]:
    path = source_tokenizer(src)
    if path is None:
        return None
    from training.data import Tokenizer

    t = Tokenizer.from_file(path)
    return int(t.eod)


def export_tokenizer(src: Source, out_dir: str, log, model_max_length: Optional[int] = None) -> List[str]:
    """Our SentencePiece model (``tokenizer.model``) and the same tokenizer for ``transformers``
    (``tokenizer.json`` + ``tokenizer_config.json``), encoding exactly as training did.

    ``tokenizer_config.json`` names its class, so the tokenizer never needs the model's remote code
    (``AutoTokenizer.from_pretrained(path, trust_remote_code=False)``: docs/conversion.md), and carries
    ``model_max_length``, the trained sequence length.  The tokenizer is the one the run record names
    (:func:`source_tokenizer`); the record itself goes into the folder as ``run_record.json``."""
    path = source_tokenizer(src, log)
    record = src.record
    if record is not None:  # the export says what it was trained on, too (tools.evaluate reads it)
        from training.run import RECORD_NAME, write_record_file

        write_record_file(os.path.join(out_dir, RECORD_NAME), record.body)
    if path is None:
        log("[xhc-convert] note: the run has no tokenizer (mock data / raw ids): the folder has none")
        return []
    if os.path.isdir(path):  # an HF tokenizer folder: copy it through transformers
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if model_max_length:
            tok.model_max_length = int(model_max_length)
        tok.save_pretrained(out_dir)
        _name_tokenizer_class(out_dir, type(tok).__name__)
        return ["tokenizer.json"]
    return sentencepiece_to_hf(path, out_dir, model_max_length)


def _name_tokenizer_class(out_dir: str, cls: str) -> None:
    """Write ``tokenizer_class`` into ``tokenizer_config.json``: AutoTokenizer builds that class, not
    one of the model's remote code (it still reads config.json first, whose ``auto_map`` makes
    transformers ask about remote code unless ``trust_remote_code`` is given: docs/conversion.md)."""
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        conf = json.load(f)
    conf["tokenizer_class"] = cls
    with open(path, "w", encoding="utf-8") as f:
        json.dump(conf, f, indent=2, ensure_ascii=False)


def sentencepiece_to_hf(model_path: str, out_dir: str, model_max_length: Optional[int] = None) -> List[str]:
    """``tokenizer.model`` + a ``transformers`` fast tokenizer of the same SentencePiece model
    (no BOS/EOS added on encode, as training tokenises)."""
    import sentencepiece as spm
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    shutil.copyfile(model_path, os.path.join(out_dir, "tokenizer.model"))
    sp = spm.SentencePieceProcessor(model_file=model_path)
    proto = import_protobuf().ModelProto()
    with open(model_path, "rb") as f:
        proto.ParseFromString(f.read())
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    backend = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab)
    if proto.trainer_spec.model_type == 2 and not json.loads(backend.to_str())["model"].get("merges"):
        # transformers < 5.2x builds the BPE model without merges when none are given (every text
        # then encodes character by character; seen with 5.17, the lent GPU image's version):
        # give it SentencePiece's merges, ranked by piece id (= by score in a BPE model).
        from transformers.tokenization_utils_base import generate_merges

        backend = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, merges=generate_merges(vocab))
    specials = {}
    for attr, fn in (("unk_token", sp.unk_id), ("bos_token", sp.bos_id), ("eos_token", sp.eos_id), ("pad_token", sp.pad_id)):
        i = fn()
        if i >= 0:
            specials[attr] = sp.id_to_piece(i)
    if model_max_length:
        specials["model_max_length"] = int(model_max_length)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **specials)
    tok.add_bos_token = False
    tok.save_pretrained(out_dir)
    _name_tokenizer_class(out_dir, "PreTrainedTokenizerFast")
    return ["tokenizer.model", "tokenizer.json"]


# ================================================================================================
# from-hf (and upcycling)
# ================================================================================================
SUPPORTED_ARCHS = ("Glm4MoeForCausalLM", "XHCMoeForCausalLM")


def read_hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(f"--hf {hf_dir}: no config.json (not a Hugging Face model folder)")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except ValueError as e:
        raise ConversionError(f"--hf {path}: not valid JSON ({e})") from None
    archs = cfg.get("architectures") or []
    if not any(a in SUPPORTED_ARCHS for a in archs) or cfg.get("model_type") not in ("glm4_moe", MODEL_TYPE_REMOTE):
        raise ConversionError(f"--hf {hf_dir}: architecture {archs or cfg.get('model_type')} is not supported; "
                              f"supported: {', '.join(SUPPORTED_ARCHS)} (GLM-4.5-MoE family)")
    return cfg


def preset_from_hf(cfg: dict, to_variant: Optional[str] = None, hc_overrides: Optional[dict] = None):
    """A :class:`~models.zoo.ModelPreset` for an HF config (ours, or any GLM-4.5-MoE model)."""
    meta = cfg.get("xhc") or {}
    rope = cfg.get("rope_parameters") or {}
    if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))) != 1.0:
        raise ConversionError("config.json: partial_rotary_factor != 1.0: partial RoPE has no Megatron counterpart here")
    if cfg.get("n_group", 1) != 1 or cfg.get("topk_group", 1) != 1:
        raise ConversionError("config.json: n_group/topk_group != 1 (group-limited routing) is not supported")
    if cfg.get("attention_bias"):
        raise ConversionError("config.json: attention_bias=true is not supported (the zoo's linears have no bias)")
    if meta.get("backbone"):
        backbone = dict(meta["backbone"])
    else:
        backbone = dict(_read_yaml(CONFIG_DIR / "_defaults.yaml").get("backbone", {}))
        heads = int(cfg["num_attention_heads"])
        backbone.update(
            num_layers=int(cfg["num_hidden_layers"]), hidden_size=int(cfg["hidden_size"]), num_attention_heads=heads,
            num_query_groups=int(cfg["num_key_value_heads"]),
            kv_channels=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            first_dense_layers=int(cfg.get("first_k_dense_replace", 1)), ffn_hidden_size=int(cfg["intermediate_size"]),
            num_moe_experts=int(cfg["n_routed_experts"]), moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
            moe_shared_expert_intermediate_size=int(cfg["moe_intermediate_size"]) * int(cfg.get("n_shared_experts", 1)),
            moe_router_topk=int(cfg["num_experts_per_tok"]), vocab_size=int(cfg["vocab_size"]),
            seq_length=int(cfg.get("max_position_embeddings", 4096)), rotary_base=float(rope.get("rope_theta", 10000)),
            layernorm_epsilon=float(cfg.get("rms_norm_eps", 1e-5)), qk_layernorm=bool(cfg.get("use_qk_norm", False)),
            untie_embeddings=not cfg.get("tie_word_embeddings", False))
        if float(cfg.get("routed_scaling_factor", 1.0)) != 1.0:
            backbone["moe_router_topk_scaling_factor"] = float(cfg["routed_scaling_factor"])
    hc_dict = dict(meta.get("hc") or cfg.get("hc") or {"variant": "none"})
    if to_variant is not None:
        if HCConfig.from_dict(hc_dict).enabled:
            raise ConversionError(f"--to-variant {to_variant}: the source is already a hyper-connection model "
                                  f"({hc_dict.get('variant')}); upcycling starts from a vanilla model")
        base = meta.get("preset") or ""
        hc_dict = {**_variant_defaults(base, to_variant), **upcycle_overrides(to_variant)}
    hc_dict.update(hc_overrides or {})
    try:
        hc = HCConfig.from_dict(hc_dict)
    except HCConfigError as e:
        raise ConversionError(f"--to-variant / --hc: {e}") from None
    return ModelPreset(name=meta.get("preset") or "hf", backbone=backbone, hc=hc,
                       description=f"converted from Hugging Face ({cfg.get('architectures')})")


UPCYCLE_LOGIT = 16.0
"""Saturation logit of the xHC upcycling state: σ(−16) ≈ 1.1e-7 of leakage per stream (logits equal
the vanilla model's to ~1e-6), while Adam still moves the biases at its learning rate."""


def upcycle_overrides(variant: str) -> dict:
    """HCConfig settings under which the initial hyper-connection model computes the vanilla model.

    mHC family: the N streams start equal (expand), a uniform read (h_pre = 1/N) returns the
    residual, every stream receives the branch output (h_post = 1), any doubly stochastic H_res
    keeps equal streams equal, and the mean readout returns the residual: the dynamic parts are
    zero because their projections W start at zero.  xHC family (sparse writes make streams
    differ): everything flows through the always-active stream 0 (see :func:`upcycle_init`); the
    exit is a softmax readout concentrated on it.
    """
    if variant in XHC_FAMILY:
        return {"reduction": "softmax", "read_init": "uniform"}
    return {"reduction": "mean", "read_init": "uniform", "init_noise": 0.0}


@torch.no_grad()
def upcycle_init(model, hc) -> None:
    """xHC family: read one-hot on stream 0 (always active, slot 0), H_res = I, write the branch
    output to slot 0 with weight 1 and its temporal components with weight 0, read out stream 0
    (all up to σ(−UPCYCLE_LOGIT)).  The mHC family needs nothing beyond :func:`upcycle_overrides`,
    except where DeepSeek-V4's ``+ ε`` terms would shift the uniform maps (docs/math.md §2.h):

    - ``convention: deepseek_v4``: h_pre = σ(b) + ε, so b_pre = logit(1/N − ε) gives h_pre = 1/N;
      the ``+ ε`` denominators of its Sinkhorn leave the rows of H_res = combᵀ summing to γ = 1 − O(ε),
      which shrinks the equal streams by γ per sublayer: sublayer l writes with h_post = γ_0···γ_l, so
      the state stays the vanilla residual times one scalar, which the final norm removes;
    - ``reduction: learned`` (its projection starts at 0, w = σ(b) + ε): b = logit(1/N − ε) on every
      stream (the mean readout) in the mHC family; in the xHC family b = logit(1 − ε) on stream 0
      and −UPCYCLE_LOGIT on the others (leakage σ(−16) + ε per stream).
    """
    eps, n = hc.sinkhorn_eps, hc.n
    if hc.convention == "deepseek_v4":
        scale = 1.0
        for mod in sorted((m for m in model.modules() if isinstance(m, HyperConnection)), key=lambda m: m.layer_index):
            if mod.b_pre is not None:
                mod.b_pre.fill_(logit(1.0 / n - eps))
            dtype = next(mod.parameters()).dtype
            _, _, H = mod.coefficients(torch.ones(1, n, mod.hidden_size, dtype=dtype))  # input-independent: W = 0
            scale *= 1.0 if H is None else H.double().sum(-1).mean().item()
            if mod.b_post is not None:
                mod.b_post.fill_(logit(scale / 2))  # h_post = 2σ(b)
    for mod in model.modules():
        if isinstance(mod, LearnedHead):
            mod.hc_fn.zero_()
            if hc.is_xhc:
                mod.hc_base.fill_(-UPCYCLE_LOGIT)
                mod.hc_base[0] = logit(1.0 - eps)
            else:
                mod.hc_base.fill_(logit(1.0 / n - eps))
    if not hc.is_xhc:
        return
    if hc.m < 1:
        raise ConversionError(f"--to-variant {hc.variant}: upcycling needs m >= 1 (an always-active stream 0); got m={hc.m}")
    B = UPCYCLE_LOGIT
    for name, mod in model.named_modules():
        if isinstance(mod, ReadMapping) and mod.bias is not None:
            mod.bias.fill_(-B)
            mod.bias[0] = B
        elif isinstance(mod, ResMapping):
            mod.bias.copy_((-B * (1.0 - torch.eye(mod.k))).flatten())
        elif isinstance(mod, PostMapping) and mod.bias is not None:
            b = mod.bias.view(mod.k, mod.K)
            b.zero_()
            b[0, 1:] = -B
    for name, p in model.named_parameters():
        if name.endswith("hc_readout_logits"):
            p.fill_(-B)
            p[0] = 0.0


def _variant_defaults(base_preset: str, variant: str) -> dict:
    """The preset file's own settings for ``variant`` when it has one (e.g. tiny-moe's xhc: n=8 k=4),
    else the HCConfig defaults for that variant."""
    if ":" in base_preset:
        path = CONFIG_DIR / f"{base_preset.rsplit(':', 1)[0]}.yaml"
        if path.is_file():
            for v in (_read_yaml(path).get("variants") or {}).values():
                if (v or {}).get("variant") == variant:
                    return dict(v)
    return {"variant": variant}


def read_hf_tensors(hf_dir: str) -> Iterator[Tuple[str, Dict[str, torch.Tensor]]]:
    """Yield ``(group, {hf name: tensor})`` one group at a time (safetensors, memory-mapped)."""
    from safetensors import safe_open

    index = os.path.join(hf_dir, SAFE_INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            wm = json.load(f)["weight_map"]
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        with safe_open(os.path.join(hf_dir, "model.safetensors"), "pt") as f:
            wm = {k: "model.safetensors" for k in f.keys()}
    else:
        raise ConversionError(f"--hf {hf_dir}: no model.safetensors or {SAFE_INDEX}")
    by_group: Dict[str, List[str]] = {}
    for k in wm:
        by_group.setdefault(M.hf_group_of(k), []).append(k)
    for g in M.sort_groups(by_group):
        out = {}
        for k in by_group[g]:
            with safe_open(os.path.join(hf_dir, wm[k]), "pt") as f:
                out[k] = f.get_tensor(k)
        yield g, out


def from_hf(hf_dir: str, out_dir: str, to_variant: Optional[str] = None, hc_overrides: Optional[dict] = None,
            overwrite: bool = False, seed: int = 1234, progress: bool = True) -> dict:
    """HF folder -> ``<out_dir>/checkpoints/step_N`` (+ ``config.yaml`` and ``preset.yaml``)."""
    import yaml

    from training.checkpoint import Checkpointer, build_state

    cfg = read_hf_config(hf_dir)
    preset = preset_from_hf(cfg, to_variant, hc_overrides)
    vocab = int(cfg["vocab_size"])
    seq = int(preset.backbone.get("seq_length", cfg.get("max_position_embeddings", 4096)))
    arch = M.arch_of(preset.backbone)
    training = (cfg.get("xhc") or {}).get("training") or {}
    step = 0 if to_variant else int(training.get("step") or 0)
    from training.run import RECORD_NAME, RecordError, read_run_record, write_record_file

    try:  # what the exported run trained on travels on (its tokenizer for the next to-hf, its data)
        record = read_run_record(hf_dir)
    except RecordError as e:
        raise ConversionError(str(e)) from None
    with staged_output(out_dir, overwrite) as tmp:
        with single_rank():
            torch.manual_seed(seed)
            model = build_single_rank_model(preset, vocab, seq, device="cpu")
            own = model.state_dict()
            seen = set()
            for g, tensors in _progress(list(read_hf_tensors(hf_dir)), "convert", progress):
                if g.startswith("layer.") and int(g.split(".")[1]) >= preset.num_layers:
                    continue  # multi-token-prediction layers of Hub GLM-4.5 checkpoints: not part of the zoo model
                for name, t in M.hf_to_megatron(tensors, arch).items():
                    if name not in own:
                        raise ConversionError(f"--hf {hf_dir}: tensor {name} does not exist in the {preset.hc.variant} "
                                              "model (wrong --to-variant?)")
                    if tuple(own[name].shape) != tuple(t.shape):
                        raise ConversionError(f"--hf {hf_dir}: tensor {name} has shape {tuple(t.shape)}, the model "
                                              f"expects {tuple(own[name].shape)}")
                    own[name].copy_(t.to(own[name].dtype))
                    seen.add(name)
            missing = [k for k, v in own.items() if torch.is_tensor(v) and k not in seen and "_extra_state" not in k]
            if to_variant:  # upcycling: the HC tensors start at the state that computes the vanilla model
                missing = [k for k in missing if not M.is_hc_name(k)]
                upcycle_init(model, preset.hc)
            if missing:
                raise ConversionError(f"--hf {hf_dir}: {len(missing)} tensor(s) missing, e.g. {missing[0]}")
            consumed = 0 if to_variant else int(training.get("consumed_samples") or 0)
            ck = Checkpointer(os.path.join(tmp, "checkpoints"), keep_last=1, log=lambda *_: None)
            state = build_state([model], trainer={"step": step, "consumed_samples": consumed, "skipped_steps": 0},
                                rng=False)
            resume_preset = f"{os.path.abspath(out_dir)}/preset.yaml:{preset.hc.variant}"  # what the run will name
            ck.save(step, state, {"world_size": 1, "reason": "from-hf", "preset": resume_preset,
                                  "parallel": {"tp": 1, "pp": 1, "ep": 1}, "consumed_samples": consumed,
                                  "run_record": record.body if record else None})
        variant_key = preset.hc.variant
        with open(os.path.join(tmp, "preset.yaml"), "w", encoding="utf-8") as f:
            yaml.safe_dump({"description": preset.description, "backbone": preset.backbone,
                            "variants": {variant_key: preset.hc.to_dict()}}, f, sort_keys=False)
        final_preset = f"{os.path.abspath(out_dir)}/preset.yaml:{variant_key}"
        with open(os.path.join(tmp, "config.yaml"), "w", encoding="utf-8") as f:
            yaml.safe_dump({"model": {"preset": final_preset}}, f, sort_keys=False)
        if record is not None:
            write_record_file(os.path.join(tmp, RECORD_NAME), record.body)
    return {"checkpoint": os.path.join(out_dir, "checkpoints", f"step_{step:08d}"), "preset": final_preset,
            "step": step}
