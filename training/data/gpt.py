"""Training datasets: Megatron's GPT datasets and a deterministic, resumable micro-batch iterator.

:func:`build_datasets` builds train/valid/test with Megatron-Core's
``BlendedMegatronDatasetBuilder`` (``GPTDataset``; ``MockGPTDataset`` for mock data).  Order is
a function of the data, the split, the sequence length, the sample counts and the seed only.
Under ``torch.distributed`` every rank calls it: Megatron builds the index caches on rank 0,
then a barrier, then the other ranks load them.

:func:`make_data_iterator` walks a dataset the way Megatron's ``MegatronPretrainingSampler``
does: global sample positions ``consumed, consumed + 1, ...`` are grouped ``micro_batch_size *
dp_size`` at a time and DP rank ``r`` takes the ``r``-th block of ``micro_batch_size`` in each
group.  The position is one integer (global consumed samples), so a run resumes exactly.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence

import numpy as np
import torch

from training.data._util import DataError
from xhc.config_base import ConfigBase

DEFAULT_SPLIT = "969,30,1"
SPLIT_NAMES = ("train", "valid", "test")


@dataclass
class DataConfig(ConfigBase):
    """Where training data comes from and how GPT samples are formed.

    Attributes:
        prefixes: Megatron data prefixes (``<prefix>.bin/.idx``); several are blended.
        weights: blend weights, one per prefix (None: in proportion to dataset size).
        split: train/valid/test proportions of each prefix's documents, e.g. ``"969,30,1"``.
        per_split: instead of ``prefixes``/``split``: ``{"train": [...], "valid": [...], "test": [...]}``
            prefixes for each split (a missing split is not built).
        mock: use Megatron's mock data (synthetic ids) instead of files.
        cache_dir: where Megatron caches its sample indices (put it under the run dir); a
            sub-folder named by a hash of the ``.idx`` files keeps stale caches from being used.
        reset_position_ids: position ids restart after each EOD.
        reset_attention_mask: tokens do not attend across EOD.
        eod_mask_loss: no loss on EOD tokens.
        create_attention_mask: return the ``[1, s, s]`` causal mask per sample (``True`` = masked).
        mmap: memory-map the ``.bin`` files.
    """

    prefixes: Optional[list[str]] = None
    weights: Optional[list[float]] = None
    split: str = DEFAULT_SPLIT
    per_split: Optional[dict[str, list[str]]] = None
    mock: bool = False
    cache_dir: Optional[str] = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask: bool = True
    mmap: bool = True

    config_error: ClassVar[type] = DataError
    key_format: ClassVar[str] = "data config: {key}: {msg}"
    unknown_key_format: ClassVar[str] = "data config: unknown key {name!r}; known keys are {known}"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], prefix: str = "") -> "DataConfig":
        """Build from a mapping (e.g. a YAML ``data:`` section); an unknown key is an error naming it
        (:class:`xhc.config_base.ConfigBase`); one prefix may be given as a string."""
        if isinstance(d, Mapping) and isinstance(d.get("prefixes"), str):
            d = {**d, "prefixes": [d["prefixes"]]}
        return super().from_dict(d, prefix)

    def validate(self) -> None:
        if self.mock:
            return
        if self.per_split is not None:
            if self.prefixes is not None:
                raise DataError("data config: give either prefixes (+ split) or per_split, not both")
            bad = sorted(set(self.per_split) - set(SPLIT_NAMES))
            if bad:
                raise DataError(f"data config: per_split keys {bad} are not splits; use {list(SPLIT_NAMES)}")
            groups = [p for p in self.per_split.values() if p]
        else:
            if not self.prefixes:
                raise DataError("data config: no data; set prefixes (or per_split), or mock: true for synthetic data")
            groups = [self.prefixes]
            parse_split(self.split)
            if self.weights is not None and len(self.weights) != len(self.prefixes):
                raise DataError(
                    f"data config: {len(self.weights)} weights for {len(self.prefixes)} prefixes; give one weight per prefix"
                )
            if self.weights is not None and (any(w < 0 for w in self.weights) or sum(self.weights) <= 0):
                raise DataError(f"data config: weights {self.weights} must be >= 0 with a positive sum")
        for group in groups:
            for prefix in group:
                missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(p)]
                if missing:
                    raise DataError(
                        f"data config: {missing[0]!r} not found; give the prefix without .bin/.idx "
                        "(make one with `python -m tools.preprocess_data`)"
                    )


def _register_tokenizer_classes() -> None:
    """Let Megatron's isinstance checks accept our tokenizers (virtual subclasses of its base)."""
    from megatron.core.tokenizers import MegatronTokenizerBase

    from training.data.tokenizer import NullTokenizer, Tokenizer

    for cls in (Tokenizer, NullTokenizer):
        if not issubclass(cls, MegatronTokenizerBase):
            MegatronTokenizerBase.register(cls)


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> normalised ``[0.969, 0.03, 0.001]`` (missing entries are 0)."""
    parts = [p.strip() for p in str(split).replace("/", ",").split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or any(v < 0 for v in values) or sum(values) <= 0:
        raise DataError(f"data config: bad split {split!r}; use up to three non-negative numbers like '969,30,1'")
    values += [0.0] * (3 - len(values))
    return [v / sum(values) for v in values]


def split_ranges(n_docs: int, split: str) -> list[Optional[tuple[int, int]]]:
    """Document index ranges per split (None for a split with share 0), as Megatron's builder computes them."""
    from megatron.core.datasets.blended_megatron_dataset_config import convert_split_vector_to_split_matrix

    ranges = []
    for bookends in convert_split_vector_to_split_matrix(parse_split(split)):
        if bookends is None:
            ranges.append(None)
        else:
            ranges.append((int(round(bookends[0] * n_docs)), int(round(bookends[1] * n_docs))))
    return ranges


