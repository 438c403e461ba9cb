"""torchrun worker: hyper-connection GPT/MoE models under TP=2+SP, EP=2, PP=2, CP=2 and resharding.

Run (2 ranks, gloo, CPU)::

    python -m torch.distributed.run --nproc_per_node 2 tests/dist/hc_gpt_worker.py <mode>...

Every mode compares the parallel run with a single-rank (TP=EP=PP=1) reference computed on each
rank from the same seed, whose HC parameters are first moved off their structured init (so
streams differ and every HC gradient is generic); the reference weights are copied into the
sharded model with ``tests.megatron_utils.load_from_reference``.  Models come from
``models.specs.get_hc_decoder_block_spec`` (``tests.megatron_utils.build_tiny_hc_gpt``).

- ``tp_sp``: TP=2 + sequence parallel, same full batch on both ranks, for mHC (softmax readout),
  xHC (N=4, k=2, m=1, κ=(4,8,12); sequence 32, so each rank holds 16 rows and the conv's 11-row
  halo crosses the rank boundary; Megatron's document-resetting mask), xHC-Flash, Flash-4sub and
  mHC with DeepSeek-V4's convention and learned head (``DEEPSEEK``; the head's parameters are SP
  parameters of the last layer).
  Loss equals the reference and every grad (HC params incl. conv weights and router, after the
  SP all-reduce of ``models.parallel.finalize_grads``) equals the reference grad.  An explicit
  ``sequence_context`` from Megatron's reset position ids gives the same loss as the mask.
- ``ep``: EP=2 (DP=2 for dense params, half the batch per rank), mHC, xHC and mHC with
  ``DEEPSEEK``: DP-averaged loss
  and every grad equal the full-batch reference.
- ``pp``: PP=2 (4 layers, 2 micro-batches) over Megatron's ``P2PCommunicator``
  (``models.pipeline.gpipe_forward_backward``) with ``[s, b, N·C]`` edges
  (``hc_p2p_shapes(p2p_num_streams(hc))``), mHC, Flash-4sub and mHC with ``DEEPSEEK`` (the learned
  head on the last stage): loss and grads equal PP=1.
- ``cp``: CP=2 (Megatron's load-balanced layout from ``get_batch_on_this_cp_rank``, and THD
  packing with ``cu_seqlens_q_padded``): the xHC MLP sublayer with the temporal conv, given
  ``models.sequence.sequence_context_from_megatron``'s context, equals the full-sequence run in
  output and gradients.  (Megatron's local ``DotProductAttention`` refuses CP, so a whole GPT
  model cannot run CP on CPU; this checks the HC side of the layer.)
- ``ddp``: Megatron's ``DistributedDataParallel`` + ``finalize_model_grads`` give the HC grads of
  our bare-model ``finalize_grads`` under TP=2+SP and EP=2 (xHC, softmax readout).
- ``ckpt``: ``dist_checkpointing`` save of an xHC model (softmax readout) at TP=2+SP, load at
  TP=1: every tensor equals the reference and the loss equals the TP=2 loss.

Prints ``OK <mode>`` per passed mode; any failure raises (non-zero exit).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

# See tests/dist/stock_gpt_worker.py: light top level (dist_checkpointing re-imports it), no dynamo.
if __name__ in ("__main__", "__mp_main__"):  # run as the worker, not imported by a test: no dynamo
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

BATCH = 4
SEQ_HALO = 32  # TP=2+SP: 16 rows per rank > κ_max − 1 = 11
# Tolerances.  Loss: relative.  Grads: err <= RTOL·max|want| + EPS_GLOBAL·max|any grad of the model|.
# The second term is fp32 round-off at the model's gradient scale: some HC grads are cancellation
# residues, mathematically ~0 (the read's scale in front of a scale-invariant norm; H_res of the
# first layer, whose input streams are identical), and their round-off is set by the size of the
# cancelling terms, not by their own size.  Parallelism bugs (missing all-reduce, wrong halo)
# give O(1) relative errors on the large grads.
RTOL, EPS_GLOBAL = 2e-5, 1e-7
LOSS_RTOL = 2e-6  # observed <= 4e-7
TIMEOUT_MINUTES = 2.0
XHC = dict(n=4, k=2, m=1)
PERTURB = 0.5  # std of the noise added to HC params: streams become clearly distinct
DEEPSEEK = dict(convention="deepseek_v4", reduction="learned")  # DeepSeek-V4's maps and head (docs/math.md §2.h)


def _imports():
    global torch, dist, ps, HCConfig, destroy_parallel, finalize_grads, _init, U
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import tests.megatron_utils as U
    from models.parallel import destroy_parallel, finalize_grads, initialize_parallel
    from xhc.config import HCConfig

    def _init(**kw):
        initialize_parallel(seed=1234, timeout_minutes=TIMEOUT_MINUTES, **kw)


def _hc(variant, **kw):
    # XHC_TEST_HC_KERNELS=compile|eager|...: run every mode on that HC kernel backend (HCConfig.kernels)
    if os.environ.get("XHC_TEST_HC_KERNELS"):
        kw.setdefault("kernels", os.environ["XHC_TEST_HC_KERNELS"])
    return HCConfig(variant=variant, **({**XHC, **kw} if variant.startswith("xhc") else {"n": 4, **kw}))


def _close(name, got, want, rtol=RTOL, atol=0.0):
    err = (got - want).abs().max().item()
    tol = atol + rtol * want.abs().max().item()
    assert err <= tol, f"{name}: max abs err {err:.3e} > tol {tol:.3e}"


def _grad_atol(ref_grads):
    return EPS_GLOBAL * max(g.abs().max().item() for g in ref_grads.values())


def _is_hc(name):
    return "hyper_connection" in name or name.endswith("hc_readout_logits") or ".hc_head." in name


def reference(hc, seq=None, **cfg):
    """TP=EP=1 model (left initialised) with perturbed HC params, and its state."""
    _init()
    config = U.tiny_moe_config(**cfg)
    model = U.build_tiny_hc_gpt(config, hc, seq_len=seq or U.SEQ)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if _is_hc(name):
                p.add_(PERTURB * torch.randn(p.shape, generator=g))
        for n, b in model.named_buffers():
            if n.endswith("expert_bias"):
                b.copy_(torch.linspace(-0.01, 0.01, b.numel()))
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    return model, state


def _loss(model, batch):
    tokens, labels, pos, mask = batch
    return model(tokens, pos, mask, labels=labels).float().mean()


def compare_grads(model, config, ref_grads):
    n_hc, atol = 0, _grad_atol(ref_grads)
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name}: no grad"
        want = U.local_slice(name, p, ref_grads[U.full_name(name, config)], config)
        _close(f"grad {name}", p.grad, want, atol=atol)
        n_hc += _is_hc(name)
    return n_hc


# ------------------------------------------------------------------------------------------------
def run_tp_sp():
    from models.hc_layer import sequence_context
    from xhc.temporal import SequenceContext, pos_in_doc_from_position_ids

    tokens, labels, mask, position_ids = U.document_batch(BATCH, SEQ_HALO, eod=0,
                                                          doc_starts=[[9], [], [17, 20], [14, 28]])  # fmt: skip
    pos = torch.arange(SEQ_HALO).expand(BATCH, SEQ_HALO)
    doc_batch = (tokens, labels, pos, mask)
    plain_batch = (*U.tiny_batch(BATCH, SEQ_HALO)[:3], None)
    n_total = 0
    for hc, batch, mtp in ((_hc("mhc", reduction="softmax"), plain_batch, {}),
                           (_hc("xhc", reduction="softmax"), doc_batch, {}),
                           (_hc("xhc_flash"), doc_batch, {}), (_hc("xhc_flash4"), plain_batch, {}),
                           (_hc("mhc", **DEEPSEEK), plain_batch, {}),
                           (_hc("mhc", **DEEPSEEK), plain_batch, MTP)):  # fmt: skip
        ref, state = reference(hc, seq=SEQ_HALO, **mtp)
        ref_loss = _loss(ref, batch)
        ref_loss.backward()
        ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
        destroy_parallel()

        _init(tp=2)
        config = U.tiny_moe_config(tensor_model_parallel_size=2, sequence_parallel=True, **mtp)
        model = U.build_tiny_hc_gpt(config, hc, seq_len=SEQ_HALO)
        U.load_from_reference(model, state, config)
        loss = _loss(model, batch)
        _close(f"{hc.variant} loss", loss.detach(), ref_loss.detach(), rtol=LOSS_RTOL)
        loss.backward()
        hc_params = {n: p for n, p in model.named_parameters() if _is_hc(n)}
        assert all(p.sequence_parallel for p in hc_params.values())
        name = next(n for n in hc_params if "router" in n or "W_pre" in n)
        partial = hc_params[name].grad.clone()
        finalize_grads(model)
        full = hc_params[name].grad
        assert (partial - full).abs().max() > 1e-3 * full.abs().max(), f"{name}: SP grad complete before the all-reduce"
        n_hc = compare_grads(model, config, ref_grads)
        assert n_hc == len(hc_params)
        if mtp:
            _check_mtp(model, hc)
        if hc.is_xhc:
            convs = [n for n in hc_params if ".conv." in n]
            assert convs and all(hc_params[n].grad.abs().max() > 0 for n in convs), convs
        if hc.variant == "xhc":  # explicit context from Megatron's reset position ids == the mask's
            tp_rank = ps.get_tensor_model_parallel_rank()
            seq = SequenceContext(pos_in_doc=pos_in_doc_from_position_ids(position_ids, tp_rank, 2),
                                  group=ps.get_tensor_model_parallel_group())  # fmt: skip
            with torch.no_grad(), sequence_context(seq):
                explicit = _loss(model, batch)
            with torch.no_grad():
                assert torch.equal(explicit, _loss(model, batch))
        n_total += n_hc
        destroy_parallel()
    return n_total


def _half(batch):
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    return tuple(t[rows] if t is not None else None for t in batch)


def run_ep():
    n_total = 0
    batch = (*U.tiny_batch(BATCH), None)
    for hc, mtp in ((_hc("mhc"), {}), (_hc("xhc"), {}), (_hc("mhc", **DEEPSEEK), {}), (_hc("xhc"), MTP)):
        ref, state = reference(hc, **mtp)
        ref_loss = _loss(ref, batch)
        ref_loss.backward()
        ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
        destroy_parallel()

        _init(ep=2)
        config = U.tiny_moe_config(expert_model_parallel_size=2, **mtp)
        model = U.build_tiny_hc_gpt(config, hc)
        U.load_from_reference(model, state, config)
        loss = _loss(model, _half(batch))
        loss.backward()
        finalize_grads(model)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        _close(f"{hc.variant} loss", mean_loss / dist.get_world_size(), ref_loss.detach(), rtol=LOSS_RTOL)
        n_total += compare_grads(model, config, ref_grads)
        if mtp:
            _check_mtp(model, hc)
        destroy_parallel()
    return n_total


# Multi-token prediction (models/mtp.py): one depth, λ = 0.5, its MoE layer included.
MTP = dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.5)


def _check_mtp(model, hc):
    """The MTP depth is there, is an HC layer, and was compared (every parameter has a grad)."""
    from models.mtp import HCMultiTokenPredictionLayer, mtp_parameters

    params = mtp_parameters(model)
    assert params and all(p.grad is not None and p.grad.abs().max() > 0 for _, p in params), \
        [n for n, p in params if p.grad is None or not p.grad.abs().max() > 0]
    assert isinstance(model.mtp.layers[0], HCMultiTokenPredictionLayer)
    if hc.reduction == "learned":
        assert any(".hc_head." in n for n, _ in params)


def _stage_name(model, name):
    if name.startswith("decoder.layers."):
        i, rest = name[len("decoder.layers."):].split(".", 1)
        return f"decoder.layers.{model.decoder.layers[int(i)].layer_number - 1}.{rest}"
    return name


def run_pp():
    from models.pipeline import gpipe_forward_backward, hc_p2p_shapes, p2p_num_streams

    four = dict(num_layers=4, moe_layer_freq=[0, 1, 1, 1])
    tokens, labels, pos = U.tiny_batch(BATCH)
    n_total = 0
    for hc, mtp in ((_hc("mhc", reduction="softmax"), {}), (_hc("xhc_flash4"), {}), (_hc("mhc", **DEEPSEEK), {}),
                    (_hc("mhc", **DEEPSEEK), MTP)):
        ref, state = reference(hc, **four, **mtp)
        ref_loss = _loss(ref, (tokens, labels, pos, None))
        ref_loss.backward()
        ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
        destroy_parallel()

        _init(pp=2)
        config = U.tiny_moe_config(**four, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32, **mtp)
        first, last = dist.get_rank() == 0, dist.get_rank() == 1
        model = U.build_tiny_hc_gpt(config, hc, pre_process=first, post_process=last)
        missing, unexpected = model.load_state_dict(
            {k: state[_stage_name(model, k)] for k in model.state_dict() if _stage_name(model, k) in state},
            strict=False)  # fmt: skip
        assert all(k.endswith("_extra_state") for k in missing) and not unexpected, (missing, unexpected)
        mb = BATCH // 2
        received = []

        def step(i, m):
            rows = slice(i * mb, (i + 1) * mb)
            if not first:
                received.append(tuple(m.decoder.input_tensor.shape))
            out = m(tokens[rows], pos[rows], None, labels=labels[rows] if last else None)
            return out.float().mean() if last else out

        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

        MTPLossAutoScaler.set_loss_scale(torch.tensor(0.5))  # the MTP losses' share of loss / 2 micro-batches
        with hc_p2p_shapes(p2p_num_streams(hc), config):
            losses = gpipe_forward_backward(model, step, 2, seq_length=tokens.shape[1], micro_batch_size=mb,
                                            config=config)  # fmt: skip
        if last:
            assert received == [(tokens.shape[1], mb, hc.n * config.hidden_size)] * 2, received
            _close(f"{hc.variant} loss", torch.stack(losses).mean(), ref_loss.detach(), rtol=LOSS_RTOL)
        MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
        if mtp:  # the last stage's embedding copy (MTP) and the first stage's: grads summed
            finalize_grads(model, config)
            if last:
                _check_mtp(model, hc)
        atol = _grad_atol(ref_grads)
        for name, p in model.named_parameters():
            _close(f"{hc.variant} grad {name}", p.grad, ref_grads[_stage_name(model, name)], atol=atol)
            n_total += _is_hc(name)
        destroy_parallel()
    return n_total


def run_cp():
    """CP=2: the xHC MLP sublayer (read, branch, temporal conv, write) on this rank's rows, with the
    SequenceContext that models.sequence derives from Megatron's parallel state."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from models.parallel import batch_on_this_cp_rank
    import models.sequence as ms
    from models.sequence import sequence_context_from_megatron
    from xhc.temporal import SequenceContext, pos_in_doc_from_cu_seqlens
    from xhc.xhc import XHCSublayer

    C, S = 16, 32
    hc = _hc("xhc")
    _init(cp=2)
    rank = ps.get_context_parallel_rank()
    config = U.tiny_moe_config(context_parallel_size=2)
    g = torch.Generator().manual_seed(3)
    W = torch.randn(C, C, generator=g) / C**0.5
    n_checked = 0
    for layout in ("bshd", "thd"):
        b = 2 if layout == "bshd" else 1
        torch.manual_seed(5)
        sub = XHCSublayer(hc, C, is_mlp=True, layer_index=1)
        with torch.no_grad():  # generic parameters
            for p in sub.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g))
        X = torch.randn(S, b, hc.n, C, generator=g, requires_grad=True)
        R = torch.randn(S, b, hc.n, C, generator=g)

        def run(Xin, seq):
            u, ctx = sub.read(Xin)
            return sub.write(Xin, torch.tanh(u @ W), ctx, seq)

        if layout == "bshd":
            packed = None
            ref_seq = None
            # Megatron's own CP split of [b, S, ...] batches (chunks r and 2cp-1-r)
            rows = batch_on_this_cp_rank({"rows": torch.arange(S)[None]})["rows"][0]
            want_rows = [list(range(0, 8)) + list(range(24, 32)), list(range(8, 24))][rank]
        else:
            cu_padded = torch.tensor([0, 16, 32])
            packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 13, 29]),
                                     cu_seqlens_kv=torch.tensor([0, 13, 29]), cu_seqlens_q_padded=cu_padded,
                                     cu_seqlens_kv_padded=cu_padded, max_seqlen_q=16, max_seqlen_kv=16)  # fmt: skip
            ref_seq = SequenceContext(pos_in_doc=pos_in_doc_from_cu_seqlens(cu_padded, S))
            # TE's THD CP split: each padded sequence in 2cp chunks, rank r holds chunks r, 2cp-1-r
            want_rows = [[*range(0, 4), *range(12, 16), *range(16, 20), *range(28, 32)],
                         [*range(4, 12), *range(20, 28)]][rank]  # fmt: skip
            rows = torch.tensor(want_rows)
        assert rows.tolist() == want_rows, (layout, rows.tolist())

        out_ref = run(X, ref_seq)
        (out_ref * R).sum().backward()
        ref_grads = {n: p.grad.clone() for n, p in sub.named_parameters()}
        ref_dX = X.grad.clone()
        sub.zero_grad()
        X.grad = None

        X_local = X.detach()[rows].clone().requires_grad_()
        seq = sequence_context_from_megatron(config, None, packed, len(want_rows), b, hc.conv_doc_reset)
        assert seq.group is ps.get_context_parallel_group()
        covered = sorted(r for start, n in seq.segments for r in range(start, start + n))
        assert covered == sorted(want_rows), (layout, seq.segments)
        # Every layer of a forward gets the same inputs, hence the same context: the exchange is
        # planned (all-gathers + host sync) once per micro-batch, not once per xHC MLP sublayer.
        plans = []
        real_plan = ms._exchange_plan
        ms._exchange_plan = lambda *a, **k: plans.append(1) or real_plan(*a, **k)
        try:
            for _ in range(3):  # three "layers"
                again = sequence_context_from_megatron(config, None, packed, len(want_rows), b, hc.conv_doc_reset)
                assert again is seq, layout
                with torch.no_grad():
                    run(X_local.detach(), again)
            assert len(plans) == 1, (layout, len(plans))
            if packed is not None:  # the next micro-batch's packing: planned afresh
                nxt = PackedSeqParams(**vars(packed))
                assert sequence_context_from_megatron(config, None, nxt, len(want_rows), b,
                                                      hc.conv_doc_reset) is not seq
        finally:
            ms._exchange_plan = real_plan
        seq = sequence_context_from_megatron(config, None, packed, len(want_rows), b, hc.conv_doc_reset)
        out = run(X_local, seq)
        _close(f"{layout} output", out.detach(), out_ref.detach()[rows])
        (out * R[rows]).sum().backward()
        _close(f"{layout} dX", X_local.grad, ref_dX[rows])
        for n, p in sub.named_parameters():
            grad = p.grad.clone()
            dist.all_reduce(grad, group=ps.get_context_parallel_group())
            if n.startswith("temporal") and rank == 0 and layout == "bshd":
                assert not torch.allclose(p.grad, grad), f"{n}: CP rank holds the whole gradient?"
            _close(f"{layout} grad {n}", grad, ref_grads[n], atol=_grad_atol(ref_grads))
            n_checked += 1
    destroy_parallel()
    return n_checked


