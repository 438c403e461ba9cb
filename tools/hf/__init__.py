"""The Hugging Face room: export a checkpoint to a ``transformers`` folder, import one back, upcycle.

``python -m tools.convert_checkpoint`` (or ``python -m tools.hf``, ``xhc-convert``) runs :func:`main`.
Modules: ``conversion`` (streaming ``to_hf``, ``from_hf``, upcycling), ``cli`` (the command),
``remote_code`` (the model code shipped in an export), ``model_card`` (its README), ``errors``.
"""

from __future__ import annotations

from training.rooms import lazy_exports

_EXPORTS = {
    "main": "cli",
    "build_single_rank_model": "conversion", "effective_preset": "conversion",
    "estimate_memory": "conversion", "from_hf": "conversion", "hf_config_kwargs": "conversion",
    "materialise": "conversion", "read_hf_config": "conversion", "read_hf_tensors": "conversion",
    "resolve_source": "conversion", "single_rank": "conversion", "Source": "conversion",
    "source_tokenizer": "conversion", "stream_checkpoint": "conversion", "to_hf": "conversion",
    "upcycle_init": "conversion", "upcycle_overrides": "conversion", "vocab_size_of": "conversion",
    "ConversionError": "errors",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
