"""A small, deterministic text corpus built from text that every Python 3.11 machine has.

Sources, in priority order (the corpus takes whole documents in this order until it reaches the
target size, then mixes them in a fixed pseudo-random order):

``reference``
    The Python language reference and library topics shipped as plain text in
    ``pydoc_data/topics.py`` (the text behind ``help("assert")``): ~0.5 MB of English prose.
``docstrings``
    Module, class and function docstrings of the standard library, pulled with :mod:`ast` and
    rendered like ``pydoc`` (``class X(Base)`` / ``def f(args)`` headers, indented text): ~1.9 MB.
``licenses``
    Python's ``LICENSE.txt`` and the license texts in ``/usr/share/common-licenses`` (Debian
    ``base-files``; skipped silently where the folder does not exist): ~0.3 MB.
``code``
    The standard library's Python source, comments included: ~11 MB.

What is left out, so that the corpus is the same on every machine with the same Python version:
``site-packages``, test folders (the ``python:3.11`` images delete them), machine-specific files
(``_sysconfigdata*``, ``config-3.11-*``) and generated tables (``encodings/``, ``pydoc_data/``
as code).

Output: JSON lines ``{"text": ..., "source": ...}`` where ``source`` names the origin
(``docstrings:json/decoder.py#0``), plus ``<out>.meta.json`` with the parameters, sizes and
the sha256 of the corpus.  Two builds with the same arguments give identical bytes.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import json
import os
import sys
import sysconfig
import time
import tokenize
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

from training.data._util import DataError, Log, atomic_open, human_bytes, read_json, sha256_file, write_json

SOURCES = ("reference", "docstrings", "licenses", "code")
DEFAULT_TARGET_MB = 3.0
DEFAULT_MAX_DOC_CHARS = 8000
DEFAULT_SEED = 1234
CORPUS_FORMAT_VERSION = 1

# Folder names never walked in the standard library (not on every machine, or not "stdlib").
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "lib-dynload", "__pycache__"}
# Extra exclusions for the ``code`` source: generated tables and the pydoc text dump.
_SKIP_CODE_TOP = {"encodings", "pydoc_data"}
LICENSE_DIR = "/usr/share/common-licenses"


@dataclass(frozen=True)
class Doc:
    """One corpus document: ``source`` names where it came from, ``text`` is its content."""

    source: str
    text: str


# --------------------------------------------------------------------------------------------
# Walking the standard library
# --------------------------------------------------------------------------------------------


def stdlib_dir() -> str:
    """The standard library folder of the running Python (``sysconfig`` ``stdlib`` path)."""
    return sysconfig.get_paths()["stdlib"]


def stdlib_python_files(root: Optional[str] = None) -> list[str]:
    """Sorted relative paths (``/``-separated) of the stdlib ``.py`` files the corpus may use."""
    root = root or stdlib_dir()
    found = []
    for folder, dirs, files in os.walk(root):
        rel = os.path.relpath(folder, root)
        parts = [] if rel == "." else rel.split(os.sep)
        if parts and (parts[0].startswith("config-") or any(p in _SKIP_DIRS for p in parts)):
            dirs[:] = []
            continue
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        for name in files:
            if not name.endswith(".py") or name.startswith("_sysconfigdata"):
                continue
            found.append("/".join(parts + [name]))
    return sorted(found)


def _read_source(path: str) -> Optional[str]:
    """Source text honouring the PEP 263 coding cookie; None when it cannot be decoded."""
    try:
        with tokenize.open(path) as f:
            return f.read()
    except (OSError, SyntaxError, UnicodeDecodeError, LookupError):
        return None


def _module_name(relpath: str) -> str:
    parts = relpath[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line if line.strip() else "" for line in text.splitlines())


def _docstring(node: ast.AST) -> Optional[str]:
    """The node's docstring with the common indent and trailing blanks removed (``inspect.cleandoc``)."""
    raw = ast.get_docstring(node, clean=False)
    if not raw:
        return None
    text = "\n".join(line.rstrip() for line in inspect.cleandoc(raw).splitlines()).strip("\n")
    return text or None


def _signature(node: ast.AST) -> str:
    if isinstance(node, ast.ClassDef):
        bases = [ast.unparse(b) for b in node.bases] + [ast.unparse(k) for k in node.keywords]
        return f"class {node.name}({', '.join(bases)})" if bases else f"class {node.name}"
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    ret = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"{prefix} {node.name}({ast.unparse(node.args)}){ret}"


def _render_body(body: Sequence[ast.stmt], depth: int) -> list[str]:
    """pydoc-like blocks for the classes/functions in ``body`` that have docstrings."""
    blocks = []
    pad = "    " * depth
    for node in body:
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = _docstring(node)
        inner = _render_body(node.body, depth + 1) if isinstance(node, ast.ClassDef) else []
        if not doc and not inner:
            continue
        block = pad + _signature(node)
        if doc:
            block += "\n" + _indent(doc, pad + "    ")
        blocks.append(block)
        blocks.extend(inner)
    return blocks