# ------------------------------------------------------------------------------------------------
def _shared_tmpdir():
    path = [tempfile.mkdtemp(prefix="xhc_hc_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def run_ckpt():
    from megatron.core import dist_checkpointing

    hc = _hc("xhc", reduction="softmax")
    batch = (*U.tiny_batch(BATCH, SEQ_HALO), None)
    _, state = reference(hc, seq=SEQ_HALO)
    destroy_parallel()
    path = _shared_tmpdir()
    _init(tp=2)
    cfg2 = U.tiny_moe_config(tensor_model_parallel_size=2, sequence_parallel=True)
    m2 = U.build_tiny_hc_gpt(cfg2, hc, seq_len=SEQ_HALO)
    U.load_from_reference(m2, state, cfg2)
    with torch.no_grad():
        loss_tp2 = _loss(m2, batch)
    dist_checkpointing.save(m2.sharded_state_dict(), path)
    dist.barrier()
    destroy_parallel()

    _init(tp=1)
    cfg1 = U.tiny_moe_config()
    torch.manual_seed(99)  # a different init, so a no-op load would be caught
    m1 = U.build_tiny_hc_gpt(cfg1, hc, seq_len=SEQ_HALO)
    hc_names = [n for n, _ in m1.named_parameters() if _is_hc(n)]
    assert any(not torch.equal(m1.state_dict()[n], state[n]) for n in hc_names)
    loaded = dist_checkpointing.load(m1.sharded_state_dict(), path)
    missing, unexpected = m1.load_state_dict(loaded, strict=False)
    assert [k for k in missing if not k.endswith("_extra_state")] == [] and not unexpected, (missing, unexpected)
    n = 0
    for name, v in m1.state_dict().items():
        if torch.is_tensor(v) and name in state:
            assert torch.equal(v, state[name]), f"{name} differs after TP=2 -> TP=1 load"
            n += _is_hc(name)
    assert n == len(hc_names)
    with torch.no_grad():
        _close("TP=1 loss after resharding vs TP=2 loss", _loss(m1, batch), loss_tp2, rtol=LOSS_RTOL)
    destroy_parallel()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    return n


def run_ddp():
    """Megatron's DistributedDataParallel + finalize_model_grads (the GPU path; they run on CPU
    under models.cpu_compat) treat HC params like our bare-model finalize_grads: all-reduced over
    TP under SP (``param.sequence_parallel``), averaged over the full DP group under EP."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    n = 0
    hc = _hc("xhc", reduction="softmax")
    for layout, cfg, full in ((dict(tp=2), dict(tensor_model_parallel_size=2, sequence_parallel=True), True),
                              (dict(ep=2), dict(expert_model_parallel_size=2), False)):  # fmt: skip
        _init(**layout)
        config = U.tiny_moe_config(**cfg)
        ours, theirs = (U.build_tiny_hc_gpt(config, hc, seq_len=SEQ_HALO) for _ in range(2))
        theirs.load_state_dict(ours.state_dict())
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), theirs)
        batch = (*U.tiny_batch(BATCH, SEQ_HALO), None)
        batch = batch if full else _half(batch)
        _loss(ours, batch).backward()
        finalize_grads(ours)
        _loss(ddp, batch).backward()
        finalize_grads(ddp)  # dispatches to megatron.core.distributed.finalize_model_grads
        for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
            if _is_hc(name):
                _close(f"{layout} grad {name}", q.main_grad, p.grad, atol=1e-9)
                n += 1
        destroy_parallel()
    return n


MODES = {"tp_sp": run_tp_sp, "ep": run_ep, "pp": run_pp, "cp": run_cp, "ckpt": run_ckpt, "ddp": run_ddp}


def main(argv):
    _imports()
    from tests.dist.launch import run_modes

    run_modes(MODES, argv, "HC tensors")


if __name__ == "__main__":
    main(sys.argv[1:])
