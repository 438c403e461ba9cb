"""models.grouped_experts: grouped expert GEMMs == Megatron-Core's SequentialMLP.

Single-process (EP=1) checks here; EP=2, expert TP=2 and the EP=2 <-> EP=1 checkpoint round trip
run in one 2-rank torchrun launch (tests/dist/grouped_experts_worker.py), reported per mode.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

megatron = pytest.importorskip("megatron.core")

from megatron.core.transformer.moe.experts import SequentialMLP  # noqa: E402

from models.grouped_experts import HAVE_GROUPED_MM, GroupedExperts, use_grouped_experts  # noqa: E402
from models.parallel import destroy_parallel, initialize_parallel  # noqa: E402
from tests.megatron_utils import build_tiny_hc_gpt, lm_loss, tiny_batch, tiny_moe_config  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.cpu_gloo]
needs_grouped = pytest.mark.skipif(not HAVE_GROUPED_MM, reason="torch < 2.9 has no grouped matmul")

E, H, FFN = 4, 32, 16  # 4 local experts, hidden 32, expert FFN 16 (fp32 rows 16-byte aligned)


@pytest.fixture
def parallel():
    initialize_parallel(seed=1234)
    yield
    destroy_parallel()


def _submodules():
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    return MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)


def _pair(**cfg):
    """(SequentialMLP, GroupedExperts) with the same weights, and the config."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    config = tiny_moe_config(hidden_size=H, moe_ffn_hidden_size=FFN, num_moe_experts=E, **cfg)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    torch.manual_seed(0)
    seq = SequentialMLP(E, config, _submodules(), pg_collection=pgs)
    torch.manual_seed(1)  # another init: the copy below must be what makes them equal
    grp = GroupedExperts(E, config, _submodules(), pg_collection=pgs)
    grp.load_state_dict(seq.state_dict())
    return seq, grp, config


def _inputs(counts, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), H, generator=g, dtype=torch.float64).to(dtype)
    probs = torch.rand(sum(counts), generator=g, dtype=torch.float64).float()
    return x, torch.tensor(counts), probs


def _run(module, x, counts, probs, grad_seed=5):
    x = x.clone().requires_grad_()
    out, bias = module(x, counts, probs)
    assert bias is None
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed), dtype=torch.float64).to(out.dtype)
    out.backward(g)
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


def _reference(seq, x, counts, probs, config):
    """float64 per-expert SwiGLU from the weights alone (independent of Megatron's MLP.forward)."""
    outs, start = [], 0
    for e, n in zip(seq.local_experts, counts.tolist()):
        xe = x[start:start + n].double()
        h = xe @ e.linear_fc1.weight.double().T
        a, b = h.chunk(2, dim=-1)
        outs.append(((F.silu(a) * b) * probs[start:start + n, None].double()) @ e.linear_fc2.weight.double().T)
        start += n
    return torch.cat(outs)


def _close(got, want, what, rel=1e-5):
    err = (got.double() - want.double()).abs().max().item()
    assert err <= rel * max(want.abs().max().item(), 1e-30), f"{what}: max abs err {err:.3e}"


@needs_grouped
@pytest.mark.parametrize("fusion", [False, pytest.param(True, marks=pytest.mark.inductor)],
                         ids=["swiglu", "fused-swiglu"])
def test_grouped_equals_sequential_outputs_and_grads(parallel, monkeypatch, fusion):
    """Outputs, input grads and every weight grad of GroupedExperts equal SequentialMLP's and a
    float64 reference, with an expert that receives no token; the per-expert loop never runs."""
    seq, grp, config = _pair(bias_activation_fusion=fusion)
    x, counts, probs = _inputs([5, 0, 9, 3])
    want_out, want_dx, want_g = _run(seq, x, counts, probs)
    _close(want_out, _reference(seq, x, counts, probs, config), "SequentialMLP vs float64")
    monkeypatch.setattr(SequentialMLP, "forward", lambda *a, **k: pytest.fail("per-expert loop ran"))
    out, dx, grads = _run(grp, x, counts, probs)
    _close(out, want_out, "output")
    _close(dx, want_dx, "input grad")
    assert grads.keys() == want_g.keys() and len(grads) == 2 * E
    for name in grads:
        _close(grads[name], want_g[name], f"grad {name}")
    assert grads["local_experts.1.linear_fc1.weight"].abs().max() == 0  # the empty expert


@needs_grouped
def test_grouped_linear_takes_expanded_gradients():
    """``.sum()`` hands the grouped matmul an expanded (stride-0) gradient, which torch's own backward
    refuses; grouped_linear's input and weight gradients then equal per-group matmuls'."""
    from models.grouped_experts import grouped_linear

    g = torch.Generator().manual_seed(2)
    x = torch.randn(10, 8, generator=g, requires_grad=True)
    ws = [torch.randn(12, 8, generator=g, requires_grad=True) for _ in range(3)]
    grouped_linear(x, ws, torch.tensor([3, 3, 10], dtype=torch.int32)).sum().backward()
    got = [t.grad.clone() for t in (x, *ws)]
    for t in (x, *ws):
        t.grad = None
    sum((x[a:b].double() @ w.double().T).sum() for (a, b), w in zip([(0, 3), (3, 3), (3, 10)], ws)).backward()
    for a, b in zip(got, (x, *ws)):
        _close(a, b.grad, "grad")


