"""The GPU path, checked on a GPU: the Python half of ``bench/gpu_check.sh`` (see docs/gpu.md).

Run::

    python -m bench.gpu_checks train_eval pipeline spec        # single GPU
    python -m bench.gpu_checks variants
    python -m bench.gpu_checks resume
    python -m bench.gpu_checks throughput
    python -m bench.gpu_checks bench                           # HC units: eager vs triton vs compile
    torchrun --nproc_per_node 2 -m bench.gpu_checks multi      # two GPUs (TP, PP, VPP, EP, CP, DP)
    python -m bench.gpu_checks --smoke --device cpu train_eval # the same code, shrunk, on CPU
    python -m bench.gpu_checks --json step.json --hc-kernels compile variants
    python -m bench.gpu_checks roofline                        # copy bandwidth, bf16 GEMM rate (--perf)
    python -m bench.gpu_checks --results DIR perf_table        # the --perf run's last table
    python -m bench.gpu_checks pack DIR FILE                   # DIR's JSON/text files as one JSON file

``--json FILE``: every line is also appended to ``rows`` of that JSON file the moment it is
printed (bench/gpu_check.sh's step files), so a kill keeps what was measured.  ``--hc-kernels``:
the HC kernel backend of every model (default: the models' ``auto``, i.e. ``triton`` on CUDA).

Every check prints one line ``PASS <name>: <numbers>``, ``FAIL <name>: <why>`` or ``SKIP <name>:
<why>`` (rank 0 only) as soon as it is measured, each variant and optimiser in its own ``try``, and
carries on with the next; the exit status is 1 if any check failed.
Pass criteria are relative to the quantity each check guards against (one update, the
bf16-vs-fp32 difference), never to a timing.  Each check drives the real trainer
(:class:`training.pretrain.Trainer`) or the zoo models; on a GPU that is bf16 with fp32 HC
parameters, Megatron DDP, Megatron's optimiser, the Transformer Engine spec when installed and
the alltoall dispatcher.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from typing import Callable, Dict, List, Optional

if __name__ in ("__main__", "__mp_main__") and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from xhc.config import KERNEL_BACKENDS  # noqa: E402
from xhc.config import VARIANTS as HC_VARIANTS  # noqa: E402

# every variant as a zoo preset name (tiny-moe:<name>): vanilla for none, hyphens for underscores
VARIANTS = tuple("vanilla" if v == "none" else v.replace("_", "-") for v in HC_VARIANTS)
THROUGHPUT_VARIANTS = ("vanilla", "mhc", "xhc-flash4")


class Ctx:
    """Settings shared by the checks."""

    def __init__(self, device: str, smoke: bool, workdir: str, json_path: Optional[str] = None,
                 hc_kernels: Optional[str] = None, warm: bool = False):
        self.cuda = device == "cuda"
        self.smoke = smoke
        self.workdir = workdir
        self.json_path = json_path
        self.hc_kernels = hc_kernels
        self.warm = warm  # bench: compile every row once (fills the caches), measure nothing
        self.results_dir: Optional[str] = None  # perf_table: bench/gpu_check.sh --perf's results
        self.results: List[str] = []
        rank = int(os.environ.get("RANK", "0"))
        self.main = rank == 0
        self.t0 = time.perf_counter()

    @property
    def backend(self) -> str:
        return self.hc_kernels or "auto"

    def report(self, status: str, name: str, text: str, data: Optional[dict] = None) -> None:
        line = f"{status} {name}: {text}"
        self.results.append(line)
        if self.main:
            print(line, flush=True)
            row = {"status": status, "name": name, "text": text, "hc_kernels": self.backend,
                   "t_s": round(time.perf_counter() - self.t0, 1)}
            if data:
                row["data"] = data
            self.update_json(row=row)

    def update_json(self, row: Optional[dict] = None, **keys) -> None:
        """Append ``row`` to ``rows`` / set ``keys`` in the --json file (read, change, atomic rewrite)."""
        if not (self.json_path and self.main):
            return
        import json

        try:
            with open(self.json_path) as f:
                d = json.load(f)
        except (OSError, ValueError):
            d = {}
        if row is not None:
            d.setdefault("rows", []).append(row)
        d.update(keys)
        tmp = self.json_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(d, f, indent=1)
        os.replace(tmp, self.json_path)


# ------------------------------------------------------------------------------------------------
# Helpers: the real trainer with small settings
# ------------------------------------------------------------------------------------------------
def overrides_for(ctx: Ctx, tag: str, preset: str = "tiny-moe:xhc", steps: int = 3, extra=()) -> List[str]:
    run_dir = os.path.join(ctx.workdir, tag)
    seq, micro = (32, 2) if ctx.smoke else (128, 4)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return [
        f"model.preset={preset}", f"run.dir={run_dir}", f"run.train_steps={steps}", "run.eval_interval=0",
        "run.eval_iters=1", "run.seed=1234", f"run.device={'cuda' if ctx.cuda else 'cpu'}",
        "data.mock=true", "tokenizer.type=none", "tokenizer.vocab_size=1024",
        f"batch.seq_length={seq}", f"batch.micro_batch_size={micro}", f"batch.global_batch_size={micro * 2 * world}",
        "logging.tensorboard=false", "logging.plot=false", "logging.jsonl=false", "logging.hc_health_interval=0",
        "logging.interval=1000", "checkpoint.interval=0", "checkpoint.save_final=false",
        "checkpoint.save_on_signal=false", "checkpoint.checksum=none", "schedule.warmup_steps=1",
        "schedule.decay_fraction=0.5",
        *([f"model.hc_kernels={ctx.hc_kernels}"] if ctx.hc_kernels else []),
        *extra]


def make_trainer(ctx: Ctx, overrides: List[str], before_wrap: Optional[Callable] = None):
    import contextlib
    import io
    import unittest.mock

    from training.config import load_config
    from training.pretrain import Trainer
    from training.run import MegatronStepRunner

    cfg = load_config(None, list(overrides))
    tr = Trainer(cfg)
    hook = contextlib.nullcontext()
    if before_wrap is not None:
        original = MegatronStepRunner.wrap

        def wrap(runner, chunks, bf16):
            before_wrap(chunks)
            return original(runner, chunks, bf16)

        hook = unittest.mock.patch.object(MegatronStepRunner, "wrap", wrap)
    with contextlib.redirect_stdout(io.StringIO()), hook:  # the setup banner; the log keeps our lines
        tr.setup()
    return tr


def close(tr) -> None:
    """Tear the trainer down (the process group stays) and free its memory before the next one."""
    import gc

    tr.close(destroy_process_group=False)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def iterators(tr):
    return [tr.data_iterator(tr.train_ds, tr.consumed_samples, cycle=False) for _ in tr.chunks]


def run_steps(tr, n: int) -> List[dict]:
    its = iterators(tr)
    out = []
    for _ in range(n):
        out.append(tr.train_step(its))
    return out


def weights(tr) -> Dict[str, torch.Tensor]:
    from training.pretrain import Trainer

    return {f"{i}.{n}": p.detach().float().clone() for i, c in enumerate(tr.chunks)
            for n, p in Trainer._unwrap(c).named_parameters()}


def l2_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    """Global L2 norm of ``a - b`` over all parameters (isolated bf16 rounding flips from
    non-deterministic GPU kernels weigh little; a wrong resume moves every weight)."""
    return math.sqrt(sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a))


def hc_params(model):
    return {n: p for n, p in model.named_parameters() if getattr(p, "is_hyper_connection", False)}


def routers(chunks):
    from training.pretrain import Trainer

    return [m for c in chunks for m in Trainer._unwrap(c).modules()
            if getattr(m, "local_tokens_per_expert", None) is not None]


def peak_gib(ctx: Ctx) -> str:
    return f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if ctx.cuda else "n/a (CPU)"


# ------------------------------------------------------------------------------------------------
# 1. three steps and one evaluation of tiny-moe:xhc
# ------------------------------------------------------------------------------------------------
def check_train_eval(ctx: Ctx) -> None:
    snap = {}

    def before_wrap(chunks):
        for i, c in enumerate(chunks):
            for n, p in hc_params(c).items():
                snap[f"{i}.{n}"] = p.detach().cpu().clone()

    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    tr = make_trainer(ctx, overrides_for(ctx, "train_eval"), before_wrap)
    try:
        from training.pretrain import Trainer

        problems = []
        hc_now = {f"{i}.{n}": p for i, c in enumerate(tr.chunks) for n, p in hc_params(Trainer._unwrap(c)).items()}
        if not hc_now:
            problems.append("no HC parameters")
        if any(p.dtype != torch.float32 for p in hc_now.values()):
            problems.append("HC parameters not fp32")
        if ctx.cuda:
            inexact = [n for n, p in hc_now.items() if not torch.equal(p.detach().cpu(), snap[n].float().cpu())]
            if inexact:
                problems.append(f"{len(inexact)} HC parameters differ from their fp32 init, e.g. {inexact[0]}")
        config = tr.tf_config
        te = any(type(m).__name__.startswith("TE") for c in tr.chunks for m in c.modules())
        dispatcher = config.moe_token_dispatcher_type
        if ctx.cuda and dispatcher != "alltoall":
            problems.append(f"dispatcher {dispatcher}, expected alltoall")
        recs = run_steps(tr, 3)
        losses = [r["loss"] for r in recs]
        if not all(math.isfinite(x) for x in losses):
            problems.append(f"non-finite loss {losses}")
        if any(r.get("skipped") for r in recs):
            problems.append("a step was skipped")
        before = [r.local_tokens_per_expert.clone() for r in routers(tr.chunks)]
        eval_loss = tr.run_eval()
        after = [r.local_tokens_per_expert for r in routers(tr.chunks)]
        touched = sum(int(not torch.equal(a, b)) for a, b in zip(after, before))
        if not before:
            problems.append("no router with expert-bias token counts")
        if touched:
            problems.append(f"evaluation changed the token counts of {touched} routers")
        if eval_loss is None or not math.isfinite(eval_loss):
            problems.append(f"eval loss {eval_loss}")
        hc_state = "HC fp32 == fp32 init" if ctx.cuda else "HC fp32 (CPU: no bf16 wrap)"
        from xhc.kernels import resolve_backend

        hc_backend = resolve_backend(ctx.backend, "cuda" if ctx.cuda else "cpu")
        text = (f"losses {', '.join(f'{x:.4f}' for x in losses)}, eval {eval_loss:.4f}; {hc_state} "
                f"({len(hc_now)} tensors); {'bf16' if config.bf16 else 'fp32'}, spec {'TE' if te else 'local'}, "
                f"dispatcher {dispatcher}, HC kernels {ctx.backend} -> {hc_backend}; token counts untouched by eval "
                f"({len(before)} routers); "
                f"peak memory {peak_gib(ctx)}")
        if ctx.cuda and not te:
            text += " [TE not installed: local spec]"
        prefix = "; ".join(problems) + " | " if problems else ""
        ctx.report("FAIL" if problems else "PASS", "train_eval", prefix + text)
    finally:
        close(tr)


# ------------------------------------------------------------------------------------------------
# 2. two steps of every variant with selective recompute
# ------------------------------------------------------------------------------------------------
def check_variants(ctx: Ctx) -> None:
    for v in VARIANTS:
        t0 = time.perf_counter()
        tr = None
        try:
            over = overrides_for(ctx, f"variant-{v}", f"tiny-moe:{v}", 2, ["model.recompute=selective"])
            tr = make_trainer(ctx, over)
            recs = run_steps(tr, 2)
            losses = [r["loss"] for r in recs]
            ok = all(math.isfinite(x) for x in losses) and not any(r.get("skipped") for r in recs)
            ctx.report("PASS" if ok else "FAIL", f"variant {v}",
                       f"selective recompute, losses {', '.join(f'{x:.4f}' for x in losses)}, "
                       f"{time.perf_counter() - t0:.1f}s")
        except Exception as e:  # one variant failing must not hide the others
            ctx.report("FAIL", f"variant {v}", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        finally:
            if tr is not None:
                close(tr)


# ------------------------------------------------------------------------------------------------
# 3. checkpoint round trips
# ------------------------------------------------------------------------------------------------
def check_resume(ctx: Ctx) -> None:
    for opt in ("adamw", "muon"):
        try:
            _resume_one(ctx, opt)
        except Exception as e:  # one optimiser failing must not hide the other
            if ctx.main:
                traceback.print_exc()
            ctx.report("FAIL", f"resume {opt}", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


def _resume_one(ctx: Ctx, opt: str) -> None:
    extra = [f"optimizer.name={opt}", "optimizer.lr=1e-2"]
    if opt == "muon":  # its state sharded over data parallelism (the GPU default, named so that the CPU smoke runs it too)
        extra.append("optimizer.use_distributed_optimizer=true")
    ck = os.path.join(ctx.workdir, f"ckpt-{opt}")
    # uninterrupted: 3 steps
    tr = make_trainer(ctx, overrides_for(ctx, f"straight-{opt}", extra=extra))
    w0 = weights(tr)
    run_steps(tr, 3)
    w_straight = weights(tr)
    close(tr)
    # 2 steps, save
    tr = make_trainer(ctx, overrides_for(ctx, f"first-{opt}", extra=extra + [f"checkpoint.dir={ck}"]))
    run_steps(tr, 2)
    w2 = weights(tr)
    state2 = {f"{i}": {k: v.detach().clone() for k, v in tr._unwrap(c).state_dict().items() if torch.is_tensor(v)}
              for i, c in enumerate(tr.chunks)}
    consumed = tr.consumed_samples
    tr.save_checkpoint("gpu-check")
    close(tr)
    update = l2_diff(w_straight, w2)  # the size of one update: what a wrong resume would be off by
    # resume (model, optimizer, scheduler, RNG), 1 step
    tr = make_trainer(ctx, overrides_for(ctx, f"resumed-{opt}", extra=extra + [f"checkpoint.dir={ck}"]))
    resumed_at = tr.step
    run_steps(tr, 1)
    err = l2_diff(weights(tr), w_straight)
    close(tr)
    ok = resumed_at == 2 and err <= 0.05 * update
    ctx.report("PASS" if ok else "FAIL", f"resume {opt}",
               f"resumed at step {resumed_at}; ||3 steps - (2 + save + load + 1)|| = {err:.3g} "
               f"(one update: {update:.3g}; limit 5%)")
    # load_optimizer=false: 1 step after loading == a fresh optimiser on the loaded weights
    tr = make_trainer(ctx, overrides_for(ctx, f"noopt-{opt}", extra=extra + [
        f"checkpoint.dir={ck}", "checkpoint.load_optimizer=false"]))
    run_steps(tr, 1)
    w_noopt = weights(tr)
    close(tr)
    def load_saved(chunks):  # before the bf16 wrap, DDP and the optimiser: built on these weights
        for i, c in enumerate(chunks):
            c.load_state_dict(state2[f"{i}"], strict=False)

    tr = make_trainer(ctx, overrides_for(ctx, f"fresh-{opt}", extra=extra), load_saved if ctx.cuda else None)
    if not ctx.cuda:
        for i, c in enumerate(tr.chunks):
            tr._unwrap(c).load_state_dict(state2[f"{i}"], strict=False)
        from training.builder import Builder

        Builder(tr).optimizer()  # a fresh optimiser and scheduler on the loaded weights
    tr.step, tr.consumed_samples = 2, consumed
    run_steps(tr, 1)
    w_fresh = weights(tr)
    close(tr)
    err = l2_diff(w_noopt, w_fresh)
    travel = l2_diff(w2, w0)  # what stale main copies would add (back to the initial weights)
    ok = err <= 0.05 * travel
    ctx.report("PASS" if ok else "FAIL", f"resume {opt} load_optimizer=false",
               f"||resumed - fresh optimiser on loaded weights|| = {err:.3g} "
               f"(stale main copies would be off by ~{travel:.3g}; limit 5%)")


# ------------------------------------------------------------------------------------------------
# 4. a pipeline boundary on one device
# ------------------------------------------------------------------------------------------------
def _zoo(ctx: Ctx, name: str, te: bool = False, bf16: Optional[bool] = None, stage=None, **kw):
    """A zoo model (bf16 + fp32 HC on a GPU); ``stage=(rank, size)``: that pipeline stage only."""
    from megatron.core import tensor_parallel

    from models.zoo import build_model, build_transformer_config, load_preset
    from training.pretrain import float16_module_keep_hc_fp32

    bf16 = ctx.cuda if bf16 is None else bf16
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    preset = load_preset(name, hc_overrides={"kernels": ctx.hc_kernels} if ctx.hc_kernels else None)
    dtype = torch.bfloat16 if bf16 else torch.float32
    parallel = {}
    if stage is not None:
        from models.pipeline import pipeline_stage_collection

        pg = pipeline_stage_collection(*stage)
        parallel["pipeline_model_parallel_size"] = stage[1]
        kw.update(pg_collection=pg, pre_process=stage[0] == 0, post_process=stage[0] == stage[1] - 1)
    config = build_transformer_config(preset, parallel=parallel or None, cpu=not ctx.cuda, bf16=bf16,
                                      params_dtype=dtype, pipeline_dtype=dtype)
    seq = 32 if ctx.smoke else 128
    model = build_model(preset, config, vocab_size=1024, seq_length=seq, use_transformer_engine=te, **kw)
    if ctx.cuda:
        model.cuda()
    if bf16:
        model = float16_module_keep_hc_fp32(config, model)
    return preset, config, model, seq


def _batch(ctx: Ctx, seq: int, b: int = 2, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 1024, (b, seq + 1), generator=g)
    dev = "cuda" if ctx.cuda else "cpu"
    return t[:, :-1].to(dev), t[:, 1:].to(dev), torch.arange(seq, device=dev).expand(b, seq)


def _init_single(ctx: Ctx) -> None:
    from models.parallel import initialize_parallel

    initialize_parallel(tp=1, pp=1, ep=1, cp=1, seed=1234)


def check_pipeline(ctx: Ctx) -> None:
    _init_single(ctx)
    name = "tiny-moe:xhc"
    preset, config, last, seq = _zoo(ctx, name, stage=(1, 2))  # layers 3-4 of 4: pre_process=False
    n, C, b = preset.hc.n, preset.hidden_size, 2
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    tokens, labels, pos = _batch(ctx, seq, b)
    x = torch.randn(seq, b, n * C, dtype=dtype, device=tokens.device, requires_grad=True)
    last.set_input_tensor(x)
    loss = last(None, pos, None, labels=labels)
    loss.float().mean().backward()
    g = x.grad
    ok_last = g is not None and g.shape == x.shape and bool(torch.isfinite(g).all()) and float(g.abs().sum()) > 0
    _, _, first, _ = _zoo(ctx, name, stage=(0, 2))  # layers 1-2: post_process=False
    out = first(tokens, pos, None)
    want = (seq, b, n * C)
    ok_first = tuple(out.shape) == want and bool(torch.isfinite(out.float()).all())
    ctx.report("PASS" if ok_last and ok_first else "FAIL", "pipeline boundary",
               f"pre_process=False chunk fed {str(dtype).replace('torch.', '')} [{seq}, {b}, {n}·{C}] -> loss "
               f"{float(loss.float().mean()):.4f}, input grad {'finite' if ok_last else 'MISSING/NON-FINITE'} "
               f"(|g|_max {float(g.abs().max()) if g is not None else float('nan'):.3g}); post_process=False "
               f"output {tuple(out.shape)} (want {want}, N·C edge)")


# ------------------------------------------------------------------------------------------------
# 5. TE spec vs local spec, bf16 vs fp32 HC layers, on the same weights
# ------------------------------------------------------------------------------------------------
def _te_key(name: str) -> str:
    """Local-spec name of a Transformer Engine spec parameter (layer norms fused into linears)."""
    return (name.replace("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
            .replace("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"))


def _load_from(model, ref: Dict[str, torch.Tensor], mapper=lambda k: k) -> List[str]:
    inner = model.module if hasattr(model, "module") else model
    missing = []
    with torch.no_grad():
        for n, p in inner.named_parameters():
            src = ref.get(mapper(n))
            if src is None or src.shape != p.shape:
                missing.append(n)
            else:
                p.copy_(src)
    return missing


def _token_losses(ctx: Ctx, model, seq: int) -> torch.Tensor:
    tokens, labels, pos = _batch(ctx, seq, 2, seed=11)
    with torch.no_grad():
        return model(tokens, pos, None, labels=labels).double()


def check_spec(ctx: Ctx) -> None:
    _init_single(ctx)
    name = "tiny-moe:xhc"
    _, _, ref_model, seq = _zoo(ctx, name, bf16=False)
    ref = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    ref_loss = _token_losses(ctx, ref_model, seq)
    if not ctx.cuda and not ctx.smoke:
        ctx.report("SKIP", "spec", "bf16 comparisons need a GPU")
        return
    _, _, local, _ = _zoo(ctx, name, bf16=True)
    _load_from(local, ref)
    err_local = float((_token_losses(ctx, local, seq) - ref_loss).abs().mean())
    _, _, local_hc16, _ = _zoo(ctx, name, bf16=True)
    for p in local_hc16.parameters():
        if getattr(p, "is_hyper_connection", False):
            p.data = p.data.bfloat16()
    _load_from(local_hc16, ref)
    err_hc16 = float((_token_losses(ctx, local_hc16, seq) - ref_loss).abs().mean())
    scale = float(ref_loss.abs().mean())
    ok = math.isfinite(err_local) and math.isfinite(err_hc16) and err_local <= 0.02 * scale
    ctx.report("PASS" if ok else "FAIL", "bf16 vs fp32 HC layers",
               f"mean |token loss - fp32 model|: bf16 backbone + fp32 HC {err_local:.3g}, all-bf16 {err_hc16:.3g} "
               f"(mean loss {scale:.3f}; limit 2% for the fp32-HC model)")
    from models.specs import HAVE_TE

    if not (ctx.cuda and HAVE_TE):
        ctx.report("SKIP", "TE spec vs local spec", "Transformer Engine not installed" if ctx.cuda else "CPU")
        return
    _, _, te_model, _ = _zoo(ctx, name, te=True, bf16=True)
    missing = _load_from(te_model, ref, _te_key)
    err_te = float((_token_losses(ctx, te_model, seq) - ref_loss).abs().mean())
    te_vs_local = float((_token_losses(ctx, te_model, seq) - _token_losses(ctx, local, seq)).abs().mean())
    ok = not missing and math.isfinite(err_te) and err_te <= 2 * err_local + 1e-3 * scale
    ctx.report("PASS" if ok else "FAIL", "TE spec vs local spec",
               (f"{len(missing)} TE params without a local twin, e.g. {missing[:2]}; " if missing else "")
               + f"mean |token loss - fp32|: TE {err_te:.3g}, local {err_local:.3g}; TE vs local {te_vs_local:.3g} "
               f"(limit: 2x local + 0.1% of the loss)")


# ------------------------------------------------------------------------------------------------
# 6. throughput of a shrunk paper preset
# ------------------------------------------------------------------------------------------------
def check_throughput(ctx: Ctx) -> None:
    steps = 4 if ctx.smoke else 20
    preset = "tiny-moe" if ctx.smoke else "moe-2p5b"
    label = f"{preset}{'' if ctx.smoke else ' (4 layers, seq 2048)'} {steps} steps"
    rows = {}
    for v in THROUGHPUT_VARIANTS:  # each in its own try, its line printed as soon as it is measured
        tr = None
        try:
            extra = ["model.recompute=selective"]
            over = overrides_for(ctx, f"tput-{v}", f"{preset}:{v}", steps, extra)
            if not ctx.smoke:  # 4 of 15 layers, 8k tokens per micro-batch, 2 micro-batches
                over += ["model.backbone.num_layers=4", "batch.seq_length=2048", "batch.micro_batch_size=4",
                         "batch.global_batch_size=8", "tokenizer.vocab_size=32768"]
                from models.specs import HAVE_TE

                if HAVE_TE:  # as configs/pretrain/*: grouped expert GEMMs, fused wgrad accumulation
                    over += ["model.backbone.moe_grouped_gemm=true", "model.backbone.gradient_accumulation_fusion=true"]
            t0 = time.perf_counter()
            tr = make_trainer(ctx, over)
            recs = run_steps(tr, steps)
            timed = recs[max(1, steps // 4):]  # after warm-up (the first steps compile the Triton kernels)
            tps = sorted(r["tokens_per_s"] for r in timed)[len(timed) // 2]
            mfu = sorted(r["mfu"] for r in timed)[len(timed) // 2]
            finite = all(math.isfinite(r["loss"]) for r in recs)
            rows[v] = tps
            ratio = f" ({tps / rows['vanilla']:.3f}x vanilla)" if "vanilla" in rows and v != "vanilla" else ""
            ctx.report("PASS" if finite else "FAIL", f"throughput {v}",
                       f"{label}: {tps:,.0f} tok/s{ratio}, MFU {mfu:.1%}, loss {recs[-1]['loss']:.3f}"
                       f"{'' if finite else ' (NON-FINITE loss)'}; {time.perf_counter() - t0:.0f}s with set-up",
                       data={"tokens_per_s": tps, "mfu": mfu, "loss": recs[-1]["loss"]})
        except Exception as e:
            if ctx.main:
                traceback.print_exc()
            ctx.report("FAIL", f"throughput {v}", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        finally:
            if tr is not None:
                close(tr)


# ------------------------------------------------------------------------------------------------
# 7. HC units side by side: eager vs triton vs compile (warm caches; one line per row)
# ------------------------------------------------------------------------------------------------
BENCH_VARIANTS = ("vanilla", "mhc", "xhc-mlp", "flash4")


def bench_backends(ctx: Ctx) -> List[str]:
    if not ctx.cuda:
        return ["eager"]  # CPU smoke: the mechanism; compile and triton are timed on the GPU only
    return ["eager", "triton", "compile"]


def check_bench(ctx: Ctx) -> None:
    """Forward + backward of one HC unit (bench.hc_kernels.build_unit: mHC N=4 sublayer, xHC MLP
    sublayer, Flash-4sub two-layer window) per backend, ms per sublayer, median of ``reps`` after an
    untimed first call (Triton JIT / inductor compile, served by the caches the warm-up filled)."""
    from bench.hc_kernels import _backward, _grads_like, _inputs, build_unit
    from xhc.kernels import compile_options

    C, tokens, dtype, reps = (2048, 8192, torch.bfloat16, 10) if ctx.cuda else (64, 64, torch.float32, 2)
    device = "cuda" if ctx.cuda else "cpu"
    sync = torch.cuda.synchronize if ctx.cuda else (lambda: None)
    base = None
    table = []
    for v in BENCH_VARIANTS:
        for b in (["eager"] if v == "vanilla" else bench_backends(ctx)):
            name = f"bench {v} {b}"
            try:
                unit = build_unit(v, C, b, device, dtype)
                X, ys = _inputs(unit, C, tokens, device, dtype, 0)
                step = unit.step
                if b == "compile":
                    torch._dynamo.reset()
                    step = torch.compile(unit.step, fullgraph=True, options=compile_options())
                params = [p for m in unit.modules for p in m.parameters()]

                def once(grads=None):
                    outs = step(X, ys)
                    grads = grads if grads is not None else _grads_like(outs, 0)
                    _backward(outs, grads)
                    for t in [X, *ys, *params]:
                        t.grad = None
                    return grads

                sync()
                t0 = time.perf_counter()
                grads = once()
                sync()
                first = time.perf_counter() - t0
                if ctx.warm:
                    print(f"[warm] {name}: first call {first:.1f}s", flush=True)
                    continue
                times = []
                for _ in range(reps):
                    sync()
                    t0 = time.perf_counter()
                    once(grads)
                    sync()
                    times.append(time.perf_counter() - t0)
                ms = 1e3 * sorted(times)[len(times) // 2] / unit.sublayers
                if v == "vanilla":
                    base = ms
                ratio = f", {ms / base:.2f}x vanilla" if base else ""
                table.append((v, b, ms, first))
                ctx.report("PASS", name, f"{ms:.3f} ms per sublayer fwd+bwd{ratio}; first call {first:.2f}s "
                           f"(JIT/compile); median of {reps}, C={C}, {tokens} tokens, "
                           f"{str(dtype).replace('torch.', '')}",
                           data={"variant": v, "backend": b, "ms_per_sublayer": ms, "vs_vanilla": ms / base if base else None,
                                 "first_call_s": first, "C": C, "tokens": tokens})
            except Exception as e:  # one row failing must not hide the others
                if ctx.main:
                    traceback.print_exc()
                ctx.report("FAIL", name, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    if table and not ctx.warm:
        lines = [f"{'variant':<9} {'backend':<8} {'ms/sublayer':>12} {'vs vanilla':>10} {'first call s':>12}"]
        lines += [f"{v:<9} {b:<8} {ms:>12.3f} {(ms / base if base else float('nan')):>10.2f} {first:>12.2f}"
                  for v, b, ms, first in table]
        if ctx.main:
            print("\n".join(lines), flush=True)
        ctx.update_json(table="\n".join(lines))


# ------------------------------------------------------------------------------------------------
# 2 GPUs: TP, PP, VPP, EP, CP, and DP with the overlapped parameter all-gather (finding 2)
# ------------------------------------------------------------------------------------------------
MULTI_LAYOUTS = {
    "tp2+sp": ["parallel.tp=2", "parallel.sp=true"],
    "pp2": ["parallel.pp=2"],
    # interleaved 1F1B (CUDA only) with the overlapped param gather: param_sync_func + align_param_gather
    "pp2-vpp2": ["parallel.pp=2", "parallel.vpp=2", "parallel.overlap_grad_reduce=true",
                 "parallel.overlap_param_gather=true"],
    "ep2": ["parallel.ep=2"],
    "cp2": ["parallel.cp=2"],  # CUDA + Transformer Engine attention only
    "dp2-muon": ["optimizer.name=muon", "optimizer.use_distributed_optimizer=true"],  # Muon's state sharded over DP = 2
}
CUDA_ONLY = {"pp2-vpp2": "the interleaved schedule needs CUDA", "cp2": "context parallelism needs CUDA and TE"}


def _all_max(x: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def check_multi(ctx: Ctx) -> None:
    from models.specs import HAVE_TE

    for name, extra in MULTI_LAYOUTS.items():
        if name in CUDA_ONLY and (not ctx.cuda or (name == "cp2" and not HAVE_TE)):
            ctx.report("SKIP", f"multi {name}", CUDA_ONLY[name])
            continue
        tr = None
        try:
            tr = make_trainer(ctx, overrides_for(ctx, f"multi-{name}", extra=extra))
            recs = run_steps(tr, 3)
            ev = tr.run_eval()
            losses = [r["loss"] for r in recs]
            ok = all(math.isfinite(x) for x in losses) and ev is not None and math.isfinite(ev)
            ctx.report("PASS" if ok else "FAIL", f"multi {name}",
                       f"losses {', '.join(f'{x:.4f}' for x in losses)}, eval {ev:.4f}")
        except Exception as e:
            ctx.report("FAIL", f"multi {name}", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        finally:
            if tr is not None:
                close(tr)
    check_overlap_param_gather_save(ctx)
    check_muon_reshard(ctx)


def check_muon_reshard(ctx: Ctx) -> None:
    """Muon with its state sharded over DP = 2, saved after 2 steps, resumed at TP = 2 + SP (DP = 1):
    the state reshards (training.optim.megatron: one checkpoint entry per parameter).  The resumed run
    saves again before its first step; every tensor of that checkpoint (weights, fp32 main copies,
    momentum, AdamW moments), read whole, equals the DP = 2 save; its first step has a finite loss."""
    import torch.distributed as dist

    from training.checkpoint import list_checkpoints, read_whole_tensors

    muon = ["optimizer.name=muon", "optimizer.use_distributed_optimizer=true"]
    first, again = os.path.join(ctx.workdir, "ckpt-muon-dp2"), os.path.join(ctx.workdir, "ckpt-muon-tp2")
    try:
        tr = make_trainer(ctx, overrides_for(ctx, "muon-dp2", extra=muon + [f"checkpoint.dir={first}"]))
        try:
            run_steps(tr, 2)
            tr.save_checkpoint("gpu-check")
        finally:
            close(tr)
        saved = list_checkpoints(first)[-1][1]
        tr = make_trainer(ctx, overrides_for(ctx, "muon-tp2", extra=muon + [
            "parallel.tp=2", "parallel.sp=true", f"checkpoint.dir={again}", f"checkpoint.load={saved}"]))
        try:
            resumed_at = tr.step
            tr.save_checkpoint("gpu-check")
            loss = float(run_steps(tr, 1)[0]["loss"])
        finally:
            close(tr)
        verdict = [None]
        if ctx.main:
            a, b = read_whole_tensors(saved), read_whole_tensors(list_checkpoints(again)[-1][1])
            differ = sorted(set(a) ^ set(b)) + [k for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]
            verdict = [(len(a), sum(k.startswith("optimizer.") for k in a), differ[:3], len(differ))]
        if dist.is_initialized():
            dist.broadcast_object_list(verdict, src=0)
        n, n_opt, first_differ, n_differ = verdict[0]
        ok = resumed_at == 2 and n_differ == 0 and n_opt > 0 and math.isfinite(loss)
        ctx.report("PASS" if ok else "FAIL", "muon sharded dp2 -> tp2 resume",
                   f"resumed at step {resumed_at}; {n} tensors ({n_opt} optimizer) of the re-saved checkpoint, "
                   f"{n_differ} differ{' ' + str(first_differ) if n_differ else ''}; next loss {loss:.4f}")
    except Exception as e:  # noqa: BLE001  reported, the other checks go on
        if ctx.main:
            traceback.print_exc()
        ctx.report("FAIL", "muon sharded dp2 -> tp2 resume", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


def check_overlap_param_gather_save(ctx: Ctx) -> None:
    """DP = 2, distributed optimizer, overlapped param all-gather: right after step() the ranks
    hold different weights (each updated only its shard); the checkpoint holds the synced ones."""
    import torch.distributed as dist

    from training.pretrain import params_synced

    ck = os.path.join(ctx.workdir, "ckpt-overlap")
    extra = ["parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true", "optimizer.name=adamw",
             f"checkpoint.dir={ck}"]
    tr = make_trainer(ctx, overrides_for(ctx, "overlap", extra=extra))
    try:
        run_steps(tr, 2)
        w = weights(tr)

        def spread(ws):  # max over params of |rank 0 - rank 1|
            worst = 0.0
            for k in sorted(ws):
                t = ws[k].to(tr.device)
                other = t.clone()
                dist.broadcast(other, src=0)
                worst = max(worst, float((t - other).abs().max()))
            return _all_max(worst)

        before = spread(w)
        tr.save_checkpoint("gpu-check")  # syncs inside
        with params_synced(tr.chunks):
            w_synced = weights(tr)
        after = spread(w_synced)
        state = {f"{i}": {k: v.detach().float().clone() for k, v in tr._unwrap(c).state_dict().items()
                          if torch.is_tensor(v)} for i, c in enumerate(tr.chunks)}
    finally:
        close(tr)
    tr = make_trainer(ctx, overrides_for(ctx, "overlap-load", extra=extra + ["checkpoint.load_optimizer=false"]))
    try:
        loaded = {f"{i}": {k: v.detach().float() for k, v in tr._unwrap(c).state_dict().items() if torch.is_tensor(v)}
                  for i, c in enumerate(tr.chunks)}
    finally:
        close(tr)
    err = _all_max(max(float((loaded[i][k].to(state[i][k].device) - state[i][k]).abs().max())
                       for i in state for k in state[i] if not k.endswith("_extra_state")))
    ok = after == 0.0 and err == 0.0
    ctx.report("PASS" if ok else "FAIL", "dp2 overlap_param_gather save",
               f"ranks differ by {before:.3g} right after step() "
               f"({'unsynced shards' if before else 'no deferred all-gather on this path'}), "
               f"by {after:.3g} after the sync; "
               f"checkpoint vs synced weights {err:.3g}")


# ------------------------------------------------------------------------------------------------
# --perf (bench/gpu_check.sh --perf): the machine's ceilings, then the table of the whole run
# ------------------------------------------------------------------------------------------------
def _median_time(fn, reps: int, cuda: bool) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls after one warm-up (CUDA events on a GPU)."""
    import statistics

    fn()
    times = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check_roofline(ctx: Ctx) -> None:
    """The two ceilings of this machine, measured as METHOD says: a large device-to-device copy
    (bytes read + bytes written; 1 GiB each way, far over L2) and a large bf16 matrix product on
    random data (8192^3).  On CPU (smoke) the same at toy sizes in fp32."""
    dev = "cuda" if ctx.cuda else "cpu"
    n_copy = (1 << 28) if ctx.cuda else (1 << 20)  # fp32 elements: 1 GiB on the GPU, 4 MiB on CPU
    src = torch.randn(n_copy, device=dev)
    dst = torch.empty_like(src)
    t = _median_time(lambda: dst.copy_(src), 20 if ctx.cuda else 3, ctx.cuda)
    gbps = 2 * src.numel() * src.element_size() / t / 1e9
    del src, dst
    m = 8192 if ctx.cuda else 256
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    a = torch.randn(m, m, device=dev, dtype=dtype)
    b = torch.randn(m, m, device=dev, dtype=dtype)
    t_mm = _median_time(lambda: a @ b, 10 if ctx.cuda else 3, ctx.cuda)
    tflops = 2 * m ** 3 / t_mm / 1e12
    name = torch.cuda.get_device_name() if ctx.cuda else "CPU"
    ctx.report("PASS" if gbps > 0 and tflops > 0 else "FAIL", "roofline",
               f"{name}: copy {gbps:,.0f} GB/s (read + write, {n_copy * 4 >> 20} MiB each way, median of "
               f"{20 if ctx.cuda else 3}), {str(dtype).split('.')[-1]} GEMM {tflops:,.1f} TFLOP/s "
               f"({m}^3 random, median "
               f"of {10 if ctx.cuda else 3})", data={"copy_gbps": gbps, "gemm_tflops": tflops, "device": name})


def pack_dir(src: str, dst: str) -> int:
    """Every ``.json`` (parsed), ``.txt`` / ``.csv`` / ``.log`` (as text) file under ``src`` as one JSON
    object ``{relative path: content}`` in ``dst``: the device tool returns at most 8 files."""
    import json

    out = {}
    for root, _, files in os.walk(src):
        for f in sorted(files):
            path = os.path.join(root, f)
            rel = os.path.relpath(path, src)
            try:
                with open(path) as fh:
                    text = f.endswith((".txt", ".csv", ".log"))
                    out[rel] = json.load(fh) if f.endswith(".json") else fh.read() if text else None
            except (OSError, ValueError, UnicodeDecodeError) as e:
                out[rel] = f"unreadable: {type(e).__name__}"
    with open(dst, "w") as fh:
        json.dump(out, fh, indent=1)
    return len(out)


PERF_UNITS = (("mhc", "mHC N=4 sublayer", 0.50), ("xhc-mlp", "xHC MLP sublayer", 0.40),
              ("flash4", "Flash-4sub window", 0.40))
PERF_RATIOS = (("mhc", "mHC", 0.93), ("xhc", "xHC", None), ("xhc_flash4", "Flash-4sub", 0.80))
_FRACTION_KEYS = ("fraction_of_copy", "fraction_of_floor", "bw_fraction", "fraction")


