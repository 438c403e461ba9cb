"""torchrun worker: stock Megatron GPT/MoE under TP=2+SP, EP=2, DP=2 and checkpoint resharding.

Run (2 ranks, gloo, CPU)::

    python -m torch.distributed.run --nproc_per_node 2 tests/dist/stock_gpt_worker.py <mode>...

Modes (each compares the parallel run with a single-rank reference computed on every rank
from the same seed; the reference weights are copied into the sharded model with
``tests.megatron_utils.load_from_reference``, written from Megatron's TP layout):

- ``tp_sp``: TP=2 + sequence parallel, same full batch on both ranks.  Loss equals the reference;
  every local grad equals the matching slice of the reference grad (after the SP/QK-norm
  all-reduce of :func:`models.parallel.finalize_grads`).
- ``ep``: EP=2 (so DP=2 for dense params), each rank gets half of the batch.  The DP-averaged
  loss and grads equal the full-batch reference; the router expert bias update matches.
- ``dp``: DP=2, each rank gets half of the batch; averaged grads equal the full-batch grads.
- ``ddp``: Megatron's ``DistributedDataParallel`` + ``finalize_model_grads`` (they run on CPU
  under :mod:`models.cpu_compat`) agree with our bare-model helpers under DP=2, TP=2+SP, EP=2.
- ``pp``: PP=2 (4 layers, 2 micro-batches) driven by ``models.pipeline.gpipe_forward_backward``
  over Megatron's ``P2PCommunicator`` equals PP=1.
- ``pp_streams``: a toy 2-stage model with ``[s, b, N·C]`` p2p edges matches its single-process
  composition under ``models.pipeline.hc_p2p_shapes(N)`` (without it the receive fails).
- ``ckpt``: ``dist_checkpointing`` save under TP=2 (SP) and load into TP=1, and the reverse
  (save TP=1, load TP=2, EP=2): loaded tensors equal the reference exactly.

Prints ``OK <mode>`` per passed mode; any failure raises (non-zero exit).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

# Keep top-level imports light: dist_checkpointing's save spawns a helper process that re-runs
# this module's top level.  torch.compile (Megatron's jit_fuser on the router's expert-bias
# step) is disabled here to save ~4 s of compilation per rank; the compiled path is exercised
# by the single-process test.
if __name__ in ("__main__", "__mp_main__"):  # run as the worker, not imported by a test: no dynamo
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

BATCH = 4
RTOL, ATOL = 1e-5, 1e-10  # observed worst: 7e-7 relative to the tensor max
TIMEOUT_MINUTES = 2.0  # a rank stuck in a collective after its peer failed errors out


def _imports():
    """Heavy imports, done in the workers only (see the note at the top)."""
    global torch, dist, destroy_parallel, finalize_grads, _init
    global build_tiny_gpt, full_name, lm_loss, load_from_reference, local_slice, tiny_batch, tiny_moe_config
    import torch
    import torch.distributed as dist

    from models.parallel import destroy_parallel, finalize_grads, initialize_parallel
    from tests.megatron_utils import (
        build_tiny_gpt,
        full_name,
        lm_loss,
        load_from_reference,
        local_slice,
        tiny_batch,
        tiny_moe_config,
    )

    def _init(**kw):
        initialize_parallel(seed=1234, timeout_minutes=TIMEOUT_MINUTES, **kw)


def _close(name, got, want):
    err = (got - want).abs().max().item()
    tol = ATOL + RTOL * want.abs().max().item()
    assert err <= tol, f"{name}: max abs err {err:.3e} > tol {tol:.3e}"


def reference():
    """Single-rank (TP=EP=1) model: its state, full-batch loss, grads, updated expert bias."""
    _init(tp=1, ep=1)
    config = tiny_moe_config()
    model = build_tiny_gpt(config)
    with torch.no_grad():  # non-zero expert bias so checkpoints and updates exercise it
        for n, b in model.named_buffers():
            if n.endswith("expert_bias"):
                b.copy_(torch.linspace(-0.01, 0.01, b.numel()))
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    tokens, labels, pos = tiny_batch(BATCH)
    loss = lm_loss(model, tokens, labels, pos)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    # Expert-bias update from the full batch, computed locally (sign rule; no collectives).
    bias = {}
    for n, m in model.named_modules():
        if getattr(m, "expert_bias", None) is not None:
            cnt = m.local_tokens_per_expert
            bias[n + ".expert_bias"] = m.expert_bias + torch.sign(cnt.mean() - cnt) * config.moe_router_bias_update_rate
    destroy_parallel()
    return state, loss.detach(), grads, bias


def compare_grads(model, config, ref_grads):
    n_checked = 0
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name}: no grad"
        want = local_slice(name, p, ref_grads[full_name(name, config)], config)
        _close(f"grad {name}", p.grad, want)
        n_checked += 1
    return n_checked


def run_tp_sp():
    state, ref_loss, ref_grads, _ = reference()
    _init(tp=2)
    config = tiny_moe_config(tensor_model_parallel_size=2, sequence_parallel=True)
    model = build_tiny_gpt(config)
    load_from_reference(model, state, config)
    tokens, labels, pos = tiny_batch(BATCH)
    loss = lm_loss(model, tokens, labels, pos)
    _close("loss", loss.detach(), ref_loss)
    loss.backward()
    # Before the SP all-reduce a norm grad is only this rank's share of the sequence.
    w = model.decoder.layers[0].input_layernorm.weight
    partial = w.grad.clone()
    finalize_grads(model)
    assert not torch.allclose(partial, w.grad), "SP norm grad was already complete before the all-reduce"
    n = compare_grads(model, config, ref_grads)
    destroy_parallel()
    return n


def _half_batch():
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, labels, pos = tiny_batch(BATCH)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    return tokens[rows], labels[rows], pos[rows]


def run_ep():
    state, ref_loss, ref_grads, ref_bias = reference()
    _init(ep=2)
    config = tiny_moe_config(expert_model_parallel_size=2)
    model = build_tiny_gpt(config)
    load_from_reference(model, state, config)
    n_local = sum(1 for n, _ in model.named_parameters() if n.startswith("decoder.layers.1.mlp.experts.local_experts.") and n.endswith("linear_fc1.weight"))
    assert n_local == 2, f"expected 2 local experts per rank, got {n_local}"
    loss = lm_loss(model, *_half_batch())
    loss.backward()
    finalize_grads(model)
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    _close("loss", mean_loss / dist.get_world_size(), ref_loss)
    n = compare_grads(model, config, ref_grads)
    for name, b in model.named_buffers():
        if name.endswith("expert_bias"):
            _close(name, b, ref_bias[name])
            assert not torch.equal(b, state[name]), f"{name} was not updated"
    destroy_parallel()
    return n


def run_dp():
    state, ref_loss, ref_grads, _ = reference()
    _init()
    config = tiny_moe_config()
    model = build_tiny_gpt(config)
    load_from_reference(model, state, config)
    loss = lm_loss(model, *_half_batch())
    loss.backward()
    before = model.output_layer.weight.grad.clone()
    finalize_grads(model)
    assert not torch.allclose(before, model.output_layer.weight.grad), "DP all-reduce changed nothing"
    n = compare_grads(model, config, ref_grads)
    destroy_parallel()
    return n


def _assert_equal_to_reference(model, config, state):
    n = 0
    for name, p in model.named_parameters():
        want = local_slice(name, p, state[full_name(name, config)], config)
        assert torch.equal(p.detach(), want), f"{name} differs after load"
        n += 1
    for name, b in model.named_buffers():
        if name.endswith("expert_bias"):
            assert torch.equal(b, state[name]), f"{name} differs after load"
    return n


def _shared_tmpdir():
    path = [tempfile.mkdtemp(prefix="xhc_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def _save(model, path):
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(model.sharded_state_dict(), path)
    dist.barrier()


def _load_fresh(config, path, seed):
    from megatron.core import dist_checkpointing

    torch.manual_seed(seed)  # different init, so a no-op load would be caught
    model = build_tiny_gpt(config)
    loaded = dist_checkpointing.load(model.sharded_state_dict(), path)
    missing, unexpected = model.load_state_dict(loaded, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    assert not missing and not unexpected, (missing, unexpected)
    return model


def run_ckpt():
    state, _, _, _ = reference()
    # TP=2 (+SP) -> TP=1
    d1 = _shared_tmpdir()
    _init(tp=2)
    cfg2 = tiny_moe_config(tensor_model_parallel_size=2, sequence_parallel=True)
    m2 = build_tiny_gpt(cfg2)
    load_from_reference(m2, state, cfg2)
    _save(m2, d1)
    _init(tp=1)
    cfg1 = tiny_moe_config()
    n = _assert_equal_to_reference(_load_fresh(cfg1, d1, seed=7), cfg1, state)
    # TP=1 -> TP=2 with EP=2
    d2 = _shared_tmpdir()
    m1 = build_tiny_gpt(cfg1)
    load_from_reference(m1, state, cfg1)
    _save(m1, d2)
    _init(tp=2, ep=2, etp=1)
    cfg3 = tiny_moe_config(
        tensor_model_parallel_size=2,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
        sequence_parallel=True,
    )
    n += _assert_equal_to_reference(_load_fresh(cfg3, d2, seed=8), cfg3, state)
    destroy_parallel()
    dist.barrier()
    if dist.get_rank() == 0:
        for d in (d1, d2):
            shutil.rmtree(d, ignore_errors=True)
    return n


def run_ddp():
    """Megatron's own DistributedDataParallel + finalize_model_grads (which run on CPU under
    models.cpu_compat) give the same grads and expert bias as our bare-model finalize_grads."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    n = 0
    for layout, cfg in (
        (dict(), dict()),
        (dict(tp=2), dict(tensor_model_parallel_size=2, sequence_parallel=True)),
        (dict(ep=2), dict(expert_model_parallel_size=2)),
    ):
        _init(**layout)
        config = tiny_moe_config(**cfg)
        ours, theirs = build_tiny_gpt(config), build_tiny_gpt(config)
        theirs.load_state_dict(ours.state_dict())
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), theirs)
        batch = _half_batch() if "tp" not in layout else tiny_batch(BATCH)
        lm_loss(ours, *batch).backward()
        finalize_grads(ours)
        lm_loss(ddp, *batch).backward()
        finalize_grads(ddp)  # dispatches to megatron.core.distributed.finalize_model_grads
        for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
            _close(f"{layout} grad {name}", p.grad, q.main_grad)
            n += 1
        for (name, a), (_, b) in zip(ours.named_buffers(), theirs.named_buffers()):
            if name.endswith("expert_bias"):
                assert torch.equal(a, b) and a.abs().sum() > 0, f"{layout} {name}: {a} vs {b}"
        destroy_parallel()
    return n


