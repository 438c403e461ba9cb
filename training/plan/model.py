"""Plan a run before launching it: memory per rank and step time for a config, a GPU kind and a GPU count.

One function, :func:`make_plan`, serves ``python -m tools.plan`` and the block training prints at start-up
(:func:`plan_block`), so what a user plans is what every run checks (docs/planning.md).

Memory per rank, one pipeline stage at a time (the most loaded one is named):

- **weights, gradients, optimizer state** from a per-tensor inventory of the model
  (:func:`param_specs`: Megatron's local-spec names and shapes for the backbone, the real HC modules
  built on the meta device for the hyper connections), sharded by the layout (:func:`rank_tensors`:
  TP on the column/row dimension, routed experts over EP and expert-TP, layers over PP stages) and
  priced by the path the trainer takes (:func:`state_bytes`):

  ===========  ==========================================  =============================================
  path         weights / grads                              optimizer state
  ===========  ==========================================  =============================================
  CPU (torch)  fp32 params; fp32 ``.grad``                   AdamW m, v (8 B) + a 4 B step per tensor;
                                                             Muon momentum (4 B)
  GPU          bf16 backbone, fp32 HC params; fp32 main     AdamW distributed: (fp32 master of bf16 params
  (Megatron)   grads (``grad_reduce_in_fp32``)              4 B + m, v 8 B) / DP (experts / expert-DP);
                                                             Muon replicated: master 4 B + momentum 4 B,
                                                             Adam rest master + m, v; Muon sharded
                                                             (:func:`training.optim.shard_owners.assign_owners`)
  ===========  ==========================================  =============================================

- **activations** of one micro-batch per layer (:func:`activation_bytes`), backbone and HC apart, times
  the micro-batches in flight (1F1B: ``pp - stage`` on stage ``stage``; interleaved: Megatron's warm-up
  count), plus the logits and loss buffers on the last stage.

Time is a roofline per component (:func:`step_time`): GEMM FLOPs (``xhc.accounting``) at a GEMM
efficiency, HC memory traffic (``xhc.accounting.memory_traffic_summary``) at a fraction of HBM bandwidth,
TP / EP / DP / PP communication over link bandwidths, and the pipeline bubble.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["GPU", "GPUS", "Efficiencies", "Layout", "ParamSpec", "Plan", "PlanError", "activation_bytes",
           "layout_from_config", "make_plan", "param_specs", "plan_block", "rank_tensors", "state_bytes",
           "stage_layers"]

GIB = 2 ** 30




from training.plan.gpu_model import (PlanError, gpu_layer_saved_elements, gpu_time,  # noqa: E402
                                     megatron_grad_bytes, model_dims)
from training.plan.layout import (GPU, GPUS, SHARDED_MUON_DEFAULT, Efficiencies,  # noqa: E402,F401 (re-exported)
                                  Layout)




def planned_vocab(cfg, preset, tp: int) -> int:
    """The embedding rows training will use: ``tokenizer.padded_vocab_size``, else the tokenizer's vocabulary
    (the config's ``tokenizer.vocab_size`` for the default data and raw ids, the preset's otherwise) padded
    as Megatron does (training.builder)."""
    from training.config import pad_vocab_size

    t = cfg.tokenizer
    if t.padded_vocab_size is not None:
        return int(t.padded_vocab_size)
    vocab = t.vocab_size if (cfg.uses_default_data or t.type == "none" or cfg.data.mock) else preset.vocab_size
    return pad_vocab_size(int(vocab), t.make_vocab_size_divisible_by, tp)


def load_run_preset(cfg):
    """The preset training builds for ``cfg`` (backbone / HC overrides, HC defaults of the optimizer)."""
    import yaml

    from models.zoo import ZooError, load_preset
    from training.config import ConfigError
    from training.optim import hc_defaults_for_optimizer

    m = cfg.model
    try:
        preset = load_preset(m.preset, backbone_overrides=m.backbone_overrides(), hc_overrides=m.hc_overrides())
    except ZooError as e:
        raise ConfigError(f"config key model.preset: {e}") from None
    explicit = set(m.hc)
    try:
        with open(preset.source, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
        explicit |= set((data.get("variants") or {}).get(preset.name.rsplit(":", 1)[1]) or {})
    except (OSError, TypeError, AttributeError):
        pass
    preset.hc = hc_defaults_for_optimizer(preset.hc, cfg.optimizer.name, explicit)
    return preset


def layout_from_config(cfg, preset, gpus: int, gpu: bool = True, sharded_muon: Optional[bool] = None) -> Layout:
    """The :class:`Layout` training would run ``cfg`` with on ``gpus`` devices (``gpu``: the Megatron path)."""
    p, b, m = cfg.parallel, cfg.batch, cfg.model
    hc_rec = preset.hc_recompute if m.hc_recompute is None else bool(m.hc_recompute)
    bf16 = gpu and cfg.run.precision in ("auto", "bf16")
    return Layout(gpus=gpus, tp=p.tp, sp=p.sp, ep=p.ep, etp=p.etp, pp=p.pp, vpp=p.vpp, cp=p.cp,
                  micro_batch=b.micro_batch_size, global_batch=b.global_batch_size,
                  seq=int(b.seq_length or preset.seq_length), recompute=m.recompute, hc_recompute=bool(hc_rec),
                  optimizer=cfg.optimizer.name, distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
                  sharded_muon=sharded_muon, gpu=gpu, bf16=bf16, overlap_grad_reduce=p.overlap_grad_reduce,
                  overlap_param_gather=p.overlap_param_gather, grad_reduce_fp32=p.grad_reduce_in_fp32,
                  tp_comm_overlap=p.tp_comm_overlap, ep_overlap=p.ep_overlap,
                  dispatcher=preset.backbone.get("moe_token_dispatcher_type"),
                  te=m.use_transformer_engine is not False)


# ================================================================================================
# The parameter inventory
# ================================================================================================
@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor of the whole model (TP = EP = PP = 1): its Megatron name and full shape.

    ``layer``: 0-based decoder layer, or None (embedding, final norm, output layer); ``tp_dim``: the dimension
    TP splits (None: replicated); ``expert``: a routed expert's weight (split over EP and expert-TP);
    ``hc``: a hyper-connection parameter (fp32 under bf16, AdamW under Muon)."""

    name: str
    shape: Tuple[int, ...]
    layer: Optional[int] = None
    tp_dim: Optional[int] = None
    expert: bool = False
    hc: bool = False
    where: str = "layer"  # layer | embedding | output

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class _Stub:
    """Enough of a parameter for :func:`training.optim.classify_param` (dim and the HC tag)."""

    def __init__(self, spec: ParamSpec):
        self.is_hyper_connection = spec.hc
        self._dim = len(spec.shape)

    def dim(self) -> int:
        return self._dim


