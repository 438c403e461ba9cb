"""Raw text input through HF ``datasets``: local JSON/JSONL, text, parquet or CSV files, or a hub name.

``load_raw`` turns a user's ``--input`` into a :class:`datasets.Dataset` and checks the text
column, with one-line errors for the usual mistakes (missing file, wrong ``--text-key``).
"""

from __future__ import annotations

import glob
import hashlib
import os
from typing import Iterator, Optional, Sequence, Union

from training.data._util import DataError, sha256_file

# file suffix -> datasets builder name
FORMATS = {
    ".jsonl": "json",
    ".json": "json",
    ".jsonl.gz": "json",
    ".json.gz": "json",
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".parquet": "parquet",
    ".csv": "csv",
}
BUILDERS = ("json", "text", "parquet", "csv")

Inputs = Union[str, Sequence[str]]


def _as_list(inputs: Inputs) -> list[str]:
    items = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    if not items:
        raise DataError("input: no input given; pass one or more files (.jsonl/.txt/.parquet) or a hub name")
    return [os.path.expanduser(os.fspath(x)) for x in items]


def _format_of(path: str) -> Optional[str]:
    lower = path.lower()
    for suffix in sorted(FORMATS, key=len, reverse=True):
        if lower.endswith(suffix):
            return FORMATS[suffix]
    return None


def _looks_local(item: str) -> bool:
    """Whether ``item`` names local data (a hub name is ``name`` or ``owner/name``)."""
    return (
        os.path.exists(item)
        or _format_of(item) is not None
        or any(c in item for c in "*?[")
        or item.startswith(("/", "./", "../", "~"))
    )


def resolve_inputs(inputs: Inputs, fmt: Optional[str] = None) -> tuple[str, Optional[list[str]]]:
    """Decide how to load ``inputs``: ``(builder, files)`` for local data, ``("hub", None)`` otherwise.

    Local items may be files, folders (all files of a known format inside, sorted) or glob
    patterns.  A single item that does not exist and has no known file suffix is a hub name.
    """
    items = _as_list(inputs)
    if fmt is not None and fmt not in BUILDERS and fmt != "hub":
        raise DataError(f"input: unknown format {fmt!r}; use one of {list(BUILDERS)} or 'hub'")
    if fmt == "hub" or (fmt is None and len(items) == 1 and not _looks_local(items[0])):
        return "hub", None
    files: list[str] = []
    for item in items:
        if any(c in item for c in "*?["):
            matched = sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p))
            if not matched:
                raise DataError(f"input: pattern {item!r} matches no files; check the path")
            files.extend(matched)
        elif os.path.isdir(item):
            inside = sorted(
                os.path.join(d, f) for d, _, fs in os.walk(item) for f in fs if _format_of(f) is not None
            )
            if not inside:
                raise DataError(f"input: folder {item!r} holds no .jsonl/.json/.txt/.parquet/.csv files")
            files.extend(inside)
        elif os.path.isfile(item):
            files.append(item)
        else:
            raise DataError(
                f"input: file {item!r} not found; pass an existing .jsonl/.json/.txt/.parquet/.csv file "
                "(or a hub dataset name)"
            )
    if fmt is None:
        kinds = {_format_of(f) for f in files}
        if None in kinds:
            bad = next(f for f in files if _format_of(f) is None)
            raise DataError(f"input: cannot tell the format of {bad!r}; pass --format {{{','.join(BUILDERS)}}}")
        if len(kinds) > 1:
            raise DataError(f"input: files mix formats {sorted(kinds)}; preprocess each format separately")
        fmt = kinds.pop()
    return fmt, files


