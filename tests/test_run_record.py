"""The run record (training.run.run_record): what a run trained on, resolved and checked by every tool.

Fast tests on small files written here: the record's paths are absolute, its sizes and hashes are
the files' own (sha256 computed here with hashlib), it survives moving the run directory, a
checkpoint carries it in its manifest, and a deleted or changed file gives one line naming the
recorded path, what was found, and the flag that points the tool elsewhere; the conversion and
evaluation tools stop with that line and exit status 2 before any tensor is read.  The whole chain
on a real run (train -> to-hf -> evaluate from other directories, after ``mv``) is
tests/test_journeys.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from types import SimpleNamespace

import pytest

from training.run import RECORD_NAME, RecordError, build_run_record, read_run_record, write_record_file


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture()
def run(tmp_path):
    """A run directory trained (as far as the record knows) on data under tmp_path/data."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "tok.model").write_bytes(b"sentencepiece model bytes")
    (data / "a.bin").write_bytes(bytes(range(40)))
    (data / "a.idx").write_bytes(b"idx-a" * 3)
    (data / "a.meta.json").write_text('{"documents": 3}')
    (data / "b.bin").write_bytes(bytes(range(24)))
    (data / "b.idx").write_bytes(b"idx-b")  # no meta: its .idx is hashed
    cwd = os.getcwd()
    os.chdir(tmp_path)  # relative prefixes resolve against the working directory, as training does
    try:
        cfg = SimpleNamespace(data=SimpleNamespace(mock=False, per_split=None, prefixes=["data/a", "data/b"],
                                                   weights=[0.7, 0.3], split="98,1,1", default_dir="data/default"))
        record = build_run_record(cfg, "data/tok.model", "sentencepiece")
    finally:
        os.chdir(cwd)
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    write_record_file(str(run_dir / RECORD_NAME), record)
    return tmp_path, run_dir, record


def test_the_record_holds_absolute_paths_sizes_and_hashes(run):
    root, run_dir, record = run
    data = root / "data"
    assert record["tokenizer"] == {"path": str(data / "tok.model"), "kind": "sentencepiece", "bytes": 25,
                                   "sha256": _sha(data / "tok.model")}
    a, b = record["data"]["prefixes"]
    assert record["data"]["source"] == "prefixes" and record["data"]["weights"] == [0.7, 0.3]
    assert record["data"]["split"] == "98,1,1"
    assert a == {"prefix": str(data / "a"), "bin_bytes": 40, "idx_bytes": 15, "hashed": "meta",
                 "sha256": _sha(data / "a.meta.json")}
    assert b == {"prefix": str(data / "b"), "bin_bytes": 24, "idx_bytes": 5, "hashed": "idx",
                 "sha256": _sha(data / "b.idx")}
    rec = read_run_record(str(run_dir))
    assert rec.body == json.loads((run_dir / RECORD_NAME).read_text())
    assert rec.tokenizer() == str(data / "tok.model")
    assert rec.prefixes() == [str(data / "a"), str(data / "b")]
    assert rec.split == "98,1,1" and rec.corpus() is None


def test_a_moved_run_directory_still_finds_its_data(run, tmp_path):
    root, run_dir, _ = run
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    shutil.move(str(run_dir), str(moved))
    rec = read_run_record(str(moved))
    assert rec.tokenizer() == str(root / "data" / "tok.model")
    assert rec.prefixes() == [str(root / "data" / "a"), str(root / "data" / "b")]


def test_the_fingerprint_names_the_content_not_the_place(run, tmp_path):
    """The sweep's ``data`` column: arms on the same data share it wherever the data lie."""
    import copy

    from training.run import RunRecord

    _, _, record = run
    moved = copy.deepcopy(record)
    moved["tokenizer"]["path"] = "/elsewhere/tok.model"
    moved["data"]["prefixes"][0]["prefix"] = "/elsewhere/a"
    other = copy.deepcopy(record)
    other["tokenizer"]["sha256"] = "0" * 64
    fp = RunRecord(record, "r").fingerprint
    assert len(fp) == 12 and RunRecord(moved, "m").fingerprint == fp and RunRecord(other, "o").fingerprint != fp


def test_a_checkpoint_carries_the_record_in_its_manifest(run, tmp_path):
    from training.checkpoint import write_manifest

    _, run_dir, record = run
    ck = tmp_path / "copied" / "step_00000001"
    ck.mkdir(parents=True)
    (ck / "weights.bin").write_bytes(b"w")
    write_manifest(str(ck), {"step": 1, "run_record": record})
    rec = read_run_record(str(ck))
    assert rec.body == record and rec.where.endswith("step_00000001/manifest.json")
    assert rec.tokenizer() == record["tokenizer"]["path"]


