"""Tiny stock Megatron-Core GPT/MoE models for CPU tests, and TP/EP weight-slicing helpers.

The model is DeepSeekMoE-shaped and built only with Megatron's own builders
(``get_gpt_decoder_block_spec`` + ``GPTModel``), with :mod:`models.norms` substituted for the
torch-norm fallback: 1 dense layer then MoE layers (``moe_layer_freq=[0, 1, 1]``), 4 routed
experts (top-2, sigmoid scores, aux-loss-free expert bias) + 1 shared expert, GQA with QK-norm,
RoPE, SwiGLU, RMSNorm, untied embeddings, no linear biases.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F

from models.pipeline import pipeline_stage_collection  # noqa: F401  (re-exported for the tests)

VOCAB = 128
SEQ = 16


def tiny_moe_config(**overrides: Any):
    """``TransformerConfig`` of the tiny MoE model; ``overrides`` win (e.g. ``sequence_parallel``).

    Parallel sizes (``tensor_model_parallel_size``, ``expert_model_parallel_size``, ...) must
    match the ones given to :func:`models.parallel.initialize_parallel`.
    """
    from megatron.core.transformer import TransformerConfig

    from models.cpu_compat import cpu_safe_overrides

    kwargs: Dict[str, Any] = dict(
        num_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,  # GQA: 2 heads per KV group
        kv_channels=8,
        ffn_hidden_size=64,  # dense layer
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        qk_layernorm=True,
        gated_linear_unit=True,  # SwiGLU
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # MoE: DeepSeekMoE-style.
        num_moe_experts=4,
        moe_layer_freq=[0, 1, 1],
        moe_ffn_hidden_size=16,
        moe_shared_expert_intermediate_size=16,
        moe_router_topk=2,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=1e-3,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_pre_softmax=False,
        moe_router_topk_scaling_factor=1.0,
        init_method_std=0.02,
        params_dtype=torch.float32,
    )
    kwargs.update(cpu_safe_overrides())
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_tiny_gpt(config, vocab_size: int = VOCAB, seq_len: int = SEQ, pre_process: bool = True, post_process: bool = True):
    """Stock ``GPTModel`` from ``get_gpt_decoder_block_spec`` with :class:`models.norms.Norm`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from models.norms import substitute_norms

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=config.normalization)
    return _tiny_gpt_model(config, substitute_norms(spec), vocab_size, seq_len, pre_process, post_process)


def _tiny_gpt_model(config, spec, vocab_size, seq_len, pre_process, post_process, pg_collection=None,
                    mtp_block_spec=None):
    """The tiny model's ``GPTModel`` arguments, shared by the stock and the HC builders."""
    from megatron.core.models.gpt import GPTModel

    kwargs = {"pg_collection": pg_collection} if pg_collection is not None else {}
    if mtp_block_spec is not None:
        kwargs["mtp_block_spec"] = mtp_block_spec
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=seq_len,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=10000,
        **kwargs,
    )


