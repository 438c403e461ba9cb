"""Hugging Face export / import (``tools.convert_checkpoint``, ``models.hf.export``).

The Megatron model is the reference: the exported ``transformers`` model (fp32) must give its
logits to 1e-4 (observed ~1e-6: fp32 round-off of a different operation order).

Parameters away from init: all nine tiny variants are exported after every parameter (and the
router's expert bias) got seeded Gaussian noise (σ = 0.05, so the HC mappings are far from their
structured init); one variant (xHC) is also exported after 200 real AdamW training steps
(``trained_run``, mock data: the session's shared run of ``tests/trained_run.py``, also read by
test_inspect), which also serves the from-hf -> next-training-step test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.filterwarnings("ignore")]

from tests.tiny_zoo import NOISE, SEQ, VARIANTS, VOCAB  # noqa: F401 (the shared zoo's sizes)
PARITY_TOL = 1e-4
UPCYCLE_TOL = 1e-5
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


from tests.tiny_zoo import megatron_logits as _megatron_logits  # noqa: E402
from tests.tiny_zoo import tokens as _tokens  # noqa: E402


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits.float()


from tests.tiny_zoo import write_run as _write_run  # noqa: E402


def _load_megatron(checkpoint, preset, vocab, seq):
    """The single-rank Megatron model loaded from ``checkpoint`` by dist_checkpointing."""
    from megatron.core import dist_checkpointing

    from tools.hf import build_single_rank_model

    model = build_single_rank_model(preset, vocab, seq, device="cpu")
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, checkpoint)
    missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected
    return model


@pytest.fixture(scope="module")
def megatron():
    from models.parallel import initialize_parallel

    torch.set_num_threads(1)
    initialize_parallel()
    yield


@pytest.fixture(scope="module")
def exported(tiny_zoo, megatron):
    """Every tiny variant: perturbed Megatron model, its run and checkpoint, its fp32 HF export and
    Megatron's logits (``tests/tiny_zoo.py``, built once per session and shared with test_inspect)."""
    return tiny_zoo


# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.slow
def test_logit_parity_perturbed(exported, variant):
    e = exported[variant]
    model = _hf(e["hf"])
    assert type(model).__name__ == ("Glm4MoeForCausalLM" if variant == "vanilla" else "XHCMoeForCausalLM")
    err = (_hf_logits(model, _tokens()) - e["logits"]).abs().max().item()
    print(f"PARITY {variant} single-rank {err:.3g}")
    assert err <= PARITY_TOL, f"{variant}: max |Δlogit| = {err:.3g}"


def test_vanilla_is_native_without_remote_code(exported):
    files = set(os.listdir(exported["vanilla"]["hf"]))
    assert not any(f.startswith("modeling_") for f in files)
    cfg = json.load(open(os.path.join(exported["vanilla"]["hf"], "config.json")))
    assert cfg["model_type"] == "glm4_moe" and "auto_map" not in cfg
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 1.0
    # Hub layout: one tensor per expert projection (what GLM-4.5 checkpoints on the Hub hold)
    from safetensors import safe_open

    with safe_open(os.path.join(exported["vanilla"]["hf"], "model.safetensors"), "pt") as f:
        assert "model.layers.1.mlp.experts.7.gate_proj.weight" in set(f.keys())


@pytest.mark.parametrize("variant", ["mhc", "xhc", "xhc-flash4"])
@pytest.mark.slow
def test_generate_with_caches_equals_full_sequence_argmax(exported, variant):
    """Greedy generate() (KV cache + xHC temporal decode cache) == argmax over full re-forwards."""
    model = _hf(exported[variant]["hf"])

    def reference(prompt):
        seq, margins = prompt, []
        with torch.no_grad():
            for _ in range(32):
                last = model(seq, use_cache=False).logits[0, -1]
                top = last.topk(2).values
                margins.append(float(top[0] - top[1]))
                seq = torch.cat([seq, last.argmax().view(1, 1)], 1)
        return seq, min(margins)

    # The first prompt whose reference argmax is decided by a margin far above fp32 round-off
    # everywhere (chosen from the reference alone, so the comparison never rests on rounding luck).
    for seed in range(9, 17):
        prompt = _tokens(1, 7, seed=seed)
        seq, margin = reference(prompt)
        if margin > 1e-4:
            break
    assert margin > 1e-4, "every candidate prompt has a near-tie in its reference argmax"
    got = model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    assert got.tolist() == seq.tolist()


