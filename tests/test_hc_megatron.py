"""Hyper-connection layers inside Megatron-Core (docs/math.md §1.6, §1.7, §4.3), on CPU.

Single-process tests run here: the vanilla/disabled specs against stock Megatron (bitwise),
equivalence at initialisation, PP=2 stages chained by hand, dist_checkpointing coverage of every
HC tensor, config rejections, recomputation, padding masks, document masks.  The TP=2+SP, EP=2,
PP=2 (Megatron p2p), CP=2 and TP=2 -> TP=1 resharding checks run in one 2-rank torchrun launch
(tests/dist/hc_gpt_worker.py), reported per mode.
"""

from __future__ import annotations

import types

import pytest
import torch

megatron = pytest.importorskip("megatron.core")

from models.hc_layer import HyperConnectionTransformerLayer  # noqa: E402
from models.parallel import destroy_parallel, initialize_parallel  # noqa: E402
from models.validation import HCMegatronConfigError, validate_hc_transformer_config  # noqa: E402
from tests.megatron_utils import (  # noqa: E402
    build_tiny_gpt,
    build_tiny_hc_gpt,
    document_batch,
    lm_loss,
    pipeline_stage_collection,
    tiny_batch,
    tiny_moe_config,
)
from xhc.config import HCConfig  # noqa: E402

pytestmark = pytest.mark.megatron  # the Python 3.12 / newest megatron-core CI stage runs these

cpu_only = pytest.mark.cpu_gloo  # on a CUDA machine: a child pytest with CUDA hidden (tests/conftest.py)

XHC = dict(n=4, k=2, m=1)
MHC_FAMILY = ("hc", "mhc", "mhc_lite", "kromhc", "identity")
ALL_VARIANTS = MHC_FAMILY + ("xhc", "xhc_flash", "xhc_flash4")


def hc_config(variant: str, **kw) -> HCConfig:
    return HCConfig(variant=variant, **({**XHC, **kw} if variant.startswith("xhc") else {"n": 4, **kw}))


@pytest.fixture
def parallel():
    initialize_parallel(tp=1, pp=1, ep=1, seed=1234)
    yield
    destroy_parallel()


def _seeded(build, seed=0):
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return build()


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _hc_params(model):
    return {n: p for n, p in model.named_parameters() if getattr(p, "is_hyper_connection", False)}


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------------
# 1. Vanilla and disabled specs are stock Megatron, bit for bit
# ------------------------------------------------------------------------------------------------
@cpu_only
@pytest.mark.slow
def test_vanilla_and_disabled_specs_are_bitwise_stock(parallel):
    from megatron.core.transformer.spec_utils import ModuleSpec

    from models.specs import get_hc_decoder_block_spec

    config = tiny_moe_config(hidden_dropout=0.1)  # dropout draws from the RNG: streams must line up too
    batch = tiny_batch(4)

    def run(build):
        model = _seeded(build)
        torch.manual_seed(7)
        loss = lm_loss(model, *batch)
        loss.backward()
        return model, loss.detach(), _grads(model)

    stock, stock_loss, stock_grads = run(lambda: build_tiny_gpt(config))
    assert stock_grads and stock_loss.isfinite()

    def hc_disabled_layer_spec():
        # HyperConnectionTransformerLayer itself with a disabled config (its pass-through path).
        block = get_hc_decoder_block_spec(config, HCConfig(variant="none"), use_transformer_engine=False)
        off = HCConfig(variant="mhc", disabled=True)
        block.layer_specs = [ModuleSpec(module=HyperConnectionTransformerLayer, params={"hc_config": off},
                                        submodules=s.submodules) for s in block.layer_specs]  # fmt: skip
        from megatron.core.models.gpt import GPTModel

        return GPTModel(config=config, transformer_layer_spec=block, vocab_size=128, max_sequence_length=16,
                        share_embeddings_and_output_weights=False, position_embedding_type="rope",
                        rotary_base=10000)  # fmt: skip

    builds = {
        "none": lambda: build_tiny_hc_gpt(config, HCConfig(variant="none")),
        "mhc-disabled": lambda: build_tiny_hc_gpt(config, HCConfig(variant="mhc", disabled=True)),
        "xhc-disabled": lambda: build_tiny_hc_gpt(config, HCConfig(variant="xhc", disabled=True)),
        "hc-layer-disabled": hc_disabled_layer_spec,
    }
    for name, build in builds.items():
        model, loss, grads = run(build)
        assert not _hc_params(model), name
        assert torch.equal(loss, stock_loss), f"{name}: loss {loss.item()!r} != stock {stock_loss.item()!r}"
        assert grads.keys() == stock_grads.keys(), name
        for k in grads:
            assert torch.equal(grads[k], stock_grads[k]), f"{name}: grad {k} differs"
    assert isinstance(model.decoder.layers[0], HyperConnectionTransformerLayer)


