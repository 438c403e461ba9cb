"""torchrun worker: Muon with its optimizer state sharded over data parallelism (torch backend, gloo, CPU).

Run::

    python -m torch.distributed.run --nproc_per_node 2 tests/dist/sharded_muon_worker.py dp ckpt
    python -m torch.distributed.run --nproc_per_node 4 tests/dist/sharded_muon_worker.py tp_dp ep_dp

Every comparison trains the zoo's tiny-moe cut to 2 layers (a dense layer, then a MoE layer), HC
parameters perturbed so that every HC gradient is well above round-off, ``STEPS`` optimiser steps with
clipping active, Muon on the matrices and AdamW on the rest (``optimizer.name=muon``), three times from
the same weights:

- the reference: every rank the whole batch, the layout TP = EP = 1 (what one process computes: the
  data-parallel average of equal gradients is exact);
- replicated: the mode's layout, each data-parallel rank its part of the batch, every rank updating
  every parameter (``use_distributed_optimizer=false``);
- sharded: the same with ``use_distributed_optimizer=true``.

Sharded equals replicated *bit for bit* (losses, weights, and the Muon momentum and AdamW moments
reassembled from the shards): the same gradients reach the same update code, only on one rank.
At DP = 2 (mode ``dp``) sharded also equals the reference within the bounds of
tests/dist/optim_worker.py (the data-parallel layout sums the gradient in another order; Muon 1e-3·lr,
AdamW with ε = 1e-3 2e-2·lr); the TP and EP layouts' replicated runs are checked against the
single-rank run there, so here they skip it.  Newton–Schulz
runs summed over the data-parallel group equal the Muon matrices × steps; each rank's optimizer state
bytes are at most an even split of the replicated state plus the largest parameter's state.

Modes: ``dp`` (DP = 2; tiny-moe:mhc and tiny-moe:xhc), ``tp_dp`` (TP = 2 + SP × DP = 2, 4 ranks),
``ep_dp`` (EP = 2 × DP = 2 for the experts, DP = 4 for the dense parameters, 4 ranks), ``ckpt`` (DP = 2:
a ``dist_checkpointing`` round trip of the sharded state continues bit for bit; a replicated optimizer
loads it, saves it again, and a sharded one loads that, each continuing bit for bit).
Prints ``OK <mode> (...)`` per passed mode; any failure exits non-zero.  The GPU path's optimizer
(``ShardedLayerWiseOptimizer``) has its own worker, tests/dist/muon_reshard_worker.py.
"""

from __future__ import annotations

import os
import sys
import tempfile

if __name__ in ("__main__", "__mp_main__"):  # run as the worker, not imported by a test: no dynamo
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

BATCH, SEQ, VOCAB, STEPS = 4, 16, 256, 5
LR, CLIP, ADAM_EPS = 1e-2, 0.5, 1e-3
TOL = {"muon": 1e-3, "adamw": 2e-2}  # vs the reference, in units of lr (see tests/dist/optim_worker.py)


def _init(**kw):
    from models.parallel import initialize_parallel

    initialize_parallel(seed=1234, timeout_minutes=2.0, **kw)


def _build(preset_name, parallel=None):
    from models.zoo import build_model, build_transformer_config, load_preset

    hc = {"res_offdiag_init": -1.0} if preset_name.endswith(":mhc") else {}
    preset = load_preset(preset_name, backbone_overrides={"num_layers": 2}, hc_overrides=hc)
    config = build_transformer_config(preset, parallel=parallel or {}, cpu=True)
    return build_model(preset, config, vocab_size=VOCAB, seq_length=SEQ), config


def _perturb_hc(model):
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if getattr(p, "is_hyper_connection", False):
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def _batch(step, rows):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ).contiguous()
    return tokens[rows, :-1].contiguous(), tokens[rows, 1:].contiguous(), pos[rows]


