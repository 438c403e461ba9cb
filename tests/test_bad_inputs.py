"""The bad-input battery: every case is a real command-line run that must fail with

- the expected exit code (2: bad input),
- exactly one line on stderr (no traceback) that names the field or file,
- and nothing changed on disk (every file under the case's directory hashed before and after).

Commands: ``python -m training.pretrain``, ``python -m tools.preprocess_data``, ``python -m
training.finetune``.  The inputs (a tiny SentencePiece model, a good ``.bin``/``.idx`` pair, a good
pre-training run with a checkpoint, a tiny GPT-2 folder) are built once per module.  The cases run
one after another in one Python process (``tests/batch_cli.py``: each command's ``main`` as ``python
-m`` runs it, file descriptors 1 and 2 its own), which saves the interpreter start and the torch and
Megatron imports per case (seconds each); each case's result is then checked by its own test.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TRANSFORMERS_OFFLINE="1",
           HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
MOCK = ["data.mock=true", "tokenizer.type=none", "tokenizer.vocab_size=64", "batch.seq_length=16",
        "batch.micro_batch_size=2", "batch.global_batch_size=4", "schedule.warmup_steps=2", "run.num_threads=1",
        "logging.tensorboard=false", "logging.plot=false", "run.eval_iters=0", "run.train_steps=5"]
WORDS = ["alpha", "beta", "gamma", "delta", "def", "return", "class", "import", "value", "print", "x", "(a, b)"]


def _digest(root: str) -> dict:
    out = {}
    for base, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(base, d), root) + "/"] = "dir"
        for n in files:
            p = os.path.join(base, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
    return out




@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tokenizer, a good indexed dataset, a good pre-training run, chat data and a GPT-2 folder."""
    from training.data import Tokenizer, preprocess, train_sentencepiece
    from training.pretrain import main

    root = tmp_path_factory.mktemp("assets")
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(300)]
    train_sentencepiece(texts, str(root / "tok.model"), vocab_size=320, log=None)
    with open(root / "good.jsonl", "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    preprocess(str(root / "good.jsonl"), str(root / "good"), Tokenizer.from_file(str(root / "tok.model")),
               cache_dir=str(root / "hf"), progress=False, log=None)
    run = str(root / "run")
    assert main([*MOCK, f"run.dir={run}"]) == 0
    chats = root / "chat.jsonl"
    with open(chats, "w", encoding="utf-8") as f:
        for i in range(40):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"q {i}"},
                                             {"role": "assistant", "content": f"a {i}"}]}) + "\n")
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=128, n_positions=64, bos_token_id=0,
                               eos_token_id=0)).save_pretrained(
        str(root / "gpt2"))
    return root


def _copy(src, dst):
    (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, dst)
    return str(dst)


# ------------------------------------------------------------------------------------------------
# The cases: (name, builder).  A builder gets (assets, case_dir) and returns
# (module, args, words that the one-line message must contain).  The case dir is hashed.
# ------------------------------------------------------------------------------------------------
def _pre(*args):
    return "training.pretrain", list(args)


def c_unknown_key(a, d):
    return (*_pre(*MOCK, f"run.dir={d}/run", "optimizer.lrr=1"), ["optimizer.lrr"])


def c_bad_type(a, d):
    return (*_pre(*MOCK, f"run.dir={d}/run", "run.train_steps=abc"), ["run.train_steps"])


def c_bad_choice(a, d):
    return (*_pre(*MOCK, f"run.dir={d}/run", "run.on_nonfinite=explode"), ["run.on_nonfinite", "rollback"])


def c_missing_config(a, d):
    return (*_pre("--config", f"{d}/nope.yaml"), ["nope.yaml"])


def c_malformed_config(a, d):
    with open(f"{d}/bad.yaml", "w") as f:
        f.write("run:\n  train_steps: [1, 2\n")
    return (*_pre("--config", f"{d}/bad.yaml"), ["bad.yaml"])


def c_unknown_preset(a, d):
    return (*_pre(*MOCK, f"run.dir={d}/run", "model.preset=tiny-moe:nope"), ["model.preset"])


def c_run_dir_under_a_file(a, d):
    open(f"{d}/file", "w").close()
    return (*_pre(*MOCK, f"run.dir={d}/file/run"), ["run.dir", f"{d}/file/run"])


def c_checkpoint_dir_under_a_file(a, d):
    open(f"{d}/file", "w").close()
    os.makedirs(f"{d}/run")
    return (*_pre(*MOCK, f"run.dir={d}/run", f"checkpoint.dir={d}/file/ck"), ["checkpoint.dir", f"{d}/file/ck"])


def c_run_dir_locked(a, d):
    import socket

    os.makedirs(f"{d}/run")
    with open(f"{d}/run/.lock", "w") as f:  # held by this (live) test process
        json.dump({"host": socket.gethostname(), "pid": os.getpid(), "since": "now"}, f)
    return (*_pre(*MOCK, f"run.dir={d}/run"), [f"in use by PID {os.getpid()}", f"{d}/run"])


