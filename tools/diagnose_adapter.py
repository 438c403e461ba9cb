"""Run the mHC adapter diagnostics ([PEFT] App. C.5, docs/math.md §2.g) on a wrapped Hugging Face model.

Examples::

    python -m tools.diagnose_adapter --tiny llama --variant kromhc --n 4
    python -m tools.diagnose_adapter --model /path/to/OLMo-2-0425-1B --variant identity --n 4
    python -m tools.diagnose_adapter --config configs/finetune/olmo2_1b_dynamic_kromhc_n4.yaml
    python -m tools.diagnose_adapter --tiny olmo2 --adapter runs/finetune/x/adapter   # a saved adapter

Prints one line per check (output shape, routing validity, frozen backbone, gradient flow, logits
equal to the backbone, sub-layer ≈ x + F(x), stream divergence after a short overfit) and exits
with status 1 if any check fails (2 on bad arguments).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

import torch

from xhc.config import MHC_FAMILY


def build(args):
    """(model, input_ids) for the arguments."""
    from transformers import AutoModelForCausalLM

    from models.hf.mhc_adapter import load_adapter, peft_paper_config, wrap_with_mhc
    from models.hf.tiny import tiny_causal_lm

    hc_cfg = None
    if args.config:
        from training.finetune import FinetuneConfig

        ft = FinetuneConfig.load(args.config)
        hc_cfg = ft.hc_config()
        if args.model is None and args.tiny is None:
            if ft.model.tiny is not None:
                t = dict(ft.model.tiny)
                args.tiny = t.pop("family", "llama")
            else:
                args.model = ft.model.name_or_path
    if args.tiny:
        model = tiny_causal_lm(args.tiny, seed=args.seed)
    elif args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    else:
        raise ValueError("give --tiny FAMILY, --model PATH or --config YAML")
    model.eval()
    if args.adapter:
        load_adapter(model, args.adapter)
    else:
        if hc_cfg is None:
            overrides = {}
            if args.no_noise:
                overrides["init_noise"] = 0.0
            hc_cfg = peft_paper_config(args.variant, args.n, not args.static, **overrides)
        elif args.no_noise:
            hc_cfg = hc_cfg.replace(init_noise=0.0)
        wrap_with_mhc(model, hc_cfg)
    g = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    input_ids = torch.randint(0, vocab, (args.batch, args.seq_len), generator=g)
    return model, input_ids


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.diagnose_adapter", description=__doc__.split("\n\n")[0])
    src = p.add_argument_group("model")
    src.add_argument("--tiny", choices=["llama", "mistral", "qwen2", "qwen3", "olmo2"],
                     help="a random tiny model of this family (no download)")
    src.add_argument("--model", help="a local model folder (or hub id where a network exists)")
    src.add_argument("--config", help="a finetune YAML (its model and hc sections)")
    src.add_argument("--adapter", help="load a saved adapter folder instead of a fresh init")
    hc = p.add_argument_group("adapter (ignored with --config/--adapter)")
    hc.add_argument("--variant", default="identity", choices=MHC_FAMILY)
    hc.add_argument("--n", type=int, default=4)
    hc.add_argument("--static", action="store_true", help="static coefficients (default dynamic)")
    hc.add_argument("--no-noise", action="store_true", help="init noise 0 (exact identity: tolerance 1e-5)")
    run = p.add_argument_group("run")
    run.add_argument("--batch", type=int, default=2)
    run.add_argument("--seq-len", type=int, default=32)
    run.add_argument("--overfit-steps", type=int, default=50)
    run.add_argument("--lr", type=float, default=1e-2, help="learning rate of the synthetic overfit")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--json", help="also write the report here")
    args = p.parse_args(argv)

    from models.hf.diagnostics import run_adapter_diagnostics
    from models.hf.mhc_adapter import adapter_config, trainable_parameter_report

    try:
        model, input_ids = build(args)
    except (ValueError, TypeError) as e:
        print(f"diagnose_adapter: {e}", file=sys.stderr)
        return 2
    cfg = adapter_config(model)
    params = trainable_parameter_report(model)
    print(f"{type(model).__name__}: variant={cfg.variant} n={cfg.n} dynamic={cfg.dynamic} preset={cfg.preset} "
          f"init_noise={cfg.init_noise} reduction={cfg.reduction}; adapter parameters {params['hc']:,} "
          f"({params['trainable_percent']:.4f}% of {params['total']:,})")
    rep = run_adapter_diagnostics(model, input_ids, overfit_steps=args.overfit_steps, overfit_lr=args.lr)
    print(rep.table())
    print("ALL PASS" if rep.ok else "FAILED")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"ok": rep.ok, "params": params, "checks": [c.__dict__ for c in rep.checks]}, f, indent=2)
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
