"""Stock Megatron-Core GPT/MoE on CPU (gloo): models.cpu_compat, models.norms, models.parallel,
models.pipeline.

Single-process tests run in the pytest process; the TP=2+SP / EP=2 / DP=2 / resharding checks
run in one 2-rank torchrun launch (tests/dist/stock_gpt_worker.py), reported per mode.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

megatron = pytest.importorskip("megatron.core")

from models import cpu_compat  # noqa: E402
from models.norms import LayerNorm, Norm, RMSNorm, substitute_norms  # noqa: E402
from models.parallel import destroy_parallel, initialize_parallel, update_router_expert_bias  # noqa: E402
from tests.megatron_utils import VOCAB, build_tiny_gpt, lm_loss, tiny_batch, tiny_moe_config  # noqa: E402

pytestmark = pytest.mark.megatron  # the Python 3.12 / newest megatron-core CI stage runs these

# Tests that run Megatron models through models.cpu_compat; on a CUDA machine they run in a child
# pytest with CUDA hidden (the cpu_gloo marker, tests/conftest.py).
cpu_only = pytest.mark.cpu_gloo


@pytest.fixture
def parallel():
    initialize_parallel(tp=1, pp=1, ep=1, seed=1234)
    yield
    destroy_parallel()


# ------------------------------------------------------------------------------------------------
# Single-process model
# ------------------------------------------------------------------------------------------------
@cpu_only
def test_tiny_moe_structure(parallel):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    config = tiny_moe_config()
    model = build_tiny_gpt(config)
    layers = model.decoder.layers
    assert len(layers) == 3
    assert not isinstance(layers[0].mlp, MoELayer)  # moe_layer_freq=[0, 1, 1]
    for layer in layers[1:]:
        assert isinstance(layer.mlp, MoELayer)
        assert len(layer.mlp.experts.local_experts) == 4
        assert layer.mlp.shared_experts is not None
        assert layer.mlp.router.expert_bias.shape == (4,)
    # GQA: q rows = heads·d, k and v rows = groups·d each -> (4 + 2·2)·8.
    assert layers[0].self_attention.linear_qkv.weight.shape == ((4 + 2 * 2) * 8, 32)
    # SwiGLU: fc1 produces gate and up.
    assert layers[0].mlp.linear_fc1.weight.shape == (2 * 64, 32)
    norms = [m for m in model.modules() if isinstance(m, (RMSNorm, LayerNorm))]
    # 2 per layer + final + q/k norm per layer.
    assert len(norms) == 3 * 2 + 1 + 3 * 2 and all(isinstance(n, RMSNorm) for n in norms)
    assert model.decoder.layers[1].self_attention.q_layernorm.hidden_size == 8
    assert model.output_layer.weight is not model.embedding.word_embeddings.weight
    assert not any(p.requires_grad and "bias" in n for n, p in model.named_parameters())


@cpu_only
def test_tiny_moe_forward_backward_and_step(parallel):
    config = tiny_moe_config()
    model = build_tiny_gpt(config)
    tokens, labels, pos = tiny_batch(4)
    loss = lm_loss(model, tokens, labels, pos)
    # Small init (std 0.02) -> near-uniform next-token distribution.
    assert abs(loss.item() - math.log(VOCAB)) < 0.05
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"{name}: zero grad"
    # Aux-loss-free balancing: bias moves by ±rate against the per-expert load.
    router = model.decoder.layers[1].mlp.router
    counts = router.local_tokens_per_expert.clone()
    assert counts.sum() == tokens.numel() * config.moe_router_topk
    bias0 = router.expert_bias.clone()
    update_router_expert_bias(model)
    expected = bias0 + torch.sign(counts.mean() - counts) * config.moe_router_bias_update_rate
    torch.testing.assert_close(router.expert_bias, expected, rtol=0, atol=0)
    assert router.local_tokens_per_expert.abs().sum() == 0
    # One optimiser step on the same batch lowers its loss.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    with torch.no_grad():
        assert lm_loss(model, tokens, labels, pos).item() < loss.item() - 0.05


@cpu_only
def test_recompute_replays_dropout_exactly(parallel):
    """Full activation recomputation (Megatron's CheckpointFunction) replays the CPU RNG streams:
    loss and grads equal the non-recomputed run with the same dropout."""
    from megatron.core import tensor_parallel

    results = []
    for recompute in (False, True):
        kw = dict(hidden_dropout=0.2, attention_dropout=0.2)
        if recompute:
            kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        torch.manual_seed(0)
        model = build_tiny_gpt(tiny_moe_config(**kw))
        torch.manual_seed(5)
        tensor_parallel.model_parallel_cuda_manual_seed(5)
        loss = lm_loss(model, *tiny_batch(2))
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-6, atol=1e-9, msg=n)
    # Dropout is active: a different seed changes the loss.
    torch.manual_seed(0)
    model = build_tiny_gpt(tiny_moe_config(hidden_dropout=0.2, attention_dropout=0.2))
    torch.manual_seed(6)
    tensor_parallel.model_parallel_cuda_manual_seed(6)
    assert lm_loss(model, *tiny_batch(2)).item() != l0.item()


@cpu_only
@pytest.mark.slow
def test_dist_checkpoint_round_trip_single_process(parallel, tmp_path):
    from megatron.core import dist_checkpointing

    config = tiny_moe_config()
    model = build_tiny_gpt(config)
    with torch.no_grad():
        for layer in model.decoder.layers[1:]:
            layer.mlp.router.expert_bias.copy_(torch.tensor([0.1, -0.2, 0.3, -0.4]))
    want = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    dist_checkpointing.save(model.sharded_state_dict(), str(tmp_path))
    torch.manual_seed(99)
    fresh = build_tiny_gpt(config)
    assert not torch.equal(fresh.output_layer.weight, want["output_layer.weight"])
    loaded = dist_checkpointing.load(fresh.sharded_state_dict(), str(tmp_path))
    missing, unexpected = fresh.load_state_dict(loaded, strict=False)
    assert [k for k in missing if not k.endswith("_extra_state")] == [] and unexpected == []
    got = {k: v for k, v in fresh.state_dict().items() if torch.is_tensor(v)}
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


# ------------------------------------------------------------------------------------------------
# Two ranks (torchrun, gloo)
# ------------------------------------------------------------------------------------------------
DIST_MODES = ("tp_sp", "ep", "dp", "ddp", "pp", "pp_streams", "ckpt")


@pytest.fixture(scope="module")
def dist_run(run_torchrun):
    proc = run_torchrun("tests/dist/stock_gpt_worker.py", nproc=2, args=list(DIST_MODES), check=False)
    return proc.stdout


@cpu_only
@pytest.mark.parametrize("mode", DIST_MODES)
@pytest.mark.slow
def test_two_rank_equivalence(dist_run, mode):
    """tp_sp: TP=2+SP == TP=1; ep: EP=2 (+DP=2) == EP=1 full batch; dp: DP=2 == full batch;
    ddp: Megatron DDP + finalize_model_grads == our finalize_grads (DP=2, TP=2+SP, EP=2);
    pp: PP=2 via gpipe_forward_backward over Megatron p2p == PP=1 (loss and grads);
    pp_streams: a toy 2-stage model with [s, b, N·C] edges runs and matches under hc_p2p_shapes(N);
    ckpt: dist_checkpointing TP=2->TP=1 and TP=1->TP=2,EP=2 resharding is exact."""
    assert f"OK {mode}" in dist_run, f"mode {mode} did not pass:\n{dist_run[-6000:]}"


# ------------------------------------------------------------------------------------------------
# Norms
# ------------------------------------------------------------------------------------------------
def _cfg(**kw):
    base = dict(normalization="RMSNorm", sequence_parallel=False, params_dtype=torch.float32,
                layernorm_zero_centered_gamma=False)  # fmt: skip
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_rmsnorm_matches_formula_and_marks_sp():
    x = torch.randn(5, 3, 16, dtype=torch.float64)
    norm = Norm(_cfg(sequence_parallel=True), 16, eps=1e-6)
    assert isinstance(norm, RMSNorm) and norm.weight.sequence_parallel is True
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 16))
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * torch.linspace(0.5, 1.5, 16, dtype=torch.float64)
    torch.testing.assert_close(norm(x), want, rtol=1e-6, atol=1e-7)  # fp32 gain, fp64 input
    assert Norm(_cfg(), 16).weight.sequence_parallel is False
    xb = torch.randn(4, 16).bfloat16()
    assert norm(xb).dtype == torch.bfloat16


def test_layernorm_and_zero_centered_gamma():
    x = torch.randn(7, 12)
    ln = Norm(_cfg(normalization="LayerNorm", sequence_parallel=True), 12, eps=1e-5)
    assert isinstance(ln, LayerNorm) and ln.bias.sequence_parallel is True
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-1, 1)
    want = torch.nn.functional.layer_norm(x, (12,), ln.weight, ln.bias, 1e-5)
    torch.testing.assert_close(ln(x), want, rtol=1e-5, atol=1e-6)
    zc = RMSNorm(_cfg(layernorm_zero_centered_gamma=True), 12, eps=1e-5)
    assert torch.equal(zc.weight, torch.zeros(12))  # stores gamma - 1
    torch.testing.assert_close(zc(x), torch.nn.functional.rms_norm(x, (12,), eps=1e-5), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="normalization"):
        Norm(_cfg(normalization="ScaleNorm"), 12)


def test_substitute_norms_replaces_wrapped_torch_norm_everywhere():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    spec = get_gpt_layer_local_spec(num_experts=4, qk_layernorm=True, normalization="RMSNorm")
    new = substitute_norms(spec)

    def norms(s, acc):
        if s is WrappedTorchNorm or s is Norm:
            acc.append(s)
        elif hasattr(s, "__dataclass_fields__") and not isinstance(s, type):
            for f in s.__dataclass_fields__:
                norms(getattr(s, f), acc)
        elif isinstance(s, (list, tuple)):
            for o in s:
                norms(o, acc)
        return acc

    before, after = norms(spec, []), norms(new, [])
    assert len(before) == 4 and set(before) == {WrappedTorchNorm}  # input, pre-mlp, q, k
    assert len(after) == 4 and set(after) == {Norm}
    assert spec.submodules.input_layernorm is WrappedTorchNorm  # input untouched


# ------------------------------------------------------------------------------------------------
# cpu_compat
# ------------------------------------------------------------------------------------------------
def test_enable_cpu_mode_is_noop_with_cuda(monkeypatch):
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    was_enabled = cpu_compat.cpu_mode_enabled()
    cpu_compat.disable_cpu_mode()
    try:
        originals = (torch.cuda.current_device, torch.cuda.synchronize, mrandom.CudaRNGStatesTracker,
                     mrandom._get_cuda_rng_state, "te_general_gemm" in vars(moe_utils))  # fmt: skip
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert cpu_compat.enable_cpu_mode() is False
        assert not cpu_compat.cpu_mode_enabled()
        after = (torch.cuda.current_device, torch.cuda.synchronize, mrandom.CudaRNGStatesTracker,
                 mrandom._get_cuda_rng_state, "te_general_gemm" in vars(moe_utils))  # fmt: skip
        assert after == originals
        monkeypatch.undo()
        if torch.cuda.is_available():
            return
        # Without CUDA it patches, idempotently, and disable restores the originals.
        assert cpu_compat.enable_cpu_mode() is True and cpu_compat.enable_cpu_mode() is True
        assert torch.cuda.current_device() == torch.device("cpu")
        assert mrandom.CudaRNGStatesTracker is cpu_compat.CpuRNGStatesTracker
        cpu_compat.disable_cpu_mode()
        assert torch.cuda.current_device is originals[0] and mrandom.CudaRNGStatesTracker is originals[2]
    finally:
        if was_enabled:
            cpu_compat.enable_cpu_mode()


@cpu_only
def test_cpu_rng_tracker_streams(parallel):
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    assert isinstance(tracker, cpu_compat.CpuRNGStatesTracker)
    torch.manual_seed(0)
    default_next = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork():
        a = torch.rand(3)
    with tracker.fork():
        b = torch.rand(3)  # the stream advanced
    assert torch.equal(torch.rand(3), default_next)  # default stream untouched by the forks
    assert not torch.equal(a, b) and not torch.equal(a, default_next)
    # Same seed -> same stream (Megatron's tp offset: seed + 2718 + tp_rank).
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    with tracker.fork():
        a2 = torch.rand(3)
    g = torch.Generator().manual_seed(1234 + 2718)
    assert torch.equal(a2, torch.rand(3, generator=g))
    with pytest.raises(Exception, match="not added"):
        with tracker.fork("no-such-stream"):
            pass


def test_cpu_safe_overrides_are_config_fields():
    from megatron.core.transformer import TransformerConfig

    ov = cpu_compat.cpu_safe_overrides()
    assert ov["use_cpu_initialization"] is True and ov["moe_token_dispatcher_type"] == "allgather"
    assert set(ov) <= set(TransformerConfig.__dataclass_fields__)
    TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, **ov)


# ------------------------------------------------------------------------------------------------
# Pipeline p2p shapes
# ------------------------------------------------------------------------------------------------
class _Group:
    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n


def test_p2p_tensor_shape():
    from models.pipeline import p2p_tensor_shape

    # seq 4096 / CP 2 / TP 2 (SP) = 1024; N·C = 4·1024.
    assert p2p_tensor_shape(4096, 2, 1024, 4, tp_size=2, cp_size=2, sequence_parallel=True) == (1024, 2, 4096)
    assert p2p_tensor_shape(4096, 2, 1024, 4, tp_size=2, cp_size=2, sequence_parallel=False) == (2048, 2, 4096)
    assert p2p_tensor_shape(16, 1, 32) == (16, 1, 32)
    with pytest.raises(ValueError, match="seq_length=30 is not divisible"):
        p2p_tensor_shape(30, 1, 32, 2, tp_size=4, sequence_parallel=True)
    with pytest.raises(ValueError, match="num_streams"):
        p2p_tensor_shape(16, 1, 32, 0)


@pytest.mark.parametrize("sp,tp,cp", [(False, 1, 1), (True, 2, 1), (True, 2, 2), (False, 4, 2)])
def test_p2p_shapes_patch_matches_megatron(sp, tp, cp):
    from megatron.core.pipeline_parallel import schedules

    from models.pipeline import hc_p2p_shapes, p2p_shapes_installed, p2p_tensor_shape

    config = types.SimpleNamespace(hidden_size=64, sequence_parallel=sp, variable_seq_lengths=False,
                                   virtual_pipeline_model_parallel_size=None)  # fmt: skip
    kw = dict(seq_length=32, micro_batch_size=3, decoder_seq_length=None, config=config,
              tp_group=_Group(tp), cp_group=_Group(cp))  # fmt: skip
    stock = schedules.get_tensor_shapes(**kw)
    assert [tuple(s) for s in stock] == [p2p_tensor_shape(32, 3, 64, 1, tp_size=tp, cp_size=cp, sequence_parallel=sp)]
    original = schedules.get_tensor_shapes
    with hc_p2p_shapes(4, config):
        assert p2p_shapes_installed() == 4
        got = schedules.get_tensor_shapes(**kw)
        assert [tuple(s) for s in got] == [p2p_tensor_shape(32, 3, 64, 4, tp_size=tp, cp_size=cp, sequence_parallel=sp)]
    assert schedules.get_tensor_shapes is original and p2p_shapes_installed() is None
    with hc_p2p_shapes(1):  # N = 1: nothing installed
        assert schedules.get_tensor_shapes is original


def test_p2p_shapes_guards_and_adjust_fn():
    from models.pipeline import (hc_adjust_tensor_shapes_fn, install_hc_p2p_shapes, scale_tensor_shapes,
                                 uninstall_hc_p2p_shapes)  # fmt: skip

    interleaved = types.SimpleNamespace(virtual_pipeline_model_parallel_size=2, variable_seq_lengths=False)
    with pytest.raises(ValueError, match="variable_seq_lengths=True"):
        install_hc_p2p_shapes(4, interleaved)
    interleaved.variable_seq_lengths = True
    install_hc_p2p_shapes(4, interleaved)
    try:
        with pytest.raises(RuntimeError, match="already installed"):
            install_hc_p2p_shapes(2)
    finally:
        uninstall_hc_p2p_shapes()
    assert scale_tensor_shapes([(8, 2, 16), ()], 3) == [(8, 2, 48), ()]  # () = dynamic (0.19)
    recv, send = hc_adjust_tensor_shapes_fn(2)([(8, 1, 16)], [(8, 1, 16)])
    assert recv == send == [(8, 1, 32)]