def c_resume_other_preset(a, d):
    run = _copy(a / "run", f"{d}/run")
    return (*_pre(*MOCK, f"run.dir={run}", "model.preset=tiny-moe:mhc", "run.train_steps=6"),
            ["model.preset=tiny-moe:xhc", "model.preset=tiny-moe:mhc", "checkpoint.load=none"])


def c_resume_other_hc(a, d):
    run = _copy(a / "run", f"{d}/run")
    return (*_pre(*MOCK, f"run.dir={run}", "model.hc.gram_schmidt=false", "run.train_steps=6"),
            ["model.hc.gram_schmidt", "checkpoint"])


def c_resume_other_vocab(a, d):
    run = _copy(a / "run", f"{d}/run")
    return (*_pre(*MOCK, f"run.dir={run}", "tokenizer.vocab_size=200", "run.train_steps=6"),
            ["vocabulary", "128", "256"])


def c_load_missing_checkpoint(a, d):
    return (*_pre(*MOCK, f"run.dir={d}/run", f"checkpoint.load={d}/nowhere/step_00000005"),
            [f"{d}/nowhere/step_00000005"])


def c_load_corrupt_checkpoint(a, d):
    run = _copy(a / "run", f"{d}/run")
    ck = f"{run}/checkpoints/step_00000005"
    data = max((os.path.join(ck, f) for f in os.listdir(ck) if f.endswith(".distcp")), key=os.path.getsize)
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) - 1)
    return (*_pre(*MOCK, f"run.dir={d}/other", f"checkpoint.load={ck}", "run.train_steps=6"), [ck, "bytes"])


def _data_args(d, prefix):
    return [f"data.prefixes=[{prefix}]", "data.split=90,10,0", "tokenizer.type=none", "tokenizer.vocab_size=320",
            "batch.seq_length=16", "batch.micro_batch_size=2", "batch.global_batch_size=4", "run.train_steps=5",
            "schedule.warmup_steps=2", "run.eval_iters=0", "logging.tensorboard=false", f"run.dir={d}/run",
            f"data.cache_dir={d}/cache"]


def c_data_prefix_missing(a, d):
    return (*_pre(*_data_args(d, f"{d}/none")), [f"{d}/none.idx"])


def c_data_idx_empty(a, d):
    shutil.copy(a / "good.bin", f"{d}/ds.bin")
    open(f"{d}/ds.idx", "w").close()
    return (*_pre(*_data_args(d, f"{d}/ds")), [f"{d}/ds.idx", "0 bytes"])