def render_docstrings(source: str, module: str) -> Optional[str]:
    """All docstrings of one module as pydoc-style text, or None when it has none.

    The module docstring comes first under the module name; each documented class, method
    and function follows as its signature line with its docstring indented below it.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    blocks = []
    doc = _docstring(tree)
    if doc:
        blocks.append(doc)
    blocks.extend(_render_body(tree.body, 0))
    if not blocks:
        return None
    return f"Module {module}\n\n" + "\n\n".join(blocks)


# --------------------------------------------------------------------------------------------
# Sources: each yields whole documents (before splitting) in a fixed order
# --------------------------------------------------------------------------------------------


def iter_reference() -> Iterator[Doc]:
    """The language reference topics behind ``help()`` (``pydoc_data.topics``), sorted by topic."""
    try:
        topics = importlib.import_module("pydoc_data.topics").topics
    except ImportError:
        return
    for name in sorted(topics):
        text = topics[name].strip()
        if text:
            yield Doc(f"reference:{name}", text)


def iter_docstrings(root: Optional[str] = None) -> Iterator[Doc]:
    """One pydoc-style document of docstrings per stdlib module, sorted by path."""
    root = root or stdlib_dir()
    for rel in stdlib_python_files(root):
        src = _read_source(os.path.join(root, rel))
        if src is None:
            continue
        text = render_docstrings(src, _module_name(rel))
        if text:
            yield Doc(f"docstrings:{rel}", text)


def iter_licenses(root: Optional[str] = None, license_dir: str = LICENSE_DIR) -> Iterator[Doc]:
    """Python's LICENSE.txt, then the Debian common licenses (sorted; symlinked names skipped)."""
    root = root or stdlib_dir()
    paths = [("LICENSE.txt", os.path.join(root, "LICENSE.txt"))]
    if os.path.isdir(license_dir):
        for name in sorted(os.listdir(license_dir)):
            path = os.path.join(license_dir, name)
            if os.path.isfile(path) and not os.path.islink(path):
                paths.append((name, path))
    for name, path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if text:
            yield Doc(f"licenses:{name}", text)


def iter_code(root: Optional[str] = None) -> Iterator[Doc]:
    """The stdlib's Python source files (comments included), sorted by path."""
    root = root or stdlib_dir()
    for rel in stdlib_python_files(root):
        if rel.split("/")[0] in _SKIP_CODE_TOP:
            continue
        src = _read_source(os.path.join(root, rel))
        if src and src.strip():
            yield Doc(f"code:{rel}", f"# {rel}\n{src.strip()}")


_ITERATORS: dict[str, Callable[[], Iterator[Doc]]] = {
    "reference": iter_reference,
    "docstrings": iter_docstrings,
    "licenses": iter_licenses,
    "code": iter_code,
}


# --------------------------------------------------------------------------------------------
# Splitting, selection, ordering
# --------------------------------------------------------------------------------------------


def split_text(text: str, max_chars: int) -> list[str]:
    """Split ``text`` into pieces of at most ``max_chars`` characters.

    Pieces end at paragraph breaks (blank lines) where possible, else at line ends, else
    anywhere; joining the pieces with the separators they were cut at gives ``text`` back
    up to whitespace at the cuts.
    """
    if max_chars <= 0:
        raise DataError(f"corpus: max_doc_chars must be positive, got {max_chars}")
    if len(text) <= max_chars:
        return [text]
    units: list[tuple[str, str]] = []  # (separator before the unit, unit)
    for para in text.split("\n\n"):
        if len(para) <= max_chars:
            units.append(("\n\n", para))
            continue
        for j, line in enumerate(para.split("\n")):  # a long paragraph: lines, then hard cuts
            for i in range(0, max(len(line), 1), max_chars):
                sep = "\n\n" if (j == 0 and i == 0) else ("\n" if i == 0 else "")
                units.append((sep, line[i : i + max_chars]))
    pieces: list[str] = []
    current: Optional[str] = None
    for sep, unit in units:
        if current is None:
            current = unit
        elif len(current) + len(sep) + len(unit) > max_chars:
            pieces.append(current)
            current = unit
        else:
            current += sep + unit
    if current is not None:
        pieces.append(current)
    return [p for p in (p.strip("\n") for p in pieces) if p.strip()]


def _order_key(seed: int, source: str) -> str:
    return hashlib.sha256(f"{seed}\0{source}".encode("utf-8")).hexdigest()


