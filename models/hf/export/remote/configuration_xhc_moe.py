"""Configuration of an xhc hyper-connection MoE model exported to Hugging Face ``transformers``.

The backbone fields are those of ``Glm4MoeConfig`` (GQA + QK-norm + RoPE + SwiGLU + sigmoid top-k
MoE with expert-bias + shared expert + leading dense layers); ``hc`` holds the hyper-connection
settings (the fields of ``HCConfig`` in ``config.py`` next to this file).
"""

from transformers.models.glm4_moe.configuration_glm4_moe import Glm4MoeConfig


class XHCMoeConfig(Glm4MoeConfig):
    model_type = "xhc_moe"

    def __init__(self, hc=None, **kwargs):
        self.hc = dict(hc or {})
        super().__init__(**kwargs)


__all__ = ["XHCMoeConfig"]