def bandwidth_fractions(packed, log_text: str = "") -> Dict[str, float]:
    """``{unit: fraction of the copy bandwidth}`` for whole sublayers from ``bench.hc_kernels --perf``.

    Read from its JSON (any record with ``variant`` and ``scope: sublayer`` (or no scope) and one of
    ``fraction_of_copy`` / ``fraction_of_floor`` / ``bw_fraction`` / ``fraction``), else from its printed
    lines ``perf <variant> sublayer ... <p>% of copy``."""
    import re

    found: Dict[str, float] = {}

    def walk(obj):
        if isinstance(obj, dict):
            v = obj.get("variant") or obj.get("unit")
            if isinstance(v, str) and obj.get("scope", obj.get("kind", "sublayer")) == "sublayer":
                for k in _FRACTION_KEYS:
                    if isinstance(obj.get(k), (int, float)):
                        found.setdefault(v, float(obj[k]))
                        break
            for x in obj.values():
                walk(x)
        elif isinstance(obj, list):
            for x in obj:
                walk(x)

    walk(packed)
    for m in re.finditer(r"^perf (\S+) sublayer\b.*?([\d.]+)\s*% of (?:the )?copy", log_text, re.M):
        found.setdefault(m.group(1), float(m.group(2)) / 100)
    return found


