"""Finetune a frozen Hugging Face causal LM with an mHC adapter (optionally + LoRA/VeRA) ([PEFT], docs/math.md §6.6).

Run::

    xhc-finetune --config configs/finetune/olmo2_1b_identity_n4.yaml [key=value ...]
    python -m training.finetune --config configs/finetune/tiny_cpu.yaml train.max_steps=20

Pipeline:

1. **Data** (:func:`load_chat_dataset`): an instruction/chat dataset through HF ``datasets``: a local
   JSONL/JSON or parquet file (or a directory of them), or a hub id where a network exists.  Every
   row has a list of ``{"role", "content"}`` messages and a source label.
2. **Split** (:func:`stratified_split`): [PEFT] App. C.4 — per-source budgets n_s = ⌊n·N_s/N⌋,
   the remainder to the largest fractional parts, sampling without replacement under a fixed seed;
   validation, test and train are disjoint.
3. **Tokenise and pack** (:func:`tokenize_chats`, :func:`pack`): the tokenizer's chat template,
   then fixed blocks of ``max_length`` tokens (the training tail is dropped; evaluation keeps it,
   padded, out of the loss).
4. **Model**: the backbone (from a path, or a tiny random one from a config), frozen, wrapped by
   :func:`models.hf.wrap_with_mhc`, optionally LoRA/VeRA through ``peft``; diagnostics first.
5. **Train**: AdamW (weight decay 0), cosine schedule with 3 % warmup, clipping 1.0, gradient
   accumulation, bf16 autocast on GPU; separate learning rates for mHC (1e-3) and LoRA/VeRA (1e-4).
6. **Report**: held-out loss and perplexity (validation during training, test at the end),
   trainable-parameter report, console progress, ``metrics.jsonl`` and tensorboard.
   The adapter is saved as ``hc_adapter.safetensors`` + ``hc_adapter_config.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import ClassVar, Dict, Iterator, List, Optional, Sequence, Union

import torch

from configs import resolve_config
from training.config import parse_overrides
from training.run import MetricsLogger as _MetricsLogger
from xhc.config import HCConfig
from xhc.config_base import ConfigBase, ConfigKeyError, set_dotted

# ================================================================================================
# Configuration
# ================================================================================================
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class FinetuneConfigError(ValueError):
    """A finetuning configuration value is invalid (the message names the key and the fix)."""


class _Section(ConfigBase):
    """The finetuning config's flavour of :class:`xhc.config_base.ConfigBase` (values pass as given;
    :meth:`FinetuneConfig.validate` checks them)."""

    config_error: ClassVar[type] = FinetuneConfigError


@dataclass
class ModelArgs(_Section):
    name_or_path: Optional[str] = None
    """A local model folder (or a hub id where a network exists)."""
    tiny: Optional[dict] = None
    """Instead of ``name_or_path``: a random tiny model, ``models.hf.tiny.tiny_config`` kwargs (family, ...)."""
    tokenizer: Optional[str] = None
    """Tokenizer folder; default ``name_or_path``; ``char`` = the built-in character tokenizer."""
    chat_template: Optional[str] = None
    """Jinja chat template to use when the tokenizer has none."""
    dtype: str = "float32"
    """Backbone weights: float32 (bf16 autocast on GPU) or bfloat16."""
    attn_implementation: Optional[str] = "sdpa"


@dataclass
class PeftArgs(_Section):
    method: str = "none"
    """none | lora | vera (combined with the mHC adapter)."""
    r: int = 8
    alpha: int = 16
    dropout: float = 0.05
    target_modules: List[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    lr: float = 1e-4
    """LoRA/VeRA learning rate ([PEFT] Table 13: 1e-4)."""
    vera_prng_key: int = 343434


@dataclass
class DataArgs(_Section):
    path: Optional[str] = None
    """JSONL/JSON/parquet file, a directory of them, or a hub dataset id."""
    format: str = "auto"
    """auto | json | parquet | hub."""
    hub_split: str = "train"
    messages_field: str = "messages"
    source_field: str = "source"
    """Column with the source label (stratification); missing -> one stratum."""
    train_size: Union[int, float, None] = None
    """Examples (int), fraction (float < 1) or None = all that remain after validation/test."""
    validation_size: Union[int, float] = 0.05
    test_size: Union[int, float] = 0.05
    split_seed: int = 343434
    """[PEFT] Table 10 validation/test split seed."""
    max_length: int = 2048
    packing: bool = True
    cache_dir: Optional[str] = None
    """Cache the split, tokenised and packed data here (reused by every run with the same data,
    tokenizer and split settings, as [PEFT] App. C.4 does); None = no cache."""


@dataclass
class TrainArgs(_Section):
    seed: int = 34
    lr: float = 1e-3
    """mHC learning rate ([PEFT]: 1e-3; 1e-4 for dynamic Sinkhorn mHC and mHC-lite)."""
    weight_decay: float = 0.0
    warmup_ratio: float = 0.03
    max_steps: int = 3000
    batch_size: int = 4
    grad_accum: int = 4
    clip: float = 1.0
    eval_interval: int = 2500
    eval_batches: Optional[int] = None
    """Cap on evaluation batches (None = the whole split)."""
    log_interval: int = 10
    save_interval: Optional[int] = None
    device: str = "auto"
    """auto | cpu | cuda | cuda:N."""
    bf16: str = "auto"
    """auto (on for CUDA) | true | false: bf16 autocast."""
    out_dir: str = "runs/finetune"
    tensorboard: bool = True
    diagnostics: bool = True
    diagnostics_steps: int = 50
    num_threads: Optional[int] = None


@dataclass
class FinetuneConfig(_Section):
    model: ModelArgs = field(default_factory=ModelArgs)
    hc: dict = field(default_factory=lambda: {"variant": "identity", "n": 4, "dynamic": True})
    """HCConfig fields.  ``base: peft_paper`` (default) starts from :func:`models.hf.peft_paper_config`
    (variant, n, dynamic) and applies the other keys on top; ``base: spec`` starts from HCConfig()."""
    peft: PeftArgs = field(default_factory=PeftArgs)
    data: DataArgs = field(default_factory=DataArgs)
    train: TrainArgs = field(default_factory=TrainArgs)

    SECTIONS = ("model", "hc", "peft", "data", "train")

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> "FinetuneConfig":
        """The config of the mapping ``d`` (an unknown key is an error naming ``section.key``), validated;
        ``source`` (the file) starts every error message."""
        if isinstance(d, dict) and "hc" in d:
            d = {**d, "hc": dict(d["hc"] or {})}
        try:
            cfg = super().from_dict(d)
        except FinetuneConfigError as e:
            raise FinetuneConfigError(f"{source}: {e}") from None
        cfg.validate(source)
        return cfg

    @classmethod
    def load(cls, path: Optional[str], overrides: Sequence[str] = ()) -> "FinetuneConfig":
        """YAML file plus ``section.key=value`` overrides (values parsed as YAML)."""
        import yaml

        d = {}
        if path:
            path = resolve_config(path, "finetune")  # a path, or a packaged config's name
            if not os.path.isfile(path):
                raise FinetuneConfigError(f"--config {path}: file not found")
            try:
                with open(path, encoding="utf-8") as f:
                    d = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                mark = getattr(e, "problem_mark", None)
                where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
                raise FinetuneConfigError(f"--config {path}: not valid YAML ({where}{getattr(e, 'problem', None) or e})"
                                          ) from None
            except UnicodeDecodeError:
                raise FinetuneConfigError(f"--config {path}: not UTF-8 text; save the YAML file as UTF-8") from None
            if not isinstance(d, dict):
                raise FinetuneConfigError(f"--config {path}: the top level must be a mapping of sections "
                                          f"(model, hc, peft, data, train), got a {type(d).__name__}")
        for key, value in parse_overrides(overrides, example="train.max_steps=100", error=FinetuneConfigError,
                                          strict=True):
            try:
                set_dotted(d, key, value)
            except ConfigKeyError as e:
                raise FinetuneConfigError(f"override {key}: {e.msg}") from None
        return cls.from_dict(d, source=path or "overrides")

    def hc_config(self) -> HCConfig:
        from models.hf.mhc_adapter import peft_paper_config

        d = dict(self.hc)
        base = d.pop("base", "peft_paper")
        if base == "spec":
            return HCConfig.from_dict(d)
        if base != "peft_paper":
            raise FinetuneConfigError(f"hc.base={base!r}; allowed: peft_paper, spec")
        HCConfig.from_dict(d)  # unknown keys -> error naming the key
        return peft_paper_config(d.pop("variant", "identity"), d.pop("n", 4), d.pop("dynamic", True), **d)

    def validate(self, source: str = "config") -> None:
        self.hc_config()  # HCConfigError names the field
        if self.peft.method not in ("none", "lora", "vera"):
            raise FinetuneConfigError(f"{source}: peft.method={self.peft.method!r}; allowed: none, lora, vera")
        if (self.model.name_or_path is None) == (self.model.tiny is None):
            raise FinetuneConfigError(f"{source}: set exactly one of model.name_or_path and model.tiny")
        if self.model.dtype not in ("float32", "bfloat16"):
            raise FinetuneConfigError(f"{source}: model.dtype={self.model.dtype!r}; allowed: float32, bfloat16")
        if self.data.format not in ("auto", "json", "parquet", "hub"):
            raise FinetuneConfigError(f"{source}: data.format={self.data.format!r}; allowed: auto, json, parquet, hub")
        if self.train.bf16 not in ("auto", True, False, "true", "false"):
            raise FinetuneConfigError(f"{source}: train.bf16={self.train.bf16!r}; allowed: auto, true, false")
        for name in ("max_steps", "batch_size", "grad_accum", "log_interval", "eval_interval"):
            v = getattr(self.train, name)
            if not isinstance(v, int) or v < 1:
                raise FinetuneConfigError(f"{source}: train.{name}={v!r} must be an integer >= 1")
        if not 0 <= self.train.warmup_ratio < 1:
            raise FinetuneConfigError(f"{source}: train.warmup_ratio={self.train.warmup_ratio!r} must lie in [0, 1)")
        if not isinstance(self.data.max_length, int) or self.data.max_length < 2:
            raise FinetuneConfigError(f"{source}: data.max_length={self.data.max_length!r} must be an integer >= 2")



# ================================================================================================
# Data
# ================================================================================================
def _resolve_size(size: Union[int, float, None], total: int, name: str) -> Optional[int]:
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, (int, float)) or size < 0:
        raise FinetuneConfigError(f"data.{name}={size!r} must be a count (int), a fraction (< 1) or null")
    if isinstance(size, float) and size < 1:
        return int(round(size * total))
    return int(size)


def proportional_budgets(counts: Dict[str, int], n: int) -> Dict[str, int]:
    """[PEFT] App. C.4: n_s = ⌊n·N_s/N⌋, then the remaining samples one each to the sources with
    the largest fractional remainders (ties: larger source first, then name)."""
    total = sum(counts.values())
    if n > total:
        raise FinetuneConfigError(f"requested {n} examples but the dataset has only {total}")
    exact = {s: n * c / total for s, c in counts.items()}
    budget = {s: int(math.floor(v)) for s, v in exact.items()}
    rest = n - sum(budget.values())
    order = sorted(counts, key=lambda s: (-(exact[s] - budget[s]), -counts[s], str(s)))
    for s in order[:rest]:
        budget[s] += 1
    return budget


def stratified_split(sources: Sequence, sizes: Dict[str, Optional[int]], seed: int) -> Dict[str, List[int]]:
    """Disjoint splits with the source distribution of the full data ([PEFT] App. C.4).

    ``sizes``: ordered ``{split: count or None}``; ``None`` (at most one, last) takes everything left.
    Each source's indices are shuffled once with ``seed``; splits take consecutive slices of them,
    with per-source budgets from :func:`proportional_budgets` (capped by what the source has left,
    the shortfall going to the sources with the most left).  Each split's indices are shuffled.
    """
    by_source: Dict[str, List[int]] = {}
    for i, s in enumerate(sources):
        by_source.setdefault(str(s), []).append(i)
    rng = random.Random(seed)
    for s in sorted(by_source):
        rng.shuffle(by_source[s])
    counts = {s: len(v) for s, v in by_source.items()}
    used = {s: 0 for s in by_source}
    out: Dict[str, List[int]] = {}
    for split, n in sizes.items():
        left = {s: counts[s] - used[s] for s in counts}
        if n is None:
            budget = left
        else:
            if n > sum(left.values()):
                raise FinetuneConfigError(
                    f"split {split!r} wants {n} examples but only {sum(left.values())} remain; reduce the sizes")
            budget = proportional_budgets(counts, n)
            short = 0
            for s in budget:
                if budget[s] > left[s]:
                    short += budget[s] - left[s]
                    budget[s] = left[s]
            for s in sorted(left, key=lambda s: (-(left[s] - budget[s]), s)):
                if short == 0:
                    break
                take = min(short, left[s] - budget[s])
                budget[s] += take
                short -= take
        idx = []
        for s in sorted(by_source):
            idx.extend(by_source[s][used[s]:used[s] + budget[s]])
            used[s] += budget[s]
        random.Random(f"{seed}-{split}").shuffle(idx)
        out[split] = idx
    return out


def load_chat_dataset(args: DataArgs):
    """The raw ``datasets.Dataset`` (local JSONL/JSON/parquet file or directory, or a hub id)."""
    import datasets

    path = args.path
    if not path:
        raise FinetuneConfigError("data.path is not set: give a JSONL/parquet file, a folder, or a hub dataset id")
    fmt = args.format
    files: List[str] = []
    if os.path.isdir(path):
        for ext in ("jsonl", "json", "parquet"):
            files += sorted(glob.glob(os.path.join(path, f"*.{ext}")))
        if not files:
            raise FinetuneConfigError(f"data.path={path}: folder holds no .jsonl/.json/.parquet files")
    elif os.path.isfile(path):
        files = [path]
    if files:
        if fmt == "auto":
            fmt = "parquet" if files[0].endswith(".parquet") else "json"
        if fmt == "hub":
            raise FinetuneConfigError(f"data.format=hub but data.path={path} is a local path")
        from training.data import DataError
        from training.data import check_text_file

        bars_were_off = datasets.are_progress_bars_disabled()
        datasets.disable_progress_bars()  # stderr carries errors only
        try:
            for f in files:
                check_text_file(f, fmt)  # empty / not UTF-8 / not JSON Lines: the file and line
            return datasets.load_dataset(fmt, data_files=files, split="train")
        except DataError as e:
            raise FinetuneConfigError(f"data.path: {str(e).removeprefix('input: ')}") from None
        except Exception as e:  # datasets raises many types: one line naming the file
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise FinetuneConfigError(f"data.path={path}: could not read it as {fmt} ({first})") from None
        finally:
            if not bars_were_off:
                datasets.enable_progress_bars()
    if fmt in ("json", "parquet"):
        raise FinetuneConfigError(f"data.path={path}: file not found")
    return datasets.load_dataset(path, split=args.hub_split)  # hub (needs a network)


def check_conversations(dataset, args: DataArgs) -> None:
    """Every row's ``messages_field`` is a non-empty list of ``{"role": str, "content": str}``; a one-line
    :class:`FinetuneConfigError` naming the file and the (1-based) row otherwise."""
    field = args.messages_field
    if len(dataset) == 0:
        raise FinetuneConfigError(f"data.path={args.path}: no rows; give chat data, one "
                                  f'{{"{field}": [{{"role": ..., "content": ...}}]}} per line')
    if field not in dataset.column_names:
        raise FinetuneConfigError(f"data.path={args.path}: no {field!r} column (columns: "
                                  f"{', '.join(dataset.column_names)}); set data.messages_field, or give chat data "
                                  f'as {{"{field}": [{{"role": ..., "content": ...}}]}} per row')
    for i, conv in enumerate(dataset[field], 1):
        ok = isinstance(conv, list) and conv and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in conv)
        if not ok:
            raise FinetuneConfigError(f"data.path={args.path} row {i}: {field} must be a non-empty list of "
                                      f'{{"role": str, "content": str}} messages, got {str(conv)[:60]!r}')


def tokenize_chats(dataset, tokenizer, messages_field: str = "messages", chunk: int = 1024) -> List[List[int]]:
    """Token ids of every conversation through the tokenizer's chat template."""
    if messages_field not in dataset.column_names:
        raise FinetuneConfigError(f"data.messages_field={messages_field!r} is not a column of the dataset "
                                  f"(columns: {', '.join(dataset.column_names)})")
    out: List[List[int]] = []
    convs = dataset[messages_field]
    for i in range(0, len(convs), chunk):
        texts = [tokenizer.apply_chat_template(m, tokenize=False) for m in convs[i:i + chunk]]
        out.extend(tokenizer(texts, add_special_tokens=False)["input_ids"])  # batched fast tokenizer
    return out