def _hc_layer_specs(hc, C: int, i: int, L: int) -> List[Tuple[str, Tuple[int, ...]]]:
    """(name, shape) of layer ``i``'s HC parameters: the real modules, built on the meta device."""
    import torch

    from models.hc_layer import _build_flash_part, _build_hc
    from models.specs import hc_sublayer_classes
    from xhc.config import FLASH_FAMILY

    out: List[Tuple[str, Tuple[int, ...]]] = []
    with torch.device("meta"):
        if hc.variant in FLASH_FAMILY:
            mods = {"self_attention_hyper_connection": _build_flash_part(hc, C, i, SimpleNamespace(num_layers=L))}
        else:
            attn_cls, mlp_cls = hc_sublayer_classes(hc)
            mods = {"self_attention_hyper_connection": _build_hc(attn_cls, hc, C, False, 2 * i),
                    "mlp_hyper_connection": _build_hc(mlp_cls, hc, C, True, 2 * i + 1)}
        for prefix, mod in mods.items():
            out += [(f"{prefix}.{n}", tuple(p.shape)) for n, p in mod.named_parameters()]
        if i == L - 1:
            if hc.reduction == "softmax":
                out.append(("hc_readout_logits", (hc.n,)))
            elif hc.reduction == "learned":
                from xhc.head import LearnedHead

                out += [(f"hc_head.{n}", tuple(p.shape)) for n, p in LearnedHead(hc, C).named_parameters()]
    return out


