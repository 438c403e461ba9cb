"""Where ``python -m tools.inspect`` reads a model from: sources (a run, a checkpoint, a Hugging Face
folder), the model's config, and its layers one at a time (so a large model is never whole in memory).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Tuple


class InspectError(RuntimeError):
    """Bad input (the one-line message names the path or flag)."""


# ================================================================================================
# Sources
# ================================================================================================
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class Target:
    """One SOURCE: what kind it is and which model snapshots of it are inspected."""

    path: str
    kind: str  # "run" | "checkpoint" | "hf"
    label: str
    checkpoints: List[Tuple[int, str]] = field(default_factory=list)  # (step, dir); empty for "hf"
    run_dir: Optional[str] = None
    run_config: dict = field(default_factory=dict)
    manifest: dict = field(default_factory=dict)
    tokenizer: Optional[str] = None  # --tokenizer PATH (a copy of the recorded one, or an old run's)
    data: Optional[List[str]] = None  # --data PREFIX ... (copies of the recorded validation prefixes)
    log: Callable[[str], None] = print


def _read_yaml(path: str) -> dict:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f) or {}
    except (OSError, ValueError) as e:
        raise InspectError(f"{path}: unreadable ({type(e).__name__}: {e})") from None


def _parse_steps(text: Optional[str]) -> Optional[List[int]]:
    """``--steps all`` -> [] (every kept checkpoint), ``2,4`` -> [2, 4], None -> None."""
    if text is None:
        return None
    if text.strip() == "all":
        return []
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise InspectError(f"--steps {text!r}: use 'all' or a comma-separated list of steps, e.g. 100,200") from None


def resolve(path: str, step: Optional[int] = None, steps: Optional[List[int]] = None) -> Target:
    """What ``path`` is (run directory, checkpoint, Hugging Face folder) and the checkpoints to inspect.

    Raises :class:`InspectError` with a one-line message naming ``path`` for anything else.
    """
    from training.checkpoint import CheckpointError, list_checkpoints, verify_checkpoint

    label = os.path.basename(os.path.normpath(path)) or path
    if not os.path.exists(path):
        raise InspectError(f"{path}: no such file or directory")
    if not os.path.isdir(path):
        raise InspectError(f"{path}: is a file; SOURCE is a run directory, a checkpoint directory or a Hugging Face folder")
    if os.path.isdir(os.path.join(path, "checkpoints")):
        found = list_checkpoints(os.path.join(path, "checkpoints"))
        if not found:
            raise InspectError(f"{path}: run directory without a finished checkpoint under {os.path.join(path, 'checkpoints')}")
        cfg = _read_yaml(os.path.join(path, "config.yaml")) if os.path.isfile(os.path.join(path, "config.yaml")) else {}
        kept = {s: p for s, p in found}
        if steps is not None:
            wanted = sorted(kept) if not steps else steps
        elif step is not None:
            wanted = [step]
        else:
            wanted = [found[-1][0]]
        missing = [s for s in wanted if s not in kept]
        if missing:
            raise InspectError(f"{path}: no checkpoint at step {missing[0]} (kept steps: "
                               f"{', '.join(str(s) for s in sorted(kept))})")
        chosen = [(s, kept[s]) for s in wanted]
        for _, ck in chosen:
            _check_manifest(ck, verify_checkpoint, CheckpointError)
        return Target(path, "run", label, chosen, path, cfg)
    if os.path.isfile(os.path.join(path, "config.json")):
        if step is not None or steps is not None:
            raise InspectError(f"{path}: a Hugging Face folder holds one model; --step/--steps apply to run directories")
        return Target(path, "hf", label)
    looks_like_ckpt = bool(_STEP_DIR.match(os.path.basename(os.path.normpath(path)))) or any(
        os.path.exists(os.path.join(path, f)) for f in (".metadata", "metadata.json", "common.pt", "manifest.json"))
    if looks_like_ckpt:
        if step is not None or steps is not None:
            raise InspectError(f"{path}: a checkpoint holds one step; --step/--steps apply to run directories")
        body = _check_manifest(path, verify_checkpoint, CheckpointError)
        run_dir = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        cfg_path = os.path.join(run_dir, "config.yaml")
        cfg = _read_yaml(cfg_path) if os.path.isfile(cfg_path) else {}
        m = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
        st = int(body.get("step", m.group(1) if m else 0))
        return Target(path, "checkpoint", label, [(st, path)], run_dir if cfg else None, cfg, body)
    raise InspectError(f"{path}: not a run directory (no checkpoints/), a checkpoint (no manifest.json) or a "
                       "Hugging Face folder (no config.json)")


def _check_manifest(ck: str, verify, error_cls) -> dict:
    if not os.path.isfile(os.path.join(ck, "manifest.json")):
        raise InspectError(f"{ck}: checkpoint without manifest.json (the save did not finish, or it was not written by "
                           "xhc training)")
    try:
        return verify(ck, hashes=False)
    except error_cls as e:
        raise InspectError(str(e)) from None


# ================================================================================================
# The model, one layer at a time
# ================================================================================================
@dataclass
class ModelInfo:
    hc: object  # xhc.config.HCConfig (kernels forced to eager)
    hf_config: object  # XHCMoeConfig, or None for vanilla
    num_layers: int
    vocab_size: int
    seq_length: int
    preset: str
    step: Optional[int]
    tokenizer: object  # SentencePiece .model or HF folder, or a function giving it (a checkpoint's: when needed)


def _hc_eager(hc_dict: dict):
    from xhc.config import HCConfig

    return HCConfig.from_dict({**hc_dict, "kernels": "eager"})


def _remote_config_class():
    from models.hf.export.remote.configuration_xhc_moe import XHCMoeConfig

    return XHCMoeConfig


def _checkpoint_source(target: Target, ck: str):
    import tools.hf as C

    cfg = target.run_config
    model = cfg.get("model") or {}
    preset = model.get("preset") or (target.manifest or {}).get("preset")
    if not preset:
        from training.checkpoint import verify_checkpoint

        preset = verify_checkpoint(ck, hashes=False).get("preset")
    if not preset:
        raise InspectError(f"{ck}: no model preset (neither the run's config.yaml nor manifest.json names one)")
    return C.Source(checkpoint=os.path.abspath(ck), run_dir=target.run_dir, run_config=cfg, preset_name=preset,
                    backbone_overrides=model.get("backbone") or {}, hc_overrides=model.get("hc") or {},
                    tokenizer_override=target.tokenizer)


def model_info_checkpoint(target: Target, ck: str, step: int) -> Tuple[ModelInfo, object, object]:
    """(ModelInfo, convert.Source, preset) of a checkpoint (nothing but metadata is read)."""
    import tools.hf as C

    src = _checkpoint_source(target, ck)
    try:
        preset = C.effective_preset(src)
        vocab = C.vocab_size_of(src.checkpoint)
    except C.ConversionError as e:
        raise InspectError(f"{ck}: {e}") from None
    seq = int((src.run_config.get("batch") or {}).get("seq_length") or preset.seq_length)
    hc = _hc_eager(preset.hc.to_dict())
    hf_config = None
    if hc.enabled:
        try:
            kwargs = C.hf_config_kwargs(preset, vocab, seq)
        except C.ConversionError as e:
            raise InspectError(f"{ck}: {e}") from None
        hf_config = _remote_config_class()(hc=hc.to_dict(), **kwargs)
    def tokenizer():  # resolved (and checked against the run record) only when --text needs it
        try:
            return C.source_tokenizer(src, lambda m: target.log(m.replace("[xhc-inspect] ", "", 1)), tool="xhc-inspect")
        except C.ConversionError as e:
            raise InspectError(str(e)) from None

    info = ModelInfo(hc, hf_config, int(preset.backbone["num_layers"]), vocab, seq, preset.name, step, tokenizer)
    return info, src, preset


def model_info_hf(target: Target) -> ModelInfo:
    import tools.hf as C
    from xhc.config import HCConfigError

    try:
        cfg = C.read_hf_config(target.path)
    except C.ConversionError as e:
        raise InspectError(f"{target.path}: {str(e).split(': ', 1)[-1]}") from None
    meta = cfg.get("xhc") or {}
    hc_dict = dict(meta.get("hc") or cfg.get("hc") or {"variant": "none"})
    try:
        hc = _hc_eager(hc_dict)
    except HCConfigError as e:
        raise InspectError(f"{target.path}/config.json: {e}") from None
    hf_config = None
    if hc.enabled:
        hf_config = _remote_config_class().from_json_file(os.path.join(target.path, "config.json"))
        hf_config.hc = hc.to_dict()
    step = (meta.get("training") or {}).get("step")
    tok = target.path if any(os.path.isfile(os.path.join(target.path, f)) for f in ("tokenizer.model", "tokenizer.json")) \
        else None
    return ModelInfo(hc, hf_config, int(cfg["num_hidden_layers"]), int(cfg["vocab_size"]),
                     int(cfg.get("max_position_embeddings") or 128), meta.get("preset") or "hf", step, tok)


def _stream_groups(model, checkpoint: str) -> Iterator[Tuple[str, Dict]]:
    """``(group, {megatron name: tensor})`` for the embedding, each layer and the head, one group at a
    time: the converter's :func:`tools.hf.conversion.stream_checkpoint` (``dist_checkpointing``
    reshards any saved layout; a dropped group is freed), with its errors as :class:`InspectError`."""
    from tools.hf import ConversionError, stream_checkpoint

    try:
        yield from stream_checkpoint(model, checkpoint, progress=False)
    except ConversionError as e:
        raise InspectError(str(e)) from None


def stream_checkpoint_layers(src, preset, info: ModelInfo, progress: bool) -> Iterator[Tuple[str, Dict]]:
    """``(group, {hf name: tensor})``: the embedding, then each decoder layer, read one group at a time
    from the checkpoint by ``dist_checkpointing`` (``tools.hf.conversion.stream_checkpoint``)."""
    import tools.hf as C
    from models.hf.export import mapping as M

    arch = M.arch_of(preset.backbone)
    with C.single_rank():
        model = C.build_single_rank_model(preset, info.vocab_size, info.seq_length)
        try:
            for g, tensors in _stream_groups(model, src.checkpoint):
                if g == "head":
                    break  # the final norm and LM head are not needed
                yield g, M.megatron_to_hf(tensors, arch, fused_experts=True)
                del tensors
        except C.ConversionError as e:
            raise InspectError(str(e)) from None


def stream_hf_layers(hf_dir: str, info: ModelInfo) -> Iterator[Tuple[str, Dict]]:
    """``(group, {hf name: tensor})`` from an exported folder (safetensors, one group at a time), in the
    fused expert layout the remote model uses (the Hub's per-expert layout is converted)."""
    import tools.hf as C
    from models.hf.export import mapping as M

    cfg = info.hf_config
    arch = {"heads": int(cfg.num_attention_heads), "groups": int(cfg.num_key_value_heads),
            "head_dim": int(cfg.head_dim), "num_experts": int(cfg.n_routed_experts)}
    try:
        for g, tensors in C.read_hf_tensors(hf_dir):
            if g == "head":
                continue
            if g.startswith("layer.") and int(g.split(".")[1]) >= info.num_layers:
                continue
            tensors = {k: v.float() for k, v in tensors.items()}
            if any(".mlp.experts." in k and k.endswith("_proj.weight") for k in tensors):
                tensors = M.megatron_to_hf(M.hf_to_megatron(tensors, arch), arch, fused_experts=True)
            yield g, tensors
    except C.ConversionError as e:
        raise InspectError(f"{hf_dir}: {str(e).split(': ', 1)[-1]}") from None


def build_layer(info: ModelInfo, i: int, tensors: Dict):
    """One remote-code decoder layer (``XHCMoeDecoderLayer``) holding ``tensors`` (HF names of layer i)."""
    import torch

    from models.hf.export.remote.modeling_xhc_moe import XHCMoeDecoderLayer

    prefix = f"model.layers.{i}."
    sd = {k[len(prefix):]: v.float() for k, v in tensors.items() if k.startswith(prefix)}
    with torch.device("meta"):
        layer = XHCMoeDecoderLayer(info.hf_config, i)
    missing, unexpected = layer.load_state_dict(sd, strict=False, assign=True)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise InspectError(f"layer {i}: tensors do not fit the model ({len(missing)} missing, e.g. "
                           f"{(missing or unexpected)[0]}; {len(unexpected)} unexpected)")
    for name, b in list(layer.named_buffers()):
        if b.is_meta:
            raise InspectError(f"layer {i}: buffer {name} has no value in the checkpoint")
    return layer.eval()