def c_data_bin_truncated(a, d):
    shutil.copy(a / "good.idx", f"{d}/ds.idx")
    with open(a / "good.bin", "rb") as f:
        data = f.read()
    with open(f"{d}/ds.bin", "wb") as f:
        f.write(data[: len(data) // 2])
    return (*_pre(*_data_args(d, f"{d}/ds")), [f"{d}/ds.bin", "truncated"])


def c_data_bin_of_another_index(a, d):
    shutil.copy(a / "good.idx", f"{d}/ds.idx")
    with open(a / "good.bin", "rb") as f:
        data = f.read()
    with open(f"{d}/ds.bin", "wb") as f:
        f.write(data + data)
    return (*_pre(*_data_args(d, f"{d}/ds")), [f"{d}/ds.bin", "another index"])


def _prep(a, d, name, content: bytes, *extra):
    with open(f"{d}/{name}", "wb") as f:
        f.write(content)
    return ("tools.preprocess_data", ["-i", f"{d}/{name}", "-t", str(a / "tok.model"), "-o", f"{d}/out",
                                      "--no-progress", "--cache-dir", f"{d}/hf", *extra])


def c_prep_empty_file(a, d):
    return (*_prep(a, d, "in.jsonl", b""), [f"{d}/in.jsonl", "empty"])


def c_prep_random_bytes(a, d):
    return (*_prep(a, d, "in.jsonl", bytes(random.Random(1).randrange(256) for _ in range(4000))),
            [f"{d}/in.jsonl", "line 1"])


def c_prep_latin1(a, d):
    body = (json.dumps({"text": "ok"}) + "\n").encode() + '{"text": "café"}\n'.encode("latin-1")
    return (*_prep(a, d, "in.jsonl", body), [f"{d}/in.jsonl", "line 2", "UTF-8"])


def c_prep_bad_json_line(a, d):
    body = b'{"text": "a"}\n{"text": "b"}\n{"text": "c"\n'
    return (*_prep(a, d, "in.jsonl", body), [f"{d}/in.jsonl", "line 3", "JSON"])


def c_prep_missing_text_key(a, d):
    return (*_prep(a, d, "in.jsonl", b'{"body": "a"}\n', "--text-key", "text"), ["'text'", "--text-key"])


def c_prep_missing_tokenizer(a, d):
    with open(f"{d}/in.jsonl", "w") as f:
        f.write('{"text": "a"}\n')
    return ("tools.preprocess_data", ["-i", f"{d}/in.jsonl", "-t", f"{d}/nope.model", "-o", f"{d}/out",
                                      "--no-progress"], ["nope.model"])


def _ft(a, d, data, *extra, config=None):
    args = ([] if config is None else ["--config", config]) + [
        "model.tiny={family: llama, vocab_size: 128, hidden_size: 32, num_layers: 2, intermediate_size: 64}",
        "model.tokenizer=char", "hc.variant=identity", "hc.n=4", f"data.path={data}", "data.validation_size=4",
        "data.test_size=4", "data.max_length=32", "train.max_steps=2", f"train.out_dir={d}/out", "train.device=cpu",
        *extra]
    return "training.finetune", args


def c_ft_no_messages(a, d):
    with open(f"{d}/c.jsonl", "w") as f:
        for i in range(20):
            f.write(json.dumps({"text": f"t {i}"}) + "\n")
    return (*_ft(a, d, f"{d}/c.jsonl"), [f"{d}/c.jsonl", "'messages'", "data.messages_field"])


def c_ft_empty_file(a, d):
    open(f"{d}/c.jsonl", "w").close()
    return (*_ft(a, d, f"{d}/c.jsonl"), [f"{d}/c.jsonl", "empty"])


def c_ft_bad_row(a, d):
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}] * 5
    rows.insert(2, {"messages": "just a string"})
    with open(f"{d}/c.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return (*_ft(a, d, f"{d}/c.jsonl"), [f"{d}/c.jsonl", "row 3", "role"])


def c_ft_missing_data(a, d):
    return (*_ft(a, d, f"{d}/nope.jsonl", "data.format=json"), [f"{d}/nope.jsonl"])


def c_ft_unsupported_model(a, d):
    model = _copy(a / "gpt2", f"{d}/gpt2")
    return ("training.finetune", [f"model.name_or_path={model}", "model.tokenizer=char", "hc.variant=identity",
                                  f"data.path={a / 'chat.jsonl'}", f"train.out_dir={d}/out", "train.device=cpu"],
            [model, "gpt2", "llama"])


def c_ft_malformed_yaml(a, d):
    with open(f"{d}/ft.yaml", "w") as f:
        f.write("train:\n  max_steps: 2\n   lr: [1\n")
    return ("training.finetune", ["--config", f"{d}/ft.yaml"], [f"{d}/ft.yaml", "line"])


CASES = {name[2:]: fn for name, fn in sorted(globals().items()) if name.startswith("c_") and callable(fn)}


def test_the_battery_has_at_least_25_cases():
    assert len(CASES) >= 25


@pytest.fixture(scope="module")
def battery(assets, tmp_path_factory):
    """Every case's command, run in one process (tests/batch_cli.py); each case's directory hashed
    before and after, and the shared assets too."""
    root = tmp_path_factory.mktemp("battery")
    cases, jobs = {}, []
    for name in sorted(CASES):
        case = root / name
        case.mkdir()
        module, args, words = CASES[name](assets, str(case))
        cases[name] = {"dir": str(case), "words": words, "before": _digest(str(case))}
        jobs.append({"name": name, "module": module, "args": [str(a) for a in args]})
    (root / "jobs.json").write_text(json.dumps(jobs))
    before_assets = _digest(str(assets))
    r = subprocess.run([sys.executable, os.path.join("tests", "batch_cli.py"), str(root / "jobs.json"),
                        str(root / "results.json")], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    results = json.loads((root / "results.json").read_text())
    for name, case in cases.items():
        case.update(results[name], after=_digest(case["dir"]))
    return cases, before_assets == _digest(str(assets))


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.slow
def test_bad_input_is_one_line_and_changes_nothing(battery, name):
    cases, assets_unchanged = battery
    r = cases[name]
    err = r["stderr"].strip()
    assert r["code"] == 2, (r["code"], r["stdout"][-2000:], err[-3000:])
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err[-3000:]
    for w in r["words"]:
        assert w in err, (w, err)
    assert r["after"] == r["before"]
    assert assets_unchanged, "a case of the battery changed the shared assets (the run, the data, the GPT-2 folder)"


@pytest.mark.slow
def test_too_little_space_for_a_checkpoint_is_found_at_start_up(tmp_path, monkeypatch, capsys):
    """The free-space pre-flight (a full disk cannot be made here without privileges: the disk's
    answer is replaced)."""
    import collections

    import training.run.reliability as rel
    from training.pretrain import main

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(rel.shutil, "disk_usage", lambda _p: usage(10**6, 10**6 - 1000, 1000))
    run = tmp_path / "run"
    assert main([*MOCK, f"run.dir={run}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "checkpoint.dir" in err and "free" in err and str(run / "checkpoints") in err
    assert not os.path.exists(run / "metrics.jsonl") and not os.path.exists(run / "config.yaml")