_IDX_MAGIC = b"MMIDIDX\x00\x00"
_DTYPE_BYTES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}  # Megatron's DType codes -> item size


def check_indexed_pair(prefix: str) -> int:
    """Check ``<prefix>.idx`` against ``<prefix>.bin`` before training; return the document count.

    Reads the index header (Megatron's format: magic, version 1, dtype code, sequence and document
    counts, then int32 lengths, int64 pointers, int64 document indices) and checks the index size
    and that the ``.bin`` holds exactly the tokens the index points to.  A missing, empty,
    truncated or mismatched file raises a one-line :class:`DataError` naming it.
    """
    import struct

    import numpy as np

    idx, bin_ = prefix + ".idx", prefix + ".bin"
    fix = f"re-run tools.preprocess_data for {prefix!r}"
    for path in (idx, bin_):
        if not os.path.isfile(path):
            raise DataError(f"data: {path} not found; check data.prefixes (a prefix has no .bin/.idx suffix) or {fix}")
    size = os.path.getsize(idx)
    head = 9 + 8 + 1 + 8 + 8
    if size < head:
        raise DataError(f"data: {idx} is {size} bytes, too short for an index (at least {head}): {fix}")
    with open(idx, "rb") as f:
        magic, version, code, n_seq, n_doc = (f.read(9), *struct.unpack("<QBQQ", f.read(25)))
        if magic != _IDX_MAGIC or version != 1 or code not in _DTYPE_BYTES:
            raise DataError(f"data: {idx} is not a Megatron index file (bad header): {fix}")
        expected = head + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if size != expected:
            raise DataError(f"data: {idx} is {size} bytes, its header says {expected} ({n_seq} sequences): "
                            f"the file is truncated or corrupt; {fix}")
        lengths = np.frombuffer(f.read(4 * n_seq), dtype=np.int32)
        pointers = np.frombuffer(f.read(8 * n_seq), dtype=np.int64)
    want = int(pointers[-1]) + int(lengths[-1]) * _DTYPE_BYTES[code] if n_seq else 0
    have = os.path.getsize(bin_)
    if have != want:
        what = "truncated" if have < want else "longer than its index says"
        raise DataError(f"data: {bin_} is {have} bytes, {idx} needs {want}: the .bin is {what} or belongs to "
                        f"another index; {fix}")
    return int(n_doc) - 1 if n_doc else 0


