"""Evaluate a Hugging Face folder with lm-eval-harness on held-out documents, offline.

::

    python -m tools.evaluate hf/X                       # the held-out split of the corpus the run trained on
    python -m tools.evaluate hf/X --limit 20 --corpus data/default/corpus.jsonl --json out.json

Runs the local task ``configs/lm_eval/xhc_heldout.yaml`` (rolling log-likelihood: word and byte
perplexity, bits per byte) through ``lm_eval.simple_evaluate`` with the ``hf`` model
(``pretrained=hf/X,trust_remote_code=True``), exactly what
``lm_eval --model hf --model_args pretrained=hf/X,trust_remote_code=True --tasks xhc_heldout
--include_path <dir>`` does.  The held-out documents are the validation and test splits of
``--corpus`` under ``--split``: the documents the run never trained on.  Both default to what the
export's run record (``run_record.json``, training.run.run_record) says the run trained on: the embedded
default corpus, wherever that run built it, and the run's ``data.split``; a recorded corpus that is
missing or changed stops with one line naming it.  A folder exported before run records falls back
to ``data/default/corpus.jsonl`` in the working directory, with a note.  Needs
``pip install -e '.[eval]'``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from configs import config_dir
from tools._cli import require, run_main

TASK = "xhc_heldout"
TASK_YAML = str(config_dir("lm_eval") / f"{TASK}.yaml")  # package data: found from any directory


class EvalError(RuntimeError):
    pass


def heldout_documents(corpus: str, split: str = "969,30,1") -> list:
    """The validation and test splits' documents of a ``{"text": ...}`` JSONL corpus (never trained on)."""
    from training.data import split_ranges

    if not os.path.isfile(corpus):
        raise EvalError(f"--corpus {corpus}: not found (build it with `python -m training.data.default` or pass a "
                        "JSONL file of {\"text\": ...} documents)")
    with open(corpus, encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f if line.strip()]
    _, valid, test = split_ranges(len(docs), split)
    held = [d for rng in (valid, test) if rng is not None for d in docs[rng[0]:rng[1]]]
    if held:
        return held
    raise EvalError(f"--corpus {corpus}: split {split!r} leaves no held-out documents among {len(docs)}")


def evaluate(hf_dir: str, corpus: str, split: str = "969,30,1", limit=None, batch_size: int = 1,
             device: str = "cpu") -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise EvalError(f"{hf_dir}: no config.json (export one with `python -m tools.convert_checkpoint to-hf`)")
    docs = heldout_documents(corpus, split)
    with tempfile.TemporaryDirectory(prefix="xhc-eval-") as tmp:
        data = os.path.join(tmp, "heldout.jsonl")
        with open(data, "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
        with open(TASK_YAML, encoding="utf-8") as f:
            task = f.read().replace("__DATA_FILE__", data)
        with open(os.path.join(tmp, f"{TASK}.yaml"), "w", encoding="utf-8") as f:
            f.write(task)
        out = lm_eval.simple_evaluate(
            model="hf", model_args=f"pretrained={os.path.abspath(hf_dir)},trust_remote_code=True,dtype=float32",
            tasks=[TASK], task_manager=TaskManager(include_path=tmp), limit=limit, batch_size=batch_size,
            device=device)
    res = {k.split(",")[0]: v for k, v in out["results"][TASK].items() if not k.startswith("alias")}
    res["documents"] = len(docs) if limit is None else min(len(docs), int(limit))
    return res


LEGACY_CORPUS = "data/default/corpus.jsonl"


def corpus_and_split(hf_dir: str, corpus=None, split=None, log=print):
    """(corpus, split) to evaluate ``hf_dir`` on: the flags where given, else the run record's."""
    from training.run import RecordError, read_run_record

    try:
        record = read_run_record(hf_dir) if os.path.isdir(hf_dir) else None
        if corpus is None and record is not None:
            corpus = record.corpus()
            if corpus is None:
                raise EvalError(f"{hf_dir}: the run trained on {record.data.get('source')} data, not the embedded "
                                "corpus (its run record names no JSONL corpus): pass --corpus FILE")
    except RecordError as e:
        raise EvalError(str(e)) from None
    if corpus is None:
        corpus = LEGACY_CORPUS
        log(f"[xhc-eval] note: {hf_dir} has no run record (exported before run records): corpus by lookup at "
            f"{os.path.abspath(corpus)}")
    if split is None:
        split = record.split if record is not None else "969,30,1"
    return corpus, split


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("hf_dir", help="Hugging Face folder written by tools.convert_checkpoint to-hf")
    p.add_argument("--corpus", metavar="FILE", help="JSONL corpus (default: the one the export's run record names)")
    p.add_argument("--split", help="train,valid,test shares (default: the run record's data.split, else 969,30,1)")
    p.add_argument("--limit", type=float, default=None, help="at most this many documents (lm-eval --limit)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)

    def body() -> None:
        require("python -m tools.evaluate", "eval", "lm_eval", "transformers", "safetensors")
        if not os.path.isfile(os.path.join(args.hf_dir, "config.json")):
            raise EvalError(f"{args.hf_dir}: no config.json (export one with `python -m tools.convert_checkpoint to-hf`)")
        corpus, split = corpus_and_split(args.hf_dir, args.corpus, args.split)
        res = evaluate(args.hf_dir, corpus, split, args.limit, args.batch_size, args.device)
        print(f"[xhc-eval] {args.hf_dir}: {TASK} over {res['documents']} held-out documents: "
              f"word_perplexity {res.get('word_perplexity'):.3f}, byte_perplexity {res.get('byte_perplexity'):.4f}, "
              f"bits_per_byte {res.get('bits_per_byte'):.4f}")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(res, f, indent=1)

    return run_main(body, EvalError)


if __name__ == "__main__":
    sys.exit(main())
