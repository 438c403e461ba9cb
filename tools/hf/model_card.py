"""The model card (README.md) of an export, with the measured speed of its HC layers."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import List

import torch

from xhc.config import FLASH_FAMILY
from xhc.flash import XHCFlashLayer
from xhc.hyper_connection import HyperConnection
from xhc.xhc import XHCSublayer


def write_model_card(out_dir: str, preset, native: bool, info: dict, n_params: int, n_hc: int, dtype: str, src) -> None:
    hc = preset.hc
    variant = "none (vanilla)" if not hc.enabled else hc.variant
    shape = "" if not hc.enabled else f" N={hc.n}" + (f", k={hc.k}, m={hc.m}" if hc.is_xhc else "")
    b = preset.backbone

    def f(x):
        return "n/a" if x is None else (f"{x:.4f}" if isinstance(x, float) else str(x))

    load = ("AutoModelForCausalLM.from_pretrained(path)" if native
            else "AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)")
    lines = [
        "---", "library_name: transformers", "pipeline_tag: text-generation", "tags: [xhc, hyper-connections, moe]", "---",
        f"# {preset.name}", "",
        f"Exported by `xhc-convert to-hf` from `{src.checkpoint}`.", "",
        "| | |", "|---|---|",
        f"| preset | `{preset.name}` ({preset.description}) |",
        f"| hyper-connection variant | {variant}{shape} |",
        f"| architecture | {'`Glm4MoeForCausalLM` (native transformers)' if native else '`XHCMoeForCausalLM` (remote code, GLM-4.5-MoE layers + xhc hyper-connections)'} |",
        f"| layers / hidden / heads / KV groups | {b['num_layers']} / {b['hidden_size']} / {b['num_attention_heads']} / {b.get('num_query_groups')} |",
        f"| experts | {b.get('num_moe_experts')} routed top-{b.get('moe_router_topk')} + shared, {b.get('first_dense_layers', 0)} leading dense layer(s) |",
        f"| parameters | {n_params:,} (hyper-connection: {n_hc:,}) |",
        f"| weights dtype | {dtype} (hyper-connection tensors and the router in fp32) |",
        f"| training step | {f(info.get('step'))} |",
        f"| tokens seen | {f(info.get('tokens_seen'))} |",
        f"| final train loss | {f(info.get('train_loss'))} |",
        f"| final validation loss | {f(info.get('valid_loss'))} |",
        "", "## Use", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f"model = {load}", "tokenizer = AutoTokenizer.from_pretrained(path)", "```", "",
    ]
    if not native:
        lines += ["## Hyper-connection implementation", "",
                  "The remote code runs the hyper-connection maths with xhc's `eager` backend: the readable "
                  "reference functions, plain PyTorch, forward only (no Triton, no custom autograd; "
                  "`config.json` → `hc.kernels: eager`). Training used the same equations through fused ops, "
                  "so logits agree to fp32 round-off.", ""]
        lines += hc_speed_lines(preset)
    with open(os.path.join(out_dir, "README.md"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines))


def hc_speed_lines(preset, tokens: int = 128, reps: int = 3) -> List[str]:
    """Model-card lines: the measured time of one layer's hyper-connection read + write on the eager
    path this folder runs, beside the fused ops of the xhc package, forward only, on this machine's CPU.
    Built from a private generator inside ``fork_rng`` (the caller's RNG is untouched)."""
    import statistics

    C, hc = int(preset.backbone["hidden_size"]), preset.hc
    g = torch.Generator().manual_seed(0)
    X = torch.randn(tokens, 1, hc.n, C, generator=g)
    y = torch.randn(tokens, 1, C, generator=g)
    ms = {}
    for backend in ("eager", "compile"):
        cfg = dataclasses.replace(hc, kernels=backend)
        with torch.random.fork_rng(devices=[]):
            if hc.variant in FLASH_FAMILY:
                mod = XHCFlashLayer(cfg, C, layer_index=1)
            elif hc.is_xhc:
                mod = XHCSublayer(cfg, C, is_mlp=True, layer_index=1)
            else:
                mod = HyperConnection(cfg, C, layer_index=1)

        def run(mod=mod):
            with torch.inference_mode():
                if isinstance(mod, XHCFlashLayer):
                    st = mod.begin(X)
                    st = mod.attn_write(st, y + 0.0 * mod.attn_read(st), None)
                    mod.mlp_write(st, y + 0.0 * mod.mlp_read(st), None)
                else:
                    u, ctx = mod.read(X)
                    mod.write(X, y + 0.0 * u, ctx)

        run()  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            times.append(1e3 * (time.perf_counter() - t0))
        ms[backend] = statistics.median(times)
    what = "one layer (attention + MLP window)" if hc.variant in FLASH_FAMILY else "one sublayer"
    return [f"Speed, measured at export on this machine's CPU ({torch.get_num_threads()} threads), {what}'s "
            f"read + write for {tokens} tokens at C = {C}, N = {hc.n}, forward only, median of {reps}:", "",
            "| path | ms |", "|---|---|",
            f"| eager (this folder) | {ms['eager']:.2f} |",
            f"| fused ops (`kernels: compile`, the xhc package) | {ms['compile']:.2f} |", ""]