# ------------------------------------------------------------------------------------------------
# 2. Equivalence at initialisation (docs/math.md §1.6)
# ------------------------------------------------------------------------------------------------
@cpu_only
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.slow
def test_hc_family_equals_vanilla_at_init(parallel, reduction):
    """HC and every mHC-family variant, with the vanilla weights copied in and HC params at their
    init, reproduce the vanilla logits and loss to fp32 round-off.  ``sum`` feeds N·h to the final
    RMSNorm, and RMSNorm(N·h; ε) = RMSNorm(h; ε/N²) exactly, so it is compared with a vanilla model
    whose final-norm ε is divided by N²."""
    config = tiny_moe_config()
    vanilla = _seeded(lambda: build_tiny_gpt(config))
    tokens, labels, pos = tiny_batch(4)
    n = 4
    if reduction == "sum":
        vanilla.decoder.final_layernorm.eps = config.layernorm_epsilon / n**2
    want_logits = vanilla(tokens, pos, None).detach()
    want_loss = lm_loss(vanilla, tokens, labels, pos).detach()
    vanilla.decoder.final_layernorm.eps = config.layernorm_epsilon
    plain_loss = lm_loss(vanilla, tokens, labels, pos).detach()
    state = vanilla.state_dict()
    for variant in MHC_FAMILY:
        model = build_tiny_hc_gpt(config, hc_config(variant, n=n, reduction=reduction))
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected
        assert {k for k in missing if not k.endswith("_extra_state")} == set(_hc_params(model)), variant
        logits = model(tokens, pos, None)
        assert _rel(logits, want_logits) < 2e-6, (variant, _rel(logits, want_logits))
        torch.testing.assert_close(lm_loss(model, tokens, labels, pos), want_loss, rtol=1e-6, atol=0)
    if reduction == "sum":  # the ε effect is real (so the ε/N² model is the right reference) but tiny
        assert 0 < abs(want_loss - plain_loss).item() < 1e-3


@cpu_only
@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_first_attention_input_is_the_embedding(parallel, variant):
    """Σ h_pre = 1 at init (docs/math.md §1.6, §3.7 #3): the first branch input u equals the embedding."""
    config = tiny_moe_config()
    model = build_tiny_hc_gpt(config, hc_config(variant))
    seen = {}
    model.embedding.register_forward_hook(lambda m, a, out: seen.__setitem__("e", out.detach()))
    model.decoder.layers[0].input_layernorm.register_forward_pre_hook(
        lambda m, a: seen.__setitem__("u", a[0].detach()))
    tokens, labels, pos = tiny_batch(2)
    lm_loss(model, tokens, labels, pos)
    assert seen["u"].shape == seen["e"].shape == (16, 2, config.hidden_size)
    assert _rel(seen["u"], seen["e"]) < 1e-6


# ------------------------------------------------------------------------------------------------
# Parameter tagging and counts
# ------------------------------------------------------------------------------------------------
@cpu_only
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_hc_params_are_tagged_replicated_dense_and_counted(parallel, sequence_parallel):
    """Every HC tensor is tagged ``is_hyper_connection``, carries ``sequence_parallel`` exactly when
    SP is on (Megatron all-reduces only those over TP), is neither TP-sharded nor an expert param
    (no ``allreduce=False``: it is averaged over the full DP group), and the count matches
    :func:`xhc.accounting.hc_params_total`."""
    from xhc.accounting import hc_params_total

    for variant in ALL_VARIANTS:
        for reduction in ("sum", "softmax", "learned"):
            hc = hc_config(variant, reduction=reduction)
            cfg = tiny_moe_config()
            cfg.sequence_parallel = sequence_parallel  # (TP=1 here: only the tagging is checked)
            model = build_tiny_hc_gpt(cfg, hc)
            params = _hc_params(model)
            assert sum(p.numel() for p in params.values()) == hc_params_total(hc, cfg.hidden_size, cfg.num_layers).total
            for name, p in params.items():
                assert ("hyper_connection" in name) or name.endswith("hc_readout_logits") or ".hc_head." in name, name
                assert p.sequence_parallel is sequence_parallel, name
                assert getattr(p, "allreduce", True) is True and not getattr(p, "tensor_model_parallel", False), name
                assert p.dtype == torch.float32, name
            tagged_modules = [n for n, _ in model.named_parameters()
                              if "hyper_connection" in n or "readout" in n or ".hc_head." in n]
            assert set(tagged_modules) == set(params), variant
            readout = [n for n in params if n.endswith("hc_readout_logits")]
            if reduction == "softmax":
                assert readout == [f"decoder.layers.{cfg.num_layers - 1}.hc_readout_logits"]
                assert torch.equal(params[readout[0]], torch.zeros(hc.n))
            else:
                assert readout == []
            head = sorted(n for n in params if ".hc_head." in n)
            want = [f"decoder.layers.{cfg.num_layers - 1}.hc_head.{k}" for k in ("hc_base", "hc_fn", "hc_scale")]
            assert head == (want if reduction == "learned" else []), (variant, reduction)