def _check_splits_nonempty(cfg: DataConfig) -> None:
    """A split with a non-zero share but no documents makes Megatron 0.16 loop forever
    (``GPTDataset._get_num_epochs`` adds 0 tokens per epoch), so refuse it up front."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if cfg.per_split is not None:
        return  # each split is a whole dataset
    for prefix in cfg.prefixes:
        count = len(IndexedDataset(prefix, mmap=False))
        for name, rng in zip(SPLIT_NAMES, split_ranges(count, cfg.split)):
            if rng is not None and rng[1] <= rng[0]:
                raise DataError(
                    f"data config: split {cfg.split!r} leaves the {name} split of {prefix!r} ({count} documents) "
                    f"empty; use more data, a larger {name} share, or share 0 for it (e.g. '98,2,0')"
                )


def _cache_dir(cfg: DataConfig) -> Optional[str]:
    """``cfg.cache_dir/<hash of the .idx files>``: a rewritten dataset never hits an old cache."""
    if cfg.mock:
        return os.path.join(cfg.cache_dir, "mock") if cfg.cache_dir else None
    prefixes = cfg.prefixes or [p for v in (cfg.per_split or {}).values() for p in (v or [])]
    base = cfg.cache_dir or os.path.join(os.path.dirname(os.path.abspath(prefixes[0])), "cache")
    h = hashlib.sha256()
    for prefix in prefixes:
        st = os.stat(prefix + ".bin")
        h.update(os.path.abspath(prefix).encode() + b"\0" + str(st.st_size).encode())
        with open(prefix + ".idx", "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return os.path.join(base, h.hexdigest()[:16])


def build_datasets(
    cfg: DataConfig | Mapping[str, Any],
    tokenizer,
    seq_length: int,
    seed: int,
    num_samples: Sequence[Optional[int]] = (None, None, None),
    is_built_on_rank: Optional[Callable[[], bool]] = None,
):
    """Build ``(train_ds, valid_ds, test_ds)`` with Megatron's ``BlendedMegatronDatasetBuilder``.

    Args:
        cfg: a :class:`DataConfig` or a mapping for :meth:`DataConfig.from_dict`.
        tokenizer: a :class:`~training.data.tokenizer.Tokenizer` (or ``NullTokenizer`` for mock data).
        seq_length: tokens per sample (each sample reads ``seq_length + 1`` tokens; labels are
            tokens shifted by one).
        seed: the shuffling seed (document order and sample order).
        num_samples: samples wanted per split (Megatron repeats epochs to reach them);
            ``None``: exactly one epoch of that split.
        is_built_on_rank: Megatron's hook; default builds on every rank.

    Returns:
        one dataset per split (``None`` for a split with share 0 or no ``per_split`` entry).
        Items are dicts of tensors: ``tokens``, ``labels`` (long ``[s]``), ``loss_mask`` (float
        ``[s]``), ``position_ids`` (long ``[s]``) and, if enabled, ``attention_mask`` (bool
        ``[1, s, s]``, ``True`` = masked).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    if not isinstance(cfg, DataConfig):
        cfg = DataConfig.from_dict(cfg)
    cfg.validate()
    if seq_length < 1:
        raise DataError(f"data: seq_length must be >= 1, got {seq_length}")
    num_samples = list(num_samples)
    if len(num_samples) != 3:
        raise DataError(f"data: num_samples needs 3 entries (train, valid, test), got {num_samples}")
    _register_tokenizer_classes()
    if not cfg.mock:
        for prefix in cfg.prefixes or [p for v in (cfg.per_split or {}).values() for p in (v or [])]:
            check_indexed_pair(prefix)
        _check_splits_nonempty(cfg)

    blend = blend_per_split = None
    split = None
    if not cfg.mock:
        if cfg.per_split is not None:
            blend_per_split = [
                (list(cfg.per_split[name]), None) if cfg.per_split.get(name) else None for name in SPLIT_NAMES
            ]
        else:
            blend = (list(cfg.prefixes), None if cfg.weights is None else [float(w) for w in cfg.weights])
            split = cfg.split
            if blend[1] is not None and any(n is None for n in num_samples):
                raise DataError("data: blend weights need a sample count for every split; pass num_samples "
                                "(train, valid, test) without None, or drop the weights")
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split,
        path_to_cache=_cache_dir(cfg),
        mmap_bin_files=cfg.mmap,
        tokenizer=tokenizer,
        reset_position_ids=cfg.reset_position_ids,
        reset_attention_mask=cfg.reset_attention_mask,
        eod_mask_loss=cfg.eod_mask_loss,
        create_attention_mask=cfg.create_attention_mask,
    )
    cls = MockGPTDataset if cfg.mock else GPTDataset
    builder = BlendedMegatronDatasetBuilder(cls, num_samples, is_built_on_rank or (lambda: True), config)
    with _rank_zero_without_process_group():
        train_ds, valid_ds, test_ds = builder.build()
    return train_ds, valid_ds, test_ds


