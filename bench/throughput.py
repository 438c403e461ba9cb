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

The realistic check (issue #35; ``bash bench/gpu_check.sh --perf`` runs it on one GPU)::

    python -m bench.throughput --realistic --json throughput.json   # moe-2p5b, >= 16k tokens per step
    python -m bench.throughput --smoke                              # the same on CPU, tiny-moe

``--realistic``: the paper's 2.5B preset ``moe-2p5b`` (C = 1024, 144 experts top-8) shrunk to
``--layers`` (default 4: 1 dense + 3 MoE, so that four models fit one GPU side by side), sequence
4096 x micro-batch 4 = 16,384 tokens per step, vocabulary 32,768, grouped expert GEMMs
(:mod:`models.grouped_experts`), vanilla, mHC, xHC and Flash-4sub on ``--backends`` (default
``compile``, the fastest measured in docs/gpu.md), with ``--profile``.  ``--smoke``: the same
mechanism with ``tiny-moe`` on CPU in seconds.

``--layers L`` keeps the preset's leading dense layers and shrinks the MoE part; ``--grouped-experts
auto|true|false`` sets ``moe_grouped_gemm`` (auto: the preset's, i.e. grouped on CUDA).  MFU is
model FLOPs per token (``training.run.metrics.model_flops_per_token``) x tokens/s over ``--peak-tflops``
(default: the device's data-sheet bf16 peak; the GPU check passes its measured GEMM rate).

``--profile``: after timing, one more training step per model under ``torch.profiler``: its top
kernels (CUDA kernels on a GPU, operators by self time on CPU) and the **HC share of the step**:
the time of the kernels that the vanilla model's step does not launch, over all kernel time of the
step (the HC modules' own Triton / inductor kernels; GEMM and element-wise kernels shared with the
backbone are not counted, so this is a lower bound).  The share from timing alone,
``1 - t_vanilla / t_variant``, is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Optional

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


REALISTIC = dict(presets="moe-2p5b:vanilla,moe-2p5b:mhc,moe-2p5b:xhc,moe-2p5b:xhc-flash4", layers=4, seq=4096,
                 micro_batch=4, vocab=32768, backends="compile", warmup=2, steps=4, rounds=3, profile=True,
                 grouped_experts="true")
SMOKE = dict(presets="tiny-moe:vanilla,tiny-moe:mhc,tiny-moe:xhc,tiny-moe:xhc-flash4", layers=None, seq=32,
             micro_batch=2, vocab=256, backends="eager", warmup=1, steps=1, rounds=1, profile=True,
             grouped_experts="true")


def backbone_overrides(layers, grouped: str) -> dict:
    """``--layers`` and ``--grouped-experts`` as preset backbone overrides."""
    out = {}
    if layers:
        out["num_layers"] = int(layers)
    if grouped != "auto":
        out["moe_grouped_gemm"] = grouped == "true"
    return out


def build(name: str, seq: int, vocab: int, cuda: bool, seed: int, backend: str = "preset",
          hc_recompute: bool = False, backbone: Optional[dict] = None):
    import torch

    from models.hc_layer import compile_hc_modules
    from models.zoo import build_model, build_transformer_config, load_preset
    from training.optim import OptimizerConfig, build_optimizer

    torch.manual_seed(seed)
    base, hc_overrides = split_name(name, backend)
    preset = load_preset(base, backbone_overrides=backbone or None, hc_overrides=hc_overrides)
    if backbone and "num_layers" in backbone:
        dense = int(preset.backbone.get("first_dense_layers", 0))
        if not dense < int(backbone["num_layers"]):
            raise SystemExit(f"--layers {backbone['num_layers']}: {base} has {dense} leading dense layer(s); "
                             f"give at least {dense + 1} so that an MoE layer remains")
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


def expert_modules(model) -> str:
    """The routed experts' module class(es) in ``model`` (``GroupedExperts``, ``SequentialMLP``, ...)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    kinds = sorted({type(m.experts).__name__ for m in model.modules() if isinstance(m, MoELayer)})
    return "+".join(kinds) or "-"


def profile_step(model, opt, tokens, pos, cuda: bool):
    """One training step under torch.profiler: ``{name: (calls, microseconds)}`` of its CUDA kernels
    (on CPU: operators by self CPU time) and the total."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        train_step(model, opt, tokens, pos)
        if cuda:
            import torch

            torch.cuda.synchronize()
    kernels = {}
    if cuda:
        from torch.autograd import DeviceType

        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                calls, us = kernels.get(e.name, (0, 0.0))
                kernels[e.name] = (calls + 1, us + e.time_range.elapsed_us())
    else:
        for e in prof.key_averages():
            if e.self_cpu_time_total > 0 and not e.key.startswith("ProfilerStep"):
                kernels[e.key] = (e.count, float(e.self_cpu_time_total))
    return kernels


def summarise_profile(kernels: dict, vanilla: Optional[dict], top: int = 8) -> dict:
    """Top kernels and the HC share (kernels absent from the vanilla step) of one profiled step."""
    total = sum(us for _, us in kernels.values()) or 1.0
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    out = {"kernel_ms": total / 1e3, "n_kernel_names": len(kernels),
           "top": [{"name": n, "calls": c, "ms": us / 1e3, "share": us / total} for n, (c, us) in ranked[:top]]}
    if vanilla is not None:
        hc = sum(us for n, (_, us) in kernels.items() if n not in vanilla)
        out["hc_share"] = hc / total
        out["hc_kernel_names"] = sum(1 for n in kernels if n not in vanilla)
    return out


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
    p.add_argument("--layers", type=int, default=None, help="shrink every preset to this many layers (dense ones kept)")
    p.add_argument("--grouped-experts", choices=("auto", "true", "false"), default="auto",
                   help="routed experts as grouped GEMMs (models.grouped_experts); "
                   "auto: the preset's (grouped on CUDA)")
    p.add_argument("--profile", action="store_true", help="profile one step per model: top kernels, HC share")
    p.add_argument("--peak-tflops", type=float, default=None, help="MFU denominator (default: data-sheet bf16 peak)")
    p.add_argument("--realistic", action="store_true",
                   help="the issue-35 check: " + ", ".join(f"{k}={v}" for k, v in REALISTIC.items()))
    p.add_argument("--smoke", action="store_true", help="the realistic check's mechanism on tiny-moe in seconds (CPU)")
    args = p.parse_args(argv)
    if args.realistic and args.smoke:
        p.error("--realistic and --smoke exclude each other")
    for key, value in (REALISTIC if args.realistic else SMOKE if args.smoke else {}).items():
        if key in ("profile",):
            args.profile = args.profile or value
        elif getattr(args, key) == p.get_default(key):  # an explicit option wins
            setattr(args, key, value)

    import warnings

    import torch

    for msg in ("Apex is not installed", "Transformer Engine and Apex are not installed", "full scope is deprecated"):
        warnings.filterwarnings("ignore", message=msg)
    from models.parallel import destroy_parallel, initialize_parallel
    from models.zoo import backbone_shape  # noqa: F401  (import check: accounting available)
    from training.run import model_flops_per_token

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
    bb = backbone_overrides(args.layers, args.grouped_experts)
    for name in names:
        pname, _, backend = name.partition("@")
        print(f"building {name} ...", file=sys.stderr, flush=True)
        preset, model, opt = build(pname, args.seq, args.vocab, cuda, args.seed, backend or "preset",
                                   args.hc_recompute, bb)
        for _ in range(args.warmup):
            train_step(model, opt, tokens, pos)
        models[name] = (preset, model, opt)
    sync()
    from training.run import peak_tflops

    peak, peak_note = peak_tflops(args.peak_tflops, cuda)
    tokens_per_step = args.micro_batch * args.seq
    dev = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} thread(s)"
    times = {n: [] for n in names}
    profiles = {}

    def make_rows():
        rows, base = [], None
        base_t = statistics.median(times[names[0]])
        vanilla_kernels = profiles.get(names[0])
        for name in names:
            preset, model, _ = models[name]
            t = statistics.median(times[name])
            tps = tokens_per_step / t
            base = base or tps
            flops = model_flops_per_token(preset, args.seq, args.vocab)
            prof = (summarise_profile(profiles[name], vanilla_kernels if name != names[0] else None)
                    if name in profiles else None)
            pname, _, backend = name.partition("@")
            if not preset.hc.enabled:
                backend = "-"
            rows.append({"preset": pname, "backend": backend or getattr(preset.hc, "kernels", "eager"),
                         "variant": preset.hc.variant, "params_M": sum(q.numel() for q in model.parameters()) / 1e6,
                         "hc_params_k": sum(q.numel() for q in model.parameters()
                                            if getattr(q, "is_hyper_connection", False)) / 1e3,
                         "ms_per_step": 1e3 * t, "tokens_per_s": tps, "ratio": tps / base,
                         "flops_ratio": flops["total"] / flops["backbone"],
                         "mfu": flops["total"] * tps / (peak * 1e12), "layers": preset.num_layers,
                         "experts": expert_modules(model), "hc_share_time": 1.0 - base_t / t,
                         "profile": prof, "rounds_ms": [round(1e3 * x, 2) for x in times[name]]})
        return rows

    def dump(rows, state):
        if args.json:  # rewritten after every round: a run killed at its time limit keeps its medians so far
            tmp = args.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"state": state, "device": dev, "args": vars(args), "tokens_per_step": tokens_per_step,
                           "peak_tflops": peak, "peak_note": peak_note, "rows": rows}, f, indent=1)
            os.replace(tmp, args.json)

    for i in range(args.rounds):
        for name in names:
            _, model, opt = models[name]
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                train_step(model, opt, tokens, pos)
            sync()
            times[name].append((time.perf_counter() - t0) / args.steps)
        dump(make_rows(), f"timed {i + 1} of {args.rounds} rounds")
        print(f"round {i + 1}/{args.rounds}: " + ", ".join(f"{n} {1e3 * times[n][-1]:.1f} ms" for n in names),
              file=sys.stderr, flush=True)
    if args.profile:
        for name in names:
            _, model, opt = models[name]
            profiles[name] = profile_step(model, opt, tokens, pos, cuda)
    rows = make_rows()
    print(f"throughput: micro-batch {args.micro_batch} x seq {args.seq} (vocab {args.vocab}), {dev}, "
          f"{'bf16' if cuda else 'fp32'}; forward+backward+AdamW; median of {args.rounds} rounds x {args.steps} steps")
    print(f"layers {rows[0]['layers']}, routed experts {', '.join(sorted({r['experts'] for r in rows}))}; "
          f"MFU against {peak:g} TFLOP/s ({peak_note})")
    head = (f"{'preset':<22} {'backend':<8} {'variant':<11} {'params':>8} {'HC':>8} {'ms/step':>9} {'tok/s':>9} "
            f"{'vs ' + names[0].split(':')[-1][:8]:>12} {'FLOPs ratio':>12} {'MFU':>7} {'HC share':>9} {'(timing)':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        share = r["profile"].get("hc_share") if r["profile"] else None
        print(f"{r['preset']:<22} {r['backend']:<8} {r['variant']:<11} {r['params_M']:>7.3f}M {r['hc_params_k']:>7.1f}k "
              f"{r['ms_per_step']:>9.1f} {r['tokens_per_s']:>9.0f} {r['ratio']:>11.3f}x {r['flops_ratio']:>11.3f}x "
              f"{r['mfu']:>7.2%} {'-' if share is None else f'{share:.1%}':>9} {r['hc_share_time']:>9.1%}")
    print("(FLOPs ratio: (backbone + F_HC) / backbone per token from xhc.accounting; tokens/s ratio measured; HC share:"
          " profiled kernel time absent from vanilla's step; (timing): 1 - t_vanilla / t.)")
    for r in rows:
        if r["profile"]:
            what = "CUDA kernels" if cuda else "CPU operators (self time)"
            print(f"top {what} of one step, {r['preset']} {r['backend']} ({r['profile']['kernel_ms']:.1f} ms in all):")
            for k in r["profile"]["top"]:
                print(f"  {k['ms']:>9.2f} ms {k['share']:>6.1%} {k['calls']:>5}x  {k['name'][:90]}")
    dump(rows, "done")
    destroy_parallel(destroy_process_group=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
