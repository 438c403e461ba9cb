"""Megatron-Core transformer layer with hyper-connections (docs/math.md §1.7).

:class:`HyperConnectionTransformerLayer` is a ``TransformerLayer`` whose two residual adds
(``self_attn_bda`` and ``mlp_bda``) are replaced by an ``xhc`` hyper-connection::

    X       = expand(h)            if this is global layer 1      [s, b, C] -> [s, b, N, C]
            = h.view(s, b, N, C)   otherwise                      (between layers: [s, b, N·C])
    u, ctx  = attn_hc.read(X)                                     [s, b, C]
    y       = dropout(self_attention(input_layernorm(u)) + bias)  stock Megatron modules
    X       = attn_hc.write(X, y, ctx)
    u, ctx  = mlp_hc.read(X)
    y       = dropout(mlp(pre_mlp_layernorm(u)) + bias)           dense MLP or MoE, stock
    X       = mlp_hc.write(X, y, ctx, seq)                        seq: temporal conv layout (xHC)
    out     = reduce(X)  [s, b, C]  if this is the last layer, else X.view(s, b, N·C)

Norms, attention, the MoE router, dispatcher, shared experts and the aux loss are untouched and
only ever see ``[s, b, C]``.  The Flash variants drive one window module per layer (xHC-Flash) or
per two layers (Flash-4sub, whose routing state is carried from layer 2g to layer 2g+1).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.utils import make_viewless_tensor

from xhc.config import FLASH_FAMILY, HCConfig, HCConfigError
from xhc.hyper_connection import expand_streams, reduce_streams

# ------------------------------------------------------------------------------------------------
# The sequence layout seen by the temporal convolution (xHC only)
# ------------------------------------------------------------------------------------------------
_SEQ_OVERRIDE: contextvars.ContextVar = contextvars.ContextVar("xhc_sequence_context", default=None)


@contextlib.contextmanager
def sequence_context(seq):
    """Give every HC layer an explicit :class:`xhc.temporal.SequenceContext` for one forward pass
    (e.g. built from ``reset_position_ids`` position ids).  Without it, layers derive the document
    layout from the attention mask or ``packed_seq_params`` they receive, and the SP/CP layout from
    Megatron's parallel state.  A context with a process ``group`` but no ``exchange`` gets
    :data:`models.sequence.HALO_EXCHANGE` (the halo exchange over torch.distributed; ``xhc``
    itself never communicates)."""
    if seq is not None and seq.group is not None and seq.exchange is None:
        from models.sequence import HALO_EXCHANGE

        seq = dataclasses.replace(seq, exchange=HALO_EXCHANGE)
    token = _SEQ_OVERRIDE.set(seq)
    try:
        yield seq
    finally:
        _SEQ_OVERRIDE.reset(token)


@dataclass
class HCTransformerLayerSubmodules(TransformerLayerSubmodules):
    """Stock submodules plus the two hyper-connection slots (names as in upstream Megatron main).

    Each slot holds a class built as ``cls(hc_config, hidden_size, is_mlp=..., layer_index=ℓ)``,
    or ``None`` for a stock residual.
    """

    self_attention_hyper_connection: Optional[Union[ModuleSpec, type]] = None
    mlp_hyper_connection: Optional[Union[ModuleSpec, type]] = None


class HyperConnectionTransformerLayer(TransformerLayer):
    """A ``TransformerLayer`` whose residual connections are hyper-connections (docs/math.md §1.7).

    Args (beyond ``TransformerLayer``'s):
        hc_config: the model's :class:`~xhc.config.HCConfig` (given through the documented ``params``).
        hc_recompute: HC recompute (:class:`HCRecompute`); also settable later with
            :func:`set_hc_recompute`.  Independent of, and combinable with, Megatron's selective
            recompute (``recompute_modules``) of the norms and the MLP.
    """

    def __init__(self, config, submodules: HCTransformerLayerSubmodules, layer_number: int = 1,
                 hidden_dropout=None, hc_config: Optional[HCConfig] = None, hc_recompute: bool = False,
                 **kwargs):
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         hidden_dropout=hidden_dropout, **kwargs)
        if hc_config is None:
            raise HCConfigError("HyperConnectionTransformerLayer needs hc_config (pass it in the layer spec params)")
        from models.validation import validate_hc_transformer_config

        validate_hc_transformer_config(config, hc_config)
        self.hc_config = hc_config
        self.hc_enabled = hc_config.enabled
        self.hc_recompute = bool(hc_recompute)
        """HC recompute: keep only each sublayer's entry state X and branch output y for backward and
        regenerate every other tensor the HC ops saved by re-running them (:class:`HCRecompute`)."""
        C = config.hidden_size
        i = self.layer_number - 1  # global 0-based layer index
        self.is_first_hc_layer = i == 0
        self.is_last_hc_layer = self.layer_number == config.num_layers
        self.self_attention_hyper_connection = None
        self.mlp_hyper_connection = None
        if self.hc_enabled:
            if hc_config.variant in FLASH_FAMILY:
                self.self_attention_hyper_connection = _build_flash_part(hc_config, C, i, config)
            else:
                attn_cls = submodules.self_attention_hyper_connection
                mlp_cls = submodules.mlp_hyper_connection
                if attn_cls is None or mlp_cls is None:
                    raise HCConfigError(f"variant {hc_config.variant!r}: the layer spec has no hyper-connection "
                                        "slot classes (build specs with models.specs)")
                self.self_attention_hyper_connection = _build_hc(attn_cls, hc_config, C, False, 2 * i)
                self.mlp_hyper_connection = _build_hc(mlp_cls, hc_config, C, True, 2 * i + 1)
            self._driver = _make_driver(self)
            _mark_hc_parameters(self, config)
            if self.is_last_hc_layer:
                attach_stream_head(self, hc_config, C, config)
            # With multi-token prediction the last layer also hands its N streams to the MTP depths
            # (models/mtp.py): it returns cat(collapse(X), X) on the hidden axis.
            self.mtp_streams_out = self.is_last_hc_layer and bool(getattr(config, "mtp_num_layers", None))

    # --------------------------------------------------------------------------------------------
    def forward(self, hidden_states, attention_mask=None, context=None, context_mask=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, attention_bias=None,
                inference_context=None, packed_seq_params=None, sequence_len_offset=None, *,
                inference_params=None, **kwargs):
        if not self.hc_enabled:  # `disabled` / vanilla: the stock layer, bit for bit
            return super().forward(
                hidden_states, attention_mask=attention_mask, context=context, context_mask=context_mask,
                rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                attention_bias=attention_bias, inference_context=inference_context,
                packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
                inference_params=inference_params, **kwargs)
        if inference_context is None and inference_params is not None:
            inference_context = inference_params
        n, C = self.hc_config.n, self.config.hidden_size
        s, b = hidden_states.shape[0], hidden_states.shape[1]
        if self.is_first_hc_layer:
            if hidden_states.shape[-1] != C:
                raise ValueError(f"layer 1 expects the embedding [s, b, {C}], got {tuple(hidden_states.shape)}")
            X = expand_streams(hidden_states, n)  # [s, b, N, C]
        else:
            if hidden_states.shape[-1] != n * C:
                raise ValueError(
                    f"layer {self.layer_number} expects the N-stream state [s, b, {n}·{C}], got "
                    f"{tuple(hidden_states.shape)}: is the pipeline p2p shape patched (models.pipeline)?")
            X = hidden_states.view(s, b, n, C)
        seq = self._sequence_context(attention_mask, packed_seq_params, s, b)
        if (inference_context is not None and seq is not None and seq.decode_cache is None
                and self.hc_config.kernel_sizes):
            # KV-cache decoding feeds one new token per step: the temporal conv would lose its
            # κ_max − 1 rows of history and silently compute a different model.
            raise NotImplementedError(
                f"variant {self.hc_config.variant!r} under Megatron inference (inference_context): the temporal "
                "conv needs its decode cache; wrap generation in models.hc_layer.sequence_context("
                "SequenceContext(decode_cache={...})) or run full-sequence forwards without inference_context")

        drv = self._driver
        st = drv.begin(X, self.hc_recompute and torch.is_grad_enabled())

        # ---- attention sublayer ----
        u = drv.read(st, "attn")
        ln, ckpt = self._norm(self.input_layernorm, u, self.recompute_input_layernorm)
        self.input_layernorm_checkpoint = ckpt
        attn_out = self.self_attention(
            ln, attention_mask=attention_mask, inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
            attention_bias=attention_bias, packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset)
        if ckpt is not None:  # selective recompute: drop the norm output, recompute it in backward
            ckpt.discard_output_and_register_recompute(attn_out[0])
        drv.write(st, "attn", self._bias_dropout(attn_out), seq)

        # ---- MLP / MoE sublayer ----
        u = drv.read(st, "mlp")
        ln, ckpt = self._norm(self.pre_mlp_layernorm, u, self.recompute_pre_mlp_layernorm)
        self.pre_mlp_norm_checkpoint = ckpt
        mlp = functools.partial(self.mlp, **mlp_kwargs(self.mlp, kwargs.get("padding_mask"), packed_seq_params))
        if self.recompute_mlp:  # selective recompute of a dense MLP, as the stock layer does
            mlp_out = tensor_parallel.checkpoint(mlp, False, ln)
        else:
            mlp_out = mlp(ln)
        if ckpt is not None:
            ckpt.discard_output_and_register_recompute(mlp_out[0])
        drv.write(st, "mlp", self._bias_dropout(mlp_out), seq)
        X = drv.end(st)

        if self.is_last_hc_layer:
            out = apply_stream_head(self, X)
            if self.mtp_streams_out:
                out = torch.cat([out, X.reshape(s, b, n * C)], dim=-1)
        else:
            out = X.reshape(s, b, n * C)
        out = make_viewless_tensor(inp=out, requires_grad=out.requires_grad, keep_graph=True)
        return out, context

    def _norm(self, norm, u, recompute: bool):
        """The backbone norm, checkpointed without output under selective ``layernorm`` recompute
        (as the stock layer does).  ``fp8`` is passed as None unless FP8/FP4 is on: Megatron's
        ``CheckpointWithoutOutput()`` default (``fp8=False``) takes its FP8 branch (it tests
        ``fp8 is not None``), which needs Transformer Engine."""
        if not recompute:
            return norm(u), None
        ckpt = tensor_parallel.CheckpointWithoutOutput(fp8=True if (self.config.fp8 or self.config.fp4) else None)
        return ckpt.checkpoint(norm, u), ckpt

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Megatron's sharded state dict, with the hyper-connection tensors keyed per global layer.

        For blocks whose layers are homogeneous (no MoE layer pattern, e.g. a dense model) Megatron
        stacks every layer's tensor under one key with a layer axis.  HC layers are not homogeneous:
        the softmax readout and the learned head live only in the last layer and Flash-4sub alternates two module types,
        so a stacked key would have missing layer shards and the save fails.  The HC tensors are
        therefore always keyed ``<block>.layers.<global layer>.<name>`` (the block's non-homogeneous
        form); backbone tensors keep Megatron's keys, so vanilla checkpoints still line up.
        """
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        stack = (0, self.layer_number - 1, self.config.num_layers)
        offsets = tuple(tuple(o) for o in sharded_offsets)
        if not self.hc_enabled or stack not in offsets:
            return sd
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

        hc_prefixes = tuple(f"{prefix}{n}" for n in ("self_attention_hyper_connection.", "mlp_hyper_connection.",
                                                      "hc_readout_logits", "hc_head."))
        unstacked = super().sharded_state_dict(prefix, tuple(o for o in offsets if o != stack), metadata)
        hc = {k: v for k, v in unstacked.items() if k.startswith(hc_prefixes)}
        # The block later replaces "<block>.layers.<local>." by "<block>.layers."; inserting the
        # global index here makes the final key "<block>.layers.<global>.<name>".
        replace_prefix_for_sharding(hc, prefix, f"{prefix}{self.layer_number - 1}.")
        sd = {k: v for k, v in sd.items() if not k.startswith(hc_prefixes)}
        sd.update(hc)
        return sd

    def _bias_dropout(self, out_with_bias):
        """y = dropout(out + bias): Megatron's bias-dropout-add without the add (docs/math.md §1.3 #3)."""
        out, bias = out_with_bias
        if bias is not None:
            out = out + bias
        return F.dropout(out, p=self.hidden_dropout, training=self.training)

    def _sequence_context(self, attention_mask, packed_seq_params, s, b):
        """The temporal conv's view of the local rows: only needed by xHC MLP sublayers."""
        if not self.hc_config.is_xhc:
            return None
        override = _SEQ_OVERRIDE.get()
        if override is not None:
            return override
        from models.sequence import sequence_context_from_megatron

        return sequence_context_from_megatron(self.config, attention_mask, packed_seq_params, s, b,
                                              self.hc_config.conv_doc_reset)


def attach_stream_head(module: torch.nn.Module, hc: HCConfig, hidden_size: int, config) -> None:
    """The final collapse of the N streams (docs/math.md §1.6) as parameters of ``module``: nothing for
    ``sum`` / ``mean``, ``hc_readout_logits`` [N] for ``softmax``, ``hc_head`` (:class:`xhc.head.LearnedHead`,
    DeepSeek-V4's head) for ``learned``.  Used by the decoder's last layer and by every MTP depth."""
    if hc.reduction == "softmax":
        module.hc_readout_logits = torch.nn.Parameter(torch.zeros(hc.n))
        _mark_param(module.hc_readout_logits, config)
    elif hc.reduction == "learned":
        from xhc.head import LearnedHead

        module.hc_head = LearnedHead(hc, hidden_size)
        for p in module.hc_head.parameters():
            _mark_param(p, config)


def apply_stream_head(module: torch.nn.Module, X: torch.Tensor) -> torch.Tensor:
    """``[..., N, C]`` -> ``[..., C]`` by the head :func:`attach_stream_head` gave ``module``."""
    hc = module.hc_config
    if hc.reduction == "learned":
        return module.hc_head(X)
    return reduce_streams(X, hc.reduction, getattr(module, "hc_readout_logits", None))


@functools.lru_cache(maxsize=None)
def _forward_takes(cls: type, name: str) -> bool:
    import inspect

    return name in inspect.signature(cls.forward).parameters


def mlp_kwargs(mlp, padding_mask, packed_seq_params) -> dict:
    """Keyword arguments of the MLP / MoE call, as the stock layer's ``_forward_mlp`` passes them.

    Megatron 0.19 also passes ``packed_seq_params`` (its MoE layer reads the THD layout of packed
    batches); 0.16.1's MLP does not take it.  Feature-detected from the ``forward`` signature."""
    kw = {"padding_mask": padding_mask}
    if packed_seq_params is not None and _forward_takes(type(mlp), "packed_seq_params"):
        kw["packed_seq_params"] = packed_seq_params
    return kw


def _build_hc(cls_or_spec, hc_config: HCConfig, hidden_size: int, is_mlp: bool, layer_index: int):
    cls = cls_or_spec.module if isinstance(cls_or_spec, ModuleSpec) else cls_or_spec
    params = dict(cls_or_spec.params) if isinstance(cls_or_spec, ModuleSpec) else {}
    import inspect

    sig = inspect.signature(cls.__init__).parameters
    kw = dict(params)
    if "is_mlp" in sig:
        kw["is_mlp"] = is_mlp
    return cls(hc_config, hidden_size, layer_index=layer_index, **kw)


def _mark_param(p: torch.nn.Parameter, config) -> None:
    """HC parameters are replicated across TP.  With sequence parallelism every TP rank sees other
    tokens, so their gradients must be all-reduced over TP: Megatron does that for parameters
    tagged ``sequence_parallel`` (docs/math.md §1.7).  ``is_hyper_connection`` routes them to AdamW under
    Muon and lets loggers find them."""
    p.sequence_parallel = bool(config.sequence_parallel)
    p.is_hyper_connection = True


def _mark_hc_parameters(layer, config) -> None:
    for mod in (layer.self_attention_hyper_connection, layer.mlp_hyper_connection):
        if mod is not None:
            for p in mod.parameters():
                _mark_param(p, config)


# ------------------------------------------------------------------------------------------------
# Drivers: one uniform begin/read/write/end over the three shapes of HC module
# ------------------------------------------------------------------------------------------------
def _build_flash_part(hc: HCConfig, C: int, i: int, config):
    """xHC-Flash: one window per layer.  Flash-4sub: layers (2g, 2g+1) share a window; a final odd
    layer falls back to Flash (docs/math.md §4.3, §8 #25).  ``layer_index`` is the layer index i here."""
    from xhc.flash import Flash4FirstLayer, Flash4SecondLayer, XHCFlashLayer

    if hc.variant == "xhc_flash":
        return XHCFlashLayer(hc, C, layer_index=i)
    if i % 2 == 1:
        return Flash4SecondLayer(hc, C, layer_index=i)
    if i + 1 < config.num_layers:
        return Flash4FirstLayer(hc, C, layer_index=i)
    return XHCFlashLayer(hc, C, layer_index=i)


class HCRecompute:
    """HC recompute: the HC ops of one region keep only the region's inputs for backward.

    A region is one sublayer (HC / mHC family / xHC: ``read`` then ``write``), one xHC-Flash layer or
    one Flash-4sub window.  Its HC calls run under a ``saved_tensors_hooks`` pair: a tensor autograd
    saves is kept only if it shares storage with a region input (the entry state X, the branch
    outputs y) or an HC parameter — memory that exists anyway; every other saved tensor is dropped.
    The branch between the calls (attention, MLP/MoE, norms) runs outside the hooks and saves as
    usual.  In backward, the first unpack of a dropped tensor re-runs the region's HC calls from the
    detached inputs (with the forward's RNG states restored) and takes the tensors saved there, in
    the same order.  The autograd graph is the forward's own, so gradients are bit-identical to no
    recompute (``tests/test_hc_recompute.py``).  Saved per sublayer: X + y (the mHC paper's recompute).
    """

    def __init__(self, params=()):
        # Hooks active around the region (a memory counter, CPU offloading): what the region keeps
        # goes through them, so an outer saved_tensors_hooks sees exactly the region's inputs.
        self._outer = _outer_saved_tensors_hooks()
        self._free = {p.untyped_storage().data_ptr() for p in params}
        self._inputs: list = []      # tensors kept by reference: X, y_1, y_2, ...
        self._calls: list = []       # (fn, arg specs, rng state) in forward order
        self._results: dict = {}     # id(object) -> (weakref or object, spec) of inputs / call results
        self._kept: dict = {}        # pack index -> tensor kept (shares storage with an input / param)
        self._n_packed = 0
        self._replayed: Optional[list] = None
        self._unpacked = 0

    # ---- forward -----------------------------------------------------------------------------
    def params_from(self, module: torch.nn.Module) -> None:
        """Also treat ``module``'s parameters as free to keep (Flash-4sub's second layer)."""
        self._free.update(p.untyped_storage().data_ptr() for p in module.parameters())

    def add_input(self, t: torch.Tensor) -> None:
        """Register a tensor the region keeps (its storage is then free to keep)."""
        self._register(t, ("in", len(self._inputs)))
        self._inputs.append(t)
        self._free.add(t.untyped_storage().data_ptr())
        if self._outer is not None:
            self._outer[0](t)  # announce the kept input; the region holds the tensor itself

    def _register(self, obj, spec) -> None:
        try:  # weak: the region must not keep forward results (the HC context, the new state) alive
            self._results[id(obj)] = (weakref.ref(obj), spec)
        except TypeError:  # None, tuples: not referable later anyway
            pass

    def _spec(self, a):
        hit = self._results.get(id(a))
        if hit is not None and hit[0]() is a:
            return hit[1]
        return ("const", a)

    def call(self, fn, *args):
        """``fn(*args)`` with its saved tensors managed by the region; returns its result."""
        specs = tuple(self._spec(a) for a in args)
        rng = _rng_state(self._inputs[0].device if self._inputs else None)
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            out = fn(*args)
        i = len(self._calls)
        self._calls.append((fn, specs, rng))
        self._register(out, ("res", i, None))
        if isinstance(out, tuple):
            for j, o in enumerate(out):
                self._register(o, ("res", i, j))
        return out

    def _pack(self, t: torch.Tensor):
        i = self._n_packed
        self._n_packed += 1
        try:
            free = t.untyped_storage().data_ptr() in self._free
        except (RuntimeError, NotImplementedError):
            free = False
        if free:
            self._kept[i] = t if self._outer is None else self._outer[0](t)
        return i

    # ---- backward ----------------------------------------------------------------------------
    def _unpack(self, i: int) -> torch.Tensor:
        if i in self._kept:
            return self._kept[i] if self._outer is None else self._outer[1](self._kept[i])
        if self._replayed is None:
            self._replay()
        t = self._replayed[i]
        self._unpacked += 1
        if self._unpacked >= self._n_packed - len(self._kept):
            self._replayed, self._unpacked = None, 0  # all handed out: free them (a retained graph replays again)
        return t

    def _replay(self) -> None:
        saved: list = []
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in self._inputs]
        results: list = []

        def resolve(spec):
            if spec[0] == "in":
                return inputs[spec[1]]
            if spec[0] == "res":
                r = results[spec[1]]
                return r if spec[2] is None else r[spec[2]]
            return spec[1]

        devices = [t.device for t in self._inputs if t.device.type == "cuda"][:1]
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t), lambda h: None):
            _REPLAYING[0] += 1
            try:
                for fn, specs, rng in self._calls:
                    _set_rng_state(rng)
                    results.append(fn(*(resolve(s) for s in specs)))
            finally:
                _REPLAYING[0] -= 1
        if len(saved) != self._n_packed:
            raise RuntimeError(f"HC recompute: the replay saved {len(saved)} tensors, the forward {self._n_packed} "
                               "(the HC ops must be deterministic in what they save); set hc_recompute: false")
        self._replayed = saved