def pack(sequences: Sequence[Sequence[int]], max_length: int, keep_tail: bool, pad_id: int):
    """Concatenate and cut into ``[k, max_length]`` blocks; returns (input_ids, labels) long tensors.

    ``keep_tail``: keep the last partial block, padded with ``pad_id`` and labels −100.
    """
    flat = [t for seq in sequences for t in seq]
    nfull = len(flat) // max_length
    blocks = [flat[i * max_length:(i + 1) * max_length] for i in range(nfull)]
    labels = [list(b) for b in blocks]
    tail = flat[nfull * max_length:]
    if keep_tail and len(tail) > 1:
        pad = max_length - len(tail)
        blocks.append(tail + [pad_id] * pad)
        labels.append(tail + [-100] * pad)
    if not blocks:
        return torch.zeros(0, max_length, dtype=torch.long), torch.zeros(0, max_length, dtype=torch.long)
    return torch.tensor(blocks, dtype=torch.long), torch.tensor(labels, dtype=torch.long)


def pad_examples(sequences: Sequence[Sequence[int]], max_length: int, pad_id: int):
    """No packing: one example per row, truncated to ``max_length`` and right-padded."""
    ids, labels = [], []
    for seq in sequences:
        s = list(seq[:max_length])
        pad = max_length - len(s)
        ids.append(s + [pad_id] * pad)
        labels.append(s + [-100] * pad)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(labels, dtype=torch.long)