def _rows(full):
    from megatron.core import parallel_state as ps

    if full:
        return slice(0, BATCH)
    r, n = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    return slice(r * BATCH // n, (r + 1) * BATCH // n)


def _optimizer(model, sharded):
    from training.optim import OptimizerConfig, build_optimizer

    cfg = OptimizerConfig(name="muon", lr=LR, clip_grad=CLIP, eps=ADAM_EPS, use_distributed_optimizer=sharded)
    return build_optimizer(model, cfg, use_megatron=False)


def _train(model, opt, steps, rows, first=0):
    from models.parallel import finalize_grads

    losses = []
    for step in range(first, first + steps):
        opt.zero_grad()
        x, y, pos = _batch(step, rows)
        loss = model(x, pos, None, labels=y).float().mean()
        loss.backward()
        finalize_grads(model)
        result = opt.step()
        assert result.updated, f"step {step} skipped (norm {result.grad_norm})"
        losses.append(float(loss))
    return losses


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _named_state(opt, expert=None):
    """``{optimizer/param name/state key: tensor}`` of the states this rank holds (``expert``: only the
    routed-expert or only the dense parameters' states)."""
    out = {}
    for oname, o in opt.optimizers.items():
        for g in o.param_groups:
            for n, p in zip(g["param_names"], g["params"]):
                if expert is not None and (getattr(p, "allreduce", True) is False) != expert:
                    continue
                for k, v in o.state.get(p, {}).items():
                    out[f"{oname}/{n}/{k}"] = v.detach().clone()
    return out


def _gathered_state(opt):
    """Every shard's state merged over the data-parallel groups (a parameter's state lives on one rank)."""
    from megatron.core import parallel_state as ps

    merged = {}
    for expert, group in ((False, ps.get_data_parallel_group(with_context_parallel=True)),
                          (True, ps.get_expert_data_parallel_group())):
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, _named_state(opt, expert), group=group)
        for part in parts:
            for k, v in part.items():
                assert k not in merged or torch.equal(merged[k], v), f"{k}: two ranks hold different states"
                merged[k] = v
    return merged


def _dp_sum(x: int, group) -> int:
    t = torch.tensor([x], dtype=torch.int64)
    dist.all_reduce(t, group=group)
    return int(t)


def _compare(preset_name, parallel_kw, init_kw, reference=True):
    """Sharded vs replicated at the layout, bit for bit; with ``reference``, also vs the single-rank run
    (for TP and EP layouts the replicated run's equality with it is tests/dist/optim_worker.py's check)."""
    from megatron.core import parallel_state as ps

    from models.parallel import destroy_parallel
    from tests.megatron_utils import full_name, load_from_reference, local_slice
    from training.optim import classify_param

    _init(tp=1, ep=1)  # the reference: every rank the whole batch
    model, _ = _build(preset_name)
    _perturb_hc(model)
    init = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    ref = None
    if reference:
        _train(model, _optimizer(model, sharded=False), STEPS, _rows(True))
        ref = _params(model)
    destroy_parallel()

    _init(**init_kw)
    runs = {}
    for sharded in (False, True):
        model, config = _build(preset_name, parallel_kw)
        load_from_reference(model, init, config)
        opt = _optimizer(model, sharded)
        losses = _train(model, opt, STEPS, _rows(False))
        runs[sharded] = (losses, _params(model), opt, _gathered_state(opt) if sharded else _named_state(opt))
    (l_rep, p_rep, o_rep, s_rep), (l_sh, p_sh, o_sh, s_sh) = runs[False], runs[True]
    assert o_sh.shards is not None and o_rep.shards is None
    # bit for bit: losses, weights, optimizer state reassembled from the shards
    assert l_sh == l_rep, (l_sh, l_rep)
    bad = [n for n in p_rep if not torch.equal(p_sh[n], p_rep[n])]
    assert not bad, f"sharded weights differ from replicated: {bad[:5]}"
    assert s_sh.keys() == s_rep.keys(), sorted(set(s_sh) ^ set(s_rep))[:5]
    bad = [k for k in s_rep if not torch.equal(s_sh[k], s_rep[k])]
    assert not bad, f"sharded optimizer state differs from replicated: {bad[:5]}"
    assert any("/momentum_buffer" in k for k in s_sh) and any("/exp_avg" in k for k in s_sh)
    # against the reference (another summation order of the data-parallel gradient)
    worst = {"muon": 0.0, "adamw": 0.0}
    for name, p in model.named_parameters() if reference else ():  # (the sharded run's model: TP attributes)
        want = local_slice(name, p, ref[full_name(name, config)], config)
        which = classify_param(name, p, "muon").optimizer
        worst[which] = max(worst[which], (p.detach() - want).abs().max().item() / LR)
    assert all(worst[k] <= TOL[k] for k in TOL), f"sharded vs reference: {worst} (·lr) > {TOL}"
    # one Newton–Schulz per matrix across the data-parallel group (dense and expert owners both count here)
    dp = ps.get_data_parallel_group(with_context_parallel=True)
    edp = ps.get_expert_data_parallel_group()
    dense_m = sum(1 for g in o_rep.optimizers["muon"].param_groups if g["tp"] == "tp" for _ in g["params"])
    expert_m = sum(1 for g in o_rep.optimizers["muon"].param_groups if g["tp"] == "expert_tp" for _ in g["params"])
    assert o_rep.ns_calls() == (dense_m + expert_m) * STEPS
    mine = {t: sum(1 for g in o_sh.optimizers["muon"].param_groups if g["tp"] == t for _ in g["params"])
            for t in ("tp", "expert_tp")}
    assert o_sh.ns_calls() == (mine["tp"] + mine["expert_tp"]) * STEPS
    assert _dp_sum(mine["tp"], dp) == dense_m and _dp_sum(mine["expert_tp"], edp) == expert_m, (mine, dense_m, expert_m)
    # bytes per rank: an even split of the replicated state (per group) plus the largest parameter's state
    per_param = {}
    for k, v in s_rep.items():
        _, pname, _ = k.split("/")
        per_param[pname] = per_param.get(pname, 0) + v.numel() * v.element_size()
    expert = {n for n, p in model.named_parameters() if getattr(p, "allreduce", True) is False}
    dense_total = sum(b for n, b in per_param.items() if n not in expert)
    expert_total = sum(b for n, b in per_param.items() if n in expert)
    bound = dense_total / dist.get_world_size(dp) + expert_total / dist.get_world_size(edp) + max(per_param.values())
    have = o_sh.state_bytes()
    assert have == sum(v.numel() * v.element_size() for v in _named_state(o_sh).values())
    assert have <= bound, f"rank holds {have} B of optimizer state > bound {bound:.0f} B (replicated {o_rep.state_bytes()} B)"
    assert o_rep.state_bytes() == dense_total + expert_total
    destroy_parallel()
    vs_ref = f"vs reference muon {worst['muon']:.1e}·lr adamw {worst['adamw']:.1e}·lr" if reference else "no reference"
    return (f"{preset_name}: bitwise vs replicated, {vs_ref}, NS calls {o_sh.ns_calls() // STEPS}/{dense_m + expert_m} per step, "
            f"state {have} B of {o_rep.state_bytes()} B")