_REPLAYING = [0]


def hc_replaying() -> bool:
    """True while an :class:`HCRecompute` region re-runs its HC calls in backward (loggers that
    wrap HC methods use it to skip the replay)."""
    return _REPLAYING[0] > 0


def _outer_saved_tensors_hooks():
    """The innermost ``saved_tensors_hooks`` (pack, unpack) pair active now, or None."""
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(True)
    except (AttributeError, RuntimeError):  # private API: without it the region just keeps its tensors
        return None


def _rng_state(device):
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device is not None and device.type == "cuda" else None
    return cpu, cuda, device


def _set_rng_state(state) -> None:
    cpu, cuda, device = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def set_hc_recompute(model: torch.nn.Module, enabled: bool = True) -> int:
    """Switch HC recompute on or off in every HC layer of ``model``; returns the number of layers."""
    count = 0
    for mod in model.modules():
        if isinstance(mod, HyperConnectionTransformerLayer):
            mod.hc_recompute = bool(enabled)
            count += 1
    return count


def compile_hc_modules(model: torch.nn.Module, fullgraph: bool = False, **compile_kwargs) -> int:
    """Wrap the HC methods (``read``/``write``, Flash ``begin``/``attn_*``/``mlp_*``) of every HC
    module of ``model`` in ``torch.compile`` by :func:`xhc.kernels.compile_module` (the one owner of
    how HC code is compiled: methods, inductor options, dynamo cache sizes): the ``compile`` kernel
    backend's fused ops then run as inductor kernels while the backbone (attention, MoE dispatch)
    stays eager.  Returns the number of modules wrapped.  ``fullgraph=True`` turns a graph break
    into an error."""
    from xhc.kernels import check_compile_enabled, compile_module

    check_compile_enabled()
    count = 0
    for layer in model.modules():
        if not isinstance(layer, HyperConnectionTransformerLayer) or not layer.hc_enabled:
            continue
        for mod in (layer.self_attention_hyper_connection, layer.mlp_hyper_connection):
            if mod is not None and compile_module(mod, fullgraph, **compile_kwargs):
                count += 1
    return count


