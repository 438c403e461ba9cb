"""``python -m tools.inspect`` (xhc-inspect): known answers on synthetic models, every SOURCE kind for
every variant, the same model read three ways, bad inputs, and the content of the figures.

Fast tier: the known answers drive hand-built hyper-connection modules (``xhc/`` only, no Megatron)
through :class:`tools.inspect.Recorder`, and the bad-input errors need no model.  The slow tests
share module-scoped fixtures: every tiny variant with its parameters moved off init by seeded
Gaussian noise (the approach of tests/test_convert_hf.py; no training), saved as a run directory
and exported to an fp32 Hugging Face folder (``tests/tiny_zoo.py``), and one tiny-moe:xhc run trained
for 201 steps on mock data (``tests/trained_run.py``); both are built once per session and shared
with test_convert_hf.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from tests.tiny_zoo import NOISE, SEQ, VARIANTS, VOCAB  # noqa: F401 (the shared zoo's sizes)
from tests.trained_run import CHECKPOINTS, STEPS  # noqa: E402 (the shared trained run)
SAME_TOL = 1e-5


def _inspect_main():
    from tools.inspect import main

    return main


# ------------------------------------------------------------------------------------------------
# Synthetic models: hand-built hyper-connection modules, fixed random branches
# ------------------------------------------------------------------------------------------------
def _branches(C, seed=0):
    g = torch.Generator().manual_seed(seed)
    Wa, Wm = torch.randn(C, C, generator=g) / C ** 0.5, torch.randn(C, C, generator=g) / C ** 0.5
    return (lambda u: torch.tanh(u @ Wa)), (lambda u: torch.tanh(u @ Wm))


def _record(pairs, X, n_layers=None):
    """Drive ``pairs`` [(attn_mod, mlp_mod), ...] over ``X`` [s, b, N, C]; returns Recorder.result()."""
    from tools.inspect import Recorder

    hc = pairs[0][0].cfg
    rec = Recorder(hc)
    attn, mlp = _branches(X.shape[-1])
    with torch.no_grad():
        for i, (a, m) in enumerate(pairs):
            X = rec.run_layer(i, a, m, attn, mlp, X)
    return rec.result()


def _state(s=6, b=2, n=4, C=8, seed=1):
    from xhc.hyper_connection import expand_streams

    e = torch.randn(s, b, C, generator=torch.Generator().manual_seed(seed))
    return expand_streams(e, n)


def _hc_pairs(cfg, layers, C=8):
    from xhc.hyper_connection import HyperConnection

    return [(HyperConnection(cfg, C, 2 * i), HyperConnection(cfg, C, 2 * i + 1)) for i in range(layers)]


def test_identity_mixing_distance_zero_gain_exactly_one():
    from xhc.config import HCConfig

    cfg = HCConfig(variant="identity", n=4, kernels="eager")
    pairs = _hc_pairs(cfg, 3)
    with torch.no_grad():  # move the read/write maps off init: H_res stays I whatever they are
        for a, m in pairs:
            for p in list(a.parameters()) + list(m.parameters()):
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    out = _record(pairs, _state())
    assert len(out["sublayers"]) == 6
    for r in out["sublayers"]:
        assert r["dist_identity"] == 0.0 and r["dist_identity_token_mean"] == 0.0
        assert r["dist_permutation"] == 0.0 and r["nearest_permutation"] == [0, 1, 2, 3]
        assert r["row_sum_error"] == 0.0 and r["col_sum_error"] == 0.0
    assert out["gain"]["forward"] == [1.0] * 6 and out["gain"]["backward"] == [1.0] * 6
    # the streams separate (different h_post per stream), so the state measures are not trivial
    assert len(set(round(v, 9) for v in out["depth"]["stream_rms"][-1])) > 1


def test_permutation_h_res_is_at_distance_zero_from_the_permutations():
    from xhc.config import HCConfig

    cfg = HCConfig(variant="hc", n=4, dynamic=False, kernels="eager")
    pairs = _hc_pairs(cfg, 2)
    perms = [[2, 0, 3, 1], [1, 0, 2, 3], [3, 2, 1, 0], [0, 1, 3, 2]]
    with torch.no_grad():
        for mod, perm in zip([m for p in pairs for m in p], perms):
            mod.S_res.zero_()
            mod.S_res[torch.arange(4), torch.tensor(perm)] = 1.0
    out = _record(pairs, _state())
    for r, perm in zip(out["sublayers"], perms):
        moved = sum(1 for i, j in enumerate(perm) if i != j)
        assert r["dist_permutation"] == 0.0
        assert r["nearest_permutation"] == perm
        assert r["dist_identity"] == pytest.approx(math.sqrt(2 * moved), abs=1e-12)  # ‖P − I‖² = 2·(moved rows)
    assert out["gain"]["forward"] == [1.0] * 4 and out["gain"]["backward"] == [1.0] * 4


def test_nearest_permutation_matches_brute_force():
    from tools.inspect import nearest_permutation

    g = np.random.default_rng(3)
    for _ in range(20):
        H = g.normal(size=(4, 4)) + 2.0 * np.eye(4)[g.permutation(4)]
        best = min(itertools.permutations(range(4)),
                   key=lambda p: ((H - np.eye(4)[list(p)]) ** 2).sum())
        perm, d = nearest_permutation(H)
        assert perm == list(best)
        assert d == pytest.approx(math.sqrt(((H - np.eye(4)[list(best)]) ** 2).sum()), rel=1e-12)


def _sinkhorn64(Z, iters=20):
    """docs/math.md §1.4 in float64: row softmax, then (columns, rows) ``iters`` times."""
    M = np.exp(Z - Z.max(1, keepdims=True))
    M = M / M.sum(1, keepdims=True)
    for _ in range(iters):
        M = M / M.sum(0, keepdims=True)
        M = M / M.sum(1, keepdims=True)
    return M


def test_gains_match_a_float64_product_of_the_matrices():
    from xhc.config import HCConfig

    # unconstrained static HC: random S_res with negative entries, so the gains are far from 1 and
    # depend on the order of the product
    cfg = HCConfig(variant="hc", n=4, dynamic=False, kernels="eager")
    pairs = _hc_pairs(cfg, 3)
    g = torch.Generator().manual_seed(7)
    mats = []
    with torch.no_grad():
        for mod in [m for p in pairs for m in p]:
            mod.S_res.copy_(torch.eye(4) + 0.4 * torch.randn(4, 4, generator=g))
            mats.append(mod.S_res.double().numpy())
    out = _record(pairs, _state())
    P = np.eye(4)
    for l, H in enumerate(mats):
        P = H @ P  # X' = H X: the composite is H_l ⋯ H_1
        assert out["gain"]["forward"][l] == pytest.approx(np.abs(P).sum(1).max(), rel=1e-12)
        assert out["gain"]["backward"][l] == pytest.approx(np.abs(P).sum(0).max(), rel=1e-12)
    assert out["gain"]["forward"][-1] > 1.5

    # static mHC: H_res = Sinkhorn(b_res), recomputed here in float64
    cfg = HCConfig(variant="mhc", n=4, dynamic=False, kernels="eager")
    pairs = _hc_pairs(cfg, 2)
    mats = []
    with torch.no_grad():
        for mod in [m for p in pairs for m in p]:
            mod.b_res.copy_(0.5 * torch.randn(16, generator=g))
            mats.append(_sinkhorn64(mod.b_res.double().view(4, 4).numpy()))
    out = _record(pairs, _state())
    P = np.eye(4)
    for l, H in enumerate(mats):
        P = H @ P
        assert out["gain"]["forward"][l] == pytest.approx(np.abs(P).sum(1).max(), abs=1e-5)
        assert out["gain"]["backward"][l] == pytest.approx(np.abs(P).sum(0).max(), abs=1e-5)
        assert np.allclose(out["sublayers"][l]["H_mean"], H, atol=1e-5)


def test_hand_built_router_gives_its_known_load():
    """n=4, k=2, m=1: stream 0 is fixed; the router's only non-zero weights read coordinate 0 of
    stream 0 (+50 for stream 3, −50 for stream 2), so a token whose coordinate is positive writes
    stream 3 and one whose coordinate is negative writes stream 2.  9 of 12 tokens are positive."""
    from xhc.config import HCConfig
    from xhc.hyper_connection import expand_streams
    from xhc.xhc import XHCSublayer

    cfg = HCConfig(variant="xhc", n=4, k=2, m=1, kernels="eager")
    C = 8
    mods = [XHCSublayer(cfg, C, is_mlp=False, layer_index=0), XHCSublayer(cfg, C, is_mlp=True, layer_index=1)]
    with torch.no_grad():
        for mod in mods:
            mod.router.weight.zero_()
            mod.router.weight[3, 0] = 50.0
            mod.router.weight[2, 0] = -50.0
    sign = torch.tensor([1.0] * 9 + [-1.0] * 3)
    e = torch.zeros(12, 1, C)
    e[:, 0, 0], e[:, 0, 1] = sign, -sign  # zero mean over the N·C entries: LayerNorm keeps the sign
    from tools.inspect import Recorder

    rec = Recorder(cfg)
    with torch.no_grad():
        rec.run_layer(0, mods[0], mods[1], lambda u: torch.zeros_like(u), lambda u: torch.zeros_like(u),
                      expand_streams(e, 4))
    out = rec.result()
    assert len(out["routing"]) == 2
    for r in out["routing"]:
        assert r["load"] == pytest.approx([1.0, 0.0, 0.25, 0.75], abs=1e-7)
        ent = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
        assert r["entropy"] == pytest.approx(ent, rel=1e-9)
        assert r["entropy_normalised"] == pytest.approx(ent / math.log(3), rel=1e-9)
        assert r["fixed_share"] == pytest.approx(0.5, abs=1e-6)  # p = [1, σ(100)] = [1, 1]
    # the routed stream's write weight p·H_post = 1·2σ(0) = 1, on 75 % / 25 % of the tokens
    assert out["sublayers"][0]["h_post"] == pytest.approx([1.0, 0.0, 0.25, 0.75], abs=1e-6)


# ------------------------------------------------------------------------------------------------
# Bad input: one line naming the path
# ------------------------------------------------------------------------------------------------
def _error_line(capsys, argv, only_line=True):
    """The one ``error:`` line of a failed run (exit status 2, no traceback).  ``only_line=False``: the
    run got as far as loading libraries, whose own notices may precede it on stderr."""
    rc = _inspect_main()(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "Traceback" not in err, err
    lines = [l for l in err.splitlines() if l.startswith("error:")]
    assert len(lines) == 1, err
    if only_line:
        assert len(err.splitlines()) == 1, err
    return lines[0]


def test_bad_inputs_name_the_path(tmp_path, capsys):
    out = str(tmp_path / "out")
    missing = str(tmp_path / "nope")
    assert missing in _error_line(capsys, [missing, "--output", out])
    assert "no such file" in _error_line(capsys, [missing, "--output", out])

    other = tmp_path / "just-a-folder"
    other.mkdir()
    (other / "notes.txt").write_text("hello")
    msg = _error_line(capsys, [str(other), "--output", out])
    assert str(other) in msg and "not a run directory" in msg

    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(b"\0")
    msg = _error_line(capsys, [str(ckpt), "--output", out])
    assert str(ckpt) in msg and "manifest" in msg

    msg = _error_line(capsys, [str(tmp_path / "run"), "--step", "5", "--output", out])
    assert str(tmp_path / "run") in msg and "step 5" in msg and "kept steps: 2" in msg
    msg = _error_line(capsys, [str(tmp_path / "run"), "--steps", "2,7", "--output", out])
    assert "step 7" in msg
    # the run's newest checkpoint is the unfinished one: named too
    msg = _error_line(capsys, [str(tmp_path / "run"), "--output", out])
    assert str(ckpt) in msg and "manifest" in msg

    empty_run = tmp_path / "empty-run"
    (empty_run / "checkpoints").mkdir(parents=True)
    msg = _error_line(capsys, [str(empty_run), "--output", out])
    assert str(empty_run) in msg and "without a finished checkpoint" in msg
    assert not os.path.exists(out)  # nothing written for bad input


def test_module_name_does_not_shadow_the_stdlib():
    """``tools.inspect`` is only reachable under its package; ``import inspect`` stays the stdlib."""
    code = ("import inspect, tools.inspect as t; assert inspect is not t and inspect.__file__ != t.__file__; "
            "assert callable(inspect.signature)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-m", "tools.inspect", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "--compare" in proc.stdout, proc.stderr[-2000:]


# ------------------------------------------------------------------------------------------------
# Real tiny models: every variant, every SOURCE kind
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def zoo(tiny_zoo):
    """Every tiny variant, parameters moved off init by seeded noise: run dir, checkpoint, fp32 HF
    folder (``tests/tiny_zoo.py``, built once per session and shared with test_convert_hf)."""
    return tiny_zoo


def _inspect(source, out_dir, *extra):
    rc = _inspect_main()([source, "--output", str(out_dir), "--tokens", "48", "--quiet", *extra])
    assert rc == 0
    with open(os.path.join(out_dir, "inspect.json")) as f:
        return json.load(f)


def _assert_same(a, b, path="", tol=SAME_TOL):
    """Every number of ``a`` equals ``b`` to ``tol`` (ignoring where it came from and how long it took)."""
    if isinstance(a, dict):
        keys = set(a) - {"seconds", "checkpoint", "largest_group_bytes"}
        assert keys == set(b) - {"seconds", "checkpoint", "largest_group_bytes"}, path
        for k in keys:
            _assert_same(a[k], b[k], f"{path}.{k}", tol)
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]", tol)
    elif isinstance(a, float) or isinstance(b, float):
        assert abs(a - b) <= tol, f"{path}: {a} vs {b}"
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_source_kind_for_every_variant(zoo, variant, tmp_path, capsys):
    z = zoo[variant]
    got = {kind: _inspect(z[kind], tmp_path / kind, "--no-figures") for kind in ("run", "checkpoint", "hf")}
    for kind, res in got.items():
        run = res["runs"][0]
        assert run["source"]["kind"] == kind
        if variant == "vanilla":
            assert run["hc"] is False and run["inspections"] == []
            assert "no hyper-connections" in run["message"] and z[kind] in run["message"]
            continue
        assert run["hc"] is True and run["variant"] == variant.replace("-", "_")
        m = run["inspections"][0]
        assert [s["index"] for s in m["sublayers"]] == list(range(8))
        assert len(m["depth"]["stream_rms"]) == 5 and len(m["depth"]["stream_rms"][0]) == run["n"]
        # the entry state is N copies of the embedding: equal RMS, cosine exactly 1
        assert len(set(m["depth"]["stream_rms"][0])) == 1
        for s in m["sublayers"]:
            H = np.array(s["H_mean"])
            if variant in ("mhc", "mhc-lite", "kromhc", "identity", "xhc", "xhc-flash", "xhc-flash4"):
                assert np.abs(H.sum(1) - 1).max() < 1e-5  # unit rows (doubly stochastic family, xHC's Ĥ)
                assert s["gain_fwd"] == pytest.approx(1.0, abs=1e-5)
            if variant == "identity":
                assert s["dist_identity"] == 0.0 and s["gain_fwd"] == 1.0 and s["gain_bwd"] == 1.0
        if variant.startswith("xhc"):
            n_routing = {"xhc": 8, "xhc-flash": 4, "xhc-flash4": 2}[variant]
            assert len(m["routing"]) == n_routing
            for r in m["routing"]:
                assert r["load"][:2] == [1.0, 1.0]  # m = 2 fixed streams
                assert sum(r["load"]) == pytest.approx(4.0, abs=1e-6)  # k = 4 written per token
            conv = [s for s in m["sublayers"] if s.get("conv_kernels")]
            assert len(conv) == 4 and [k["size"] for k in conv[0]["conv_kernels"]] == [4, 8, 12]
            for s in conv:  # Gram–Schmidt keeps y as it is
                assert s["gs_rms_after"][0] == pytest.approx(s["gs_rms_before"][0], rel=1e-12)
        else:
            assert m["routing"] == []
    if variant == "vanilla":
        return
    # one model, three ways: the same numbers
    ins = [got[k]["runs"][0]["inspections"][0] for k in ("run", "checkpoint", "hf")]
    _assert_same(ins[0], ins[1])
    _assert_same(ins[0], ins[2])


@pytest.mark.slow
@pytest.mark.megatron
def test_vanilla_is_reported_in_one_clear_line(zoo, tmp_path, capsys):
    rc = _inspect_main()([zoo["vanilla"]["run"], "--output", str(tmp_path / "v"), "--quiet"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    msgs = [l for l in out if "no hyper-connections" in l]
    assert len(msgs) == 1 and "vanilla" in msgs[0] and zoo["vanilla"]["run"] in msgs[0]
    assert "no hyper-connections" in (tmp_path / "v" / "report.md").read_text()


# ------------------------------------------------------------------------------------------------
# A trained run: three ways, over training, curves, figures
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(trained_xhc, tmp_path_factory):
    """tiny-moe:xhc trained 201 AdamW steps on mock data, checkpoints at 100, 200 and 201, HC health
    every step: the session's shared run (``tests/trained_run.py``, also read by test_convert_hf),
    and an fp32 export of its last checkpoint."""
    from tools.hf import conversion as C
    from tests.trained_run import STEPS, checkpoint

    hf = str(tmp_path_factory.mktemp("inspect-trained") / "hf")
    C.to_hf(C.resolve_source(run=trained_xhc), hf, dtype="fp32", progress=False, log=lambda *_: None)
    return {"run": trained_xhc, "checkpoint": checkpoint(trained_xhc, STEPS), "hf": hf}


def _png_has_content(path):
    import matplotlib.image as mpimg

    assert os.path.getsize(path) > 2000, path
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100, path
    assert float(img[..., :3].std()) > 0.02, f"{path} is blank"  # more than a background colour


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.train
def test_trained_model_three_ways_same_numbers(trained, tmp_path, capsys):
    res = {k: _inspect(trained[k], tmp_path / k, "--no-figures") for k in ("run", "checkpoint", "hf")}
    ins = [res[k]["runs"][0]["inspections"] for k in ("run", "checkpoint", "hf")]
    assert [len(i) for i in ins] == [1, 1, 1] and ins[0][0]["step"] == STEPS and ins[2][0]["step"] == STEPS
    _assert_same(ins[0][0], ins[1][0])
    _assert_same(ins[0][0], ins[2][0])
    # a trained model, not the initial one: xHC's read starts exactly uniform, h_pre = 1/N (W_pre = 0,
    # b_pre = −ln(N − 1)), and the AdamW steps move it
    assert max(abs(h - 1 / 8) for s in ins[0][0]["sublayers"] for h in s["h_pre"]) > 1e-6
    # --text needs a tokenizer; this mock-data run has none: one line naming the file
    text = tmp_path / "notes.txt"
    text.write_text("def main():\n    return 0\n")
    msg = _error_line(capsys, [trained["run"], "--text", str(text), "--output", str(tmp_path / "t"), "--quiet"],
                      only_line=False)
    assert str(text) in msg and "tokenizer" in msg


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.train
def test_figures_steps_curves_and_compare(trained, zoo, tmp_path):
    out = tmp_path / "all"
    res = _inspect(trained["run"], out, "--steps", "all", "--compare", zoo["mhc"]["hf"], zoo["vanilla"]["run"])
    runs = res["runs"]
    assert [m["step"] for m in runs[0]["inspections"]] == list(CHECKPOINTS)
    # the curves are metrics.jsonl's numbers
    want = {}
    with open(os.path.join(trained["run"], "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") == "train" and "loss" in r:
                want[r["step"]] = (r["loss"], (r.get("hc") or {}).get("amax_gain_fwd"))
    c = runs[0]["curves"]
    assert dict(zip(c["train"]["step"], c["train"]["loss"])) == {s: v[0] for s, v in want.items()}
    assert dict(zip(c["hc"]["amax_gain_fwd"]["step"], c["hc"]["amax_gain_fwd"]["value"])) == {
        s: v[1] for s, v in want.items() if v[1] is not None}
    assert len(c["eval"]["step"]) >= 1
    # figures: every PNG listed exists and has content; report.md shows each with its caption
    files = [f["file"] for r in runs for f in r.get("figures", [])] + [f["file"] for f in res["figures"]]
    for name in ("steps_mixing.png", "steps_stream_rms.png", "training_curves.png", "compare.png"):
        assert name in files
    for prefix in ("run_", "mhc-hf_"):
        for name in ("mixing_mean.png", "mixing_composite.png", "mixing_static.png", "mixing_distances.png",
                     "read_write.png", "gain.png", "stream_rms.png", "stream_cosine.png"):
            assert prefix + name in files
    for name in ("router.png", "temporal_kernels.png", "gram_schmidt.png", "mixing_spread.png"):
        assert "run_" + name in files
    assert not any(f.startswith("vanilla") for f in files)
    report = (out / "report.md").read_text()
    for name in files:
        _png_has_content(out / name)
        assert f"]({name})" in report
    assert sorted(p for p in os.listdir(out) if p.endswith(".png")) == sorted(files)
    # what the figures plot is in inspect.json: the gains drawn in gain.png are the composite products
    m = runs[0]["inspections"][-1]
    P = np.eye(8)
    for s, f, b in zip(m["sublayers"], m["gain"]["forward"], m["gain"]["backward"]):
        P = np.array(s["H_mean"]) @ P
        assert np.allclose(s["H_composite"], P, rtol=0, atol=1e-12)  # what mixing_composite.png draws
        assert f == pytest.approx(np.abs(P).sum(1).max(), rel=1e-12)
        assert b == pytest.approx(np.abs(P).sum(0).max(), rel=1e-12)


@pytest.mark.slow
@pytest.mark.megatron
def test_text_file_tokens_through_the_folders_tokenizer(zoo, tmp_path):
    """``--text``: the file is encoded with the exported folder's tokenizer (here a word-level
    tokenizer.json written into a copy of the xHC folder) and the first --tokens ids are used."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = tmp_path / "xhc-hf"
    shutil.copytree(zoo["xhc"]["hf"], hf)
    words = ["[UNK]", "alpha", "beta", "gamma", "delta"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(hf / "tokenizer.json"))
    text = tmp_path / "notes.txt"
    text.write_text(" ".join(words[1 + i % 4] for i in range(60)))
    res = _inspect(str(hf), tmp_path / "out", "--text", str(text), "--no-figures")
    m = res["runs"][0]["inspections"][0]
    assert m["tokens"] == {"count": 48, "shape": [1, 48], "from": f"--text {text}"}
    # ids 1..4 only: the embedding rows of four words, so the entry state has four distinct tokens
    from safetensors import safe_open

    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        E = f.get_tensor("model.embed_tokens.weight").double()
    ids = torch.tensor([1 + i % 4 for i in range(48)])
    want = float(E[ids].pow(2).mean().sqrt())
    assert m["depth"]["stream_rms"][0] == pytest.approx([want] * 8, rel=1e-6)


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.parametrize("variant", ["hc", "mhc", "xhc", "xhc-flash", "xhc-flash4"])
def test_layer_driver_matches_the_exported_models_forward(zoo, variant, tmp_path):
    """The per-stream RMS that xhc-inspect records after each layer equals the state of the exported
    model's own forward pass (``transformers``, hooks on the decoder layers) on the same tokens."""
    from transformers import AutoModelForCausalLM

    res = _inspect(zoo[variant]["hf"], tmp_path / "out", "--no-figures")
    m = res["runs"][0]["inspections"][0]
    assert m["tokens"]["from"].startswith("random token ids")
    ids = torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(0)).view(1, 48)
    model = AutoModelForCausalLM.from_pretrained(zoo[variant]["hf"], trust_remote_code=True, dtype=torch.float32).eval()
    states = {}
    hooks = [layer.register_forward_hook(lambda mod, args, out, i=i: states.__setitem__(i, out))
             for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    checked = 0
    for i in range(3):  # the last layer returns the reduced [s, b, C] state
        if variant == "xhc-flash4" and i % 2 == 0:
            continue  # Flash-4sub's first layer hands on its entry state; the window writes X at its end
        X = states[i].double()  # [s, b, N, C]
        want = X.pow(2).mean((0, 1, 3)).sqrt().tolist()
        assert m["depth"]["stream_rms"][i + 1] == pytest.approx(want, rel=1e-4)
        checked += 1
    assert checked >= 1


@pytest.mark.slow
@pytest.mark.megatron
def test_checkpoint_stream_holds_one_group_at_a_time(zoo):
    """Streaming from a checkpoint keeps nothing of a group once the next one is read, and the model
    it reads through stays on the meta device."""
    import gc
    import weakref

    from tools.hf import conversion as C
    from tools.inspect.cli import _stream_groups, model_info_checkpoint, resolve

    target = resolve(zoo["xhc"]["run"])
    info, src, preset = model_info_checkpoint(target, target.checkpoints[0][1], target.checkpoints[0][0])
    refs, seen = [], []
    with C.single_rank():
        model = C.build_single_rank_model(preset, info.vocab_size, info.seq_length)
        for g, tensors in _stream_groups(model, src.checkpoint):
            gc.collect()
            assert all(r() is None for r in refs), f"a tensor of the group before {g} is still alive"
            refs = [weakref.ref(t) for t in tensors.values()]
            seen.append(g)
            del tensors
        assert all(p.is_meta for p in model.parameters())
    assert seen == ["embedding", "layer.0", "layer.1", "layer.2", "layer.3", "head"]


def test_an_unnamed_default_corpus_is_never_taken_from_the_working_directory(tmp_path, monkeypatch):
    """The README's order (the main job, then the tests) leaves data/default in the checkout.  A run
    whose config names no data must not pick up the working directory's corpus or tokenizer: its
    checkpoint and its Hugging Face export would inspect other tokens.  Next to the run directory
    (runs/<name> in the checkout that trained it) the default corpus is still found."""
    from tools.hf import conversion as C
    from tools.inspect.cli import Target, _validation_tokens
    from training.data.default import PREFIX_NAME, TOKENIZER_NAME

    checkout = tmp_path / "checkout"
    (checkout / "data" / "default").mkdir(parents=True)
    for name in (PREFIX_NAME + ".idx", PREFIX_NAME + ".bin", TOKENIZER_NAME):
        (checkout / "data" / "default" / name).write_bytes(b"not read")  # opened only if chosen
    elsewhere = tmp_path / "elsewhere" / "run"
    elsewhere.mkdir(parents=True)
    monkeypatch.chdir(checkout)
    run = Target(str(elsewhere), "run", "run", [], str(elsewhere), {"model": {"preset": "tiny-moe:xhc"}})
    assert _validation_tokens(run, 16) is None  # random ids, as for the HF export of the same model
    src = C.Source(str(elsewhere / "checkpoints" / "step_00000001"), str(elsewhere), {}, "tiny-moe:xhc", {}, {})
    assert C._lookup_tokenizer_path(src) is None
    # the run that was trained in this checkout (runs/<name>) still finds the corpus it used
    inside = checkout / "runs" / "x"
    inside.mkdir(parents=True)
    src = C.Source(str(inside / "checkpoints" / "step_00000001"), str(inside), {}, "tiny-moe:xhc", {}, {})
    assert C._lookup_tokenizer_path(src) == str(checkout / "data" / "default" / TOKENIZER_NAME)