def tiny_batch(batch: int = 4, seq_len: int = SEQ, seed: int = 0):
    """Deterministic token ids / labels / positions ``[b, s]``."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, seq_len + 1), generator=g)
    pos = torch.arange(seq_len).unsqueeze(0).expand(batch, seq_len)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), pos.contiguous()


def lm_loss(model, tokens, labels, pos) -> torch.Tensor:
    """Mean next-token loss of a GPTModel (causal mask comes from docs/math.md)."""
    per_token = model(tokens, pos, None, labels=labels)  # [b, s]
    return per_token.float().mean()


# ---------------------------------------------------------------------------------------------
# Weight transfer from a single-rank (TP=EP=1) reference model into a parallel one.
# ---------------------------------------------------------------------------------------------
def _expert_ids(name: str):
    """'...mlp.experts.local_experts.<i>.<rest>' -> (prefix, i, rest) or None."""
    key = ".local_experts."
    if key not in name:
        return None
    prefix, rest = name.split(key, 1)
    i, rest = rest.split(".", 1)
    return prefix, int(i), rest


def full_name(name: str, config) -> str:
    """Name of the reference (EP=1) parameter that local parameter ``name`` is a slice of."""
    from megatron.core import parallel_state as ps

    ids = _expert_ids(name)
    if ids is None:
        return name
    prefix, i, rest = ids
    n_local = config.num_moe_experts // ps.get_expert_model_parallel_world_size()
    return f"{prefix}.local_experts.{ps.get_expert_model_parallel_rank() * n_local + i}.{rest}"


def local_slice(name: str, param: torch.nn.Parameter, full: torch.Tensor, config) -> torch.Tensor:
    """The part of the reference tensor ``full`` that the local (TP/EP-sharded) ``param`` holds.

    Written from Megatron's TP layout, independently of its checkpoint code: column/row-parallel
    weights split contiguously along ``param.partition_dim``; SwiGLU ``linear_fc1`` holds
    ``[gate; up]`` per rank, so the gate and up halves are split separately; expert weights use
    the expert-TP rank.  Replicated params are copied whole.
    """
    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False):
        assert full.shape == param.shape, (name, full.shape, param.shape)
        return full
    if ".experts." in name:  # routed experts use the expert-TP group (shared experts do not)
        rank, world = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    else:
        rank, world = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    dim = param.partition_dim
    if config.gated_linear_unit and "linear_fc1" in name:
        halves = full.chunk(2, dim=dim)
        out = torch.cat([h.chunk(world, dim=dim)[rank] for h in halves], dim=dim)
    else:
        out = full.chunk(world, dim=dim)[rank]
    assert out.shape == param.shape, (name, out.shape, param.shape)
    return out


def load_from_reference(model, reference_state: Dict[str, torch.Tensor], config) -> None:
    """Copy a TP=EP=1 ``state_dict`` (params and buffers) into a TP/EP-sharded model."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(local_slice(name, p, reference_state[full_name(name, config)], config))
        for name, b in model.named_buffers():
            if name in reference_state:
                b.copy_(reference_state[name])


def reference_grads(model) -> Dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------------------------------------
# Hyper-connection models (models.specs) and Megatron's document-resetting masks.
# ---------------------------------------------------------------------------------------------
def build_tiny_hc_gpt(config, hc, vocab_size: int = VOCAB, seq_len: int = SEQ, pre_process: bool = True,
                      post_process: bool = True, pg_collection=None):
    """``GPTModel`` from :func:`models.specs.get_hc_decoder_block_spec` (local backend), otherwise
    exactly :func:`build_tiny_gpt`.  ``pg_collection`` (optional) selects the pipeline stage by its
    ``pp`` group's rank, so one process can build every stage (see :class:`models.pipeline.StageGroup`)."""
    from models.specs import get_hc_decoder_block_spec

    pp_rank = pg_collection.pp.rank() if pg_collection is not None else None
    spec = get_hc_decoder_block_spec(config, hc, use_transformer_engine=False, pp_rank=pp_rank)
    if not getattr(config, "mtp_num_layers", None):
        return _tiny_gpt_model(config, spec, vocab_size, seq_len, pre_process, post_process, pg_collection)
    # multi-token prediction (models/mtp.py): the depths on the last stage, as models.zoo.build_model
    from models.mtp import finish_mtp_model, get_mtp_block_spec

    mtp_spec = get_mtp_block_spec(config, spec, hc, use_transformer_engine=False, pp_rank=pp_rank)
    model = _tiny_gpt_model(config, spec, vocab_size, seq_len, pre_process, post_process, pg_collection,
                            mtp_block_spec=mtp_spec)
    finish_mtp_model(model, hc)
    return model


def document_batch(batch: int, seq_len: int, eod: int, doc_starts, seed: int = 0):
    """Tokens with EOD tokens at fixed places, and Megatron's own document-resetting attention mask
    and position ids (``datasets.gpt_dataset._get_ltor_masks_and_position_ids`` with
    ``reset_attention_mask`` and ``reset_position_ids``).

    ``doc_starts[i]``: positions where a document starts in row i (the token before is EOD).
    Returns ``tokens, labels [b, s]``, ``mask [b, 1, s, s]`` (True = masked), ``position_ids [b, s]``.
    """
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    tokens, labels, _ = tiny_batch(batch, seq_len, seed)
    tokens = tokens.masked_fill(tokens == eod, eod + 1)
    masks, positions = [], []
    for i in range(batch):
        for start in doc_starts[i]:
            tokens[i, start - 1] = eod
        mask, _, pos = _get_ltor_masks_and_position_ids(tokens[i], eod, True, True, False, True)
        masks.append(mask)
        positions.append(pos)
    return tokens, labels, torch.stack(masks), torch.stack(positions)