# ------------------------------------------------------------------------------------------------
# Padding mask, recomputation, softmax readout
# ------------------------------------------------------------------------------------------------
@cpu_only
@pytest.mark.parametrize("variant", ["mhc", "xhc", "xhc_flash"])
def test_padding_mask_reaches_the_mlp_as_in_stock(parallel, variant):
    """``padding_mask`` (True = padding) reaches every layer's MLP/MoE inside the HC layer exactly
    as the stock layer passes it.  (The MoE consumers are Megatron's: note that Megatron
    0.16.1-0.19.0 cannot combine a padding mask with the aux-loss-free expert bias —
    ``routing_map & ~padding_mask`` does not broadcast [T, E] with [T] — so that is off here.)"""
    config = tiny_moe_config(moe_router_enable_expert_bias=False)
    tokens, labels, pos = tiny_batch(2)
    padding = torch.zeros_like(tokens, dtype=torch.bool)
    padding[0, 11:] = True
    padding[1, 14:] = True
    seen = {}
    for name, model in (("stock", build_tiny_gpt(config)), ("hc", build_tiny_hc_gpt(config, hc_config(variant)))):
        got = seen[name] = []
        for layer in model.decoder.layers:
            layer.mlp.register_forward_pre_hook(
                lambda m, args, kwargs, got=got: got.append(kwargs.get("padding_mask")), with_kwargs=True)
        model(tokens, pos, None, labels=labels, padding_mask=padding).mean().backward()
    assert len(seen["hc"]) == len(seen["stock"]) == config.num_layers
    for a, b in zip(seen["hc"], seen["stock"]):
        assert a is not None and torch.equal(a, b)


@cpu_only
@pytest.mark.parametrize("variant,recompute", [
    ("mhc", "full"), ("xhc", "full"), ("mhc", "selective"), ("xhc_flash4", "selective"),
])  # fmt: skip
def test_recompute_matches_no_recompute(parallel, variant, recompute):
    """Activation recomputation through HC layers (full: Megatron's CheckpointFunction around
    layers; selective: the HC layer's norm/MLP checkpoints) replays dropout and gives the same
    loss and grads; selective ``layernorm`` recompute really discards the norm outputs."""
    kw = dict(hidden_dropout=0.2, attention_dropout=0.2)
    rkw = (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
           if recompute == "full" else
           dict(recompute_granularity="selective", recompute_modules=["core_attn", "layernorm", "mlp"]))  # fmt: skip
    hc = hc_config(variant)
    results = []
    for extra in ({}, rkw):
        model = _seeded(lambda: build_tiny_hc_gpt(tiny_moe_config(**kw, **extra), hc))
        if extra.get("recompute_granularity") == "selective":
            layer0 = model.decoder.layers[0]
            assert layer0.recompute_input_layernorm and layer0.recompute_pre_mlp_layernorm and layer0.recompute_mlp
        torch.manual_seed(5)
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(5)
        loss = lm_loss(model, *tiny_batch(2))
        if extra.get("recompute_granularity") == "selective":
            # the checkpointed norm outputs were freed (storage resized to 0) until backward
            for layer in model.decoder.layers:
                for ckpt in (layer.input_layernorm_checkpoint, layer.pre_mlp_norm_checkpoint):
                    assert ckpt.outputs[0].untyped_storage().size() == 0
        loss.backward()
        results.append((loss.detach(), _grads(model)))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-6, atol=1e-9, msg=n)


@cpu_only
def test_softmax_readout_starts_as_mean_and_learns(parallel):
    """``reduction='softmax'``: N zero logits on the last layer = the mean readout at init; the
    logits receive gradient once the streams differ."""
    config = tiny_moe_config()
    batch = tiny_batch(2)
    mean_model = _seeded(lambda: build_tiny_hc_gpt(config, hc_config("xhc", reduction="mean")))
    soft_model = _seeded(lambda: build_tiny_hc_gpt(config, hc_config("xhc", reduction="softmax")))
    soft_model.load_state_dict(mean_model.state_dict(), strict=False)
    loss = lm_loss(soft_model, *batch)
    torch.testing.assert_close(loss, lm_loss(mean_model, *batch), rtol=1e-6, atol=0)
    loss.backward()
    g = soft_model.decoder.layers[-1].hc_readout_logits.grad
    assert g is not None and g.abs().max() > 0  # xHC streams differ after the first sparse write
    assert abs(g.sum().item()) < 1e-6 * g.abs().max().item() * 10  # softmax: shift-invariant logits