def test_missing_or_changed_files_give_one_line_with_the_recorded_path_and_the_flag(run, tmp_path):
    root, run_dir, record = run
    data = root / "data"
    rec = read_run_record(str(run_dir))
    where = str(run_dir / RECORD_NAME)
    (data / "tok.model").write_bytes(b"another model")
    with pytest.raises(RecordError) as e:
        rec.tokenizer()
    msg = str(e.value)
    assert msg == (f"run record {where}: tokenizer {data / 'tok.model'} is not the tokenizer the run trained with "
                   f"(sha256 {_sha(data / 'tok.model')[:12]} found, {record['tokenizer']['sha256'][:12]} recorded at "
                   f"{data / 'tok.model'}); pass --tokenizer PATH to a copy of the tokenizer the run trained with")
    os.remove(data / "tok.model")
    with pytest.raises(RecordError, match=r"^run record .*: tokenizer .*tok\.model is missing; pass --tokenizer PATH"):
        rec.tokenizer()
    (data / "b.bin").write_bytes(bytes(range(25)))
    with pytest.raises(RecordError) as e:
        rec.prefixes()
    assert str(e.value) == (f"run record {where}: dataset {data / 'b'} has changed since training (.bin bytes 25 found, "
                            f"24 recorded); pass --data PREFIX to a copy of the dataset the run trained on")
    os.remove(data / "a.idx")
    with pytest.raises(RecordError, match=r"dataset .*/data/a is missing \(.*a\.idx not found\); pass --data PREFIX"):
        rec.prefixes()
    for err in (e.value,):
        assert "\n" not in str(err)


def test_a_copy_passed_by_flag_must_be_the_same_file(run, tmp_path):
    root, run_dir, _ = run
    rec = read_run_record(str(run_dir))
    copy = tmp_path / "copy.model"
    shutil.copyfile(root / "data" / "tok.model", copy)
    os.remove(root / "data" / "tok.model")
    assert rec.tokenizer(str(copy)) == str(copy)
    copy.write_bytes(b"not it")
    with pytest.raises(RecordError, match=r"--tokenizer .*copy\.model is not the tokenizer the run trained with"):
        rec.tokenizer(str(copy))
    for ext in (".bin", ".idx", ".meta.json"):
        shutil.copyfile(root / "data" / f"a{ext}", tmp_path / f"a2{ext}")
    shutil.copyfile(root / "data" / "b.bin", tmp_path / "b2.bin")
    shutil.copyfile(root / "data" / "b.idx", tmp_path / "b2.idx")
    assert rec.prefixes(override=[str(tmp_path / "a2"), str(tmp_path / "b2")]) == [str(tmp_path / "a2"),
                                                                                  str(tmp_path / "b2")]
    with pytest.raises(RecordError, match=r"--data .*a2: 1 prefixes for the 2 the run recorded"):
        rec.prefixes(override=[str(tmp_path / "a2")])


def test_runs_before_records_and_mock_runs(tmp_path):
    assert read_run_record(str(tmp_path)) is None  # no record: the tools fall back to the lookup, with a note
    cfg = SimpleNamespace(data=SimpleNamespace(mock=True, per_split=None, prefixes=None, weights=None, split="1,0,0"))
    record = build_run_record(cfg, None, None)
    assert record["tokenizer"] is None and record["data"] == {"source": "mock"}
    write_record_file(str(tmp_path / RECORD_NAME), record)
    rec = read_run_record(str(tmp_path))
    assert rec.tokenizer() is None and rec.prefixes() == [] and rec.corpus() is None
    (tmp_path / RECORD_NAME).write_text("{not json")
    with pytest.raises(RecordError, match=r"run_record\.json: unreadable"):
        read_run_record(str(tmp_path))


def _checkpointed_run(run_dir, record) -> str:
    from training.checkpoint import write_manifest

    (run_dir / "config.yaml").write_text("model:\n  preset: tiny-moe:xhc\n")
    ck = run_dir / "checkpoints" / "step_00000001"
    ck.mkdir(parents=True)
    write_manifest(str(ck), {"step": 1, "preset": "tiny-moe:xhc", "run_record": record})
    return str(ck)


def test_to_hf_stops_with_the_line_and_exit_2_before_reading_tensors(run, tmp_path, capsys):
    """The checkpoint has no tensors at all: the tokenizer check comes first."""
    from tools.hf import main

    root, run_dir, record = run
    _checkpointed_run(run_dir, record)
    os.remove(root / "data" / "tok.model")
    out = str(tmp_path / "hf")
    assert main(["to-hf", "--run", str(run_dir), "--output", out, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"error: run record {run_dir}/checkpoints/step_00000001/manifest.json: tokenizer "
                          f"{root / 'data' / 'tok.model'} is missing; pass --tokenizer PATH"), err
    assert not os.path.exists(out)


def test_evaluate_reads_the_corpus_from_the_export_record(tmp_path, capsys):
    from tools.evaluate import corpus_and_split, main

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a"}\n')
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    record = {"format": "xhc-run-record/1", "tokenizer": None,
              "data": {"source": "default", "split": "90,5,5", "prefixes": [],
                       "corpus": {"path": str(corpus), "bytes": corpus.stat().st_size, "sha256": _sha(corpus)}}}
    write_record_file(str(hf / RECORD_NAME), record)
    assert corpus_and_split(str(hf)) == (str(corpus), "90,5,5")
    assert corpus_and_split(str(hf), split="1,1,1") == (str(corpus), "1,1,1")
    corpus.write_text('{"text": "b"}\n')
    assert main([str(hf)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"corpus {corpus} has changed since training" in err, err
    assert err.endswith("pass --corpus FILE to a copy of the corpus the run trained on")
    notes = []
    (hf / RECORD_NAME).unlink()  # an export made before records: today's lookup, with a note
    assert corpus_and_split(str(hf), log=notes.append) == ("data/default/corpus.jsonl", "969,30,1")
    assert len(notes) == 1 and "has no run record" in notes[0]