def run_dp():
    return "; ".join(_compare(p, {}, {"tp": 1, "ep": 1}) for p in ("tiny-moe:mhc", "tiny-moe:xhc"))


def run_tp_dp():
    return _compare("tiny-moe:mhc", {"tensor_model_parallel_size": 2, "sequence_parallel": True}, {"tp": 2},
                    reference=False)


def run_ep_dp():
    return _compare("tiny-moe:xhc", {"expert_model_parallel_size": 2}, {"ep": 2}, reference=False)


def _save(model, opt, directory):
    from megatron.core import dist_checkpointing

    from training.checkpoint import build_state

    if dist.get_rank() == 0:
        os.makedirs(directory)
    dist.barrier()
    dist_checkpointing.save(build_state([model], opt, rng=False), directory)


def _load(model, opt, directory):
    from megatron.core import dist_checkpointing

    from training.checkpoint import build_state

    loaded = dist_checkpointing.load(build_state([model], opt, rng=False, is_loading=True), directory)
    missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    opt.load_torch_sharded_state_dict(loaded["optimizer_torch"])


def run_ckpt():
    from models.parallel import destroy_parallel

    _init(tp=1, ep=1)
    root = [tempfile.mkdtemp(prefix="sharded-muon-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root, src=0)
    root = root[0]
    rows = _rows(False)
    model, _ = _build("tiny-moe:xhc")
    _perturb_hc(model)
    init = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}

    def fresh(sharded):
        model.load_state_dict(init, strict=False)
        return _optimizer(model, sharded)

    opt = fresh(True)
    straight = _train(model, opt, 4, rows)
    want = _params(model)
    opt = fresh(True)
    _train(model, opt, 2, rows)
    _save(model, opt, os.path.join(root, "sharded"))
    checks = []
    for sharded, src, resave in ((True, "sharded", None), (False, "sharded", "replicated"), (True, "replicated", None)):
        opt = fresh(sharded)
        _load(model, opt, os.path.join(root, src))
        if resave:
            _save(model, opt, os.path.join(root, resave))
        losses = _train(model, opt, 2, rows, first=2)
        assert losses == straight[2:], (sharded, src, losses, straight[2:])
        bad = [n for n, p in _params(model).items() if not torch.equal(p, want[n])]
        assert not bad, f"{'sharded' if sharded else 'replicated'} resumed from {src}: {bad[:5]} differ"
        checks.append(f"{'sharded' if sharded else 'replicated'}<-{src}")
    destroy_parallel()
    return "bit-exact resume: " + ", ".join(checks)


MODES = {"dp": run_dp, "tp_dp": run_tp_dp, "ep_dp": run_ep_dp, "ckpt": run_ckpt}


if __name__ == "__main__":
    from tests.dist.launch import run_modes

    torch.set_num_threads(1)
    _init()  # torch.distributed first: modes read the rank before building their groups
    run_modes(MODES, sys.argv[1:], what="checks")
