"""Hugging Face integration: mHC as a parameter-efficient adapter on frozen causal LMs ([PEFT], docs/math.md §2.g).

Quick use::

    from models.hf import wrap_with_mhc, peft_paper_config, save_adapter, load_adapter
    model = AutoModelForCausalLM.from_pretrained(...)            # Llama, Mistral, Qwen2/3, OLMo-2
    wrap_with_mhc(model, peft_paper_config("identity", n=4))     # in place; backbone frozen
    ...train (forward / loss / generate unchanged)...
    save_adapter(model, "my_adapter")                            # safetensors + JSON config

Modules: :mod:`models.hf.mhc_adapter` (wrapper, save/load, parameter groups),
:mod:`models.hf.diagnostics` (pre-training checks), :mod:`models.hf.tiny` (tiny models and
tokenizers built in code, the OLMo-2 geometries for parameter counts).
"""

from models.hf.mhc_adapter import (
    FAMILIES,
    HCDecoderLayer,
    RoutingRecord,
    UnsupportedModelError,
    adapter_config,
    adapter_named_parameters,
    adapter_param_groups,
    count_adapter_parameters,
    hc_disabled,
    hc_layers,
    is_adapter_parameter,
    is_wrapped,
    load_adapter,
    mark_adapter_trainable,
    peft_paper_config,
    read_adapter_config,
    record_routing,
    save_adapter,
    trainable_parameter_report,
    unwrap_mhc,
    wrap_with_mhc,
)

__all__ = [
    "FAMILIES", "HCDecoderLayer", "RoutingRecord", "UnsupportedModelError", "adapter_config",
    "adapter_named_parameters", "adapter_param_groups", "count_adapter_parameters", "hc_disabled", "hc_layers",
    "is_adapter_parameter", "is_wrapped", "load_adapter", "mark_adapter_trainable", "peft_paper_config",
    "read_adapter_config", "record_routing", "save_adapter", "trainable_parameter_report", "unwrap_mhc",
    "wrap_with_mhc", "run_adapter_diagnostics",
]


def __getattr__(name):  # lazy: the diagnostics import xhc.diagnostics only when asked for
    if name == "run_adapter_diagnostics":
        from models.hf.diagnostics import run_adapter_diagnostics

        return run_adapter_diagnostics
    raise AttributeError(name)