def param_specs(preset, vocab: int) -> List[ParamSpec]:
    """Every parameter tensor of ``preset``'s GPTModel (Megatron's local spec, SequentialMLP experts) with
    ``vocab`` embedding rows (already padded for the TP size; see :func:`planned_vocab`)."""
    b = preset.backbone
    L, C = preset.num_layers, preset.hidden_size
    heads = int(b["num_attention_heads"])
    groups = int(b.get("num_query_groups") or heads)
    d = int(b.get("kv_channels") or C // heads)
    E = int(b.get("num_moe_experts") or 0)
    dense_layers = int(b.get("first_dense_layers", 0)) if E else L
    F = int(b["ffn_hidden_size"])
    Fe = int(b.get("moe_ffn_hidden_size") or F)
    Fs = int(b.get("moe_shared_expert_intermediate_size") or 0)
    glu = 2 if b.get("gated_linear_unit", True) else 1
    if b.get("add_bias_linear"):
        raise PlanError("model.backbone.add_bias_linear: the planner counts bias-free linears (the zoo's); set it "
                        "to false")
    if b.get("mtp_num_layers"):
        raise PlanError("model.backbone.mtp_num_layers: the planner does not count multi-token prediction depths "
                        "yet; plan without them")
    specs = [ParamSpec("embedding.word_embeddings.weight", (vocab, C), tp_dim=0, where="embedding")]
    hc = preset.hc
    for i in range(L):
        pre = f"decoder.layers.{i}."
        lay = [ParamSpec(pre + "input_layernorm.weight", (C,), i),
               ParamSpec(pre + "self_attention.linear_proj.weight", (C, heads * d), i, tp_dim=1),
               ParamSpec(pre + "self_attention.linear_qkv.weight", ((heads + 2 * groups) * d, C), i, tp_dim=0)]
        if b.get("qk_layernorm"):
            lay += [ParamSpec(pre + "self_attention.q_layernorm.weight", (d,), i),
                    ParamSpec(pre + "self_attention.k_layernorm.weight", (d,), i)]
        lay.append(ParamSpec(pre + "pre_mlp_layernorm.weight", (C,), i))
        if i < dense_layers:
            lay += [ParamSpec(pre + "mlp.linear_fc1.weight", (glu * F, C), i, tp_dim=0),
                    ParamSpec(pre + "mlp.linear_fc2.weight", (C, F), i, tp_dim=1)]
        else:
            lay.append(ParamSpec(pre + "mlp.router.weight", (E, C), i))
            for e in range(E):
                ex = f"{pre}mlp.experts.local_experts.{e}."
                lay += [ParamSpec(ex + "linear_fc1.weight", (glu * Fe, C), i, tp_dim=0, expert=True),
                        ParamSpec(ex + "linear_fc2.weight", (C, Fe), i, tp_dim=1, expert=True)]
            if Fs:
                lay += [ParamSpec(pre + "mlp.shared_experts.linear_fc1.weight", (glu * Fs, C), i, tp_dim=0),
                        ParamSpec(pre + "mlp.shared_experts.linear_fc2.weight", (C, Fs), i, tp_dim=1)]
        if hc.enabled:
            lay += [ParamSpec(pre + n, s, i, hc=True) for n, s in _hc_layer_specs(hc, C, i, L)]
        specs += lay
    specs.append(ParamSpec("decoder.final_layernorm.weight", (C,), where="output"))
    if b.get("untie_embeddings", True):
        specs.append(ParamSpec("output_layer.weight", (vocab, C), tp_dim=0, where="output"))
    return specs


def stage_layers(L: int, pp: int, vpp: Optional[int], stage: int) -> List[int]:
    """Decoder layers held by pipeline rank ``stage``: chunk ``i`` holds virtual stage ``i·pp + stage``
    (Megatron's interleaving), each of ``L / (pp·vpp)`` contiguous layers."""
    v = vpp or 1
    per = L // (pp * v)
    return [(i * pp + stage) * per + j for i in range(v) for j in range(per)]


def rank_tensors(specs: Sequence[ParamSpec], lay: Layout, stage: int) -> List[Tuple[ParamSpec, Tuple[int, ...]]]:
    """The tensors one rank of pipeline stage ``stage`` holds, with their local shapes."""
    L = 1 + max((s.layer for s in specs if s.layer is not None), default=-1)
    layers = set(stage_layers(L, lay.pp, lay.vpp, stage))
    first, last = stage == 0, stage == lay.pp - 1
    tied = not any(s.name == "output_layer.weight" for s in specs)
    E = len({s.name.split("local_experts.")[1].split(".")[0] for s in specs if s.expert}) if any(
        s.expert for s in specs) else 0
    out = []
    for s in specs:
        if s.where == "embedding":
            keep = first or (last and tied and lay.pp > 1)
        elif s.where == "output":
            keep = last
        else:
            keep = s.layer in layers
        if not keep:
            continue
        if s.expert:
            e = int(s.name.split("local_experts.")[1].split(".")[0])
            if E % lay.ep:
                raise PlanError(f"parallel.ep: {lay.ep} does not divide num_moe_experts={E}")
            if e >= E // lay.ep:  # every EP rank holds E/ep experts, renumbered 0 .. E/ep - 1
                continue
        shape = list(s.shape)
        split = lay.expert_tp if s.expert else lay.tp
        if s.tp_dim is not None and split > 1:
            if shape[s.tp_dim] % split:
                raise PlanError(f"parallel.tp: {split} does not divide {s.name}'s dimension {shape[s.tp_dim]}")
            shape[s.tp_dim] //= split
        out.append((s, tuple(shape)))
    return out


# ================================================================================================
# Weights, gradients, optimizer state
# ================================================================================================
@dataclass
class StateBytes:
    weights: int = 0
    grads: int = 0
    optimizer: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer


def _optimizer_of(spec: ParamSpec, optimizer: str) -> str:
    from training.optim import classify_param

    return classify_param(spec.name, _Stub(spec), optimizer).optimizer


def state_bytes(tensors: Sequence[Tuple[ParamSpec, Tuple[int, ...]]], lay: Layout, dp_rank: Optional[int] = None
                ) -> StateBytes:
    """Bytes of weights, gradients and optimizer state of one rank holding ``tensors`` (see the module
    docstring for the two paths).  ``dp_rank``: for sharded Muon, the rank of the DP group (None: the most
    loaded one)."""
    out = StateBytes()
    numel = [math.prod(shape) for _, shape in tensors]
    opt = [_optimizer_of(s, lay.optimizer) for s, _ in tensors]
    if not lay.gpu:  # torch backend: fp32 params, fp32 .grad, torch AdamW / our Muon states
        per = [4 * n if o == "muon" else 8 * n + 4 for n, o in zip(numel, opt)]  # Adam: exp_avg, exp_avg_sq, step
        out.weights = out.grads = 4 * sum(numel)
        # optimizer.use_distributed_optimizer=true shards either optimizer's state (training.optim.shards_state)
        sharded = bool(lay.distributed_optimizer) and max(lay.dp, lay.expert_dp) > 1
        out.optimizer = _owned_bytes(tensors, per, opt, lay, dp_rank) if sharded else sum(per)
        return out
    for (s, _), n in zip(tensors, numel):
        out.weights += n * (4 if (s.hc or not lay.bf16) else 2)
        out.grads += megatron_grad_bytes(lay) * n  # Megatron DDP's main-grad buffer (grad_reduce_in_fp32: fp32)
    master = [0 if (s.hc or not lay.bf16) else 4 for s, _ in tensors]  # fp32 master copy of a bf16 param
    if lay.uses_sharded_muon and lay.dp > 1:
        per = [n * (m + (4 if o == "muon" else 8)) for n, o, m in zip(numel, opt, master)]
        out.optimizer = _owned_bytes(tensors, per, opt, lay, dp_rank)
        return out
    dist_opt = lay.uses_distributed_optimizer
    for (s, _), n, o, m in zip(tensors, numel, opt, master):
        per = m + (4 if o == "muon" else 8)
        if dist_opt and o == "adamw":
            group = lay.expert_dp if s.expert else lay.dp * lay.cp
            out.optimizer += per * n / group
        else:
            out.optimizer += per * n
    out.optimizer = int(round(out.optimizer))
    return out


def _ns_shape(tensor: Tuple[ParamSpec, Tuple[int, ...]], lay: Layout) -> Tuple[int, ...]:
    """The matrix Newton–Schulz runs on for a rank's ``(spec, local shape)``: the TP-gathered one, as
    :func:`training.optim.param_shards.muon_matrix_shape` gives the optimizer (so both pick the same owners)."""
    spec, shape = tensor
    split = lay.expert_tp if spec.expert else lay.tp
    if spec.tp_dim is None or split == 1:
        return tuple(shape)
    return tuple(d * split if i == spec.tp_dim else d for i, d in enumerate(shape))


def _owned_bytes(tensors, per: Sequence[int], opt: Sequence[str], lay: Layout, dp_rank: Optional[int]) -> int:
    """Optimizer state sharded over data parallelism (issue #44; ``per``: each tensor's bytes of state and
    fp32 master): each tensor on one rank of its DP group (expert-DP for routed experts), chosen by
    :func:`training.optim.shard_owners.assign_owners` as :func:`training.optim.param_shards.shard_owner_ranks` chooses (Muon
    matrices by Newton–Schulz cost on the TP-gathered matrix, AdamW parameters by numel, two passes per
    group).  ``dp_rank``: the dense DP rank (TP rank 0) whose bytes to return; None: the fullest rank.
    Dense DP rank ``r`` is the stage's rank ``tp·cp·r``; Megatron orders the expert groups etp-ep-dp, so
    that rank's expert-DP rank is ``tp·cp·r // (etp·ep)``."""
    from training.optim import assign_owners, newton_schulz_cost

    loads = {False: [0] * lay.dp, True: [0] * lay.expert_dp}
    for expert in (False, True):
        size = lay.expert_dp if expert else lay.dp
        for kind in ("muon", "adamw"):
            idx = [i for i, (s, _) in enumerate(tensors) if s.expert == expert and opt[i] == kind]
            if not idx:
                continue
            costs = [newton_schulz_cost(_ns_shape(tensors[i], lay)) if kind == "muon" else math.prod(tensors[i][1])
                     for i in idx]
            for i, r in zip(idx, assign_owners(costs, size)):
                loads[expert][r] += per[i]
    rank = lambda r: loads[False][r] + loads[True][(lay.tp * lay.cp * r) // (lay.expert_tp * lay.ep)]  # noqa: E731
    if dp_rank is not None:
        return rank(dp_rank)
    return max(rank(r) for r in range(lay.dp))


# ================================================================================================
# Activations
# ================================================================================================
class SavedTensorMeter:
    """Bytes autograd saves for backward inside the block, counted once per unique storage
    (``torch.autograd.graph.saved_tensors_hooks``); storages in ``exclude`` (the parameters) are left out.
    The CPU measurement of activations: the tests compare the plan with it and training records it."""

    def __init__(self, exclude=()):
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.seen: Dict[int, int] = {}
        self._alive: List = []  # the counted storages, held so that no later tensor reuses an address
        self._ctx = None

    @property
    def bytes(self) -> int:
        return sum(self.seen.values())

    def _pack(self, t):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in self.exclude and key not in self.seen:
            self.seen[key] = st.nbytes()
            self._alive.append(t)
        return t

    def __enter__(self):
        import torch

        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        getattr(self, "_alive", []).clear()  # (LiveSavedMeter shares this exit and holds nothing)
        return False




def _hc_probe_bytes(hc, C: int, recompute: bool, layers: Tuple[int, ...], L: int, s: int, b: int = 2) -> int:
    """Bytes the real HC modules of ``layers`` save for backward on ``s·b`` tokens at width ``C`` (fp32, CPU),
    driven as the HC transformer layer drives them; the branch outputs are leaves."""
    import torch

    from models.hc_layer import _make_driver

    gen = torch.Generator().manual_seed(0)
    config = SimpleNamespace(num_layers=L, hidden_size=C)
    mods = {}
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for i in layers:
            built = _hc_layer_modules(hc, C, i, L)
            mods[i] = SimpleNamespace(hc_config=hc, config=config, layer_number=i + 1,
                                      self_attention_hyper_connection=built[0], mlp_hyper_connection=built[1])
    params = [p for m in mods.values() for mod in (m.self_attention_hyper_connection, m.mlp_hyper_connection)
              if mod is not None for p in mod.parameters()]
    X = torch.randn(s, b, hc.n, C, generator=gen, requires_grad=True)
    meter = SavedTensorMeter(exclude=params)
    with meter:
        for i in layers:
            drv = _make_driver(mods[i])
            st = drv.begin(X, recompute)
            for which in ("attn", "mlp"):
                u = drv.read(st, which)
                y = (torch.randn(u.shape, generator=gen) + 0 * u.detach()).requires_grad_(True)
                drv.write(st, which, y, None)
            X = drv.end(st)
    return meter.bytes


def _hc_layer_modules(hc, C: int, i: int, L: int):
    from models.hc_layer import _build_flash_part, _build_hc
    from models.specs import hc_sublayer_classes
    from xhc.config import FLASH_FAMILY

    if hc.variant in FLASH_FAMILY:
        return _build_flash_part(hc, C, i, SimpleNamespace(num_layers=L)), None
    attn_cls, mlp_cls = hc_sublayer_classes(hc)
    return _build_hc(attn_cls, hc, C, False, 2 * i), _build_hc(mlp_cls, hc, C, True, 2 * i + 1)


_HC_PROBE_CACHE: Dict[tuple, Tuple[float, float, float, float]] = {}
_PROBE_WIDTHS, _PROBE_SEQS = (16, 32), (8, 16)  # b = 2: 16 and 32 tokens


def hc_saved_elements(hc, C: int, tokens: int, recompute: bool) -> float:
    """Elements (4-byte units of the fp32 probe) the HC modules of one layer save for backward on ``tokens``
    tokens at width ``C``.

    Counted from the real modules (eager, the CPU path) at two widths and two token counts over a window of
    layers (two for Flash-4sub, one otherwise, away from the first and last layer).  The count is
    ``tokens · (a₁·C + a₀) + (c₁·C + c₀)``: every saved tensor is per token ([tokens, …, C] states and
    per-token coefficients) or weight-sized (casts and transposes of the HC weights, each ∝ C at fixed
    N, k, m), so the four probes give the count at any width and length."""
    if not hc.enabled:
        return 0.0
    layers = (2, 3) if hc.variant == "xhc_flash4" else (1,)
    key = (repr(hc), recompute)
    if key not in _HC_PROBE_CACHE:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = {(c, s): _hc_probe_bytes(hc, c, recompute, layers, 6, s) / 4 / len(layers)
                 for c in _PROBE_WIDTHS for s in _PROBE_SEQS}
        (c1, c2), (s1, s2) = _PROBE_WIDTHS, _PROBE_SEQS
        per_tok = {c: (m[c, s2] - m[c, s1]) / (2 * (s2 - s1)) for c in (c1, c2)}
        const = {c: m[c, s1] - 2 * s1 * per_tok[c] for c in (c1, c2)}
        a1 = (per_tok[c2] - per_tok[c1]) / (c2 - c1)
        k1 = (const[c2] - const[c1]) / (c2 - c1)
        _HC_PROBE_CACHE[key] = (a1, per_tok[c1] - a1 * c1, k1, const[c1] - k1 * c1)
    a1, a0, k1, k0 = _HC_PROBE_CACHE[key]
    return tokens * (a1 * C + a0) + max(0.0, k1 * C + k0)


@dataclass
class ActivationBytes:
    """Activations of one pipeline stage (bytes): one micro-batch per layer kind, and the stage's total with
    the micro-batches in flight."""

    backbone_per_micro: float = 0.0
    hc_per_micro: float = 0.0
    hc_state_per_micro: float = 0.0  # of hc_per_micro: the N-stream state at layer boundaries / sublayer entries
    logits_per_micro: float = 0.0
    in_flight: int = 1
    recompute_transient: float = 0.0  # full recompute: one layer's activations rebuilt during backward

    @property
    def per_micro(self) -> float:
        return self.backbone_per_micro + self.hc_per_micro + self.logits_per_micro

    @property
    def total(self) -> float:
        return self.in_flight * (self.backbone_per_micro + self.hc_per_micro) + self.logits_per_micro \
            + self.recompute_transient


def _dims(preset):
    """The backbone's dimensions (:func:`training.plan.gpu_model.model_dims`: refuses, in one line, a model the
    accounting cannot place; a preset without experts is dense in every layer)."""
    return model_dims(preset)


def backbone_saved_elements(preset, lay: Layout, layer: int, s: int, b: int) -> float:
    """Elements one layer of the backbone saves for backward on one micro-batch of ``b`` sequences of ``s``
    tokens on one TP rank (docs/planning.md, "Activations").

    Per token: the two RMSNorms save input, normalised input and 1/rms (2C + 1 each); the QKV GEMM its input
    (C); QK-norm, RoPE and the GQA expansion save q, k, v in their shapes; attention saves q, k, v and, on the
    CPU's unfused path, the softmax probabilities (a·s per token) and the causal mask (s² bytes per sequence;
    GPU: flash attention, q, k, v, output and the log-sum-exp); the output projection its input (a·d).  A
    dense SwiGLU MLP saves C + 3F, a MoE layer the router scores (2E), the K permuted copies of each token
    (C + 6·F_e + 1 each, the unpermute another K·C) and the shared expert (C + 5·F_s).  Head-split terms
    divide by TP, the sequence-parallel ones (norms, residual-side inputs) by TP under SP; ``selective``
    recompute drops core attention's tensors, ``full`` keeps the layer input only (see
    :func:`activation_bytes`)."""
    D = _dims(preset)
    if lay.gpu:  # what Megatron-Core / TE keep (training.plan.gpu_model); the CPU path below is autograd's
        return gpu_layer_saved_elements(D, lay, layer, s, b)
    tp = lay.tp
    etp = lay.expert_tp
    seq_split = tp if lay.sp else 1
    C, a, g, d = D.C, D.a, D.g, D.d
    norms = 2 * (2 * C + 1) / seq_split
    qkv_in = C / seq_split
    qk = ((2 * a * d + a) + ((a + 2 * g) * d + 2 * g * d + g) if D.qk_norm else (a + 2 * g) * d) / tp
    rope = 2 * g * d / tp
    proj_in = a * d / tp
    if lay.gpu:  # flash attention: q, k, v, output, log-sum-exp
        core = ((a + 2 * g) * d + a * d + a) / tp
    else:  # unfused: GQA-expanded q, k, v, softmax probabilities, the bool mask (s² bytes per sequence)
        core = (3 * a * d + a * s) / tp + s / 4 / b
    if lay.recompute == "selective":
        core = 0.0
    attn = norms + qkv_in + qk + rope + core + proj_in
    if layer < D.dense:
        mlp = C / seq_split + 3 * D.F / tp
    else:
        mlp = 2 * D.E + D.K * (C + (6 * D.Fe) / etp + 1) + D.K * C + (C / seq_split + 5 * D.Fs / tp if D.Fs else 0)
    return s * b * (attn + mlp)


def _in_flight(lay: Layout, stage: int) -> int:
    """Micro-batches whose activations a stage holds at its peak: GPipe on CPU (all of them), 1F1B on GPU
    (``pp - stage``), interleaved 1F1B per chunk (Megatron's warm-up ``2·(pp - stage - 1) + (vpp - 1)·pp``
    plus one, in chunk-micro-batches, divided by the chunks)."""
    m = lay.num_micro
    if lay.pp == 1:
        return 1
    if not lay.gpu:
        return m
    if lay.vpp:
        warm = min(2 * (lay.pp - stage - 1) + (lay.vpp - 1) * lay.pp + 1, m * lay.vpp)
        return max(1, math.ceil(warm / lay.vpp))
    return min(lay.pp - stage, m)


def activation_bytes(preset, lay: Layout, stage: int) -> ActivationBytes:
    """Activations of pipeline stage ``stage`` (bytes), backbone and HC apart (docs/planning.md)."""
    from xhc.config import FLASH_FAMILY

    s, b = lay.seq // lay.cp, lay.micro_batch
    L, C, hc = preset.num_layers, preset.hidden_size, preset.hc
    layers = stage_layers(L, lay.pp, lay.vpp, stage)
    elt = 2 if lay.bf16 else 4
    seq_split = lay.tp if lay.sp else 1
    out = ActivationBytes(in_flight=_in_flight(lay, stage))
    hc_tokens = s * b / seq_split  # HC ops run on the sequence-parallel shard of the state
    n = hc.n if hc.enabled else 1
    for i in layers:
        bb = backbone_saved_elements(preset, lay, i, s, b)
        h = hc_saved_elements(hc, C, hc_tokens, lay.hc_recompute) if hc.enabled else 0.0
        if lay.recompute == "full":  # uniform, one layer per checkpoint: the layer input only
            out.recompute_transient = max(out.recompute_transient, (bb + h) * elt)
            bb, h = (0.0, n * C * hc_tokens) if hc.enabled else (C * s * b / seq_split, 0.0)
        out.backbone_per_micro += bb * elt
        out.hc_per_micro += h * elt
        if hc.enabled:  # the N-stream state kept at each sublayer entry (pairs), window entry (Flash family)
            entries = (0.5 if hc.variant == "xhc_flash4" else 1.0) if hc.variant in FLASH_FAMILY else 2.0
            out.hc_state_per_micro += n * C * hc_tokens * elt * entries
    if stage == 0:
        out.backbone_per_micro += 8 * s * b  # token ids and positions (int64)
    if stage == lay.pp - 1:
        # final norm (2C + 1) and the output layer's input (C) per token; the logits and the loss's saved
        # softmax: fp32 V/tp per token (CPU), bf16 logits + fp32 softmax on GPU
        out.backbone_per_micro += (3 * C + 1) * s * b / seq_split * elt
        out.logits_per_micro = _vocab_rows(preset, lay) / lay.tp * s * b * (6 if lay.bf16 else 4) + 8 * s * b
    return out


def _vocab_rows(preset, lay: Layout) -> int:
    return lay.vocab or preset.vocab_size


# ================================================================================================
# Time (a roofline per component)
# ================================================================================================
@dataclass
class StepTime:
    """Seconds per optimizer step, by component (docs/planning.md, "Time").  On the GPU path the components are
    the slowest pipeline stage's (``gemm``: the GEMMs at their shapes' efficiency and the fp32 router;
    ``attention``: the fused attention; ``elementwise``: the memory-bound ops and the loss); the ``*_comm`` ones
    are what stays exposed after the overlaps, ``hidden`` what the overlaps hide."""

    gemm: float = 0.0
    hc_memory: float = 0.0
    tp_comm: float = 0.0
    ep_comm: float = 0.0
    cp_comm: float = 0.0
    dp_comm: float = 0.0
    pp_comm: float = 0.0
    bubble: float = 0.0
    overhead: float = 0.0
    flops_per_token: float = 0.0
    tokens: int = 0
    attention: float = 0.0
    elementwise: float = 0.0
    hc_flops: float = 0.0
    optimizer: float = 0.0
    hidden: Dict[str, float] = dataclasses.field(default_factory=dict)

    moe_overhead: float = 0.0

    COMPONENTS = ("gemm", "attention", "elementwise", "hc_flops", "hc_memory", "tp_comm", "ep_comm", "cp_comm",
                  "dp_comm", "pp_comm", "moe_overhead", "bubble", "optimizer", "overhead")

    @property
    def total(self) -> float:
        return sum(getattr(self, k) for k in self.COMPONENTS)


HC_TRAINING_TRAFFIC = 3.0
"""Training traffic of the HC ops as a multiple of the forward traffic ``xhc.accounting`` counts (backward
reads the forward's inputs and writes their gradients: about twice the forward)."""


HC_PERF_UNITS = {"mhc": ("moe-2p5b:mhc-n4", 1, "total"), "xhc-mlp": ("moe-2p5b:xhc-n16", 1, "mlp"),
                 "flash4": ("moe-2p5b:xhc-flash4", 4, "total")}
"""The units of ``python -m bench.hc_kernels --perf`` (its ``hc_perf.json``): the preset whose HC config gives the
accounted traffic, the sublayers of the unit, and which traffic (``mlp``: the xHC MLP sublayer's table)."""


def hbm_fraction_from_perf(perf: dict, gpu: GPU) -> float:
    """The HC streams' HBM fraction measured on a GPU: from ``bench.hc_kernels --perf``'s ``hc_perf.json`` (the
    forward + backward seconds of the mHC, xHC-MLP and Flash-4sub units), each unit's planned bytes (accounted
    forward traffic × :data:`HC_TRAINING_TRAFFIC` × C × tokens × 2 bytes, as :func:`step_time` plans them) over
    its seconds and ``gpu``'s HBM bandwidth; the geometric mean over the units, as docs/planning.md calibrates
    the default ``hbm`` on the H200 table.  ``tools.plan --hc-perf FILE`` plans with it."""
    from models.zoo import load_preset
    from xhc.accounting import memory_traffic_summary

    if "bfloat16" not in str(perf.get("dtype", "")):
        raise PlanError(f"--hc-perf: the table was measured in {perf.get('dtype')!r}; the planner's HC bytes are bf16 "
                        "(run bench.hc_kernels --perf with --dtype bf16)")
    C, tokens = int(perf["C"]), int(perf["tokens"])
    fracs = []
    for r in perf.get("rows", []):
        if r.get("what") != "unit" or r.get("variant") not in HC_PERF_UNITS or not r.get("seconds"):
            continue
        name, subl, part = HC_PERF_UNITS[r["variant"]]
        summ = memory_traffic_summary(load_preset(name).hc)
        per = summ.tables[1].read + summ.tables[1].write if part == "mlp" else summ.total
        nbytes = per * subl * C * tokens * 2 * HC_TRAINING_TRAFFIC
        fracs.append(nbytes / float(r["seconds"]) / (gpu.hbm_tbs * 1e12))
    if not fracs:
        raise PlanError("--hc-perf: no unit rows (mhc, xhc-mlp, flash4) in the table; give bench.hc_kernels --perf's "
                        "hc_perf.json")
    return math.prod(fracs) ** (1 / len(fracs))


def step_time(preset, lay: Layout, gpu: GPU, eff: Efficiencies, params_per_rank: float, vocab: int,
              stages: Optional[Sequence[Tuple[List[int], bool, bool, float, float]]] = None) -> StepTime:
    """Predicted seconds per step on ``lay.gpus`` GPUs of kind ``gpu`` (each component in docs/planning.md).

    ``stages``: per pipeline stage ``(layers, first, last, dense params, expert params)`` of one rank (default:
    the uniform split, with ``params_per_rank`` as dense parameters).  The FLOPs per token (the MFU numerator)
    are training's (``xhc.accounting`` via ``training.run.model_flops_per_token``); the time is
    :func:`training.plan.gpu_model.gpu_time` on the GEMM shapes, plus the HC terms below."""
    from training.run import model_flops_per_token
    from xhc.accounting import memory_traffic_summary

    D = _dims(preset)
    hc = preset.hc
    L, C = preset.num_layers, D.C
    out = StepTime(tokens=lay.global_batch * lay.seq)
    flops = model_flops_per_token(preset, lay.seq, vocab, "megatron", hc)
    out.flops_per_token = flops["total"]
    peak = gpu.bf16_tflops * 1e12
    # HC streams: forward traffic per sublayer (units of C elements per token), bf16, on the SP shard
    seq_split = lay.tp if lay.sp else 1
    tokens_rank = out.tokens / lay.dp / lay.cp / seq_split  # tokens one rank's HC ops touch per step
    layers_rank = L / lay.pp
    hc_seconds = 0.0
    if hc.enabled:
        try:
            per_sub = memory_traffic_summary(hc).total
        except ValueError:  # no published formula (e.g. Flash-4sub outside N = 16, k = 4): mHC's as a stand-in
            per_sub = 8 * hc.n + 2
        reps = HC_TRAINING_TRAFFIC + (1.0 if lay.hc_recompute else 0.0)
        hc_seconds = per_sub * C * 2 * reps * 2 * layers_rank * tokens_rank / (gpu.hbm_tbs * 1e12 * eff.hbm)
    # the HC maps' FLOPs (F_HC = 6·P_HC per token, on the SP shard; HC recompute: their forward again)
    hc_flops = flops["hc"] * (1 + (1 / 3 if lay.hc_recompute else 0)) * tokens_rank / lay.pp
    if stages is None:
        stages = [(stage_layers(L, lay.pp, lay.vpp, st), st == 0, st == lay.pp - 1, params_per_rank, 0.0)
                  for st in range(lay.pp)]
    comps = gpu_time(D, lay, gpu, eff, list(stages), hc_seconds, hc_flops / (peak * eff.gemm),
                     (hc.n if hc.enabled else 1) * C)
    out.gemm = comps["gemm"] + comps["router"]
    out.attention, out.elementwise = comps["attention"], comps["elementwise"]
    out.hc_memory, out.hc_flops = hc_seconds, hc_flops / (peak * eff.gemm)
    for k in ("tp_comm", "ep_comm", "cp_comm", "dp_comm", "pp_comm", "moe_overhead", "bubble", "optimizer"):
        setattr(out, k, comps[k])
    out.hidden = {k[:2]: comps[k] for k in ("tp_hidden", "ep_hidden", "dp_hidden") if comps.get(k)}
    out.overhead = eff.layer_overhead_ms * 1e-3 * 3 * layers_rank * lay.num_micro
    return out


# ================================================================================================
# The plan
# ================================================================================================
@dataclass
class StagePlan:
    stage: int
    state: StateBytes
    act: ActivationBytes
    params: int
    first: bool
    last: bool

    @property
    def total(self) -> float:
        return self.state.total + self.act.total

    def describe(self, pp: int) -> str:
        if pp == 1:
            return "the only pipeline stage (embedding and output layer)"
        what = "first, embedding" if self.first else "last, output layer and loss" if self.last else "middle"
        return f"pipeline stage {self.stage} of {pp} ({what})"


@dataclass
class Plan:
    name: str
    lay: Layout
    gpu: Optional[GPU]
    eff: Efficiencies
    stages: List[StagePlan]
    time: Optional[StepTime] = None
    hc_desc: str = ""

    @property
    def peak(self) -> StagePlan:
        """The most loaded rank's stage."""
        return max(self.stages, key=lambda s: s.total)

    @property
    def capacity(self) -> Optional[float]:
        return self.gpu.memory_bytes if self.gpu else None

    @property
    def fits(self) -> Optional[bool]:
        return None if self.capacity is None else self.peak.total <= self.capacity

    @property
    def tokens_per_s(self) -> Optional[float]:
        return None if self.time is None or not self.time.total else self.time.tokens / self.time.total

    @property
    def mfu(self) -> Optional[float]:
        if self.time is None or not self.time.total or self.gpu is None:
            return None
        return self.time.flops_per_token * self.tokens_per_s / (self.lay.gpus * self.gpu.bf16_tflops * 1e12)

    def to_dict(self) -> dict:
        pk = self.peak
        return {"preset": self.name, "layout": self.lay.describe(), "gpus": self.lay.gpus,
                "gpu": self.gpu.name if self.gpu else None, "peak_stage": pk.stage,
                "weights_gib": pk.state.weights / GIB, "grads_gib": pk.state.grads / GIB,
                "optimizer_gib": pk.state.optimizer / GIB, "activations_gib": pk.act.total / GIB,
                "activations_backbone_gib": pk.act.in_flight * pk.act.backbone_per_micro / GIB,
                "activations_hc_gib": pk.act.in_flight * pk.act.hc_per_micro / GIB,
                "logits_gib": pk.act.logits_per_micro / GIB, "in_flight": pk.act.in_flight,
                "total_gib": pk.total / GIB, "capacity_gib": None if self.capacity is None else self.capacity / GIB,
                "fits": self.fits, "step_s": None if self.time is None else self.time.total,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "tokens_per_s_per_gpu": None if self.tokens_per_s is None else self.tokens_per_s / self.lay.gpus,
                "headroom_gib": None if self.capacity is None else (self.capacity - pk.total) / GIB,
                "time_s": None if self.time is None else {k: getattr(self.time, k) for k in StepTime.COMPONENTS},
                "hidden_s": None if self.time is None else dict(self.time.hidden),
                "stages_gib": [s.total / GIB for s in self.stages]}

    def lines(self) -> List[str]:
        lay, pk = self.lay, self.peak
        g = lambda x: f"{x / GIB:8.3f} GiB"  # noqa: E731
        dev = f"{lay.gpus}x {self.gpu.name} ({self.gpu.memory_gb:g} GB)" if self.gpu else f"{lay.gpus}x cpu"
        out = [f"[plan] {self.name} ({self.hc_desc}) on {dev}: {lay.describe()}, seq {lay.seq}, "
               f"global batch {lay.global_batch} ({lay.num_micro} micro-batch{'es' if lay.num_micro > 1 else ''} per DP rank)",
               f"[plan] most loaded rank: {pk.describe(lay.pp)}"]
        if lay.gpu:
            wdesc = "bf16 backbone, fp32 HC" if lay.bf16 else "fp32"
            gdesc = "fp32 main grads" if lay.grad_reduce_fp32 else "bf16 main grads"
        else:
            wdesc, gdesc = "fp32", "fp32 .grad"
        # the torch backend (CPU) shards either optimizer's state with optimizer.use_distributed_optimizer=true
        # (training.optim.shards_state), as state_bytes plans it
        cpu_sharded = not lay.gpu and bool(lay.distributed_optimizer) and max(lay.dp, lay.expert_dp) > 1
        if cpu_sharded:
            odesc = (f"{'Muon + AdamW' if lay.optimizer == 'muon' else 'AdamW'}, state sharded over DP {lay.dp} / "
                     f"expert-DP {lay.expert_dp} (training.optim.shard_owners)")
        elif lay.optimizer == "muon":
            odesc = ("Muon sharded over DP (training.optim.shard_owners)" if lay.uses_sharded_muon and lay.dp > 1
                     else "Muon + AdamW, replicated")
        else:
            odesc = (f"AdamW, distributed over DP {lay.dp * lay.cp} / expert-DP {lay.expert_dp}"
                     if lay.uses_distributed_optimizer else "AdamW, replicated")
        a = pk.act
        out += [f"[plan]   weights      {g(pk.state.weights)}  ({pk.params / 1e6:.1f}M params, {wdesc})",
                f"[plan]   gradients    {g(pk.state.grads)}  ({gdesc})",
                f"[plan]   optimizer    {g(pk.state.optimizer)}  ({odesc})",
                f"[plan]   activations  {g(a.total)}  (backbone {a.in_flight * a.backbone_per_micro / GIB:.2f} + HC "
                f"{a.in_flight * a.hc_per_micro / GIB:.2f} [state {a.in_flight * a.hc_state_per_micro / GIB:.2f}] + "
                f"logits {a.logits_per_micro / GIB:.2f}"
                + (f" + recompute {a.recompute_transient / GIB:.2f}" if a.recompute_transient else "")
                + f"; {a.in_flight} micro-batch{'es' if a.in_flight > 1 else ''} in flight, HC recompute "
                f"{'on' if lay.hc_recompute else 'off'})"]
        if self.capacity is None:
            out.append(f"[plan]   total        {g(pk.total)}  (CPU: no device memory limit)")
        else:
            head = self.capacity - pk.total
            verdict = "fits" if head >= 0 else "DOES NOT FIT"
            out.append(f"[plan]   total        {g(pk.total)}  of {self.capacity / GIB:.1f} GiB: {verdict}, headroom "
                       f"{head / GIB:.2f} GiB ({head / self.capacity:.0%})")
        if len(self.stages) > 1:
            out.append("[plan]   per stage    " + ", ".join(f"{s.stage}: {s.total / GIB:.2f}" for s in self.stages)
                       + " GiB")
        if self.time is not None:
            t, e = self.time, self.eff
            parts = [(k, getattr(t, k)) for k in StepTime.COMPONENTS]
            out.append(f"[plan] time: {t.total:.3f} s/step = " + " + ".join(f"{k} {v:.3f}" for k, v in parts if v)
                       + f"; {self.tokens_per_s:,.0f} tokens/s ({self.tokens_per_s / lay.gpus:,.0f} per GPU), "
                       f"MFU {self.mfu:.1%}")
            if t.hidden:
                out.append("[plan] hidden by overlap: " + ", ".join(f"{k} {v:.3f} s" for k, v in t.hidden.items()))
            out.append(f"[plan] assumptions: GEMM {e.gemm:g} of peak at large shapes (roofline on intensity), "
                       f"attention {e.attn:g}, elementwise {e.elementwise:g} of HBM, HC {e.hbm:g} of HBM, links "
                       f"{e.link:g}, all-to-all {e.a2a:g} (DeepEP {e.deepep:g}), MoE imbalance {e.moe_imbalance:g}, "
                       f"overlaps TP {e.overlap_tp:g} EP {e.overlap_ep:g} DP {e.overlap_dp:g} PP {e.overlap_pp:g}, "
                       f"{e.moe_layer_overhead_ms:g} ms per MoE layer pass, {e.layer_overhead_ms:g} ms per layer per "
                       "micro-batch pass (docs/planning.md)")
        return out

    def format(self) -> str:
        return "\n".join(self.lines())


def hc_description(hc) -> str:
    if not hc.enabled:
        return "vanilla"
    return f"{hc.variant} N={hc.n}" + (f" k={hc.k} m={hc.m}" if hc.is_xhc else "")


_SPECS_CACHE: Dict[tuple, object] = {}


def make_plan(cfg, gpus: int, gpu: Optional[GPU], eff: Efficiencies = Efficiencies(), preset=None,
              sharded_muon: Optional[bool] = None, validate: bool = True) -> Plan:
    """The plan of ``cfg`` on ``gpus`` devices of kind ``gpu`` (None: the CPU path, no time, no capacity).

    Raises :class:`training.config.ConfigError` where training's validation would refuse the layout."""
    from training.config import validate_runtime

    preset = preset if preset is not None else load_run_preset(cfg)
    _dims(preset)  # a model the accounting cannot place is refused here, in one line
    if validate:
        validate_runtime(cfg, gpus, preset, cuda=gpu is not None)
    lay = layout_from_config(cfg, preset, gpus, gpu=gpu is not None, sharded_muon=sharded_muon)
    vocab = planned_vocab(cfg, preset, lay.tp)
    lay = dataclasses.replace(lay, vocab=vocab)
    pkey = (preset.name, repr(preset.hc), repr(sorted(preset.backbone.items())), vocab)
    if pkey not in _SPECS_CACHE:
        _SPECS_CACHE.clear()  # one model at a time (a search plans one preset under many layouts)
        _SPECS_CACHE[pkey] = param_specs(preset, vocab)
    specs = _SPECS_CACHE[pkey]
    stages, timing = [], []
    for st in range(lay.pp):
        tkey = (pkey, lay.tp, lay.expert_tp, lay.ep, lay.pp, lay.vpp, st)
        if tkey not in _SPECS_CACHE:
            _SPECS_CACHE[tkey] = rank_tensors(specs, lay, st)
        tensors = _SPECS_CACHE[tkey]
        skey = (tkey, lay.gpu, lay.bf16, lay.optimizer, lay.uses_distributed_optimizer, lay.uses_sharded_muon,
                lay.distributed_optimizer,  # the CPU path shards by it alone (state_bytes)
                lay.dp, lay.cp, lay.expert_dp, lay.grad_reduce_fp32)
        if skey not in _SPECS_CACHE:
            _SPECS_CACHE[skey] = (state_bytes(tensors, lay), sum(math.prod(sh) for _, sh in tensors),
                                  sum(math.prod(sh) for sp_, sh in tensors if sp_.expert))
        state, numel, expert_numel = _SPECS_CACHE[skey]
        stages.append(StagePlan(st, state, activation_bytes(preset, lay, st), numel, st == 0, st == lay.pp - 1))
        timing.append((stage_layers(preset.num_layers, lay.pp, lay.vpp, st), st == 0, st == lay.pp - 1,
                       numel - expert_numel, expert_numel))
    plan = Plan(preset.name, lay, gpu, eff, stages, hc_desc=hc_description(preset.hc))
    if gpu is not None:
        plan.time = step_time(preset, lay, gpu, eff, plan.peak.params, vocab, stages=timing)
    return plan


def plan_block(cfg, gpus: int, cuda: bool, gpu_name: Optional[str] = None) -> str:
    """The block training prints at start-up: :func:`make_plan` for this run (the device kind named by
    ``gpu_name``, e.g. ``torch.cuda.get_device_name()``; an unknown GPU is planned as an H100)."""
    return make_plan(cfg, gpus, _gpu_of(gpu_name) if cuda else None).format()


def _gpu_of(name: Optional[str]) -> GPU:
    key = next((k for k in GPUS if name and k in name.lower()), "h100")
    return GPUS[key]