@dataclass
class Splits:
    train: tuple  # (input_ids [k, T], labels [k, T])
    validation: tuple
    test: tuple
    source_counts: Dict[str, Dict[str, int]]


def _cache_key(args: DataArgs, tokenizer) -> str:
    import hashlib

    d = dataclasses.asdict(args)
    d.pop("cache_dir")
    if args.path and os.path.exists(args.path):
        files = [args.path] if os.path.isfile(args.path) else sorted(glob.glob(os.path.join(args.path, "*")))
        d["files"] = [(f, os.path.getsize(f), os.path.getmtime(f)) for f in files]
    d["tokenizer"] = [getattr(tokenizer, "name_or_path", ""), len(tokenizer), tokenizer.chat_template or "",
                      hashlib.sha256(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode()).hexdigest()]
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def prepare_data(args: DataArgs, tokenizer) -> Splits:
    """Load, split by source, tokenise and pack (through ``args.cache_dir`` when set)."""
    if args.cache_dir:
        path = os.path.join(args.cache_dir, f"packed-{_cache_key(args, tokenizer)}.pt")
        if os.path.isfile(path):
            d = torch.load(path)
            return Splits(d["train"], d["validation"], d["test"], d["source_counts"])
        splits = _prepare_data(args, tokenizer)
        os.makedirs(args.cache_dir, exist_ok=True)
        tmp = path + ".tmp"
        torch.save(dataclasses.asdict(splits), tmp)
        os.replace(tmp, path)
        return splits
    return _prepare_data(args, tokenizer)


