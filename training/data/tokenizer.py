"""Tokenizers: train a SentencePiece model, and one wrapper with the interface Megatron's datasets use.

Megatron-Core 0.16's GPT datasets read ``tokenizer.eod`` (document separator and mask/position
resets), ``tokenizer.pad`` (masked out of the loss; must differ from ``eod``),
``tokenizer.vocab_size`` (mock data and the token dtype) and ``tokenizer.unique_identifiers``
(part of the dataset cache key).  :class:`Tokenizer` provides these for a SentencePiece
``.model`` file or a local Hugging Face tokenizer folder, plus ``tokenize``/``detokenize``.
``training.data.gpt`` registers it as a virtual subclass of Megatron's ``MegatronTokenizerBase``
(importing Megatron here would cost seconds in every tool and worker process).

Trained SentencePiece models use ids ``<pad>`` 0, ``<unk>`` 1, ``<s>`` 2, ``</s>`` 3 (the EOD),
``"\\n"`` 4, and keep text exactly: identity normalisation, no dummy prefix, whitespace kept,
byte fallback for characters outside the vocabulary, so ``detokenize(tokenize(x)) == x``.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import time
from collections import OrderedDict
from typing import Iterable, Optional, Sequence

from training.data._util import DataError, Log, atomic_open, read_json, sha256_file, write_json

DEFAULT_VOCAB_SIZE = 4096
DEFAULT_SAMPLE_LINES = 500_000
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
NO_PAD = -1  # Megatron's "no pad token" id: never present in data, so nothing is masked for it


class Tokenizer:
    """A SentencePiece or Hugging Face tokenizer behind Megatron's tokenizer interface.

    Build with :meth:`from_file` (a ``.model`` file or an HF tokenizer folder).  Token ids are
    plain ``list[int]``.  Pickles by value (the model bytes), so it can go to worker processes.
    """

    def __init__(self, kind: str, path: str, model_bytes: Optional[bytes] = None):
        if kind not in ("sentencepiece", "huggingface"):
            raise DataError(f"tokenizer: unknown kind {kind!r}; use 'sentencepiece' or 'huggingface'")
        self.kind = kind
        self.path = os.path.abspath(path)
        if kind == "sentencepiece":
            import sentencepiece as spm

            if model_bytes is None:
                with open(path, "rb") as f:
                    model_bytes = f.read()
            self._model_bytes = model_bytes
            try:
                self._sp = spm.SentencePieceProcessor(model_proto=model_bytes)
            except Exception as err:
                raise DataError(f"tokenizer: {path!r} is not a SentencePiece model ({err})") from err
            if self._sp.eos_id() < 0:
                raise DataError(f"tokenizer: SentencePiece model {path!r} has no eos token to use as EOD; retrain with eos_id set")
            self._fingerprint = hashlib.sha256(model_bytes).hexdigest()
        else:
            from transformers import AutoTokenizer

            self._model_bytes = None
            try:
                self._hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
            except Exception as err:
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise DataError(f"tokenizer: cannot load a Hugging Face tokenizer from {path!r}: {first}") from err
            if self._hf.eos_token_id is None:
                raise DataError(f"tokenizer: Hugging Face tokenizer {path!r} has no eos token to use as EOD; set eos_token")
            self._fingerprint = folder_fingerprint(path)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_file(cls, path: str) -> "Tokenizer":
        """Load from a SentencePiece ``.model`` file or a folder holding an HF tokenizer."""
        path = os.path.expanduser(os.fspath(path))
        if os.path.isdir(path):
            return cls("huggingface", path)
        if os.path.isfile(path):
            if os.path.basename(path) in ("tokenizer.json", "tokenizer_config.json"):
                return cls("huggingface", os.path.dirname(path) or ".")
            return cls("sentencepiece", path)
        raise DataError(
            f"tokenizer: {path!r} not found; pass a SentencePiece .model file or an HF tokenizer folder "
            "(train one with `python -m tools.train_tokenizer`)"
        )

    def save(self, path: str) -> None:
        """Write the SentencePiece model (atomically) or the HF tokenizer folder to ``path``."""
        if self.kind == "sentencepiece":
            with atomic_open(path, "wb") as f:
                f.write(self._model_bytes)
        else:
            self._hf.save_pretrained(path)

    def __getstate__(self):
        return {"kind": self.kind, "path": self.path, "model_bytes": self._model_bytes}

    def __setstate__(self, state):
        self.__init__(state["kind"], state["path"], state["model_bytes"])

    # ---------------------------------------------------------------- encode / decode
    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        if self.kind == "sentencepiece":
            return self._sp.encode(text, out_type=int)
        return self._hf.encode(text, add_special_tokens=False)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (no BOS/EOS added)."""
        if self.kind == "sentencepiece":
            return self._sp.encode(list(texts), out_type=int)
        return self._hf(list(texts), add_special_tokens=False)["input_ids"]

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens (pad/bos/eos) decode to nothing."""
        ids = [int(i) for i in ids]
        if self.kind == "sentencepiece":
            return self._sp.decode(ids)
        return self._hf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("xhc pre-training tokenizers have no chat template")

    # ---------------------------------------------------------------- vocabulary and specials
    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size() if self.kind == "sentencepiece" else len(self._hf)

    @property
    def vocab(self) -> dict[str, int]:
        if self.kind == "sentencepiece":
            return {self._sp.id_to_piece(i): i for i in range(self.vocab_size)}
        return dict(self._hf.get_vocab())

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: p for p, i in self.vocab.items()}

    def _id(self, sp_method: str, hf_attr: str) -> int:
        """A special token's id, or -1 when the tokenizer does not define it."""
        i = getattr(self._sp, sp_method)() if self.kind == "sentencepiece" else getattr(self._hf, hf_attr)
        return NO_PAD if i is None or i < 0 else int(i)

    @property
    def eod(self) -> int:
        """End-of-document id (SentencePiece ``</s>`` / the HF ``eos_token``)."""
        return self._id("eos_id", "eos_token_id")

    @property
    def eos(self) -> int:
        return self.eod

    @property
    def bos(self) -> int:
        """Beginning-of-sequence id, or -1 when the tokenizer has none."""
        return self._id("bos_id", "bos_token_id")

    @property
    def pad(self) -> int:
        """Padding id, or -1 (Megatron's "no pad" value) when the tokenizer has none."""
        return self._id("pad_id", "pad_token_id")

    @property
    def unk(self) -> int:
        return self._id("unk_id", "unk_token_id")

    @property
    def unique_identifiers(self) -> OrderedDict:
        """What identifies this tokenizer in Megatron's dataset cache key: kind and content hash."""
        return OrderedDict(
            [("class", f"{type(self).__module__}.{type(self).__qualname__}"), ("kind", self.kind),
             ("sha256", self._fingerprint)]
        )

    @property
    def fingerprint(self) -> str:
        """sha256 of the model bytes (SentencePiece) or of the tokenizer folder's files (HF)."""
        return self._fingerprint

    def __repr__(self) -> str:
        return f"Tokenizer({self.kind}, {self.path!r}, vocab_size={self.vocab_size}, eod={self.eod}, pad={self.pad})"


