"""Run stock Megatron-Core on a CPU-only PyTorch build (gloo), for tests and the CPU training path.

Megatron-Core assumes CUDA in a handful of places that are not about GPU kernels at all: it
allocates small buffers on ``torch.cuda.current_device()``, keeps its dropout RNG streams in the
CUDA generator, and (0.16.x only) leaves a Transformer-Engine symbol unbound when TE is absent
(on CPU and GPU alike: :func:`bind_te_less_moe_names`, applied on import, patch 3 below).
:func:`enable_cpu_mode` redirects exactly those calls.  It is

- **a no-op when CUDA is available** (it returns ``False`` and touches nothing), so the GPU path
  is stock Megatron;
- **idempotent**, and undoable with :func:`disable_cpu_mode` (tests use this);
- **narrow**: each patch below says why it is needed and which Megatron versions need it
  (tested on 0.16.1 with Python 3.11 and on 0.19.2 with Python 3.12, see
  ``tools/compat_check.sh``).  Patches look attributes up with ``getattr`` and skip what a
  version does not have (feature detection, never version strings).

The patches:

1. ``torch.cuda.current_device`` returns ``torch.device("cpu")``.  Megatron passes it as the
   ``device=`` of buffers (router expert bias, rotary inv-freq, TP all-gather outputs, ...);
   on a CPU build the original raises "Torch not compiled with CUDA enabled".
   ``torch.cuda.synchronize`` becomes a no-op (dist_checkpointing's save path calls it
   unconditionally; CPU work is synchronous).  ``torch.cuda.current_stream`` returns
   ``torch.cpu.current_stream()``, whose ``wait_event`` / ``wait_stream`` are no-ops: since
   0.19.0 ``param_and_grad_buffer``'s ``start_grad_sync`` (reached from
   ``finalize_model_grads`` under Megatron's ``DistributedDataParallel``) always asks for the
   current CUDA stream, to wait for CUDA-graph gradient events that never exist on CPU.
2. Megatron's RNG tracker (``tensor_parallel.random``) gets a CPU backend:
   ``CudaRNGStatesTracker`` is replaced by :class:`CpuRNGStatesTracker`, whose named states are
   CPU generator states, so ``get_cuda_rng_tracker().fork()`` (attention dropout, expert init)
   and the stock ``model_parallel_cuda_manual_seed`` work unchanged; ``_get_cuda_rng_state`` /
   ``_set_cuda_rng_state`` read/write the CPU generator so activation recomputation
   (``tensor_parallel.checkpoint``, ``CheckpointWithoutOutput``) replays dropout masks exactly.
3. ``megatron.core.transformer.moe.moe_utils``: in 0.16.x the TE imports sit in one
   ``try/except ImportError`` and, without TE, ``te_general_gemm`` (and the ``fused_*`` router /
   permute kernels) are never bound, so the router's gating GEMM raises ``NameError``.  They are
   bound to ``None`` (0.17+ do exactly this themselves).  The condition is "Transformer Engine
   absent" (``moe_utils.HAVE_TE`` false), not "CUDA absent": a CUDA machine without TE (the
   project's GPU check image) hits the same ``NameError``.  So this one is not part of
   :func:`enable_cpu_mode`'s CPU-only patches: :func:`bind_te_less_moe_names` runs when this
   module is imported (``models.parallel`` imports it, so every trainer and check does), on CPU
   and GPU alike, and is not undone by :func:`disable_cpu_mode`.
4. ``transformer.utils.get_default_causal_mask`` / ``get_sliding_window_causal_mask`` (also
   imported by name into ``fusions.fused_softmax``) build the causal mask with ``device="cuda"``
   when the caller passes ``attention_mask=None``; CPU copies replace both names.

Configuration that CPU needs (no TE/apex fusions, no grouped GEMM, CPU initialisation, the
all-gather MoE dispatcher, ...) is returned by :func:`cpu_safe_overrides`; it is *config*, not a
patch.

With these patches, on CPU/gloo (tested in tests/test_megatron_cpu.py): GPTModel/MoE forward and
backward under TP+SP, EP, DP; activation recomputation; ``dist_checkpointing`` save/load
(``torch_dist``) with resharding; Megatron's ``DistributedDataParallel`` +
``finalize_model_grads``; ``P2PCommunicator`` (see :func:`models.pipeline.gpipe_forward_backward`).
Still CUDA-only, not patched: the pipeline schedules (``forward_backward_*`` allocate a
``device="cuda"`` token counter), the optimizer wrappers (``FP32Optimizer``,
``Float16OptimizerWithFloat16Params``, ``DistributedOptimizer``) and ``clip_grad_norm_fp32``
(``device='cuda'`` scalars), CUDA graphs, the alltoall/flex dispatchers, TE/apex modules.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Dict, List, Tuple

import torch
from megatron.core.tensor_parallel import random as _mrandom

__all__ = [
    "CpuRNGStatesTracker",
    "TE_ONLY_MOE_NAMES",
    "bind_te_less_moe_names",
    "cpu_mode_enabled",
    "cpu_safe_overrides",
    "disable_cpu_mode",
    "enable_cpu_mode",
]

# (owner object, attribute name, original value or _MISSING) for every patch applied, in order.
_PATCHES: List[Tuple[Any, str, Any]] = []
_MISSING = object()
_ENABLED = False


def _patch(owner: Any, name: str, value: Any) -> None:
    _PATCHES.append((owner, name, getattr(owner, name, _MISSING)))
    setattr(owner, name, value)


def _cpu_current_device() -> torch.device:
    """Stand-in for ``torch.cuda.current_device`` on CPU builds: the device is the CPU."""
    return torch.device("cpu")


def _cpu_synchronize(device: Any = None) -> None:
    """Stand-in for ``torch.cuda.synchronize`` on CPU builds: CPU ops are synchronous."""


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """CPU copy of ``transformer.utils.get_default_causal_mask``: True above the diagonal."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_sliding_window_causal_mask(sq: int, skv: int, window_size) -> torch.Tensor:
    """CPU copy of ``transformer.utils.get_sliding_window_causal_mask`` (True = masked)."""
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(mu, diagonal=skv - sq + window_size[1])