@contextlib.contextmanager
def _rank_zero_without_process_group():
    """Megatron-Core 0.16.1's ``BlendedDataset`` calls ``torch.distributed.get_rank()`` without
    checking ``is_initialized()`` when it has a cache dir (fixed upstream after 0.16), so a
    single-process blend fails.  Without a process group, answer rank 0 while building."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        yield
        return
    real = dist.get_rank
    dist.get_rank = lambda group=None: 0
    try:
        yield
    finally:
        dist.get_rank = real


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------


def collate(samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Stack per-sample values: ``tokens``/``labels``/``loss_mask``/``position_ids`` -> ``[b, s]``,
    ``attention_mask`` ``[1, s, s]`` -> ``[b, 1, s, s]``, scalars (a blend's ``dataset_id``) -> ``[b]``."""
    out = {}
    for k in samples[0]:
        values = [s[k] for s in samples]
        if isinstance(values[0], torch.Tensor):
            out[k] = torch.stack(values)
        else:
            out[k] = torch.as_tensor(np.asarray(values))
    return out


class DataIterator:
    """Deterministic, resumable micro-batches for one data-parallel rank.

    The position is :attr:`consumed_samples`, a count of samples taken by *all* DP ranks
    together (Megatron's ``consumed_samples``); each ``next()`` advances it by
    ``micro_batch_size * dp_size``.  Global group ``g`` covers sample indices
    ``[g * m * D, (g + 1) * m * D)`` (``m`` micro batch, ``D`` DP size) and rank ``r`` gets
    ``[g*m*D + r*m, g*m*D + (r+1)*m)``.  Without ``cycle`` the last partial group is dropped
    and iteration stops; with ``cycle`` indices wrap around modulo ``len(dataset)``.
    """

    def __init__(self, dataset, micro_batch_size: int, start_sample: int = 0, dp_rank: int = 0,
                 dp_size: int = 1, cycle: bool = False):
        if dataset is None:
            raise DataError("data iterator: dataset is None (that split was not built); check split/num_samples")
        if micro_batch_size < 1:
            raise DataError(f"data iterator: micro_batch_size must be >= 1, got {micro_batch_size}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise DataError(f"data iterator: need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
        if start_sample < 0:
            raise DataError(f"data iterator: start_sample must be >= 0, got {start_sample}")
        self.dataset = dataset
        self.total = len(dataset)
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.cycle = cycle
        self.group = micro_batch_size * dp_size
        if self.total < self.group:
            raise DataError(
                f"data iterator: dataset has {self.total} samples, fewer than micro_batch_size*dp_size={self.group}; "
                "ask for more samples or use a smaller batch"
            )
        self.consumed_samples = int(start_sample)
        self.drawn: list[int] = []
        """Every sample index this iterator has returned (a caller may read and clear it)."""

    def indices(self, consumed_samples: Optional[int] = None) -> Optional[list[int]]:
        """This rank's sample indices for the group starting at ``consumed_samples`` (None: exhausted)."""
        c = self.consumed_samples if consumed_samples is None else consumed_samples
        if not self.cycle and c + self.group > self.total:
            return None
        start = c + self.dp_rank * self.micro_batch_size
        return [(start + j) % self.total for j in range(self.micro_batch_size)]

    def __iter__(self) -> "DataIterator":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        idx = self.indices()
        if idx is None:
            raise StopIteration
        batch = collate([self.dataset[i] for i in idx])
        self.consumed_samples += self.group
        self.drawn.extend(idx)
        return batch

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.consumed_samples = int(state["consumed_samples"])


def make_data_iterator(dataset, micro_batch_size: int, start_sample: int = 0, dp_rank: int = 0,
                       dp_size: int = 1, cycle: bool = False) -> DataIterator:
    """A :class:`DataIterator` over ``dataset`` starting at global sample ``start_sample``."""
    return DataIterator(dataset, micro_batch_size, start_sample, dp_rank, dp_size, cycle)


def document_positions(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """Position of each token inside its document: 0 at the sequence start and after every EOD.

    ``tokens``: ``[..., s]`` ids -> long ``[..., s]`` (the same values Megatron gives as
    ``position_ids`` with ``reset_position_ids``; for the temporal conv's ``pos_in_doc``, transpose
    to ``[s, b]``).
    """
    s = tokens.shape[-1]
    idx = torch.arange(s, device=tokens.device).expand_as(tokens)
    starts = torch.zeros_like(tokens, dtype=torch.long)
    starts[..., 1:] = torch.where(tokens[..., :-1] == eod, idx[..., 1:], 0)
    return idx - torch.cummax(starts, dim=-1).values