@cpu_only
@pytest.mark.parametrize("variant", ["none", "mhc", "xhc", "xhc_flash4"])
def test_kv_cache_decoding_equals_full_forward(parallel, variant):
    """Megatron's KV-cache inference (StaticInferenceContext: prefill 8 tokens, then 8 one-token
    steps) through HC layers gives the full-sequence logits.  xHC variants need the temporal
    conv's decode cache (``sequence_context(SequenceContext(decode_cache={}))``); without it the
    layer refuses instead of silently convolving over one token."""
    import contextlib

    from megatron.core.inference.contexts import StaticInferenceContext

    from models.hc_layer import sequence_context
    from xhc.temporal import SequenceContext

    config = tiny_moe_config()
    model = _seeded(lambda: build_tiny_hc_gpt(config, hc_config(variant))).eval()
    tokens, _, pos = tiny_batch(2)
    is_xhc = variant.startswith("xhc")

    def decode(seq):
        ctx = StaticInferenceContext(2, 16)
        steps = [(0, 8)] + [(t, t + 1) for t in range(8, 16)]
        out = []
        with torch.no_grad(), (sequence_context(seq) if seq is not None else contextlib.nullcontext()):
            for a, b in steps:
                out.append(model(tokens[:, a:b], pos[:, a:b], None, inference_context=ctx,
                                 runtime_gather_output=True)[:, -1])  # fmt: skip
                ctx.sequence_len_offset += b - a
        return torch.stack(out, 1)  # logits at positions 7..15

    with torch.no_grad():
        full = model(tokens, pos, None)[:, 7:]
    got = decode(SequenceContext(decode_cache={}) if is_xhc else None)
    assert _rel(got, full) < 2e-6, _rel(got, full)
    if is_xhc:
        with pytest.raises(NotImplementedError, match=r"inference_context.*decode_cache"):
            decode(None)


# ------------------------------------------------------------------------------------------------
# Documents: Megatron's reset mask -> conv positions
# ------------------------------------------------------------------------------------------------
def test_positions_from_megatron_reset_mask():
    """Megatron's own ``reset_attention_mask`` mask (True = masked) gives exactly the position ids
    Megatron computes with ``reset_position_ids`` (independent code path)."""
    from models.sequence import pos_in_doc_from_attention_mask

    _, _, mask, position_ids = document_batch(3, 24, eod=0, doc_starts=[[5, 13], [], [1, 2, 23]])
    assert mask.dtype == torch.bool and mask.shape == (3, 1, 24, 24)
    assert torch.equal(pos_in_doc_from_attention_mask(mask), position_ids.t())
    # one mask shared by the batch: [1, 1, S, S]
    assert torch.equal(pos_in_doc_from_attention_mask(mask[:1]), position_ids[:1].t())
    with pytest.raises(ValueError, match=r"attention_mask has shape .*expected \[b, 1, S, S\]"):
        pos_in_doc_from_attention_mask(mask[0])


def test_mask_positions_cache_is_never_stale():
    """The per-forward cache of mask positions is keyed by the live mask object and its version:
    an edited or new mask is recomputed."""
    from models.sequence import sequence_context_from_megatron

    cfg = types.SimpleNamespace(sequence_parallel=False)
    _, _, mask, pos_a = document_batch(1, 16, eod=0, doc_starts=[[6]])
    got = sequence_context_from_megatron(cfg, mask, None, 16, 1).pos_in_doc
    assert torch.equal(got, pos_a.t())
    mask[0, 0, 10:, :10] = True  # in-place: a new document at 10
    got = sequence_context_from_megatron(cfg, mask, None, 16, 1).pos_in_doc
    assert got[10, 0] == 0 and got[9, 0] == 3
    for starts in ([3], [9], [3, 9]):
        _, _, m, p = document_batch(1, 16, eod=0, doc_starts=[starts])
        assert torch.equal(sequence_context_from_megatron(cfg, m, None, 16, 1).pos_in_doc, p.t())
        del m


@cpu_only
def test_xhc_conv_follows_document_resets(parallel):
    """With Megatron's reset mask the xHC conv resets at document starts: the result equals an
    explicit ``sequence_context`` built from Megatron's reset position ids, and differs from
    ``conv_doc_reset='never'`` (the resets matter)."""
    from megatron.core import tensor_parallel

    from models.hc_layer import sequence_context
    from xhc.temporal import SequenceContext, pos_in_doc_from_position_ids

    config = tiny_moe_config()
    tokens, labels, mask, position_ids = document_batch(2, 16, eod=0, doc_starts=[[6], [3, 11]])
    pos = torch.arange(16).expand(2, 16)
    losses = {}
    for mode in ("mask", "explicit", "never"):
        hc = hc_config("xhc", conv_doc_reset="never" if mode == "never" else "auto")
        model = _seeded(lambda: build_tiny_hc_gpt(config, hc))
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        if mode == "explicit":
            with sequence_context(SequenceContext(pos_in_doc=pos_in_doc_from_position_ids(position_ids))):
                losses[mode] = model(tokens, pos, mask, labels=labels).mean()
        else:
            losses[mode] = model(tokens, pos, mask, labels=labels).mean()
    assert torch.equal(losses["mask"], losses["explicit"])
    assert losses["mask"] != losses["never"]


