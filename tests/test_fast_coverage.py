"""Fast tests for the modules the fast tier did not otherwise exercise (coverage of
`pytest -m "not slow"`: bench/kernel_choice.py, bench/throughput.py, bench/gpu_checks.py,
tools/hf/cli.py, tools/evaluate.py, tools/peft_experiment.py, tools/triton_aot.py and the
exported remote model code).  Each checks real behaviour, on tiny inputs."""

from __future__ import annotations

import json
import math

import pytest
import torch


def test_kernel_choice_measures_both_backends_and_keeps_the_global_rng():
    from bench import kernel_choice

    torch.manual_seed(7)
    state = torch.get_rng_state()
    ms = kernel_choice.measure(C=8, tokens=4, train=False, reps=1)
    assert set(ms) == {"xhc N=8 k=4", "mhc n=4"}
    assert all(set(v) == {"eager", "compile"} and min(v.values()) > 0 for v in ms.values())
    assert torch.equal(state, torch.get_rng_state())  # its own generator; no draw from the global RNG
    lines = []
    best = kernel_choice.recommend(hidden=(8,), tokens=(4,), reps=1, out=lines.append)
    assert best in ("eager", "compile") and f"recommended for CPU: {best}" in lines[-1]
    assert len([ln for ln in lines if ln.startswith(("xhc", "mhc"))]) == 4  # 2 cases x (forward, fwd+bwd)


def test_throughput_preset_names():
    from bench.throughput import split_name

    assert split_name("tiny-moe:mhc/n=8+dynamic=false", "eager") == ("tiny-moe:mhc", {"n": 8, "dynamic": False,
                                                                                      "kernels": "eager"})
    assert split_name("tiny-moe:vanilla") == ("tiny-moe:vanilla", None)
    with pytest.raises(SystemExit, match="key=value"):
        split_name("tiny-moe:mhc/n8")


def test_gpu_checks_l2_diff():
    from bench.gpu_checks import l2_diff

    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0])}
    b = {"w": torch.tensor([1.0, 0.0]), "b": torch.tensor([-1.0])}
    assert l2_diff(a, b) == pytest.approx(math.sqrt(4 + 16))
    assert l2_diff(a, a) == 0.0


@pytest.mark.parametrize("argv, needle", [
    (["to-hf", "--run", "/nonexistent/run", "--output", "/tmp/xhc-never-written"], "/nonexistent/run"),
    (["from-hf", "--hf", "/nonexistent/hf", "--output", "/tmp/xhc-never-written"], "/nonexistent/hf"),
])
def test_convert_checkpoint_bad_paths_are_one_line_errors(argv, needle, capsys):
    from tools.hf import main

    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and needle in err[0], err


def test_evaluate_missing_folder_is_a_one_line_error(capsys, tmp_path):
    from tools.evaluate import main

    with pytest.raises(SystemExit) as e:
        rc = main([str(tmp_path / "missing-hf"), "--limit", "1"])
        raise SystemExit(rc)
    assert e.value.code not in (0, None)
    out = capsys.readouterr()
    assert "missing-hf" in (out.err + out.out)


def test_peft_experiment_and_triton_aot_parsers():
    from tools import peft_experiment

    with pytest.raises(SystemExit) as e:
        peft_experiment.main(["--help"])
    assert e.value.code == 0
    pytest.importorskip("triton")
    from tools import triton_aot

    for v in (None, True, 3, 2.5, "x"):
        assert triton_aot._decode(json.loads(json.dumps(triton_aot._encode(v)))) == v
    t = triton_aot._decode(triton_aot._encode(torch.zeros(2, dtype=torch.bfloat16)))
    assert t.dtype == torch.bfloat16


def test_remote_model_code_builds_and_runs_forward_only():
    """The exported remote code (models/hf/export/remote) from its package path: a 1-layer xHC model
    from a config, forward under inference_mode, cached decode equal to the full forward."""
    from transformers import DynamicCache

    from models.hf.export.remote.configuration_xhc_moe import XHCMoeConfig
    from models.hf.export.remote.modeling_xhc_moe import XHCMoeForCausalLM

    hc = {"variant": "xhc", "n": 4, "k": 2, "m": 1, "kernels": "eager"}
    cfg = XHCMoeConfig(hc=hc, vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                       n_group=1, topk_group=1, max_position_embeddings=64)
    torch.manual_seed(0)
    model = XHCMoeForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        full = model(ids).logits
        cache = DynamicCache(config=cfg)
        steps = [model(ids[:, :4], use_cache=True, past_key_values=cache).logits]
        for t in range(4, 10):
            steps.append(model(ids[:, t:t + 1], use_cache=True, past_key_values=cache).logits)
    assert torch.isfinite(full).all()
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)
