"""Tiny Hugging Face models, tokenizers and configs built in code (tests, tools; nothing is downloaded).

- :func:`tiny_config`          a small random-init config for one of the wrappable families
- :func:`tiny_causal_lm`       ``tiny_config`` -> ``*ForCausalLM`` (seeded)
- :func:`char_tokenizer`       a character-level ``PreTrainedTokenizerFast`` with a chat template
- :func:`olmo2_1b_config`      the OLMo-2-0425-1B geometry ([PEFT] backbone), for meta-device counts
"""

from __future__ import annotations

import string
from typing import Iterable, Optional

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "olmo2")

# A plain role-tag template: every message is "<|role|>\n{content}<|end|>\n".
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<pad>", "<unk>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>")


def tiny_config(
    family: str = "llama",
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 256,
    initializer_range: float = 0.02,
    **overrides,
):
    """A small config of ``family`` (llama, mistral, qwen2, qwen3, olmo2); ``overrides`` go to the config."""
    from transformers import LlamaConfig, MistralConfig, Olmo2Config, Qwen2Config, Qwen3Config

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
               "olmo2": Olmo2Config}
    if family not in classes:
        raise ValueError(f"tiny_config(family={family!r}): allowed values are {', '.join(classes)}")
    kw = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings, initializer_range=initializer_range,
        pad_token_id=0, bos_token_id=None, eos_token_id=2, tie_word_embeddings=False,
    )
    if family in ("qwen3", "mistral"):
        kw["head_dim"] = hidden_size // num_heads
    kw.update(overrides)
    return classes[family](**kw)


def tiny_causal_lm(family: str = "llama", seed: int = 0, **config_kwargs):
    """A seeded random ``*ForCausalLM`` built from :func:`tiny_config` (fp32, eval mode, eager attention)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family, **config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    return model.eval()


def olmo2_1b_config():
    """OLMo-2-0425-1B ([PEFT] main backbone): 16 layers, C = 2048, untied 100,352-token vocabulary.

    The sizes are those of the published ``allenai/OLMo-2-0425-1B`` config; with an untied LM head the
    backbone has 1,484,916,736 parameters, which reproduces [PEFT] App. D.1 (384 parameters =
    0.00002586 % of the backbone) and Table 4 (one layer = 67.1M).
    """
    from transformers import Olmo2Config

    return Olmo2Config(
        vocab_size=100352, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096, rope_theta=500000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, pad_token_id=100277,
        bos_token_id=None, eos_token_id=100257,
    )


def olmo2_7b_config():
    """OLMo-2-1124-7B ([PEFT] scaling backbone): 32 layers, C = 4096."""
    from transformers import Olmo2Config

    return Olmo2Config(
        vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rope_theta=500000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=100277, bos_token_id=None,
        eos_token_id=100257,
    )


def char_tokenizer(extra_chars: Iterable[str] = (), chat_template: Optional[str] = CHAT_TEMPLATE):
    """A character-level fast tokenizer: special tokens, then printable ASCII (+ ``extra_chars``).

    Ids: ``<pad>`` 0, ``<unk>`` 1, ``<|end|>`` 2 (also EOS), role tags 3–5, then one id per character
    (vocabulary 103 for plain ASCII).  Built with the ``tokenizers`` library, no download.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = []
    for c in list(string.printable) + list(extra_chars):
        if c not in chars and c not in "\r\x0b\x0c":
            chars.append(c)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>", eos_token="<|end|>",
        additional_special_tokens=list(SPECIAL_TOKENS[3:]),
    )
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok
