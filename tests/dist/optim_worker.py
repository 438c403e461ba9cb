"""torchrun worker: optimiser steps under TP=2 (+SP) and EP=2 equal the single-rank steps.

Run (2 ranks, gloo, CPU)::

    python -m torch.distributed.run --nproc_per_node 2 tests/dist/optim_worker.py tp ep

The model is the zoo's ``tiny-moe:mhc`` cut to 2 layers (a dense layer, then a MoE layer with
routed and shared experts; mHC parameters are replicated and SP-tagged), with the HC parameters
perturbed and ``res_offdiag_init = −1`` so that every HC gradient is well above round-off (at the
documented init all streams are equal and the residual-mixing gradients are zero up to round-off).  Each mode first runs
the single-rank reference on every rank (TP = EP = 1, same seed, full batch), then the parallel
run from the same weights (copied with ``tests.megatron_utils.load_from_reference``), for both
``adamw`` and ``muon``, ``STEPS`` optimiser steps on different batches with clipping active:

- ``tp``: TP=2 + sequence parallel, full batch on both ranks; routed experts are sharded over the
  expert-TP group (ETP = TP = 2).  Per step the global grad norm equals the reference norm; after
  the steps every local parameter equals its slice of the reference parameter.  Negative
  control: Muon orthogonalising each shard separately does *not* match (so the test exercises
  the full-matrix gather).
- ``ep``: EP=2 (DP=2 for dense params), half the batch per rank; same checks (experts are whole
  matrices per rank, the grad norm sums expert squares over the EP group).

Prints ``OK <mode> ...`` per passed mode; any failure raises (non-zero exit).
"""

from __future__ import annotations

import os
import sys
import traceback

if __name__ in ("__main__", "__mp_main__"):  # run as the worker, not imported by a test: no dynamo
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

BATCH, SEQ, VOCAB, STEPS = 4, 16, 256, 2
CLIP = 0.5
LR = 1e-2
RTOL_NORM = 1e-5  # observed ~1e-7
# Parameter error after STEPS steps, in units of lr.  Muon (observed ~1e-5): the full-matrix
# Newton-Schulz result only differs by round-off.  AdamW: an element's step is
# lr·m̂/(√v̂ + ε), whose sensitivity to a gradient error δ is about lr·δ/ε.  Some gradients are
# zero up to round-off (e.g. the last sublayer's H_res under a sum readout barely touches the
# loss; one seen at 1.7e-6 flips sign with the summation order of the TP layout), so with a tiny ε
# their step is ±lr depending on rounding luck.  ADAM_EPS = 1e-3 makes the step a Lipschitz
# function of the gradient: a round-off of ≤ 1e-5 in a gradient moves the parameter by
# ≤ 1e-2·lr per step, whatever its sign; gradients above ε still take normalised Adam steps and
# smaller ones a proportional step, so a wrong slice, a missing all-reduce or a wrong clip still
# shows as an O(lr) error.  The bound holds by construction, not by the observed margin.
ADAM_EPS = 1e-3
TOL = {"muon": 1e-3, "adamw": 2e-2}
TIMEOUT_MINUTES = 2.0


def _init(**kw):
    from models.parallel import initialize_parallel

    initialize_parallel(seed=1234, timeout_minutes=TIMEOUT_MINUTES, **kw)


def _build(parallel=None):
    from models.zoo import build_model, build_transformer_config, load_preset

    preset = load_preset("tiny-moe:mhc", backbone_overrides={"num_layers": 2}, hc_overrides={"res_offdiag_init": -1.0})
    config = build_transformer_config(preset, parallel=parallel or {}, cpu=True)
    return build_model(preset, config, vocab_size=VOCAB, seq_length=SEQ), config


def _batch(step, rows=None):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ).contiguous()
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if rows is not None:
        return x[rows], y[rows], pos[rows]
    return x, y, pos


def _opt_cfg(name, lr=None):
    from training.optim import OptimizerConfig

    return OptimizerConfig(name=name, lr=lr or LR, clip_grad=CLIP, eps=ADAM_EPS)


def _train(model, name, rows=None, process_groups=None):
    """STEPS optimiser steps; returns the grad norms."""
    from models.parallel import finalize_grads
    from training.optim import build_optimizer

    opt = build_optimizer(model, _opt_cfg(name), process_groups=process_groups)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        tokens, labels, pos = _batch(step, rows)
        loss = model(tokens, pos, None, labels=labels).float().mean()
        loss.backward()
        finalize_grads(model)
        result = opt.step()
        assert result.updated, f"{name} step {step} was skipped (norm {result.grad_norm})"
        norms.append(result.grad_norm)
    return norms


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