class NullTokenizer:
    """A stand-in for mock data: ``vocab_size`` ids, the last one is EOD, no pad.

    ``tokenize("3 1 4")`` gives ``[3, 1, 4]``; ``detokenize`` is the inverse.
    """

    def __init__(self, vocab_size: int):
        if vocab_size < 2:
            raise DataError(f"tokenizer: mock vocab_size must be >= 2, got {vocab_size}")
        self._vocab_size = int(vocab_size)

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("NullTokenizer has no chat template")

    vocab = property(lambda self: {str(i): i for i in range(self._vocab_size)})
    inv_vocab = property(lambda self: {i: str(i) for i in range(self._vocab_size)})
    vocab_size = property(lambda self: self._vocab_size)
    eod = property(lambda self: self._vocab_size - 1)
    eos = eod
    bos = property(lambda self: NO_PAD)
    pad = property(lambda self: NO_PAD)
    fingerprint = property(lambda self: f"null-{self._vocab_size}")
    unique_identifiers = property(
        lambda self: OrderedDict([("class", "NullTokenizer"), ("vocab_size", self._vocab_size)])
    )


def folder_fingerprint(path: str) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            h.update(name.encode() + b"\0" + sha256_file(full).encode())
    return h.hexdigest()


def load_tokenizer(path_or_tokenizer) -> "Tokenizer":
    """A :class:`Tokenizer` from a path, or the argument itself if it already is a tokenizer."""
    if isinstance(path_or_tokenizer, (str, os.PathLike)):
        return Tokenizer.from_file(os.fspath(path_or_tokenizer))
    return path_or_tokenizer


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def sample_lines(texts: Iterable[str], max_lines: int, seed: int) -> list[str]:
    """Non-empty lines of ``texts``; a fixed-seed uniform sample of ``max_lines`` if there are more.

    Reservoir sampling (Algorithm R) with ``random.Random(seed)``: memory stays at ``max_lines``
    and the result depends only on the text stream and the seed.
    """
    rng = random.Random(seed)
    reservoir: list[str] = []
    seen = 0
    for text in texts:
        for line in text.split("\n"):
            if not line.strip():
                continue
            if len(reservoir) < max_lines:
                reservoir.append(line)
            else:
                j = rng.randrange(seen + 1)
                if j < max_lines:
                    reservoir[j] = line
            seen += 1
    return reservoir