def _hc_params(*mods):
    return [p for m in mods if m is not None for p in m.parameters()]


class _PairDriver:
    """HC / mHC family / xHC: one module per sublayer with ``read``/``write``."""

    def __init__(self, layer):
        self.mods = {"attn": layer.self_attention_hyper_connection, "mlp": layer.mlp_hyper_connection}

    def begin(self, X, recompute: bool = False):
        return {"X": X, "recompute": recompute}

    def read(self, st, which):
        mod = self.mods[which]
        if st["recompute"]:  # one region per sublayer: inputs X (here) and y (at the write)
            rc = st["rc"] = HCRecompute(_hc_params(mod))
            rc.add_input(st["X"])
            u, st["ctx"] = rc.call(mod.read, st["X"])
            return u
        u, st["ctx"] = mod.read(st["X"])
        return u

    def write(self, st, which, y, seq):
        mod = self.mods[which]
        if st["recompute"]:
            rc = st.pop("rc")
            rc.add_input(y)
            st["X"] = rc.call(mod.write, st["X"], y, st.pop("ctx"), seq)
            return
        st["X"] = mod.write(st["X"], y, st.pop("ctx"), seq)

    def end(self, st):
        return st["X"]


class _FlashDriver:
    """xHC-Flash (and Flash-4sub's window halves): a window module driven one sublayer at a time.

    Under HC recompute the whole window is one region (inputs: the window-entry state and the
    branch outputs), carried from layer 2g to 2g+1 with the Flash-4sub state."""

    # Flash-4sub state carried from layer 2g to 2g+1, keyed by (config identity, window index).
    # A window never crosses a pipeline stage, so the two layers run back to back on this rank.
    _carry: dict = {}

    def __init__(self, layer):
        self.mod = layer.self_attention_hyper_connection
        self.kind = type(self.mod).__name__
        self.key = (id(layer.config), (layer.layer_number - 1) // 2)

    def _call(self, st, fn, *args):
        rc = st.get("rc")
        return fn(*args) if rc is None else rc.call(fn, *args)

    def begin(self, X, recompute: bool = False):
        if self.kind == "Flash4SecondLayer":
            carried = self._carry.pop(self.key, None)
            st, rc = carried if carried is not None else (None, None)
            if st is None or st.X0.data_ptr() != X.data_ptr():
                raise RuntimeError(
                    "Flash-4sub: layer 2g+1 did not receive the window state of layer 2g (the two layers of a "
                    "window must run back to back on one rank; full-layer recompute is not supported)")
            if rc is not None:
                rc.params_from(self.mod)
            return {"st": st, "rc": rc}
        rc = None
        if recompute:
            rc = HCRecompute(_hc_params(self.mod))
            rc.add_input(X)
        return {"st": self._call({"rc": rc}, self.mod.begin, X), "X0": X, "rc": rc}

    def read(self, st, which):
        return self._call(st, self.mod.attn_read if which == "attn" else self.mod.mlp_read, st["st"])

    def write(self, st, which, y, seq):
        fn = self.mod.attn_write if which == "attn" else self.mod.mlp_write
        if st.get("rc") is not None:
            st["rc"].add_input(y)
        st["st"] = self._call(st, fn, st["st"], y, seq)

    def end(self, st):
        if self.kind == "Flash4FirstLayer":
            self._carry[self.key] = (st["st"], st.get("rc"))
            return st["X0"]  # the state is unchanged until the window's single scatter in layer 2g+1
        return st["st"]


def _make_driver(layer):
    if layer.hc_config.variant in FLASH_FAMILY:
        return _FlashDriver(layer)
    return _PairDriver(layer)