def collect_documents(
    target_bytes: Optional[int],
    sources: Sequence[str] = SOURCES,
    max_doc_chars: int = DEFAULT_MAX_DOC_CHARS,
) -> list[Doc]:
    """Documents from ``sources`` in priority order until ``target_bytes`` of UTF-8 text.

    Each source document is split into pieces of at most ``max_doc_chars`` characters; a piece
    identical to one already taken is dropped.  The piece that crosses the target is kept, so
    the result is at least the target (or everything there is).  ``None`` takes everything.
    """
    unknown = [s for s in sources if s not in _ITERATORS]
    if unknown:
        raise DataError(f"corpus: unknown source(s) {unknown}; choose from {list(SOURCES)}")
    docs: list[Doc] = []
    seen: set[str] = set()
    total = 0
    for name in sources:
        for doc in _ITERATORS[name]():
            for k, piece in enumerate(split_text(doc.text, max_doc_chars)):
                digest = hashlib.sha256(piece.encode("utf-8")).hexdigest()
                if digest in seen:
                    continue
                seen.add(digest)
                docs.append(Doc(f"{doc.source}#{k}", piece))
                total += len(piece.encode("utf-8"))
                if target_bytes is not None and total >= target_bytes:
                    return docs
    return docs


def corpus_params(target_mb: Optional[float], sources: Sequence[str], max_doc_chars: int, seed: int) -> dict:
    """The parameters that determine a corpus's content (stored in its meta file)."""
    return {
        "format_version": CORPUS_FORMAT_VERSION,
        "python": ".".join(map(str, sys.version_info[:3])),
        "target_mb": target_mb,
        "sources": list(sources),
        "max_doc_chars": max_doc_chars,
        "seed": seed,
    }


def meta_path(out_path: str) -> str:
    return out_path + ".meta.json"


def corpus_is_current(out_path: str, params: dict) -> bool:
    """True when ``out_path`` exists, was built with ``params`` and still has its recorded hash."""
    meta = read_json(meta_path(out_path))
    if meta is None or meta.get("params") != params or not os.path.isfile(out_path):
        return False
    return os.path.getsize(out_path) == meta.get("bytes") and sha256_file(out_path) == meta.get("sha256")


def build_corpus(
    out_path: str,
    target_mb: Optional[float] = DEFAULT_TARGET_MB,
    sources: Sequence[str] = SOURCES,
    max_doc_chars: int = DEFAULT_MAX_DOC_CHARS,
    seed: int = DEFAULT_SEED,
    log: Optional[Log] = print,
) -> dict:
    """Write the JSONL corpus to ``out_path`` (atomically) and return its meta dict.

    Args:
        out_path: the ``.jsonl`` file to write; ``<out_path>.meta.json`` is written next to it.
        target_mb: megabytes (10**6 bytes) of UTF-8 text to collect; None takes every source whole.
        sources: which sources to draw from, in priority order (subset of :data:`SOURCES`).
        max_doc_chars: documents longer than this are split at paragraph/line breaks.
        seed: fixes the order in which the selected documents are written.

    Returns:
        ``{"path", "params", "documents", "bytes", "text_bytes", "by_source", "sha256", "seconds"}``.
    """
    log = log or (lambda _msg: None)
    if target_mb is not None and target_mb <= 0:
        raise DataError(f"corpus: target_mb must be positive (got {target_mb}); use e.g. 3.0")
    t0 = time.perf_counter()
    target_bytes = None if target_mb is None else int(target_mb * 1e6)
    docs = collect_documents(target_bytes, sources, max_doc_chars)
    if not docs:
        raise DataError(f"corpus: no text found in sources {list(sources)}; check the Python install")
    docs.sort(key=lambda d: _order_key(seed, d.source))
    by_source: dict[str, int] = {}
    text_bytes = 0
    with atomic_open(out_path, "w", encoding="utf-8", newline="\n") as f:
        for d in docs:
            f.write(json.dumps({"text": d.text, "source": d.source}, ensure_ascii=False) + "\n")
            n = len(d.text.encode("utf-8"))
            text_bytes += n
            kind = d.source.split(":", 1)[0]
            by_source[kind] = by_source.get(kind, 0) + n
    if target_bytes is not None and text_bytes < target_bytes:
        log(f"[corpus] note: only {human_bytes(text_bytes)} of text available (target {target_mb} MB)")
    meta = {
        "path": os.path.abspath(out_path),
        "params": corpus_params(target_mb, sources, max_doc_chars, seed),
        "documents": len(docs),
        "bytes": os.path.getsize(out_path),
        "text_bytes": text_bytes,
        "by_source": by_source,
        "sha256": sha256_file(out_path),
        "seconds": round(time.perf_counter() - t0, 3),
    }
    write_json(meta_path(out_path), meta)
    parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in by_source.items())
    log(f"[corpus] {len(docs)} documents, {human_bytes(text_bytes)} of text ({parts}) -> {out_path}"
        f" in {meta['seconds']:.1f}s")
    return meta