def test_fresh_process_no_grad_and_generate_every_variant(exported, tmp_path):
    """The crash users met: in a fresh process with no pinning variable, the first HC call is a
    ``no_grad`` forward (what ``generate`` and lm-eval do).  Every variant: a ``no_grad`` forward, an
    ``inference_mode`` forward, then greedy cached ``generate`` equal to the argmax loop over full
    forwards (tests/journey.py, GENERATE_CHECK)."""
    from tests.journey import Workspace, generate_check

    res = generate_check(Workspace(tmp_path / "ws"), [exported[v]["hf"] for v in VARIANTS])
    assert len(res) == len(VARIANTS)
    for path, r in res.items():
        assert r["generate"] == r["argmax_loop"], path


def test_cached_decode_logits_equal_full_forward(exported):
    """Token-by-token decoding of xHC reproduces the full-sequence logits at every position."""
    model = _hf(exported["xhc"]["hf"])
    tokens = _tokens(1, 20, seed=4)
    full = _hf_logits(model, tokens)
    from transformers import DynamicCache

    cache, steps = DynamicCache(config=model.config), []
    with torch.no_grad():
        out = model(tokens[:, :5], cache=cache, use_cache=True)
        steps.append(out.logits)
        for t in range(5, 20):
            out = model(tokens[:, t:t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
    err = (torch.cat(steps, 1) - full).abs().max().item()
    assert err <= PARITY_TOL, err


@pytest.mark.slow
def test_isolation_without_xhc_models_training(exported, tmp_path):
    """The folder loads and runs where importing xhc, models and training is blocked."""
    ref = {}
    for v in ("vanilla", "xhc-flash4", "kromhc"):
        ref[v] = exported[v]["logits"]
        torch.save(_tokens(), tmp_path / "tokens.pt")
    script = textwrap.dedent(f"""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('xhc', 'models', 'training'):
                    raise ImportError('blocked: ' + name)
        sys.meta_path.insert(0, Block())
        sys.path = [p for p in sys.path if p not in ('', {REPO!r})]
        import torch
        from transformers import AutoModelForCausalLM
        tokens = torch.load({str(tmp_path / 'tokens.pt')!r})
        out = {{}}
        for v, path in {json.dumps({v: exported[v]['hf'] for v in ref})}.items():
            m = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()
            with torch.no_grad():
                out[v] = m(tokens).logits
        assert not any(k.split('.')[0] in ('xhc', 'models', 'training') for k in sys.modules)
        torch.save(out, {str(tmp_path / 'out.pt')!r})
    """)
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf_home"), PYTHONPATH="", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    for v in ref:
        assert (out[v] - ref[v]).abs().max().item() <= PARITY_TOL, v


# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant, hc", [("mhc", {}), ("xhc", {}),
                                         ("mhc", {"convention": "deepseek_v4", "reduction": "learned"}),
                                         ("xhc", {"reduction": "learned"})])  # fmt: skip