def sentencepiece_options(vocab_size: int, model_type: str, num_threads: int) -> dict:
    """The SentencePiece trainer flags used by :func:`train_sentencepiece` (deterministic, lossless)."""
    return dict(
        vocab_size=vocab_size,
        model_type=model_type,
        byte_fallback=True,
        character_coverage=0.9995,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        max_sentence_length=16384,
        input_sentence_size=0,  # sampling is done by sample_lines, deterministically
        shuffle_input_sentence=False,
        num_threads=num_threads,
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        pad_piece="<pad>",
        unk_piece="<unk>",
        bos_piece="<s>",
        eos_piece="</s>",
        user_defined_symbols=["\n"],
        minloglevel=2,
    )


def tokenizer_meta_path(model_path: str) -> str:
    return model_path + ".meta.json"


def train_sentencepiece(
    texts: Iterable[str],
    model_path: str,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    model_type: str = "bpe",
    max_lines: int = DEFAULT_SAMPLE_LINES,
    num_threads: int = 2,
    seed: int = 1234,
    extra_meta: Optional[dict] = None,
    log: Optional[Log] = print,
) -> dict:
    """Train a SentencePiece model on ``texts`` and write it to ``model_path`` (atomically).

    Args:
        texts: documents; training uses their non-empty lines (sampled to ``max_lines``).
        model_path: the ``.model`` file to write; ``<model_path>.meta.json`` records how.
        vocab_size: vocabulary size including the 4 special ids, ``"\\n"`` and 256 byte pieces.
        model_type: ``bpe`` (fast; default) or ``unigram``.
        max_lines: the most training lines (a fixed-seed sample above that).
        num_threads: SentencePiece trainer threads.
        seed: the line-sampling seed.
        extra_meta: merged into the meta file (e.g. the corpus sha256).

    Returns:
        the meta dict: ``{"path", "vocab_size", "model_type", "lines", "sha256", "seconds", ...}``.
    """
    import sentencepiece as spm

    log = log or (lambda _msg: None)
    if model_type not in ("bpe", "unigram"):
        raise DataError(f"tokenizer: model_type must be 'bpe' or 'unigram', got {model_type!r}")
    if vocab_size < 300:
        raise DataError(f"tokenizer: vocab_size {vocab_size} is too small; byte fallback needs >= 300")
    t0 = time.perf_counter()
    lines = sample_lines(texts, max_lines, seed)
    if not lines:
        raise DataError("tokenizer: the training text is empty; check the input and --text-key")
    log(f"[tokenizer] training SentencePiece {model_type}, vocab {vocab_size}, on {len(lines)} lines ...")
    spm.set_random_generator_seed(seed)
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=buf, **sentencepiece_options(vocab_size, model_type, num_threads)
        )
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0]
        raise DataError(f"tokenizer: SentencePiece training failed: {first} (try a smaller --vocab-size)") from err
    model_bytes = buf.getvalue()
    with atomic_open(model_path, "wb") as f:
        f.write(model_bytes)
    meta = {
        "path": os.path.abspath(model_path),
        "kind": "sentencepiece",
        "vocab_size": vocab_size,
        "model_type": model_type,
        "lines": len(lines),
        "max_lines": max_lines,
        "seed": seed,
        "num_threads": num_threads,
        "sha256": hashlib.sha256(model_bytes).hexdigest(),
        "seconds": round(time.perf_counter() - t0, 3),
        **(extra_meta or {}),
    }
    write_json(tokenizer_meta_path(model_path), meta)
    log(f"[tokenizer] {model_path} (vocab {vocab_size}) in {meta['seconds']:.1f}s")
    return meta


def tokenizer_is_current(model_path: str, expected: dict) -> bool:
    """True when ``model_path`` exists, matches its meta's sha256, and the meta has ``expected``."""
    meta = read_json(tokenizer_meta_path(model_path))
    if meta is None or not os.path.isfile(model_path):
        return False
    if any(meta.get(k) != v for k, v in expected.items()):
        return False
    return sha256_file(model_path) == meta.get("sha256")