def _prepare_data(args: DataArgs, tokenizer) -> Splits:
    ds = load_chat_dataset(args)
    check_conversations(ds, args)
    n = len(ds)
    sources = ds[args.source_field] if args.source_field in ds.column_names else ["all"] * n
    sizes = {
        "validation": _resolve_size(args.validation_size, n, "validation_size"),
        "test": _resolve_size(args.test_size, n, "test_size"),
        "train": _resolve_size(args.train_size, n, "train_size"),
    }
    idx = stratified_split(sources, sizes, args.split_seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    out, counts = {}, {}
    for split in ("train", "validation", "test"):
        sub = ds.select(idx[split])
        seqs = tokenize_chats(sub, tokenizer, args.messages_field)
        c: Dict[str, int] = {}
        for i in idx[split]:
            c[str(sources[i])] = c.get(str(sources[i]), 0) + 1
        counts[split] = c
        if args.packing:
            out[split] = pack(seqs, args.max_length, keep_tail=(split != "train"), pad_id=pad_id)
        else:
            out[split] = pad_examples(seqs, args.max_length, pad_id)
    if out["train"][0].shape[0] == 0:
        raise FinetuneConfigError(f"data: the training split has fewer than data.max_length={args.max_length} "
                                  "tokens; lower max_length or add data")
    return Splits(out["train"], out["validation"], out["test"], counts)


def train_batches(data: tuple, batch_size: int, seed: int) -> Iterator[tuple]:
    """Endless shuffled mini-batches (a new permutation every epoch)."""
    ids, labels = data
    g = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(ids.shape[0], generator=g)
        for i in range(0, len(perm) - batch_size + 1 if len(perm) >= batch_size else 1, batch_size):
            j = perm[i:i + batch_size]
            yield ids[j], labels[j]


# ================================================================================================
# Model
# ================================================================================================
def build_tokenizer(args: ModelArgs):
    from models.hf.tiny import char_tokenizer

    name = args.tokenizer or args.name_or_path
    if name is None or name == "char":
        tok = char_tokenizer()
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(name)
    if args.chat_template:
        tok.chat_template = args.chat_template
    if not getattr(tok, "chat_template", None):
        raise FinetuneConfigError(f"tokenizer {name!r} has no chat template; set model.chat_template")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def check_model_supported(args: ModelArgs) -> None:
    """Before anything is written: the backbone's family can be wrapped (reads only its config)."""
    from models.hf.mhc_adapter import FAMILIES

    if args.tiny is not None:
        family = dict(args.tiny).get("family", "llama")
        if family not in FAMILIES:
            raise FinetuneConfigError(f"model.tiny.family={family!r}: not supported; allowed: {', '.join(FAMILIES)}")
        return
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(args.name_or_path)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FinetuneConfigError(f"model.name_or_path={args.name_or_path}: cannot read its config ({first})") from None
    if config.model_type not in FAMILIES:
        arch = ", ".join(getattr(config, "architectures", None) or []) or config.model_type
        raise FinetuneConfigError(f"model.name_or_path={args.name_or_path}: {arch} (model_type "
                                  f"{config.model_type!r}) cannot be wrapped with mHC; supported model types: "
                                  f"{', '.join(FAMILIES)}")


def build_backbone(args: ModelArgs, seed: int):
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    kw = {"attn_implementation": args.attn_implementation} if args.attn_implementation else {}
    if args.tiny is not None:
        from models.hf.tiny import tiny_config

        t = dict(args.tiny)
        family = t.pop("family", "llama")
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(tiny_config(family, **t), dtype=dtype, **kw)
    return AutoModelForCausalLM.from_pretrained(args.name_or_path, dtype=dtype, **kw)


def apply_peft(model, args: PeftArgs):
    """LoRA or VeRA on the (already mHC-wrapped) model; the mHC parameters stay trainable."""
    if args.method == "none":
        return model
    from peft import LoraConfig, VeraConfig, get_peft_model

    from models.hf.mhc_adapter import mark_adapter_trainable

    if args.method == "lora":
        pc = LoraConfig(r=args.r, lora_alpha=args.alpha, lora_dropout=args.dropout, bias="none",
                        target_modules=list(args.target_modules), task_type="CAUSAL_LM")
    else:
        pc = VeraConfig(r=args.r, vera_dropout=args.dropout, target_modules=list(args.target_modules),
                        projection_prng_key=args.vera_prng_key, task_type="CAUSAL_LM")
    model = get_peft_model(model, pc)
    return mark_adapter_trainable(model)


# ================================================================================================
# Logging
# ================================================================================================
class MetricsLogger(_MetricsLogger):
    """:class:`training.run.metrics.MetricsLogger` (console, ``metrics.jsonl``, tensorboard under
    ``tb/``) with finetuning's call style ``log(kind, step, **values)``."""

    def __init__(self, out_dir: str, tensorboard: bool = True, stream=None):
        self.stream = stream or sys.stdout
        super().__init__(out_dir, tensorboard_dir=os.path.join(out_dir, "tb") if tensorboard else None,
                         print_fn=lambda msg: print(msg, file=self.stream, flush=True))
        self.path = self.jsonl_path
        for note in self.notes:  # e.g. tensorboard missing: keep going without it
            self.print(f"[finetune] {note}")

    def log(self, kind: str, step: int, **values) -> None:
        self.write(kind, step, values)


# ================================================================================================
# Training
# ================================================================================================
def _autocast(device: torch.device, enabled: bool):
    if enabled:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    import contextlib

    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model, data: tuple, batch_size: int, device, use_bf16: bool, max_batches: Optional[int] = None) -> dict:
    """Token-weighted mean next-token loss and perplexity on ``(input_ids, labels)``."""
    ids, labels = data
    was = model.training
    model.eval()
    total, count = 0.0, 0
    for b, i in enumerate(range(0, ids.shape[0], batch_size)):
        if max_batches is not None and b >= max_batches:
            break
        x, y = ids[i:i + batch_size].to(device), labels[i:i + batch_size].to(device)
        attn = (y != -100).long() if (y == -100).any() else None
        with _autocast(device, use_bf16):
            loss = model(input_ids=x, attention_mask=attn, labels=y, use_cache=False).loss
        ntok = int((y[:, 1:] != -100).sum())
        total += loss.item() * ntok
        count += ntok
    model.train(was)
    loss = total / max(count, 1)
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": count}