def test_thd_positions_use_the_padded_offsets():
    """Padded THD packing: rows of sequence i start at ``cu_seqlens_q_padded[i]`` (the unpadded
    ``cu_seqlens_q`` only gives lengths), so the conv resets there, with or without CP."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from models.sequence import sequence_context_from_megatron

    cu, cu_pad = torch.tensor([0, 5, 12]), torch.tensor([0, 8, 16])
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad,
                             cu_seqlens_kv_padded=cu_pad, max_seqlen_q=8, max_seqlen_kv=8)  # fmt: skip
    seq = sequence_context_from_megatron(types.SimpleNamespace(sequence_parallel=False), None, packed, 16, 1)
    want = torch.tensor([*range(8), *range(8)])[:, None]  # two documents, each starting at a padded offset
    assert torch.equal(seq.pos_in_doc, want)
    unpadded = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)
    seq = sequence_context_from_megatron(types.SimpleNamespace(sequence_parallel=False), None, unpadded, 12, 1)
    assert torch.equal(seq.pos_in_doc, torch.tensor([*range(5), *range(7)])[:, None])


def test_packed_context_is_shared_within_a_forward_and_never_stale():
    """Layers of one forward (same ``packed_seq_params`` object) share one context; an edited
    ``cu_seqlens`` or the next micro-batch's packing object gets a new one."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from models.sequence import sequence_context_from_megatron

    cfg = types.SimpleNamespace(sequence_parallel=False)
    cu = torch.tensor([0, 5, 12])
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)
    first = sequence_context_from_megatron(cfg, None, packed, 12, 1)
    assert sequence_context_from_megatron(cfg, None, packed, 12, 1) is first
    cu[1] = 3  # in place: the first document is now 3 tokens long
    edited = sequence_context_from_megatron(cfg, None, packed, 12, 1)
    assert edited is not first and edited.pos_in_doc[3, 0] == 0 and edited.pos_in_doc[4, 0] == 1
    nxt = PackedSeqParams(**vars(packed))
    assert sequence_context_from_megatron(cfg, None, nxt, 12, 1) is not edited
    assert sequence_context_from_megatron(cfg, None, None, 12, 1).pos_in_doc is None  # no packing: no resets


# ------------------------------------------------------------------------------------------------
# 3, 4, 5, 6, 9. Two ranks (torchrun, gloo): TP=2+SP, EP=2, PP=2, CP=2, TP=2 -> TP=1, Megatron DDP
# ------------------------------------------------------------------------------------------------
DIST_MODES = ("tp_sp", "ep", "pp", "cp", "ckpt", "ddp")


@pytest.fixture(scope="module")
def hc_dist_run(run_torchrun):
    proc = run_torchrun("tests/dist/hc_gpt_worker.py", nproc=2, args=list(DIST_MODES), check=False)
    return proc.stdout


@cpu_only
@pytest.mark.parametrize("mode", DIST_MODES)
@pytest.mark.slow
def test_two_rank_hc_equivalence(hc_dist_run, mode):
    """tp_sp: TP=2+SP == TP=1 (loss, every grad incl. HC/conv/router after the SP all-reduce) for
    mHC (softmax readout), xHC (conv halo across the rank boundary, Megatron reset mask, explicit
    sequence_context), xHC-Flash, Flash-4sub and mHC with DeepSeek-V4's convention + learned head;
    ep: EP=2 == EP=1 for mHC, xHC and DeepSeek-V4 mHC + learned head;
    pp: PP=2 over Megatron p2p with [s, b, N·C] edges == PP=1 (mHC, Flash-4sub, DeepSeek-V4 mHC with
    the learned head on the last stage);
    cp: CP=2 xHC MLP sublayer with the Megatron-derived SequenceContext == full sequence (BSHD, THD);
    ckpt: dist_checkpointing save at TP=2+SP, load at TP=1: tensors exact, loss equal;
    ddp: Megatron DDP + finalize_model_grads treat HC params like our finalize_grads (TP=2+SP, EP=2)."""
    assert f"OK {mode}" in hc_dist_run, f"mode {mode} did not pass:\n{hc_dist_run[-6000:]}"


# ------------------------------------------------------------------------------------------------
# 5. Pipeline parallelism: two stages chained by hand == PP=1
# ------------------------------------------------------------------------------------------------
def _global_name(model, name):
    if name.startswith("decoder.layers."):
        i, rest = name[len("decoder.layers."):].split(".", 1)
        return f"decoder.layers.{model.decoder.layers[int(i)].layer_number - 1}.{rest}"
    return name