@pytest.mark.slow
def test_upcycling_keeps_vanilla_logits(exported, variant, hc, tmp_path):
    """from-hf --to-variant (--hc): the hyper-connection model computes the vanilla model (≤ 1e-5),
    also with DeepSeek-V4's convention (its + ε terms compensated) and its learned head."""
    from tools.hf import conversion as C
    from models.zoo import load_preset
    from xhc.head import LearnedHead

    res = C.from_hf(exported["vanilla"]["hf"], str(tmp_path / "up"), to_variant=variant.replace("-", "_"),
                    hc_overrides=hc, progress=False)
    preset = load_preset(res["preset"])
    assert preset.hc.variant == variant and {k: getattr(preset.hc, k) for k in hc} == hc
    model = _load_megatron(res["checkpoint"], preset, VOCAB, SEQ)
    assert sum(isinstance(m, LearnedHead) for m in model.modules()) == (hc.get("reduction") == "learned")
    err = (_megatron_logits(model, _tokens()) - exported["vanilla"]["logits"]).abs().max().item()
    print(f"UPCYCLE vanilla->{variant} {hc} {err:.3g}")
    assert err <= UPCYCLE_TOL, f"upcycled {variant}: max |Δlogit| = {err:.3g}"
    # it is a real HC model: its HC parameters exist and train (nonzero gradient on them)
    hc = [p for n, p in model.named_parameters() if getattr(p, "is_hyper_connection", False)]
    assert hc
    model.train()
    pos = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    model(_tokens(), pos, None, labels=_tokens(seed=2)).float().mean().backward()
    assert any(p.grad is not None and p.grad.abs().max() > 0 for p in hc)


def test_round_trip_to_from_to_is_byte_identical(exported, tmp_path):
    from safetensors import safe_open

    from tools.hf import conversion as C

    first = exported["xhc-flash4"]["hf"]
    back = C.from_hf(first, str(tmp_path / "back"), progress=False)
    C.to_hf(C.resolve_source(checkpoint=back["checkpoint"]), str(tmp_path / "again"), dtype="fp32", progress=False)

    def tensors(d):
        with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    a, b = tensors(first), tensors(str(tmp_path / "again"))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        assert a[k].view(torch.uint8).equal(b[k].view(torch.uint8)), k


def test_bf16_export_keeps_hc_fp32(exported, tmp_path):
    from safetensors import safe_open

    from tools.hf import conversion as C

    C.to_hf(C.resolve_source(run=exported["xhc"]["run"]), str(tmp_path / "bf16"), max_shard_size="100KB",
            progress=False)
    index = json.load(open(tmp_path / "bf16" / "model.safetensors.index.json"))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0].startswith("model-00001-of-")
    dtypes = {}
    for fn in files:
        with safe_open(str(tmp_path / "bf16" / fn), "pt") as f:
            dtypes.update({k: f.get_tensor(k).dtype for k in f.keys()})
    assert dtypes.keys() == set(index["weight_map"])
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    assert all(d == torch.float32 for k, d in dtypes.items() if "_hyper_connection." in k)
    model = _hf(str(tmp_path / "bf16"))
    err = (_hf_logits(model, _tokens()) - exported["xhc"]["logits"]).abs().max().item()
    assert err < 0.5, err  # bf16 weights: only a sanity bound


# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def parallel_sources(tmp_path_factory, run_torchrun, megatron):
    root = tmp_path_factory.mktemp("parallel")
    run_torchrun("tests/dist/convert_worker.py", args=[str(root), "tp_sp", "ep", "pp", "vpp"], timeout=420)
    return root


@pytest.mark.parametrize("mode", ["tp_sp", "ep", "pp", "vpp"])
@pytest.mark.slow
def test_parity_from_parallel_checkpoints(parallel_sources, mode, tmp_path):
    """Checkpoints saved by 2 ranks under TP=2+SP, EP=2, PP=2, PP=2+VPP=2 export on one process with parity."""
    from tools.hf import conversion as C
    from models.zoo import load_preset
    from tests.dist import convert_worker as W

    run = str(parallel_sources / mode)
    C.to_hf(C.resolve_source(run=run), str(tmp_path / "hf"), dtype="fp32", progress=False)
    tokens = W.batch()
    got = _hf_logits(_hf(str(tmp_path / "hf")), tokens)
    if mode in ("pp", "vpp"):  # reference: the single-rank Megatron model resharded from the PP checkpoint
        src = C.resolve_source(run=run)
        ref = _megatron_logits(_load_megatron(src.checkpoint, load_preset(W.MODES[mode][0]), W.VOCAB, W.SEQ), tokens)
    else:  # reference: the parallel model's own logits
        ref = torch.load(os.path.join(run, "logits.pt"))
    if mode == "vpp":  # each rank's two virtual stages land on the right HF layers
        from safetensors.torch import load_file

        hf = {}
        for f in os.listdir(tmp_path / "hf"):
            if f.endswith(".safetensors"):
                hf.update(load_file(str(tmp_path / "hf" / f)))
        seen = {}
        for r in range(2):
            seen.update(torch.load(os.path.join(run, f"layer_norms_rank{r}.pt")))
        assert sorted(seen) == list(range(load_preset(W.MODES[mode][0]).num_layers))
        for i, w in seen.items():
            assert torch.equal(hf[f"model.layers.{i}.input_layernorm.weight"], w), i
    err = (got - ref).abs().max().item()
    print(f"PARITY {W.MODES[mode][0]} {mode} {err:.3g}")
    assert err <= PARITY_TOL, f"{mode}: max |Δlogit| = {err:.3g}"


