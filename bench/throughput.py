"""Training throughput of zoo presets side by side: vanilla vs mHC vs xHC (tokens/s, ratios).

Run::

    python -m bench.throughput                          # tiny-moe: vanilla, mhc, xhc, xhc-flash, xhc-flash4 on CPU
    python -m bench.throughput --presets tiny-moe:vanilla,tiny-moe:xhc --seq 128 --micro-batch 8 --steps 10
    python -m bench.throughput --json out.json          # also write the table as JSON
    python -m bench.throughput --presets tiny-moe:vanilla,tiny-moe:mhc/n=8,tiny-moe:xhc-flash4 --backends eager,compile

Every model is built in the same process with the same seed, sees the same random batch and
takes full training steps (forward, backward, AdamW update).  After ``--warmup`` untimed steps
each, the models are timed in interleaved rounds (A B C, A B C, ...) so that drift in machine
load affects all of them alike; a model's time per step is the median over rounds of its mean
over ``--steps`` steps.  Ratios are tokens/s relative to the first preset (vanilla by default).
On CUDA the models run in bf16 with HC parameters in fp32 (as training does), without DDP.

``--backends``: one row per preset and HC kernel backend (``HCConfig.kernels``, docs/kernels.md):
``eager`` (reference ops), ``compile`` (fused ops, each HC module's methods under ``torch.compile``
via :func:`models.hc_layer.compile_hc_modules`; the backbone stays eager), ``triton`` (CUDA), or
``preset`` (the preset's own setting, uncompiled; the default).  A preset name may carry HC
overrides, ``tiny-moe:mhc/n=8`` (mHC at the N·C of the tiny xHC variants).  ``--hc-recompute`` turns HC
recompute on.  A vanilla preset has no HC code, so it gets one row whatever the backends.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from xhc.config import OP_BACKENDS

if __name__ in ("__main__", "__mp_main__") and not os.path.exists("/dev/nvidiactl") and "compile" not in " ".join(sys.argv):
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # no compile asked for: skip dynamo's start-up
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

DEFAULT_PRESETS = "tiny-moe:vanilla,tiny-moe:mhc,tiny-moe:xhc,tiny-moe:xhc-flash,tiny-moe:xhc-flash4"


def split_name(name: str, backend: str = "preset"):
    """``file:variant[/key=value+key=value]`` -> (preset name, HCConfig overrides or None)."""
    import yaml

    base, _, extra = name.partition("/")
    ov = {}
    for kv in filter(None, extra.split("+")):
        key, sep, value = kv.partition("=")
        if not sep:
            raise SystemExit(f"--presets: {name!r}: HC overrides are written /key=value+key=value, e.g. tiny-moe:mhc/n=8")
        ov[key] = yaml.safe_load(value)
    if backend != "preset":
        ov["kernels"] = backend
    return base, (ov or None)


def build(name: str, seq: int, vocab: int, cuda: bool, seed: int, backend: str = "preset",
          hc_recompute: bool = False):
    import torch

    from models.hc_layer import compile_hc_modules
    from models.zoo import build_model, build_transformer_config, load_preset
    from training.optim import OptimizerConfig, build_optimizer

    torch.manual_seed(seed)
    base, hc_overrides = split_name(name, backend)
    preset = load_preset(base, hc_overrides=hc_overrides)
    extra = dict(bf16=True, params_dtype=torch.bfloat16) if cuda else {}
    config = build_transformer_config(preset, cpu=not cuda, **extra)
    model = build_model(preset, config, vocab_size=vocab, seq_length=seq, hc_recompute=hc_recompute)
    if backend == "compile":
        compile_hc_modules(model)
    if cuda:
        model.cuda()
        for p in model.parameters():
            if getattr(p, "is_hyper_connection", False):
                p.data = p.data.float()
    opt = build_optimizer(model, OptimizerConfig(lr=1e-4, eps=1e-8), use_megatron=False)
    return preset, model, opt


def train_step(model, opt, tokens, pos):
    opt.zero_grad()
    loss = model(tokens, pos, None, labels=tokens).float().mean()
    loss.backward()
    opt.step()
    return loss


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.throughput", description=__doc__.split("\n")[0])
    p.add_argument("--presets", default=DEFAULT_PRESETS, help="comma-separated zoo presets; the first is the baseline")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per model")
    p.add_argument("--steps", type=int, default=5, help="timed steps per model per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="CPU: torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--backends", default="preset",
                   help="comma-separated HC kernel backends per preset: preset, eager, compile, triton")
    p.add_argument("--hc-recompute", action="store_true", help="HC recompute on (models.hc_layer.HCRecompute)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)

    import warnings

    import torch

    for msg in ("Apex is not installed", "Transformer Engine and Apex are not installed", "full scope is deprecated"):
        warnings.filterwarnings("ignore", message=msg)
    from models.parallel import destroy_parallel, initialize_parallel
    from models.zoo import backbone_shape  # noqa: F401  (import check: accounting available)
    from training.metrics import model_flops_per_token

    cuda = torch.cuda.is_available()
    if args.threads and not cuda:
        torch.set_num_threads(args.threads)
    initialize_parallel(seed=args.seed)
    presets = [n.strip() for n in args.presets.split(",") if n.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in ("preset",) + OP_BACKENDS:
            p.error(f"--backends: unknown backend {b!r}; choose from preset, {', '.join(OP_BACKENDS)}")
    from models.zoo import load_preset

    names = []  # (preset, backend) runs, "preset@backend"
    for n in presets:
        base, hc_overrides = split_name(n)
        if not load_preset(base, hc_overrides=hc_overrides).hc.enabled:
            names.append(n)  # no HC code: one row
            continue
        for b in backends:
            names.append(n if b == "preset" else f"{n}@{b}")
    device = torch.device("cuda") if cuda else torch.device("cpu")
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=g).to(device)
    pos = torch.arange(args.seq, device=device).expand(args.micro_batch, args.seq)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    models = {}
    for name in names:
        pname, _, backend = name.partition("@")
        print(f"building {name} ...", file=sys.stderr, flush=True)
        preset, model, opt = build(pname, args.seq, args.vocab, cuda, args.seed, backend or "preset",
                                   args.hc_recompute)
        for _ in range(args.warmup):
            train_step(model, opt, tokens, pos)
        models[name] = (preset, model, opt)
    sync()
    times = {n: [] for n in names}
    for _ in range(args.rounds):
        for name in names:
            _, model, opt = models[name]
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                train_step(model, opt, tokens, pos)
            sync()
            times[name].append((time.perf_counter() - t0) / args.steps)

    tokens_per_step = args.micro_batch * args.seq
    rows = []
    base = None
    for name in names:
        preset, model, _ = models[name]
        t = statistics.median(times[name])
        tps = tokens_per_step / t
        base = base or tps
        flops = model_flops_per_token(preset, args.seq, args.vocab)
        pname, _, backend = name.partition("@")
        if not preset.hc.enabled:
            backend = "-"
        rows.append({"preset": pname, "backend": backend or getattr(preset.hc, "kernels", "eager"), "variant": preset.hc.variant, "params_M": sum(q.numel() for q in model.parameters()) / 1e6,
                     "hc_params_k": sum(q.numel() for q in model.parameters() if getattr(q, "is_hyper_connection", False)) / 1e3,
                     "ms_per_step": 1e3 * t, "tokens_per_s": tps, "ratio": tps / base,
                     "flops_ratio": flops["total"] / flops["backbone"],
                     "rounds_ms": [round(1e3 * x, 2) for x in times[name]]})
    dev = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} thread(s)"
    print(f"throughput: micro-batch {args.micro_batch} x seq {args.seq} (vocab {args.vocab}), {dev}, "
          f"{'bf16' if cuda else 'fp32'}; forward+backward+AdamW; median of {args.rounds} rounds x {args.steps} steps")
    head = f"{'preset':<22} {'backend':<8} {'variant':<11} {'params':>8} {'HC':>8} {'ms/step':>9} {'tok/s':>9} {'vs ' + names[0].split(':')[-1][:8]:>12} {'FLOPs ratio':>12}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['preset']:<22} {r['backend']:<8} {r['variant']:<11} {r['params_M']:>7.3f}M {r['hc_params_k']:>7.1f}k "
              f"{r['ms_per_step']:>9.1f} {r['tokens_per_s']:>9.0f} {r['ratio']:>11.3f}x {r['flops_ratio']:>11.3f}x")
    print("(FLOPs ratio: (backbone + F_HC) / backbone per token from xhc.accounting; tokens/s ratio measured.)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev, "args": vars(args), "rows": rows}, f, indent=1)
    destroy_parallel(destroy_process_group=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
