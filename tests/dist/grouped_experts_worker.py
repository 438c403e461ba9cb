"""torchrun worker: grouped expert GEMMs (models.grouped_experts) under EP=2 and expert TP=2.

Run (2 ranks, gloo, CPU)::

    python -m torch.distributed.run --nproc_per_node 2 tests/dist/grouped_experts_worker.py <mode>...

The reference is a single-rank (TP=EP=1) tiny mHC GPT with Megatron's ``SequentialMLP`` experts,
computed on every rank from the same seed; its weights are copied into the parallel model with
``tests.megatron_utils.load_from_reference`` (written from Megatron's TP/EP layout).

- ``ep``: EP=2 (DP=2 for dense params, half the batch per rank) with GroupedExperts: the
  DP-averaged loss and every grad equal the SequentialMLP full-batch reference.
- ``etp``: TP=2 + SP with expert TP=2 (each rank holds half of every expert's FFN): loss and
  every grad equal the reference.
- ``ckpt``: ``dist_checkpointing`` save of GroupedExperts at EP=2, load into SequentialMLP at EP=1,
  and SequentialMLP at EP=1 into GroupedExperts at EP=2: every tensor equals the saved one.

Prints ``OK <mode>`` per passed mode; any failure raises (non-zero exit).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

if __name__ in ("__main__", "__mp_main__"):  # no dynamo start-up in the workers (nothing compiles here)
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

BATCH = 4
RTOL, ATOL = 1e-5, 1e-10
TIMEOUT_MINUTES = 2.0


def _imports():
    global torch, dist, U, destroy_parallel, finalize_grads, initialize_parallel, HC, GroupedExperts, SequentialMLP
    import torch
    import torch.distributed as dist
    from megatron.core.transformer.moe.experts import SequentialMLP

    import tests.megatron_utils as U
    from models.grouped_experts import GroupedExperts
    from models.parallel import destroy_parallel, finalize_grads, initialize_parallel
    from xhc.config import HCConfig

    HC = HCConfig(variant="mhc", n=4)


def _init(**kw):
    initialize_parallel(seed=1234, timeout_minutes=TIMEOUT_MINUTES, **kw)


def _close(name, got, want):
    err = (got - want).abs().max().item()
    tol = ATOL + RTOL * want.abs().max().item()
    assert err <= tol, f"{name}: max abs err {err:.3e} > tol {tol:.3e}"


def _loop_forbidden(*a, **k):
    raise AssertionError("GroupedExperts fell back to the per-expert loop")


def _build(grouped, **cfg):
    model = U.build_tiny_hc_gpt(U.tiny_moe_config(moe_grouped_gemm=grouped, **cfg), HC)
    kinds = {type(m) for m in model.modules() if isinstance(m, SequentialMLP)}
    assert kinds == {GroupedExperts if grouped else SequentialMLP}, kinds
    return model


def reference():
    _init()
    torch.manual_seed(0)
    model = _build(False)
    with torch.no_grad():  # HC parameters off their structured init: generic gradients
        for n, p in model.named_parameters():
            if getattr(p, "is_hyper_connection", False):
                p.add_(0.05 * torch.randn_like(p))
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    loss = U.lm_loss(model, *U.tiny_batch(BATCH))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    destroy_parallel()
    return state, loss.detach(), grads


def _compare_grads(model, config, ref_grads):
    n = 0
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name}: no grad"
        _close(f"grad {name}", p.grad, U.local_slice(name, p, ref_grads[U.full_name(name, config)], config))
        n += 1
    return n


def _half_batch():
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    return [t[rows] for t in U.tiny_batch(BATCH)]


def run_ep():
    state, ref_loss, ref_grads = reference()
    _init(ep=2)
    model = _build(True, expert_model_parallel_size=2)
    config = model.config
    loop, SequentialMLP.forward = SequentialMLP.forward, _loop_forbidden  # the grouped path must run
    U.load_from_reference(model, state, config)
    loss = U.lm_loss(model, *_half_batch())
    loss.backward()
    finalize_grads(model)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    _close("loss", mean / dist.get_world_size(), ref_loss)
    n = _compare_grads(model, config, ref_grads)
    SequentialMLP.forward = loop
    destroy_parallel()
    return n


def run_etp():
    state, ref_loss, ref_grads = reference()
    _init(tp=2, etp=2)
    model = _build(True, tensor_model_parallel_size=2, expert_tensor_parallel_size=2, sequence_parallel=True)
    config = model.config
    loop, SequentialMLP.forward = SequentialMLP.forward, _loop_forbidden
    w = model.decoder.layers[1].mlp.experts.local_experts[0].linear_fc1.weight
    assert w.shape[0] == 2 * config.moe_ffn_hidden_size // 2, w.shape  # [gate; up] halves of one rank
    U.load_from_reference(model, state, config)
    loss = U.lm_loss(model, *U.tiny_batch(BATCH))
    _close("loss", loss.detach(), ref_loss)
    loss.backward()
    finalize_grads(model)
    n = _compare_grads(model, config, ref_grads)
    SequentialMLP.forward = loop
    destroy_parallel()
    return n


def _shared_tmpdir():
    path = [tempfile.mkdtemp(prefix="xhc_gx_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def _save(model, path):
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(model.sharded_state_dict(), path)
    dist.barrier()


def _load_fresh(grouped, path, seed, **cfg):
    from megatron.core import dist_checkpointing

    torch.manual_seed(seed)  # another init, so a no-op load would be caught
    model = _build(grouped, **cfg)
    loaded = dist_checkpointing.load(model.sharded_state_dict(), path)
    missing, unexpected = model.load_state_dict(loaded, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    assert not missing and not unexpected, (missing, unexpected)
    return model


def _assert_equal(model, state):
    n = 0
    for name, p in model.named_parameters():
        want = U.local_slice(name, p, state[U.full_name(name, model.config)], model.config)
        assert torch.equal(p.detach(), want), f"{name} differs after load"
        n += 1
    return n


def run_ckpt():
    state, _, _ = reference()
    d1, d2 = _shared_tmpdir(), _shared_tmpdir()
    _init(ep=2)
    g = _build(True, expert_model_parallel_size=2)
    U.load_from_reference(g, state, g.config)
    _save(g, d1)  # GroupedExperts, EP=2 ...
    destroy_parallel()
    _init()
    n = _assert_equal(_load_fresh(False, d1, seed=7), state)  # ... -> SequentialMLP, EP=1
    s = _build(False)
    U.load_from_reference(s, state, s.config)
    _save(s, d2)  # SequentialMLP, EP=1 ...
    destroy_parallel()
    _init(ep=2)
    n += _assert_equal(_load_fresh(True, d2, seed=8, expert_model_parallel_size=2), state)  # ... -> grouped, EP=2
    destroy_parallel()
    dist.barrier()
    if dist.get_rank() == 0:
        for d in (d1, d2):
            shutil.rmtree(d, ignore_errors=True)
    return n


MODES = {"ep": lambda: run_ep(), "etp": lambda: run_etp(), "ckpt": lambda: run_ckpt()}

if __name__ == "__main__":
    _imports()
    from tests.dist.launch import run_modes

    run_modes(MODES, sys.argv[1:])