def check_text_file(path: str, builder: str, text_key: Optional[str] = None) -> None:
    """One-line :class:`DataError` for a local file ``datasets`` would fail on with a traceback or an
    opaque message: empty, not UTF-8 (the line and byte), (JSON Lines) a line that is not a JSON
    object, or a first object without ``text_key``.  One streaming pass; parquet is binary and left
    to ``datasets``."""
    import json

    if builder not in ("json", "text", "csv"):
        return
    if os.path.getsize(path) == 0:
        raise DataError(f"input: {path} is empty (0 bytes); remove it from the inputs or give it documents")
    lines = path.lower().endswith(".jsonl") or builder == "json"
    whole_json = False
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"input: {path} line {n}: not UTF-8 (byte 0x{raw[e.start]:02x} at column "
                                f"{e.start + 1}); convert the file to UTF-8, e.g. iconv -f latin1 -t utf-8") from None
            if not lines or whole_json or not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                if n == 1 and not path.lower().endswith(".jsonl") and line.lstrip().startswith(("[", "{")):
                    whole_json = True  # a .json document spanning lines: checked as a whole below
                    continue
                raise DataError(f"input: {path} line {n}: not valid JSON ({getattr(e, 'msg', e)} at column "
                                f"{getattr(e, 'colno', '?')}); one JSON object per line is expected") from None
            if not isinstance(obj, dict) and not (n == 1 and isinstance(obj, list)):
                raise DataError(f"input: {path} line {n}: a JSON {type(obj).__name__}, expected an object "
                                f"like {{\"text\": ...}}")
            if text_key is not None and isinstance(obj, dict) and text_key not in obj:
                raise DataError(f"input: column {text_key!r} not found in {path!r} (line {n} has keys "
                                f"{sorted(obj)}); pass --text-key with the text column")
            text_key = None  # the first object is enough (datasets unifies the columns)
    if whole_json:
        try:
            with open(path, encoding="utf-8") as f:
                json.load(f)
        except ValueError as e:
            raise DataError(f"input: {path} line {getattr(e, 'lineno', '?')}: not valid JSON "
                            f"({getattr(e, 'msg', e)})") from None


def load_raw(
    inputs: Inputs,
    text_key: str = "text",
    fmt: Optional[str] = None,
    split: str = "train",
    hub_config: Optional[str] = None,
    cache_dir: Optional[str] = None,
    text_sample_by: str = "paragraph",
    progress: bool = True,
):
    """Load raw documents as a :class:`datasets.Dataset` and check that ``text_key`` is a column.

    Args:
        inputs: file(s), folder(s), glob pattern(s), or one hub dataset name.
        text_key: the column holding the document text.
        fmt: ``json``/``text``/``parquet``/``csv``/``hub``; inferred from the file suffix if None.
        split: the split to read (local files are always one ``train`` split; hub datasets vary).
        hub_config: the hub dataset's configuration name, if it has several.
        cache_dir: where ``datasets`` keeps its Arrow cache (None: the HF default).
        text_sample_by: for plain text files, one document per ``line``, ``paragraph`` or ``document``.
        progress: show ``datasets``' progress bars while it converts the files.
    """
    import datasets

    builder, files = resolve_inputs(inputs, fmt)
    bars_were_off = datasets.are_progress_bars_disabled()
    if not progress:
        datasets.disable_progress_bars()
    try:
        if builder == "hub":
            name = _as_list(inputs)[0]
            ds = datasets.load_dataset(name, hub_config, split=split, cache_dir=cache_dir)
        else:
            for f in files:
                check_text_file(f, builder, text_key)
            kwargs = {"sample_by": text_sample_by} if builder == "text" else {}
            ds = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=cache_dir, **kwargs)
    except DataError:
        raise
    except Exception as err:  # datasets raises many types; keep the message to one line
        if builder == "hub":
            what = f"{_as_list(inputs)[0]!r} (not a local file, so tried as a hub dataset)"
        else:
            what = f"{len(files)} {builder} file(s) ({files[0]} ...)"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"input: could not load {what}: {first}") from err
    finally:
        if not progress and not bars_were_off:
            datasets.enable_progress_bars()
    if isinstance(ds, datasets.DatasetDict):  # a hub dataset loaded without a split
        raise DataError(f"input: {inputs!r} has splits {list(ds)}; pass --split with one of them")
    if text_key not in ds.column_names:
        raise DataError(
            f"input: column {text_key!r} not found in {_as_list(inputs)[0]!r} (columns: {ds.column_names}); "
            f"pass --text-key with the text column"
        )
    return ds


def input_fingerprint(inputs: Inputs, fmt: Optional[str] = None, split: str = "train",
                      hub_config: Optional[str] = None) -> dict:
    """What identifies the raw input: file sha256s for local data, name/config/split for the hub."""
    builder, files = resolve_inputs(inputs, fmt)
    if builder == "hub":
        return {"hub": _as_list(inputs)[0], "config": hub_config, "split": split}
    h = hashlib.sha256()
    for f in files:
        h.update(sha256_file(f).encode())
    return {"format": builder, "files": [os.path.abspath(f) for f in files], "sha256": h.hexdigest()}


def iter_texts(ds, text_key: str = "text", batch_size: int = 1024) -> Iterator[str]:
    """The text column of ``ds`` in order, ``None`` values read as empty strings."""
    for start in range(0, len(ds), batch_size):
        for text in ds[start : start + batch_size][text_key]:
            yield "" if text is None else str(text)