def cosine_lambda(warmup: int, total: int):
    """``LambdaLR`` factor: linear warmup to 1 over ``warmup`` steps, then cosine decay to 0 at
    the last update ``total − 1`` (:mod:`training.schedule`'s ``cosine`` kind, floor 0)."""
    from training.schedule import ScheduleConfig, schedule_factor

    cfg = ScheduleConfig(kind="cosine", warmup_steps=warmup, total_steps=total, min_lr_ratio=0.0)
    return lambda step: schedule_factor(step, cfg)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def run(cfg: FinetuneConfig, stream=None) -> dict:
    """Finetune per ``cfg``; returns the final summary (also written to ``summary.json``)."""
    from models.hf.diagnostics import run_adapter_diagnostics
    from models.hf.mhc_adapter import (adapter_param_groups, save_adapter, trainable_parameter_report,
                                       wrap_with_mhc)

    t0 = time.time()
    tr = cfg.train
    if tr.num_threads:
        torch.set_num_threads(tr.num_threads)
    torch.manual_seed(tr.seed)
    random.seed(tr.seed)
    device = _device(tr.device)
    use_bf16 = device.type == "cuda" if tr.bf16 == "auto" else tr.bf16 in (True, "true")
    # inputs are checked before anything is written to out_dir
    tokenizer = build_tokenizer(cfg.model)
    check_model_supported(cfg.model)
    splits = prepare_data(cfg.data, tokenizer)
    log = MetricsLogger(tr.out_dir, tr.tensorboard, stream)
    log.print(f"[finetune] device={device} bf16_autocast={use_bf16} out_dir={tr.out_dir}")
    log.print("[finetune] data: " + ", ".join(
        f"{s} {sum(splits.source_counts[s].values())} examples -> {getattr(splits, s)[0].shape[0]} blocks"
        for s in ("train", "validation", "test")))
    log.log("data", 0, **{f"{s}_blocks": int(getattr(splits, s)[0].shape[0]) for s in ("train", "validation", "test")},
            sources={s: splits.source_counts[s] for s in splits.source_counts})

    model = build_backbone(cfg.model, tr.seed)
    model.to(device)
    hc_cfg = cfg.hc_config()
    wrap_with_mhc(model, hc_cfg)
    model = apply_peft(model, cfg.peft)
    report = trainable_parameter_report(model)
    log.print(f"[finetune] trainable parameters: mHC {report['hc']:,} + other {report['other_trainable']:,} "
              f"= {report['trainable']:,} of {report['total']:,} ({report['trainable_percent']:.4f}%)")
    log.log("params", 0, **report)

    if tr.diagnostics:
        n = min(2, splits.train[0].shape[0])
        x = splits.train[0][:n, :min(64, cfg.data.max_length)].to(device)
        diag = run_adapter_diagnostics(model, x, overfit_steps=tr.diagnostics_steps)
        log.print("[finetune] diagnostics:\n" + diag.table())
        log.log("diagnostics", 0, ok=diag.ok, **{c.name: c.value for c in diag.checks if c.value is not None})
        if not diag.ok:
            log.close()
            raise RuntimeError("[finetune] adapter diagnostics failed; see the table above")

    groups = adapter_param_groups(model, hc_lr=tr.lr, other_lr=cfg.peft.lr, weight_decay=tr.weight_decay)
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.999), eps=1e-8)
    warmup = int(math.ceil(tr.warmup_ratio * tr.max_steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_lambda(warmup, tr.max_steps))
    trainable = [p for g in groups for p in g["params"]]

    base = evaluate(model, splits.validation, tr.batch_size, device, use_bf16, tr.eval_batches)
    log.print(f"[finetune] step 0 validation loss {base['loss']:.4f} ppl {base['ppl']:.3f}")
    log.log("validation", 0, loss=base["loss"], ppl=base["ppl"])

    batches = train_batches(splits.train, tr.batch_size, tr.seed)
    model.train()
    tokens, t_last, tok_last = 0, time.time(), 0
    last_val = base
    for step in range(1, tr.max_steps + 1):
        loss_sum = 0.0
        for _ in range(tr.grad_accum):
            x, y = next(batches)
            x, y = x.to(device), y.to(device)
            attn = (y != -100).long() if not cfg.data.packing else None
            with _autocast(device, use_bf16):
                loss = model(input_ids=x, attention_mask=attn, labels=y, use_cache=False).loss / tr.grad_accum
            loss.backward()
            loss_sum += loss.item()
            tokens += int(x.numel())
        gnorm = float(torch.nn.utils.clip_grad_norm_(trainable, tr.clip))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % tr.log_interval == 0 or step == tr.max_steps:
            now = time.time()
            tps = (tokens - tok_last) / max(now - t_last, 1e-9)
            t_last, tok_last = now, tokens
            lrs = {f"lr_{g.get('name', i)}": g["lr"] for i, g in enumerate(opt.param_groups)}
            log.print(f"[finetune] step {step}/{tr.max_steps} | loss {loss_sum:.4f} | grad {gnorm:.3g} | "
                      + " ".join(f"{k} {v:.2e}" for k, v in lrs.items())
                      + f" | {tps:,.0f} tok/s | {now - t0:.1f}s")
            log.log("train", step, loss=loss_sum, grad_norm=gnorm, tokens=tokens, tokens_per_s=tps, **lrs)
        if step % tr.eval_interval == 0 or step == tr.max_steps:
            last_val = evaluate(model, splits.validation, tr.batch_size, device, use_bf16, tr.eval_batches)
            log.print(f"[finetune] step {step} validation loss {last_val['loss']:.4f} ppl {last_val['ppl']:.3f}")
            log.log("validation", step, loss=last_val["loss"], ppl=last_val["ppl"])
        if tr.save_interval and step % tr.save_interval == 0:
            save_adapter(model, os.path.join(tr.out_dir, f"adapter_step{step}"))

    test = evaluate(model, splits.test, tr.batch_size, device, use_bf16, tr.eval_batches)
    log.print(f"[finetune] test loss {test['loss']:.4f} ppl {test['ppl']:.3f}")
    log.log("test", tr.max_steps, loss=test["loss"], ppl=test["ppl"])
    adapter_dir = os.path.join(tr.out_dir, "adapter")
    save_adapter(model, adapter_dir)
    if cfg.peft.method != "none":
        model.save_pretrained(os.path.join(tr.out_dir, "peft_adapter"))
    summary = {
        "validation_loss_init": base["loss"], "validation_loss": last_val["loss"], "validation_ppl": last_val["ppl"],
        "test_loss": test["loss"], "test_ppl": test["ppl"], "params": report, "steps": tr.max_steps,
        "tokens": tokens, "wall_time_s": time.time() - t0, "adapter_dir": adapter_dir, "config": cfg.to_dict(),
    }
    with open(os.path.join(tr.out_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    log.print(f"[finetune] done in {summary['wall_time_s']:.1f}s; adapter saved to {adapter_dir}")
    log.close()
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="xhc-finetune", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file (sections model, hc, peft, data, train)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.max_steps=100")
    a = p.parse_args(argv)
    try:
        cfg = FinetuneConfig.load(a.config, a.overrides)
    except (FinetuneConfigError, ValueError) as e:
        print(f"xhc-finetune: {e}", file=sys.stderr)
        return 2
    from models.hf.mhc_adapter import UnsupportedModelError

    try:
        run(cfg)
    except (FinetuneConfigError, UnsupportedModelError) as e:
        print(f"xhc-finetune: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