@cpu_only
@pytest.mark.parametrize("variant", ["mhc", "xhc", "xhc_flash4"])
def test_two_pipeline_stages_chained_equal_single_stage(parallel, variant):
    """Stage 0 (layers 1-2, embedding) and stage 1 (layers 3-4, final norm, output) are built in one
    process (Megatron reads the stage from a fake ``pg_collection.pp``).  Stage 0 sends
    ``[s, b, N·C]`` — the shape the patched schedule allocates — stage 1 takes it through
    ``set_input_tensor``; loss and every gradient equal the PP=1 model with the same weights.
    HC inits that depend on the global sublayer index (near-one-hot read) also agree."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules

    from models.pipeline import hc_p2p_shapes, p2p_num_streams

    hc = hc_config(variant)
    four = dict(num_layers=4, moe_layer_freq=[0, 1, 1, 1])
    ref = _seeded(lambda: build_tiny_hc_gpt(tiny_moe_config(**four), hc))
    state = ref.state_dict()
    tokens, labels, pos = tiny_batch(4)
    ref_loss = lm_loss(ref, tokens, labels, pos)
    ref_loss.backward()
    ref_grads = _grads(ref)

    config = tiny_moe_config(**four, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    stages = [build_tiny_hc_gpt(config, hc, pre_process=r == 0, post_process=r == 1,
                                pg_collection=pipeline_stage_collection(r, 2)) for r in range(2)]  # fmt: skip
    assert [[layer.layer_number for layer in s.decoder.layers] for s in stages] == [[1, 2], [3, 4]]
    assert stages[0].decoder.final_layernorm is None and stages[1].decoder.final_layernorm is not None
    for s in stages:
        if variant == "mhc":  # deterministic init: read bias one-hot on stream ℓ mod N, ℓ global
            for n, p in _hc_params(s).items():
                assert torch.equal(p, state[_global_name(s, n)]), n
        s.load_state_dict({k: state[_global_name(s, k)] for k in s.state_dict()}, strict=True)

    out = stages[0](tokens, pos, None)
    with hc_p2p_shapes(p2p_num_streams(hc), config):
        shapes = schedules.get_tensor_shapes(seq_length=16, micro_batch_size=4, decoder_seq_length=None,
                                             config=config, tp_group=ps.get_tensor_model_parallel_group(),
                                             cp_group=ps.get_context_parallel_group())  # fmt: skip
    assert [tuple(out.shape)] == [tuple(s) for s in shapes] == [(16, 4, hc.n * config.hidden_size)]
    received = out.detach().requires_grad_()
    stages[1].set_input_tensor(received)
    loss = lm_loss(stages[1], tokens, labels, pos)
    loss.backward()
    out.backward(received.grad)
    assert torch.equal(loss, ref_loss)
    n = 0
    for s in stages:
        for name, p in s.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[_global_name(s, name)], rtol=1e-6, atol=1e-10, msg=name)
            n += 1
    assert n == len(ref_grads)


def test_p2p_shapes_follow_the_hc_config():
    """The schedule's p2p shape is [s, b, N·C] for an HC config and [s, b, C] for vanilla/disabled."""
    from megatron.core.pipeline_parallel import schedules

    from models.pipeline import hc_p2p_shapes, p2p_num_streams

    config = types.SimpleNamespace(hidden_size=64, sequence_parallel=True, variable_seq_lengths=False,
                                   virtual_pipeline_model_parallel_size=None)  # fmt: skip
    group = types.SimpleNamespace(size=lambda: 2)
    kw = dict(seq_length=32, micro_batch_size=3, decoder_seq_length=None, config=config, tp_group=group,
              cp_group=types.SimpleNamespace(size=lambda: 1))  # fmt: skip
    for hc, width in ((HCConfig(variant="mhc", n=4), 256), (HCConfig(variant="xhc", n=16, k=4, m=2), 1024),
                      (HCConfig(variant="none"), 64), (HCConfig(variant="mhc", n=4, disabled=True), 64)):  # fmt: skip
        with hc_p2p_shapes(p2p_num_streams(hc), config):
            assert [tuple(s) for s in schedules.get_tensor_shapes(**kw)] == [(16, 3, width)], hc


# ------------------------------------------------------------------------------------------------
# 6. dist_checkpointing covers every HC tensor
# ------------------------------------------------------------------------------------------------
def _dense_config(**kw):
    return tiny_moe_config(num_moe_experts=None, moe_layer_freq=1, moe_ffn_hidden_size=None,
                           moe_shared_expert_intermediate_size=None, moe_router_enable_expert_bias=False,
                           **kw)  # fmt: skip