def perf_table(results: str, log_text: str = "") -> List[str]:
    """The --perf run's last table from the files in ``results`` (rows in docs/gpu.md)."""
    import json

    def load(name):
        try:
            with open(os.path.join(results, name)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    summary = load("summary.json") or {}
    roof = {}
    for step in (summary.get("steps") or {}).values():
        for row in step.get("rows", []):
            if row.get("name") == "roofline" and row.get("data"):
                roof = row["data"]
    tput = load("throughput.json") or {}
    rows = {r["variant"]: r for r in tput.get("rows", [])}
    fracs = bandwidth_fractions(load("hc_perf.json") or {}, log_text)
    lines = [f"perf table: {roof.get('device', tput.get('device', '?'))}; copy "
             + (f"{roof['copy_gbps']:,.0f} GB/s, {roof.get('gemm_dtype', 'bfloat16')} GEMM "
                f"{roof['gemm_tflops']:,.1f} TFLOP/s"
                if roof else "not measured")]
    head = f"  {'quantity':<54} {'measured':>12} {'target':>9}  verdict"
    lines += [head, "  " + "-" * (len(head) - 2)]

    def row(label, value, target, ok):
        verdict = "n/a" if ok is None else ("MET" if ok else "MISSED")
        lines.append(f"  {label:<54} {value:>12} {target:>9}  {verdict}")

    van = rows.get("none")
    if van:
        extra = f", {van['mfu'] * tput['peak_tflops'] / roof['gemm_tflops']:.1%} of GEMM" if roof else ""
        row(f"vanilla tokens/s ({van['layers']} layers, {tput.get('tokens_per_step', '?')} tok/step)",
            f"{van['tokens_per_s']:,.0f}", "-", None)
        row(f"vanilla MFU (of {tput.get('peak_tflops', 0):g} TFLOP/s{extra})", f"{van['mfu']:.1%}", "-", None)
    for key, label, target in PERF_RATIOS:
        r = rows.get(key)
        if r is None:
            row(f"{label} / vanilla tokens/s", "not measured", f">= {target:.2f}x" if target else "-",
                None if not target else False)
            continue
        share = (r.get("profile") or {}).get("hc_share")
        row(f"{label} / vanilla tokens/s ({r['backend']}; HC share {'-' if share is None else f'{share:.0%}'})",
            f"{r['ratio']:.3f}x", f">= {target:.2f}x" if target else "-", None if not target else r["ratio"] >= target)
    for key, label, target in PERF_UNITS:
        f = fracs.get(key)
        row(f"{label} fwd+bwd, share of copy bandwidth", "not measured" if f is None else f"{f:.1%}",
            f">= {target:.0%}", False if f is None else f >= target)
    if os.path.exists(os.path.join(results, "tuned_blocks.json")):
        lines.append("  autotuned block sizes: commit them with  "
                     "cp <files_at>/tuned_blocks.json xhc/kernels/tuned_blocks.json")
    return lines


def check_perf_table(ctx: Ctx) -> None:
    results = ctx.results_dir or ctx.workdir
    log = ""
    try:
        with open(os.path.join(results, "gpu_check.log")) as f:
            log = f.read()
    except OSError:
        pass
    lines = perf_table(results, log)
    if ctx.main:
        print("\n".join(lines), flush=True)
    missed = sum(1 for line in lines if line.endswith("MISSED"))
    ctx.report("PASS", "perf table", f"{sum(1 for x in lines if x.endswith(('MET', 'MISSED')))} targets, "
               f"{missed} missed (targets are reported, not failed)", data={"lines": lines})


CHECKS = {"train_eval": check_train_eval, "variants": check_variants, "resume": check_resume,
          "pipeline": check_pipeline, "spec": check_spec, "throughput": check_throughput, "multi": check_multi,
          "bench": check_bench, "roofline": check_roofline, "perf_table": check_perf_table}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["pack"]:
        if len(argv) != 3:
            print("usage: python -m bench.gpu_checks pack DIR FILE", file=sys.stderr)
            return 2
        print(f"[gpu_checks] packed {pack_dir(argv[1], argv[2])} file(s) of {argv[1]} into {argv[2]}")
        return 0
    p = argparse.ArgumentParser(prog="python -m bench.gpu_checks", description=__doc__.split("\n\n")[0])
    p.add_argument("checks", nargs="+", choices=sorted(CHECKS))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="shrunk sizes (the CPU smoke run of bench/gpu_check.sh)")
    p.add_argument("--workdir", default=None, help="run and checkpoint directories (default: a temp dir, removed)")
    p.add_argument("--json", default=None, help="append every PASS/FAIL/SKIP line to `rows` of this JSON file")
    p.add_argument("--hc-kernels", default=None, choices=KERNEL_BACKENDS,
                   help="HC kernel backend of every model (default: the models' auto)")
    p.add_argument("--results", default=None, help="perf_table: the results folder of bench/gpu_check.sh --perf")
    p.add_argument("--warm", action="store_true", help="bench: only the first call of every row (fills the "
                   "Triton and inductor caches for a later run), nothing measured")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAIL setup: --device cuda but torch.cuda.is_available() is False", flush=True)
        return 1
    if args.device == "cpu":
        torch.set_num_threads(1)
    workdir = args.workdir or tempfile.mkdtemp(prefix="xhc-gpu-check-")
    ctx = Ctx(args.device, args.smoke, workdir, json_path=args.json, hc_kernels=args.hc_kernels, warm=args.warm)
    ctx.results_dir = args.results
    try:
        for name in args.checks:
            t0 = time.perf_counter()
            try:
                CHECKS[name](ctx)
            except Exception as e:
                if ctx.main:
                    traceback.print_exc()
                ctx.report("FAIL", name, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            if ctx.main:
                print(f"[gpu_checks] {name} took {time.perf_counter() - t0:.1f}s", flush=True)
                ctx.update_json(**{f"{name}_s": round(time.perf_counter() - t0, 1)})
    finally:
        if "models.parallel" in sys.modules:  # perf_table alone never imports Megatron
            from models.parallel import destroy_parallel

            destroy_parallel(destroy_process_group=True)
        if args.workdir is None and ctx.main:
            shutil.rmtree(workdir, ignore_errors=True)
    return 1 if any(r.startswith("FAIL") for r in ctx.results) else 0


if __name__ == "__main__":
    sys.exit(main())