def _stage_name(model, name):
    """Local name on a pipeline stage -> name in the single-stage reference."""
    if name.startswith("decoder.layers."):
        i, rest = name[len("decoder.layers."):].split(".", 1)
        return f"decoder.layers.{model.decoder.layers[int(i)].layer_number - 1}.{rest}"
    return name


def run_pp():
    """PP=2 stock GPT (4 layers, 2 micro-batches) driven by models.pipeline.gpipe_forward_backward
    over Megatron's P2PCommunicator == the PP=1 model on the full batch."""
    from models.pipeline import gpipe_forward_backward

    four = dict(num_layers=4, moe_layer_freq=[0, 1, 1, 1])
    _init()
    config = tiny_moe_config(**four)
    ref = build_tiny_gpt(config)
    state = {k: v.detach().clone() for k, v in ref.state_dict().items() if torch.is_tensor(v)}
    tokens, labels, pos = tiny_batch(BATCH)
    ref_loss = lm_loss(ref, tokens, labels, pos)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    destroy_parallel()

    _init(pp=2)
    config = tiny_moe_config(**four, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    first, last = dist.get_rank() == 0, dist.get_rank() == 1
    model = build_tiny_gpt(config, pre_process=first, post_process=last)
    assert len(model.decoder.layers) == 2
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state[_stage_name(model, name)])
    mb = BATCH // 2

    def step(i, m):
        rows = slice(i * mb, (i + 1) * mb)
        out = m(tokens[rows], pos[rows], None, labels=labels[rows] if last else None)
        return out.float().mean() if last else out

    losses = gpipe_forward_backward(model, step, 2, seq_length=tokens.shape[1], micro_batch_size=mb, config=config)
    if last:
        _close("loss", torch.stack(losses).mean(), ref_loss.detach())
    n = 0
    for name, p in model.named_parameters():
        _close(f"grad {name}", p.grad, ref_grads[_stage_name(model, name)])
        n += 1
    destroy_parallel()
    return n