# ------------------------------------------------------------------------------------------------
def _cli(*argv):
    proc = subprocess.run([sys.executable, "-m", "tools.convert_checkpoint", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    return proc.returncode, proc.stderr.strip().splitlines()


def _cli_batch(tmp_path, **commands):
    """Several ``python -m tools.convert_checkpoint`` command lines in one process (tests/batch_cli.py:
    one interpreter start and one import of torch, Megatron and transformers): ``{name: (exit code,
    stderr lines)}``."""
    jobs = [{"name": k, "module": "tools.convert_checkpoint", "args": list(map(str, v))} for k, v in commands.items()]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    proc = subprocess.run([sys.executable, os.path.join("tests", "batch_cli.py"), str(tmp_path / "jobs.json"),
                           str(tmp_path / "results.json")], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    return {k: (r["code"], r["stderr"].strip().splitlines()) for k, r in results.items()}


@pytest.mark.slow
def test_bad_inputs_one_line_errors_nothing_overwritten(exported, tmp_path):
    import shutil

    from tools.hf import conversion as C

    # missing checkpoint
    with pytest.raises(C.ConversionError, match="no such directory"):
        C.resolve_source(checkpoint=str(tmp_path / "nope"))
    # corrupt checkpoint: a shard truncated
    bad = tmp_path / "bad"
    shutil.copytree(exported["mhc"]["run"], bad)
    ck = C.resolve_source(run=str(bad)).checkpoint
    shard = next(os.path.join(ck, f) for f in os.listdir(ck) if f.endswith(".distcp"))
    with open(shard, "r+b") as f:
        f.truncate(10)
    # existing output folder: refused, untouched
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    # an HF folder of another architecture
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    got = _cli_batch(tmp_path, corrupt=["to-hf", "--run", bad, "--output", tmp_path / "out"],
                     exists=["to-hf", "--run", exported["mhc"]["run"], "--output", out],
                     llama=["from-hf", "--hf", llama, "--output", tmp_path / "x"])
    code, err = got["corrupt"]
    assert code == 2 and len(err) == 1 and err[0].startswith("error: checkpoint") and ".distcp" in err[0], err
    assert not (tmp_path / "out").exists()
    code, err = got["exists"]
    assert code == 2 and len(err) == 1 and "--overwrite" in err[0], err
    assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    code, err = got["llama"]
    assert code == 2 and len(err) == 1 and "LlamaForCausalLM" in err[0] and "not supported" in err[0], err
    assert not (tmp_path / "x").exists()
    # upcycling an HC model is refused
    with pytest.raises(C.ConversionError, match="already a hyper-connection model"):
        C.from_hf(exported["mhc"]["hf"], str(tmp_path / "y"), to_variant="xhc", progress=False)
    assert not (tmp_path / "y").exists()
    # DeepSeek-V4's convention on a variant that has no such maps: one line naming the field and the fix
    with pytest.raises(C.ConversionError, match=r"^--to-variant / --hc: HCConfig\.convention='deepseek_v4' .*"
                                                r"use convention: paper$"):
        C.from_hf(exported["vanilla"]["hf"], str(tmp_path / "z"), to_variant="xhc",
                  hc_overrides={"convention": "deepseek_v4"}, progress=False)
    assert not (tmp_path / "z").exists()


# ------------------------------------------------------------------------------------------------
TRAIN_STEPS = 200
VARIANT_STEPS = 50  # every other variant: 50 AdamW steps move the HC tensors ~0.1 from init (10x the bound below)


def _pretrain_args(run, preset: str, steps: int, interval: int) -> list:
    return [f"model.preset={preset}", "data.mock=true", f"run.train_steps={steps}", "batch.micro_batch_size=2",
            "batch.global_batch_size=2", "batch.seq_length=32", "run.eval_interval=0", "logging.tensorboard=false",
            "logging.plot=false", f"checkpoint.interval={interval}", f"run.dir={run}", "run.num_threads=1",
            "tokenizer.vocab_size=512", "logging.interval=100"]


@pytest.fixture(scope="module")
def trained_run(trained_xhc):
    """tiny-moe:xhc pre-trained for 201 AdamW steps on mock data (checkpoints at 100, 200 and 201):
    the session's shared run (``tests/trained_run.py``, also read by test_inspect)."""
    from tests.trained_run import STEPS

    assert STEPS == TRAIN_STEPS + 1
    return trained_xhc


def _metrics(run, kind="train"):
    out = {}
    with open(os.path.join(run, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") == kind and "loss" in r:
                out[r["step"]] = r["loss"]
    return out


def _trained_parity(run, tmp_path, label: str, steps: int = TRAIN_STEPS) -> None:
    from tools.hf import conversion as C

    ckpt = os.path.join(run, "checkpoints", f"step_{steps:08d}")
    src = C.resolve_source(checkpoint=ckpt)
    C.to_hf(src, str(tmp_path / "hf"), dtype="fp32", progress=False)
    preset = C.effective_preset(src)
    model = _load_megatron(ckpt, preset, 512, 32)
    # "Moved from init" is measured on the tensors whose init does not depend on the seed (built
    # twice under different seeds: equal), so it compares against the run's real initial values.
    fresh = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        fresh.append(C.build_single_rank_model(preset, 512, 32, device="cpu").state_dict())
    fixed = [k for k, v in fresh[0].items() if torch.is_tensor(v) and v.is_floating_point() and torch.equal(v, fresh[1][k])]
    hc_keys = [k for k in fixed if "_hyper_connection." in k]
    keys = hc_keys or fixed  # vanilla: norm gains and the router's expert bias
    moved = max((model.state_dict()[k] - fresh[0][k]).abs().max().item() for k in keys)
    assert moved > 1e-2, f"{label}: {'HC' if hc_keys else 'backbone'} tensors barely moved from init ({moved:.2g})"
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    err = (_hf_logits(_hf(str(tmp_path / "hf")), tokens) - _megatron_logits(model, tokens)).abs().max().item()
    print(f"PARITY {label} trained-{steps}-steps {err:.3g} ({'HC' if hc_keys else 'backbone'} tensors "
          f"moved up to {moved:.3g})")
    assert err <= PARITY_TOL, f"trained {label}: max |Δlogit| = {err:.3g}"


@pytest.mark.slow
def test_parity_after_training(trained_run, megatron, tmp_path):
    """After 200 real training steps the HC tensors are far from init and parity still holds."""
    _trained_parity(trained_run, tmp_path, "tiny-moe:xhc")
    card = open(tmp_path / "hf" / "README.md").read()
    assert "tiny-moe:xhc" in card and f"| training step | {TRAIN_STEPS} |" in card


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "xhc"])  # xhc: test_parity_after_training
@pytest.mark.slow
def test_parity_after_training_every_variant(variant, megatron, tmp_path):
    """Every other variant, 50 real AdamW steps away from init (the HC tensors moved > 1e-2, checked):
    exported logits equal Megatron's."""
    from training.pretrain import main  # in-process: no interpreter start-up per variant

    from models.parallel import initialize_parallel

    assert main(_pretrain_args(tmp_path / "run", f"tiny-moe:{variant}", VARIANT_STEPS, VARIANT_STEPS)) == 0
    initialize_parallel()  # the run tore its parallel state down; later tests of this module use it
    torch.set_num_threads(1)
    _trained_parity(tmp_path / "run", tmp_path, f"tiny-moe:{variant}", VARIANT_STEPS)


@pytest.mark.slow
def test_from_hf_then_one_step_gives_the_original_next_loss(trained_run, tmp_path):
    """to-hf (step 200) -> from-hf -> one training step: the loss of step 201 equals the original run's."""
    code, err = _cli("to-hf", "--checkpoint", os.path.join(trained_run, "checkpoints", f"step_{TRAIN_STEPS:08d}"),
                     "--output", str(tmp_path / "hf"), "--dtype", "fp32", "--quiet")
    assert code == 0, err
    code, err = _cli("from-hf", "--hf", str(tmp_path / "hf"), "--output", str(tmp_path / "back"), "--quiet")
    assert code == 0, err
    cmd = [sys.executable, "-m", "training.pretrain", f"model.preset={tmp_path / 'back' / 'preset.yaml'}:xhc",
           "data.mock=true", f"run.train_steps={TRAIN_STEPS + 1}", "batch.micro_batch_size=2",
           "batch.global_batch_size=2", "batch.seq_length=32", "run.eval_interval=0", "logging.tensorboard=false",
           "logging.plot=false", f"run.dir={tmp_path / 'resumed'}", "run.num_threads=1", "tokenizer.vocab_size=512",
           f"checkpoint.load={tmp_path / 'back' / 'checkpoints'}", "checkpoint.load_optimizer=false",
           "checkpoint.load_rng=false", "checkpoint.save_final=false"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    want = _metrics(trained_run)[TRAIN_STEPS + 1]
    got = _metrics(tmp_path / "resumed")
    assert list(got) == [TRAIN_STEPS + 1]
    assert abs(got[TRAIN_STEPS + 1] - want) <= 1e-5 * abs(want), (got, want)


# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported_with_tokenizer(tmp_path_factory, megatron):
    """A vanilla tiny model with a SentencePiece tokenizer (trained here on a few stdlib docstrings)."""
    import inspect

    import yaml

    from tools.hf import conversion as C
    from models.zoo import build_model, build_transformer_config, load_preset
    from training.data.tokenizer import train_sentencepiece

    root = tmp_path_factory.mktemp("tok")
    docs = [inspect.getdoc(o) for o in (json, os, subprocess, inspect, dict, list, str, int, textwrap, pytest)]
    docs = [d for d in docs if d]
    with open(root / "corpus.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    train_sentencepiece(docs, str(root / "tok.model"), vocab_size=384, log=None)
    preset = load_preset("tiny-moe:vanilla")
    torch.manual_seed(0)
    model = build_model(preset, build_transformer_config(preset, cpu=True), use_transformer_engine=False,
                        vocab_size=384, seq_length=64)
    run = root / "run"
    _write_run(str(run), "tiny-moe:vanilla", model)
    with open(run / "config.yaml", "w") as f:
        yaml.safe_dump({"model": {"preset": "tiny-moe:vanilla"}, "tokenizer": {"path": str(root / "tok.model")},
                        "batch": {"seq_length": 64}}, f)
    C.to_hf(C.resolve_source(run=str(run)), str(root / "hf"), progress=False)
    return root, docs


def test_tokenizer_encodes_like_training(exported_with_tokenizer):
    import sentencepiece as spm
    from transformers import AutoTokenizer

    root, docs = exported_with_tokenizer
    assert {"tokenizer.model", "tokenizer.json"} <= set(os.listdir(root / "hf"))
    hf = AutoTokenizer.from_pretrained(str(root / "hf"))
    sp = spm.SentencePieceProcessor(model_file=str(root / "tok.model"))
    for text in docs[:4] + ["  x = 12345 ü 😀  \n\n\tdef f(a):  return  a+1 ##"]:
        ids = sp.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids
        assert hf.decode(ids) == sp.decode(ids)
    assert hf.eos_token_id == sp.eos_id()


@pytest.mark.slow
def test_lm_eval_end_to_end(exported_with_tokenizer):
    """lm-eval-harness (hf model, local task) on the exported folder, through tools.evaluate."""
    pytest.importorskip("lm_eval")
    import math

    from tools.evaluate import evaluate

    root, docs = exported_with_tokenizer
    res = evaluate(str(root / "hf"), str(root / "corpus.jsonl"), split="1,1,1", limit=2)
    assert res["documents"] == 2
    # bits per byte and byte perplexity are two views of the same log-likelihood
    assert math.isfinite(res["bits_per_byte"]) and res["bits_per_byte"] > 0
    assert abs(2 ** res["bits_per_byte"] - res["byte_perplexity"]) <= 1e-6 * res["byte_perplexity"]


def test_bf16_checkpoint_source(megatron, tmp_path):
    """GPU runs save the backbone in bf16 (HC in fp32): both read back exactly."""
    from safetensors.torch import load_file

    from tools.hf import conversion as C
    from models.zoo import build_model, build_transformer_config, load_preset

    preset = load_preset("tiny-moe:mhc")
    model = build_model(preset, build_transformer_config(preset, cpu=True), use_transformer_engine=False,
                        vocab_size=VOCAB, seq_length=SEQ)
    for _, p in model.named_parameters():
        if not getattr(p, "is_hyper_connection", False):
            p.data = p.data.bfloat16()
    _write_run(str(tmp_path / "run"), "tiny-moe:mhc", model)
    C.to_hf(C.resolve_source(run=str(tmp_path / "run")), str(tmp_path / "hf"), dtype="fp32", progress=False)
    got, sd = load_file(str(tmp_path / "hf" / "model.safetensors")), model.state_dict()
    assert torch.equal(got["model.embed_tokens.weight"], sd["embedding.word_embeddings.weight"].float())
    name = "self_attention_hyper_connection.b_pre"
    assert got[f"model.layers.0.{name}"].dtype == torch.float32
    assert torch.equal(got[f"model.layers.0.{name}"], sd[f"decoder.layers.0.{name}"])


def test_streaming_reads_one_group_at_a_time(exported, monkeypatch, tmp_path):
    """to-hf asks dist_checkpointing for one group (embedding, one layer, head) per read, in order."""
    from megatron.core import dist_checkpointing

    from tools.hf import conversion as C
    from models.hf.export import mapping as M

    calls, real = [], dist_checkpointing.load

    def spy(sharded, path, *a, **k):
        calls.append(sorted({M.group_of(n) for n in sharded}))
        return real(sharded, path, *a, **k)

    monkeypatch.setattr(dist_checkpointing, "load", spy)
    C.to_hf(C.resolve_source(run=exported["xhc-flash4"]["run"]), str(tmp_path / "hf"), dtype="fp32", progress=False)
    assert calls == [["embedding"]] + [[f"layer.{i}"] for i in range(4)] + [["head"]]


def test_streaming_holds_one_group_at_a_time(exported):
    """Once the caller drops a group's tensors, nothing keeps them alive: the next group's read
    finds the previous one freed (the model's sharded entries must not hold the loaded storage)."""
    import gc
    import weakref

    from tools.hf import conversion as C

    src = C.resolve_source(run=exported["xhc"]["run"])
    with C.single_rank():
        model = C.build_single_rank_model(C.effective_preset(src), C.vocab_size_of(src.checkpoint), SEQ)
        previous = []
        for _g, tensors in C.stream_checkpoint(model, src.checkpoint, progress=False):
            gc.collect()
            assert all(r() is None for r in previous), "an earlier group's tensors are still alive"
            previous = [weakref.ref(t) for t in tensors.values()]
            del tensors
        assert previous