def _get_cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """CPU version of ``tensor_parallel.random._get_cuda_rng_state`` (same signature)."""
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """CPU version of ``tensor_parallel.random._set_cuda_rng_state`` (same signature)."""
    torch.set_rng_state(new_state)


class CpuRNGStatesTracker(_mrandom.CudaRNGStatesTracker):
    """Megatron's RNG-states tracker with CPU generator states.

    Same contract as ``CudaRNGStatesTracker``: ``add(name, seed)`` registers a stream,
    ``fork(name)`` swaps it into the (CPU) default generator for the duration of the block and
    stores the advanced state on exit, ``get_states``/``set_states`` save and restore the dict of
    states (activation recomputation).  Inside ``fork`` all CPU randomness (dropout) draws from
    the named stream, exactly as CUDA randomness does on GPU.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["use_cudagraphable_rng"] = False  # no CUDA graphs on CPU
        super().__init__(*args, **kwargs)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed)
        self.states_[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = _mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig_state = torch.get_rng_state()
        orig_name = self._current_state_name
        if orig_name != "default-rng":
            self.states_[orig_name] = orig_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            if self._current_state_name != name:
                raise Exception(
                    f"current state name {self._current_state_name} is not the same as the "
                    f"desired state name {name}."
                )
            self.states_[name] = torch.get_rng_state()
            if orig_name != "default-rng":
                orig_state = self.states_[orig_name]
            torch.set_rng_state(orig_state)
            self._current_state_name = orig_name


def _patch_streams() -> None:
    """Redirect ``torch.cuda.current_stream`` to the CPU stream (part of patch 1).

    ``torch.cpu.Stream`` has the ``wait_event`` / ``wait_stream`` methods Megatron calls, as
    no-ops: CPU work is synchronous, so there is nothing to wait for.
    """
    cpu_stream = getattr(getattr(torch, "cpu", None), "current_stream", None)
    if cpu_stream is not None:
        _patch(torch.cuda, "current_stream", cpu_stream)


# The names 0.16.x's moe_utils imports from Megatron's TE extension in one try/except ImportError.
TE_ONLY_MOE_NAMES = (
    "te_general_gemm",
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_permute",
    "fused_permute_and_pad_with_probs",
    "fused_permute_with_probs",
    "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function",
    "fused_unpermute",
)


def bind_te_less_moe_names(moe_utils: Any = None) -> List[str]:
    """Patch 3: where Megatron's ``moe_utils`` found no Transformer Engine (``HAVE_TE`` false),
    bind the TE-only names it left unbound to ``None``, as 0.17+ do themselves; Megatron then
    takes its torch paths (``if te_general_gemm is not None``, ``if not HAVE_TE or fused_x is
    None``).  Independent of CUDA; a no-op where TE imported or every name is bound (0.17+).
    Returns the names it bound.  ``moe_utils``: the module (default: Megatron's)."""
    if moe_utils is None:
        moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if getattr(moe_utils, "HAVE_TE", False):
        return []
    bound = [name for name in TE_ONLY_MOE_NAMES if not hasattr(moe_utils, name)]
    for name in bound:
        setattr(moe_utils, name, None)
    return bound


def cpu_mode_enabled() -> bool:
    """True while :func:`enable_cpu_mode`'s patches are installed."""
    return _ENABLED


def enable_cpu_mode() -> bool:
    """Install the CPU redirections (see the module docstring).  Returns True if CPU mode is active.

    Does nothing and returns False when ``torch.cuda.is_available()``.  Idempotent.  Call it
    before building a Megatron model (before ``model_parallel_cuda_manual_seed``; calling it
    later is fine too: an existing CUDA tracker is replaced by an empty CPU tracker, so re-seed).
    """
    global _ENABLED
    if torch.cuda.is_available():
        return False
    if _ENABLED:
        return True

    # 1. Buffers allocated on torch.cuda.current_device().
    _patch(torch.cuda, "current_device", _cpu_current_device)

    # 1b. torch.cuda.synchronize is called unconditionally by dist_checkpointing's save path
    #     (FileSystemWriterAsync.preload_tensors, fully_parallel / async_utils).  With no CUDA
    #     device there is nothing to synchronise.
    _patch(torch.cuda, "synchronize", _cpu_synchronize)

    # 1c. Streams (0.19+: DDP's grad sync waits on the current stream).
    _patch_streams()

    # 2. RNG tracker on CPU generator states.
    _patch(_mrandom, "CudaRNGStatesTracker", CpuRNGStatesTracker)
    _patch(_mrandom, "_get_cuda_rng_state", _get_cpu_rng_state)
    _patch(_mrandom, "_set_cuda_rng_state", _set_cpu_rng_state)
    tracker = getattr(_mrandom, "_CUDA_RNG_STATE_TRACKER", None)
    if tracker is not None and not isinstance(tracker, CpuRNGStatesTracker):
        # A CUDA tracker made before CPU mode cannot fork on CPU; replace it with an empty one.
        _patch(_mrandom, "_CUDA_RNG_STATE_TRACKER", CpuRNGStatesTracker())

    # 3. 0.16.x: TE-only names left unbound in moe_utils when TE is missing (also done at import,
    #    on CPU and GPU alike: bind_te_less_moe_names).
    bind_te_less_moe_names()

    # 4. The default causal / sliding-window masks (used by the unfused softmax when no
    #    attention_mask is passed) are built with device="cuda" (0.16.1-0.19.0).  fused_softmax
    #    imports them by name, so both module attributes are replaced.
    tutils = importlib.import_module("megatron.core.transformer.utils")
    fsoftmax = importlib.import_module("megatron.core.fusions.fused_softmax")
    for name, fn in (
        ("get_default_causal_mask", _cpu_default_causal_mask),
        ("get_sliding_window_causal_mask", _cpu_sliding_window_causal_mask),
    ):
        for mod in (tutils, fsoftmax):
            if hasattr(mod, name):
                _patch(mod, name, fn)

    # 5. Multi-token prediction under PP: LanguageModule.setup_embeddings_and_output_layer moves the
    #    last stage's embedding copy to CUDA (``weight.data.cuda()``) before the all-reduce that gives
    #    it the first stage's values.  On CPU the copy stays where it is.
    lm = importlib.import_module("megatron.core.models.common.language_module.language_module")
    original_setup = lm.LanguageModule.setup_embeddings_and_output_layer

    def _cpu_setup_embeddings_and_output_layer(self, *args: Any, **kwargs: Any):
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t
        try:
            return original_setup(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda

    _patch(lm.LanguageModule, "setup_embeddings_and_output_layer", _cpu_setup_embeddings_and_output_layer)

    _ENABLED = True
    return True


def disable_cpu_mode() -> None:
    """Undo every patch of :func:`enable_cpu_mode`, newest first (for tests)."""
    global _ENABLED
    while _PATCHES:
        owner, name, original = _PATCHES.pop()
        if original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    _ENABLED = False


def cpu_safe_overrides() -> Dict[str, Any]:
    """``TransformerConfig`` kwargs a Megatron model needs on CPU (checked on 0.16.1, CPU torch).

    Apply them last: ``TransformerConfig(**{**model_kwargs, **cpu_safe_overrides()})``.  None
    changes the model's maths.  Each entry was found by switching it back on and running a
    forward/backward of the tiny MoE GPT on CPU:

    =================================  ==========================================================
    ``use_cpu_initialization=True``    Not a crash fix: with it every TP rank builds the full
                                       fp32 master weight from the (TP-identical) default
                                       generator and keeps its slice, so initialisation does not
                                       depend on the TP size (the GPU path draws each shard from a
                                       per-TP-rank RNG stream).
    ``apply_rope_fusion=False``        "apply_rope_fusion is not available. Please install TE"
    ``gradient_accumulation_fusion``   needs apex's ``fused_weight_gradient_mlp_cuda``
    ``moe_grouped_gemm=False``         GroupedMLP needs the ``grouped_gemm`` CUDA package
    ``moe_token_dispatcher_type``      ``"alltoall"`` creates a ``torch.cuda.Stream``; ``"flex"``
    = ``"allgather"``                  needs DeepEP/HybridEP
    ``moe_router_fusion=False``        TE >= 2.6 fused top-k
    ``moe_permute_fusion=False``       TE >= 2.1 fused permutation
    ``moe_shared_expert_overlap``      CUDA side stream (and only with alltoall)
    ``cuda_graph_impl="none"``         CUDA graphs (the RNG tracker refuses them on CPU)
    ``fp8=None``                       TE only
    =================================  ==========================================================

    Work on CPU and are **not** overridden: ``bias_activation_fusion``, ``bias_dropout_fusion``,
    ``masked_softmax_fusion`` (falls back to torch softmax), ``persist_layer_norm`` (ignored by
    :mod:`models.norms`), ``cross_entropy_loss_fusion``, ``moe_router_dtype``, bf16, dropout,
    full/selective recomputation.  ``attention_backend`` is left alone too: with the local spec
    attention is always Megatron's ``DotProductAttention``, and every ``GPTModel`` writes the
    backend into ``NVTE_*_ATTN`` environment variables and asserts that they agree, so all models
    in one process must use the same backend (keep the default ``auto``).
    """
    overrides: Dict[str, Any] = {
        "use_cpu_initialization": True,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "moe_grouped_gemm": False,
        "moe_token_dispatcher_type": "allgather",
        "moe_router_fusion": False,
        "moe_permute_fusion": False,
        "moe_shared_expert_overlap": False,
        "cuda_graph_impl": "none",
        "enable_cuda_graph": False,
        "fp8": None,
    }
    from megatron.core.transformer import TransformerConfig

    fields = getattr(TransformerConfig, "__dataclass_fields__", {})
    return {k: v for k, v in overrides.items() if k in fields}


# Patch 3 on every path, CPU or GPU, as soon as the trainer's modules are imported.
bind_te_less_moe_names()