def _break_stream_symmetry(model):
    """Perturb the HC parameters.  At the documented init every stream holds the same copy of the
    embedding, so the residual-mixing logits get exactly-zero gradients up to round-off, and
    AdamW (ε = 1e-15) turns that round-off into full-size steps whose sign depends on the
    parallel layout.  Distinct streams make every gradient well above round-off."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if getattr(p, "is_hyper_connection", False):
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def reference():
    """Single-rank runs: initial state, and per optimiser (norms, final state)."""
    from models.parallel import destroy_parallel
    from tests.megatron_utils import load_from_reference

    _init(tp=1, ep=1)
    model, config = _build()
    _break_stream_symmetry(model)
    init = _state(model)
    out = {}
    for name in ("adamw", "muon"):
        load_from_reference(model, init, config)
        norms = _train(model, name)
        assert all(n > CLIP for n in norms), f"reference norms {norms} do not exceed the clip {CLIP}"
        out[name] = (norms, _state(model))
    destroy_parallel()
    return init, out


def _errors(model, config, ref_state, opt_name):
    """Worst ``|local − slice(reference)| / lr`` over the AdamW- and the Muon-managed params."""
    from tests.megatron_utils import full_name, local_slice
    from training.optim import classify_param

    worst = {"adamw": (0.0, None), "muon": (0.0, None)}
    for name, p in model.named_parameters():
        want = local_slice(name, p, ref_state[full_name(name, config)], config)
        err = (p.detach() - want).abs().max().item() / LR
        which = classify_param(name, p, opt_name).optimizer
        worst[which] = max(worst[which], (err, name))
    return worst


def _check_norms(mode, name, got, want):
    for s, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= RTOL_NORM * w, f"{mode} {name} step {s}: grad norm {g!r} != reference {w!r}"


def _run_parallel(mode, parallel_kw, init_kw, rows, negative_control):
    from models.parallel import destroy_parallel
    from tests.megatron_utils import load_from_reference

    init, ref = reference()
    _init(**init_kw)
    model, config = _build(parallel_kw)
    report = []
    for name in ("adamw", "muon"):
        load_from_reference(model, init, config)
        norms = _train(model, name, rows)
        _check_norms(mode, name, norms, ref[name][0])
        for which, (err, where) in _errors(model, config, ref[name][1], name).items():
            assert err <= TOL[which], \
                f"{mode} {name}: {which} param {where} differs by {err:.2e}·lr > {TOL[which]}·lr"
            if where is not None:
                report.append(f"{name}/{which} {err:.1e}·lr")
    if negative_control:
        load_from_reference(model, init, config)
        _train(model, "muon", rows, process_groups={"tp": None, "expert_tp": None})
        err, where = _errors(model, config, ref["muon"][1], "muon")["muon"]
        assert err > 0.1, f"{mode}: per-shard Muon matched the full-matrix reference (max err {err:.2e}·lr)"
        report.append(f"per-shard muon {err:.1e}·lr")
    destroy_parallel()
    return ", ".join(report)


def run_tp():
    return _run_parallel("tp", {"tensor_model_parallel_size": 2, "sequence_parallel": True}, {"tp": 2},
                         rows=None, negative_control=True)


def run_ep():
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    return _run_parallel("ep", {"expert_model_parallel_size": 2}, {"ep": 2}, rows=rows, negative_control=False)


MODES = {"tp": run_tp, "ep": run_ep}


def main(argv):
    modes = argv or list(MODES)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    torch.set_num_threads(1)
    _init()  # torch.distributed first: modes read the rank before building their groups
    failed = False
    for mode in modes:
        try:
            info = MODES[mode]()
            if dist.get_rank() == 0:
                print(f"OK {mode}: {info}", flush=True)
        except Exception:
            failed = True
            print(f"FAIL {mode} (rank {dist.get_rank() if dist.is_initialized() else '?'}):\n{traceback.format_exc()}",
                  flush=True)
            break  # the peer may be stuck in a collective; stop here
    from models.parallel import destroy_parallel

    destroy_parallel(destroy_process_group=not failed)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main(sys.argv[1:])