@cpu_only
@pytest.mark.parametrize("layers", ["moe", "dense"])
@pytest.mark.slow
def test_dist_checkpoint_round_trip_covers_every_hc_param(parallel, tmp_path, layers):
    """Save with ``dist_checkpointing`` and load into a differently initialised model: the saved
    checkpoint holds every ``is_hyper_connection`` tensor (router, pre/res/post maps, conv weights,
    Flash and Flash-4sub windows incl. the odd-layer fallback, softmax readout) under a per-layer
    key, every tensor comes back bitwise, and the loss is the same.  ``dense``: Megatron stacks the
    layers of a homogeneous block along a layer axis, which HC layers (readout only in the last
    layer, alternating Flash-4sub halves) must opt out of."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    config = tiny_moe_config() if layers == "moe" else _dense_config()
    batch = tiny_batch(2)
    for i, hc in enumerate([hc_config("xhc", reduction="softmax"), hc_config("xhc_flash4", reduction="softmax"),
                            hc_config("mhc", reduction="softmax")]):  # fmt: skip
        model = _seeded(lambda: build_tiny_hc_gpt(config, hc), seed=1)
        with torch.no_grad():  # move HC params off their (structured) init
            for p in _hc_params(model).values():
                p.add_(0.05 * torch.randn_like(p))
        sharded = model.sharded_state_dict()
        hc_names = _hc_params(model)
        for name in hc_names:
            sh = sharded[name]
            assert isinstance(sh, ShardedTensor), name
            assert sh.key == name, (name, sh.key)  # one key per global layer, no stacking axis
        path = tmp_path / f"ckpt{i}"
        path.mkdir()
        dist_checkpointing.save(sharded, str(path))
        saved = dist_checkpointing.load_tensors_metadata(str(path))
        missing = [n for n in hc_names if n not in saved]
        assert not missing, missing
        want = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        want_loss = lm_loss(model, *batch)
        fresh = _seeded(lambda: build_tiny_hc_gpt(config, hc), seed=2)
        assert not torch.equal(fresh.state_dict()[next(iter(hc_names))], want[next(iter(hc_names))])
        loaded = dist_checkpointing.load(fresh.sharded_state_dict(), str(path))
        missing, unexpected = fresh.load_state_dict(loaded, strict=False)
        assert [k for k in missing if not k.endswith("_extra_state")] == [] and unexpected == []
        for k, v in fresh.state_dict().items():
            if torch.is_tensor(v):
                assert torch.equal(v, want[k]), k
        assert torch.equal(lm_loss(fresh, *batch), want_loss)


# ------------------------------------------------------------------------------------------------
# 7. Rejected combinations (one per option; the message names the option and the alternative)
# ------------------------------------------------------------------------------------------------
def _cfg(**kw):
    base = dict(num_layers=4, mtp_num_layers=None, enable_cuda_graph=False, external_cuda_graph=False,
                cuda_graph_impl="none", fused_residual_rmsnorm=False, fp32_residual_connection=False,
                inference_fuse_tp_communication=False, pipeline_model_parallel_size=1,
                virtual_pipeline_model_parallel_size=None, recompute_granularity=None)  # fmt: skip
    base.update(kw)
    return types.SimpleNamespace(**base)


REJECTED = [
    # multi-token prediction through the streams is supported (tests/test_mtp.py), on the last stage only
    ("pipeline_model_parallel_layout", dict(mtp_num_layers=1, pipeline_model_parallel_layout="Et|tmL"),
     "drop the layout"),
    ("enable_cuda_graph", dict(enable_cuda_graph=True), "set it to False"),
    ("external_cuda_graph", dict(external_cuda_graph=True), "set it to False"),
    ("cuda_graph_impl", dict(cuda_graph_impl="transformer_engine"), "cuda_graph_impl='none'"),
    ("fused_residual_rmsnorm", dict(fused_residual_rmsnorm=True), "fused_residual_rmsnorm=False"),
    ("fp32_residual_connection", dict(fp32_residual_connection=True), "fp32_residual_connection=False"),
    ("inference_fuse_tp_communication", dict(inference_fuse_tp_communication=True),
     "inference_fuse_tp_communication=False"),
]


@pytest.mark.parametrize("option,kw,alternative", REJECTED, ids=[r[0] for r in REJECTED])
def test_rejected_option(option, kw, alternative):
    for variant in ("hc", "mhc", "xhc", "xhc_flash4"):
        with pytest.raises(HCMegatronConfigError) as err:
            validate_hc_transformer_config(_cfg(**kw), hc_config(variant))
        msg = str(err.value)
        assert f"TransformerConfig.{option}=" in msg and alternative in msg and "\n" not in msg, msg
    # vanilla and disabled configs are never rejected
    validate_hc_transformer_config(_cfg(**kw), HCConfig(variant="none"))
    validate_hc_transformer_config(_cfg(**kw), HCConfig(variant="mhc", disabled=True))


@cpu_only
def test_rejection_happens_when_the_layer_is_built(parallel):
    config = tiny_moe_config(fp32_residual_connection=True)
    with pytest.raises(HCMegatronConfigError, match="fp32_residual_connection=False"):
        build_tiny_hc_gpt(config, hc_config("mhc"))
    build_tiny_hc_gpt(config, HCConfig(variant="none"))  # vanilla builds


def test_flash4_rejects_full_recompute():
    with pytest.raises(HCMegatronConfigError, match="recompute_granularity.*'selective' or None"):
        validate_hc_transformer_config(_cfg(recompute_granularity="full"), hc_config("xhc_flash4"))
    validate_hc_transformer_config(_cfg(recompute_granularity="full"), hc_config("xhc_flash"))


def _pp_config(**kw):
    from megatron.core.transformer import TransformerConfig

    from models.cpu_compat import cpu_safe_overrides

    return TransformerConfig(hidden_size=8, num_attention_heads=2, pipeline_dtype=torch.float32,
                             **{**cpu_safe_overrides(), **kw})  # fmt: skip


@pytest.mark.parametrize("kw,ok", [
    (dict(num_layers=8, pipeline_model_parallel_size=2), True),  # [0-3] [4-7]
    (dict(num_layers=6, pipeline_model_parallel_size=2), False),  # [0-2] [3-5]: window (2, 3) split
    (dict(num_layers=8, pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=3), False),
    (dict(num_layers=8, pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=2), True),
    (dict(num_layers=8, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), True),
    (dict(num_layers=12, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), False),
    (dict(num_layers=7, pipeline_model_parallel_size=1), True),  # odd last layer falls back to Flash
    (dict(num_layers=7, pipeline_model_parallel_size=2, account_for_embedding_in_pipeline_split=True), False),
])  # fmt: skip
def test_flash4_windows_never_cross_pipeline_stages(kw, ok):
    """Validation places layers with Megatron's own functions (uneven first/last stage, virtual
    stages, embedding accounting) and rejects any Flash-4sub window (2g, 2g+1) split by a stage."""
    from models.validation import stage_layer_ids

    config = _pp_config(**kw)
    chunks = stage_layer_ids(config)
    assert sorted(i for c in chunks for i in c) == list(range(config.num_layers))
    split = any(any((i % 2 == 0 and i + 1 < config.num_layers and i + 1 not in c) for i in c) for c in chunks)
    assert split is (not ok)  # independent statement of the rule
    if ok:
        validate_hc_transformer_config(config, hc_config("xhc_flash4"))
    else:
        with pytest.raises(HCMegatronConfigError, match=r"TransformerConfig\.num_layers=.*Flash-4sub.*"
                                                        r"may not cross a pipeline stage.*xhc_flash"):
            validate_hc_transformer_config(config, hc_config("xhc_flash4"))
    validate_hc_transformer_config(config, hc_config("xhc_flash"))  # one-layer windows always fit


# ------------------------------------------------------------------------------------------------
# Flash-4sub carry under the TransformerBlock
# ------------------------------------------------------------------------------------------------
@cpu_only
def test_flash4_state_is_carried_and_released(parallel):
    """The window state passes from layer 2g to 2g+1 inside the block, is not left behind after a
    forward, and layer 2g+1 refuses to run without it."""
    from models.hc_layer import _FlashDriver

    config = tiny_moe_config(num_layers=4, moe_layer_freq=[0, 1, 1, 1])
    model = build_tiny_hc_gpt(config, hc_config("xhc_flash4"))
    kinds = [type(layer.self_attention_hyper_connection).__name__ for layer in model.decoder.layers]
    assert kinds == ["Flash4FirstLayer", "Flash4SecondLayer"] * 2
    lm_loss(model, *tiny_batch(2)).backward()
    assert not _FlashDriver._carry
    x = torch.zeros(16, 2, 4 * config.hidden_size)
    with pytest.raises(RuntimeError, match="did not receive the window state of layer 2g"):
        model.decoder.layers[1](x)


@cpu_only
@pytest.mark.parametrize("variant", ["mhc", "xhc", "xhc_flash", "xhc_flash4"])
def test_layer_outputs_are_viewless_stream_states(parallel, variant):
    """Between layers the state is a viewless ``[s, b, N·C]`` tensor (Megatron frees pipeline
    outputs by swapping ``.data``, which needs ``._base is None``); the last layer reduces to C."""
    config = tiny_moe_config()
    hc = hc_config(variant)
    model = build_tiny_hc_gpt(config, hc)
    outs = []
    for layer in model.decoder.layers:
        layer.register_forward_hook(lambda m, a, out: outs.append(out[0]))
    lm_loss(model, *tiny_batch(2)).backward()
    C = config.hidden_size
    assert [tuple(o.shape) for o in outs] == [(16, 2, hc.n * C)] * (config.num_layers - 1) + [(16, 2, C)]
    assert all(o._base is None for o in outs)