def run_pp_streams():
    """The N·C p2p patch end to end: a toy 2-stage model whose inter-stage edge is [s, b, N·C]
    (stage 0 expands C -> N·C, stage 1 reduces); with models.pipeline.hc_p2p_shapes(N) the
    receive buffers fit and loss/grads equal the single-process composition."""
    from megatron.core.transformer import TransformerConfig

    from models.pipeline import gpipe_forward_backward, hc_p2p_shapes, p2p_tensor_shape

    C, N, S, B = 8, 4, 6, 2
    g = torch.Generator().manual_seed(0)
    w_in, w_mid, w_out = (torch.randn(C, N * C, generator=g) * 0.3, torch.randn(N * C, N * C, generator=g) * 0.3,
                          torch.randn(N * C, generator=g))  # fmt: skip
    x = torch.randn(2 * S, B, C, generator=g)  # 2 micro-batches along dim 0 (split below)

    class Stage(torch.nn.Module):
        def __init__(self, first):
            super().__init__()
            self.first = first
            self.w = torch.nn.Parameter((w_in if first else w_mid).clone())
            self.input_tensor = None

        def set_input_tensor(self, t):
            self.input_tensor = t

        def forward(self, xb):
            if self.first:
                return torch.tanh(xb @ self.w)  # [S, B, N·C]
            h = torch.tanh(self.input_tensor @ self.w)
            return (h @ w_out).pow(2).mean()

    ref = [Stage(True), Stage(False)]
    ref_losses = []
    for i in range(2):
        ref[1].set_input_tensor(ref[0](x[i * S:(i + 1) * S]))
        ref_losses.append(ref[1](None))
    torch.stack(ref_losses).mean().backward()

    _init(pp=2)
    config = TransformerConfig(num_layers=2, hidden_size=C, num_attention_heads=1, pipeline_model_parallel_size=2,
                               pipeline_dtype=torch.float32)  # fmt: skip
    rank = dist.get_rank()
    stage = Stage(rank == 0)
    with hc_p2p_shapes(N, config):
        losses = gpipe_forward_backward(stage, lambda i, m: m(x[i * S:(i + 1) * S]), 2, seq_length=S,
                                        micro_batch_size=B, config=config)  # fmt: skip
    if rank == 1:
        assert p2p_tensor_shape(S, B, C, N) == tuple(stage.input_tensor.shape)
        _close("loss", torch.stack(losses).mean(), torch.stack(ref_losses).mean().detach())
    _close("grad", stage.w.grad, ref[rank].w.grad)
    destroy_parallel()
    return 2


MODES = {"tp_sp": run_tp_sp, "ep": run_ep, "dp": run_dp, "ckpt": run_ckpt, "ddp": run_ddp, "pp": run_pp,
         "pp_streams": run_pp_streams}  # fmt: skip


def main(argv):
    _imports()
    from tests.dist.launch import run_modes

    run_modes(MODES, argv, "tensors")


if __name__ == "__main__":
    main(sys.argv[1:])