@needs_grouped
def test_fallback_loop_where_grouped_cannot_run(parallel):
    """float64 tokens (no grouped kernel) take SequentialMLP's loop: same results."""
    seq, grp, _ = _pair()
    seq.double(), grp.double()
    x, counts, probs = _inputs([3, 4, 2, 6], dtype=torch.float64)
    a, b = _run(seq, x, counts, probs), _run(grp, x, counts, probs)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert grp._fallback_reason(x) is not None


@needs_grouped
@pytest.mark.slow  # ~2.6 s: two distributed-checkpoint saves and loads
def test_checkpoint_round_trip_both_ways(parallel, tmp_path):
    """The same state-dict and sharded keys; a distributed checkpoint of either loads into the other."""
    from megatron.core import dist_checkpointing

    seq, grp, _ = _pair()
    assert list(seq.state_dict()) == list(grp.state_dict())
    sk_seq, sk_grp = seq.sharded_state_dict(prefix="experts."), grp.sharded_state_dict(prefix="experts.")
    assert {v.key for v in sk_seq.values()} == {v.key for v in sk_grp.values()}
    for src_cls, dst_cls, name in ((SequentialMLP, GroupedExperts, "s2g"), (GroupedExperts, SequentialMLP, "g2s")):
        src = seq if src_cls is SequentialMLP else grp
        with torch.no_grad():
            for p in src.parameters():
                p.add_(torch.randn_like(p))  # a state neither module was initialised with
        (tmp_path / name).mkdir()
        dist_checkpointing.save(src.sharded_state_dict(prefix="experts."), str(tmp_path / name))
        dst = grp if dst_cls is GroupedExperts else seq
        loaded = dist_checkpointing.load(dst.sharded_state_dict(prefix="experts."), str(tmp_path / name))
        dst.load_state_dict({k[len("experts."):]: v for k, v in loaded.items()})
        for (n, p), (_, q) in zip(src.named_parameters(), dst.named_parameters()):
            assert torch.equal(p, q), f"{name}: {n} differs after load"


def test_spec_swap_both_megatron_styles():
    """use_grouped_experts swaps the local experts in a 0.16-style ModuleSpec and in a 0.19-style
    functools.partial builder, and leaves dense layers alone."""
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    experts = ModuleSpec(module=SequentialMLP, submodules=_submodules())
    spec = ModuleSpec(module=MoELayer, submodules=MoESubmodules(experts=experts))
    assert use_grouped_experts(spec).submodules.experts.module is GroupedExperts
    assert spec.submodules.experts.module is SequentialMLP  # the input is not modified
    sequential = functools.partial(SequentialMLP, submodules=_submodules())
    builder = functools.partial(MoELayer, submodules=MoESubmodules(experts=sequential))
    swapped = use_grouped_experts(builder).keywords["submodules"].experts
    assert swapped.func is GroupedExperts and swapped.keywords["submodules"] is not None
    dense = ModuleSpec(module=torch.nn.Linear)
    assert use_grouped_experts(dense) is dense


@needs_grouped
@pytest.mark.slow
def test_model_grouped_equals_sequential(parallel):
    """A whole tiny HC GPT (mHC) with config.moe_grouped_gemm=True builds GroupedExperts and equals
    the SequentialMLP model in loss and every gradient; the default on CPU stays SequentialMLP."""
    from xhc.config import HCConfig

    hc = HCConfig(variant="mhc", n=4)
    runs = {}
    for grouped in (False, True):
        torch.manual_seed(0)
        model = build_tiny_hc_gpt(tiny_moe_config(moe_grouped_gemm=grouped), hc)
        kinds = {type(m) for m in model.modules() if isinstance(m, SequentialMLP)}
        assert kinds == {GroupedExperts if grouped else SequentialMLP}
        loss = lm_loss(model, *tiny_batch(4))
        loss.backward()
        runs[grouped] = loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    _close(runs[True][0], runs[False][0], "loss")
    assert runs[True][1].keys() == runs[False][1].keys()
    for n, g in runs[False][1].items():
        _close(runs[True][1][n], g, f"grad {n}")


DIST_MODES = ("ep", "etp", "ckpt")


@pytest.fixture(scope="module")
def dist_run(run_torchrun):
    return run_torchrun("tests/dist/grouped_experts_worker.py", nproc=2, args=list(DIST_MODES), check=False).stdout


@needs_grouped
@pytest.mark.parametrize("mode", DIST_MODES)
def test_two_rank_grouped_experts(dist_run, mode):
    """ep: GroupedExperts at EP=2 (+DP=2) == SequentialMLP at EP=1 on the full batch (loss, every grad);
    etp: TP=2+SP with expert TP=2 == the same reference; ckpt: distributed checkpoints of GroupedExperts
    at EP=2 load into SequentialMLP at EP=1 and back, exactly (tests/dist/grouped_experts_worker.py)."""
    assert f"OK {mode}" in dist_run, f"mode {mode} did not pass:\n{dist_run[-6000:]}"
