"""The planner against published runs that nobody here wrote: planned vs published tokens/s/GPU, and fits.

    python -m bench.plan_public            # one row per published run: layout, planned / published, fits
    python -m bench.plan_public --json     # the same as JSON (rows with their sources)
    python -m bench.plan_public --detail   # and each row's full plan (memory by part, time by component)

Each row is data (:data:`RUNS`): the model's dimensions (:data:`MODELS`), the GPU kind and count, the layout,
the batch, the sequence length, the dtype, the published tokens/s/GPU and the dispatcher, recompute and
overlap settings of the run, with the source it was read from.  Published tokens/s/GPU is
``seq · global batch / step time / GPUs`` for the runs that publish a step time; where a run publishes
TFLOP/s/GPU only, the conversion is stated in the row.  The planner sees each run as a ``vanilla`` preset with
the run's settings as training-config keys (:func:`run_config`) and plans it with its default efficiencies
(one set for every row: no per-row factor).  docs/planning.md ("Published runs") shows this table and the
remaining error per row with its cause.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Dict, List, Optional

# ------------------------------------------------------------------------------------------------
# The models (Megatron argument names; dimensions from the sources of the runs below)
# ------------------------------------------------------------------------------------------------
MODELS: Dict[str, dict] = {
    "llama3.1-8b": dict(  # Meta Llama 3.1 8B (config.json of meta-llama/Llama-3.1-8B; the dgxc README's FLOP notes)
        num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8, kv_channels=128,
        ffn_hidden_size=14336, vocab_size=128256, qk_layernorm=False, rotary_base=500000),
    "llama3.1-70b": dict(  # Meta Llama 3.1 70B
        num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8, kv_channels=128,
        ffn_hidden_size=28672, vocab_size=128256, qk_layernorm=False, rotary_base=500000),
    "mixtral-8x22b": dict(  # yanring/Megatron-MoE-ModelZoo model_configs/benchmarking/Mixtral-8x22B.yaml
        num_layers=56, hidden_size=6144, num_attention_heads=48, num_query_groups=8, kv_channels=128,
        ffn_hidden_size=16384, num_moe_experts=8, moe_ffn_hidden_size=16384, moe_router_topk=2,
        vocab_size=32000, qk_layernorm=False),
    # yanring/Megatron-MoE-ModelZoo model_configs/benchmarking/Qwen3-235B-A22B.yaml: 94 layers, and the runs
    # pass --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split (runtime.conf: "96
    # layers, account loss and embedding"): the pipeline is cut as 96 layer slots.  The planner's split is
    # uniform, so the model is planned with 96 layers: about 2 % more layer work than the real run (named
    # as a cause of the rows' residual in docs/planning.md).
    "qwen3-235b-a22b": dict(
        num_layers=96, hidden_size=4096, num_attention_heads=64, num_query_groups=4, kv_channels=128,
        ffn_hidden_size=12288, num_moe_experts=128, moe_ffn_hidden_size=1536, moe_router_topk=8,
        vocab_size=151936, qk_layernorm=True),
}

DGXC_8B = ("NVIDIA/dgxc-benchmarking llama3.1/README_8b.md (GSW 25.01, NeMo 24.09), 'Llama 3.1 8b 24.09 BF16' "
           "table; NeMo's Llama 3.1 8B recipe: no recompute, distributed optimizer, DP overlap")
DGXC_70B = ("NVIDIA/dgxc-benchmarking llama3.1/README_70b.md (GSW 25.01, NeMo 24.09), 'Llama 3.1 70b 24.09 BF16' "
            "table; NeMo's Llama 3.1 70B recipe: TP communication overlap (userbuffers), no recompute, "
            "distributed optimizer, DP overlap")
MOE_ZOO_MIXTRAL = ("yanring/Megatron-MoE-ModelZoo best_practice/Mixtral/run_mixtral_8x22B.sh (dropless, "
                   "alltoall dispatcher) and model_configs/benchmarking/Mixtral-8x22B.yaml (--tp-comm-overlap, "
                   "--moe-grouped-gemm, --moe-permute-fusion, distributed optimizer, DP overlap, no recompute)")
MOE_ZOO_QWEN3 = ("yanring/Megatron-MoE-ModelZoo best_practice/qwen3/readme.md, H100 table (256 H100, IB 8x50 GB/s) "
                 "and model_configs/benchmarking/Qwen3-235B-A22B.yaml (grouped GEMM, permute fusion, distributed "
                 "optimizer, DP overlap, no TP comm overlap)")


def _tok(seq: int, gbs: int, step_s: float, gpus: int) -> float:
    return seq * gbs / step_s / gpus


# ------------------------------------------------------------------------------------------------
# The runs.  settings: dispatcher ("alltoall" | "flex" = DeepEP), recompute ("none" | "selective" with
# Megatron's recompute_modules), tp_comm_overlap, ep_overlap (Megatron's overlap_moe_expert_parallel_comm,
# the ModelZoo's "1F1B overlap" / A2A_OVERLAP=1), dp_overlap (overlap_grad_reduce + overlap_param_gather).
# ------------------------------------------------------------------------------------------------
RUNS: List[dict] = [
    dict(name="Llama 3.1 8B, 8 GPUs", model="llama3.1-8b", gpu="h100", gpus=8,
         layout=dict(tp=1, pp=1, cp=2), mbs=1, gbs=128, seq=8192, dtype="bf16",
         step_s=12.91, published=_tok(8192, 128, 12.91, 8),
         settings=dict(recompute="none", tp_comm_overlap=False, dp_overlap=True), source=DGXC_8B),
    dict(name="Llama 3.1 8B, 128 GPUs", model="llama3.1-8b", gpu="h100", gpus=128,
         layout=dict(tp=1, pp=1, cp=2), mbs=1, gbs=2048, seq=8192, dtype="bf16",
         step_s=13.10, published=_tok(8192, 2048, 13.10, 128),
         settings=dict(recompute="none", tp_comm_overlap=False, dp_overlap=True), source=DGXC_8B),
    dict(name="Llama 3.1 70B, 64 GPUs", model="llama3.1-70b", gpu="h100", gpus=64,
         layout=dict(tp=4, sp=True, pp=4, vpp=5, cp=2), mbs=1, gbs=128, seq=8192, dtype="bf16",
         step_s=14.72, published=_tok(8192, 128, 14.72, 64),
         settings=dict(recompute="none", tp_comm_overlap=True, dp_overlap=True), source=DGXC_70B),
    dict(name="Llama 3.1 70B, 1024 GPUs", model="llama3.1-70b", gpu="h100", gpus=1024,
         layout=dict(tp=4, sp=True, pp=4, vpp=5, cp=2), mbs=1, gbs=2048, seq=8192, dtype="bf16",
         step_s=14.92, published=_tok(8192, 2048, 14.92, 1024),
         settings=dict(recompute="none", tp_comm_overlap=True, dp_overlap=True), source=DGXC_70B),
    # The ModelZoo publishes 445 TFLOP/s/GPU for this run (issue 52's reading); the tokens/s/GPU is that over
    # Megatron-LM's training FLOPs per token of the model at seq 4096 (num_floating_point_operations:
    # 242.1 GFLOP/token), as issue 52 converts it.  runtime.conf's default for the model is VPP 1; the issue
    # plans VPP 7 (one layer per virtual stage), which is what this row plans.
    dict(name="Mixtral 8x22B, 128 GPUs", model="mixtral-8x22b", gpu="h100", gpus=128,
         layout=dict(tp=2, sp=True, pp=8, vpp=7, ep=8, etp=1), mbs=1, gbs=256, seq=4096, dtype="bf16",
         step_s=None, published=1838.0,
         settings=dict(dispatcher="alltoall", recompute="none", tp_comm_overlap=True, dp_overlap=True),
         source=MOE_ZOO_MIXTRAL + "; 445 TFLOP/s/GPU -> 1,838 tokens/s/GPU (issue 52)"),
    dict(name="Qwen3-235B-A22B, EP 32", model="qwen3-235b-a22b", gpu="h100", gpus=256,
         layout=dict(tp=2, sp=True, pp=8, vpp=4, ep=32, etp=1), mbs=1, gbs=2048, seq=4096, dtype="bf16",
         step_s=19.7, published=_tok(4096, 2048, 19.7, 256),
         settings=dict(dispatcher="flex", recompute="selective", recompute_modules=["layernorm", "moe_act"],
                       tp_comm_overlap=False, dp_overlap=True), source=MOE_ZOO_QWEN3 + ", row 1 (DeepEP, norm+act)"),
    dict(name="Qwen3-235B-A22B, EP 32, 1F1B A2A overlap", model="qwen3-235b-a22b", gpu="h100", gpus=256,
         layout=dict(tp=2, sp=True, pp=8, vpp=4, ep=32, etp=1), mbs=1, gbs=2048, seq=4096, dtype="bf16",
         step_s=17.6, published=_tok(4096, 2048, 17.6, 256),
         settings=dict(dispatcher="flex", recompute="selective", recompute_modules=["layernorm", "moe_act"],
                       tp_comm_overlap=False, dp_overlap=True, ep_overlap=True),
         source=MOE_ZOO_QWEN3 + ", row 2 ('+1f1b overlap')"),
    dict(name="Qwen3-235B-A22B, TP 4, EP 8", model="qwen3-235b-a22b", gpu="h100", gpus=256,
         layout=dict(tp=4, sp=True, pp=8, vpp=4, ep=8, etp=1), mbs=1, gbs=2048, seq=4096, dtype="bf16",
         step_s=29.0, published=_tok(4096, 2048, 29.0, 256),
         settings=dict(dispatcher="flex", recompute="none", tp_comm_overlap=False, dp_overlap=True),
         source=MOE_ZOO_QWEN3 + ", intra-node EP row 3 (DeepEP, no recompute)"),
    dict(name="Qwen3-235B-A22B, PP 32, EP 8", model="qwen3-235b-a22b", gpu="h100", gpus=256,
         layout=dict(tp=2, sp=True, pp=32, vpp=3, ep=8, etp=1), mbs=1, gbs=2048, seq=4096, dtype="bf16",
         step_s=24.2, published=_tok(4096, 2048, 24.2, 256),
         settings=dict(dispatcher="alltoall", recompute="selective", recompute_modules=["layernorm", "moe_act"],
                       tp_comm_overlap=False, dp_overlap=True), source=MOE_ZOO_QWEN3 + ", intra-node EP row 2 (A2A)"),
]

FAMILY = {"llama3.1-8b": "dense", "llama3.1-70b": "dense", "mixtral-8x22b": "coarse-moe",
          "qwen3-235b-a22b": "fine-moe"}
"""The bound each family's rows are held to (tests/test_plan_public.py): dense and coarse MoE ±15 %, fine
MoE ±30 % (issue 52)."""


def run_preset(model: str, settings: Optional[dict] = None):
    """The run's model as a ``vanilla`` zoo preset (the zoo's defaults under the model's dimensions; the MoE
    router settings of the zoo are left as they are: they change no byte or FLOP the planner counts)."""
    from models.zoo import CONFIG_DIR, ModelPreset, _read_yaml
    from xhc.config import HCConfig

    backbone = {**(_read_yaml(CONFIG_DIR / "_defaults.yaml").get("backbone") or {}), **MODELS[model]}
    backbone["seq_length"] = backbone.get("seq_length", 4096)
    backbone["moe_grouped_gemm"] = True if backbone.get("num_moe_experts") else None
    # Megatron-LM's --swiglu turns its fused bias-SwiGLU on (bias_swiglu_fusion, default true) for every run here
    backbone["bias_activation_fusion"] = True
    for key, value in _backbone_settings(settings or {}).items():
        backbone[key] = value
    return ModelPreset(name=f"{model}:vanilla", backbone=backbone, hc=HCConfig.from_dict({"variant": "none"}))


def _backbone_settings(settings: dict) -> dict:
    """The run's settings that are Megatron TransformerConfig fields (passed as ``model.backbone.*``)."""
    out = {}
    if settings.get("dispatcher"):
        out["moe_token_dispatcher_type"] = settings["dispatcher"]
        out["moe_permute_fusion"] = True
    if settings.get("recompute_modules"):
        out["recompute_modules"] = list(settings["recompute_modules"])
    return out


def _known_keys() -> set:
    """Dotted keys the training config knows today (the bench passes only those it knows)."""
    import dataclasses

    from training.config import PretrainConfig

    out = set()
    for f in dataclasses.fields(PretrainConfig):
        sect = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if sect is not None and dataclasses.is_dataclass(sect):
            out |= {f"{f.name}.{g.name}" for g in dataclasses.fields(sect)}
    return out


def run_config(run: dict):
    """The training config of one published run (overrides of the embedded default; mock data, the run's
    padded vocabulary) and its preset."""
    from training.config import load_config

    lay, st = run["layout"], run["settings"]
    model = MODELS[run["model"]]
    over = ["data.mock=true", "tokenizer.type=none", f"tokenizer.vocab_size={model['vocab_size']}",
            f"tokenizer.padded_vocab_size={model['vocab_size']}", "run.precision=bf16", "optimizer.name=adamw",
            "optimizer.use_distributed_optimizer=true",
            f"batch.micro_batch_size={run['mbs']}", f"batch.global_batch_size={run['gbs']}", f"batch.seq_length={run['seq']}",
            f"model.recompute={st.get('recompute', 'none')}"]
    for k in ("tp", "sp", "pp", "vpp", "cp", "ep", "etp"):
        if k in lay:
            v = lay[k]
            over.append(f"parallel.{k}={'true' if v is True else 'false' if v is False else v}")
    known = _known_keys()
    dp = "true" if st.get("dp_overlap") else "false"
    extra = {"parallel.overlap_grad_reduce": dp, "parallel.overlap_param_gather": dp,
             "parallel.tp_comm_overlap": "true" if st.get("tp_comm_overlap") else "false",
             "parallel.ep_overlap": "true" if st.get("ep_overlap") else "false"}
    over += [f"{k}={v}" for k, v in extra.items() if k in known]
    return load_config(None, over), run_preset(run["model"], st)


def plan_run(run: dict, eff=None):
    """:func:`training.plan.make_plan` of one published run on its GPUs."""
    from training.plan import GPUS, Efficiencies, make_plan

    cfg, preset = run_config(run)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_plan(cfg, run["gpus"], GPUS[run["gpu"]], eff or Efficiencies(), preset=preset)


def rows(eff=None) -> List[dict]:
    """Planned vs published, one dict per run."""
    out = []
    for run in RUNS:
        plan = plan_run(run, eff)
        planned = plan.tokens_per_s / run["gpus"]
        d = plan.to_dict()
        out.append({"name": run["name"], "family": FAMILY[run["model"]], "gpus": run["gpus"], "gpu": run["gpu"],
                    "layout": plan.lay.describe(), "published": run["published"], "planned": planned,
                    "ratio": planned / run["published"], "fits": bool(plan.fits), "peak_gib": d["total_gib"],
                    "capacity_gib": d["capacity_gib"], "mfu": plan.mfu, "source": run["source"],
                    "settings": run["settings"], "plan": plan})
    return out


def fit_moe_overhead(eff=None) -> float:
    """The one fitted efficiency: ``moe_layer_overhead_ms`` minimising the squared log ratio planned/published
    over the MoE rows (scipy's bounded scalar minimiser, 0-5 ms); every other efficiency stays at its default."""
    import dataclasses
    import math

    from scipy.optimize import minimize_scalar

    from training.plan import Efficiencies

    base = eff or Efficiencies()
    moe = [r for r in RUNS if FAMILY[r["model"]] != "dense"]

    def loss(ms: float) -> float:
        e = dataclasses.replace(base, moe_layer_overhead_ms=ms)
        return sum(math.log(plan_run(r, e).tokens_per_s / r["gpus"] / r["published"]) ** 2 for r in moe)

    return float(minimize_scalar(loss, bounds=(0.0, 5.0), method="bounded", options={"xatol": 1e-3}).x)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.plan_public", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print JSON rows with their sources")
    ap.add_argument("--detail", action="store_true", help="print each row's whole plan too")
    ap.add_argument("--fit", action="store_true", help="fit moe_layer_overhead_ms on the MoE rows and print it")
    args = ap.parse_args(argv)
    if args.fit:
        print(f"moe_layer_overhead_ms fitted on the {sum(FAMILY[r['model']] != 'dense' for r in RUNS)} MoE rows: "
              f"{fit_moe_overhead():.3f}")
        return 0
    table = rows()
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "plan"} for r in table], indent=1))
        return 0
    print(f"{'run':<42}{'GPUs':>5}  {'layout':<52}{'published':>10}{'planned':>9}{'ratio':>7}{'peak GiB':>9}  fits")
    for r in table:
        print(f"{r['name']:<42}{r['gpus']:>5}  {r['layout'][:52]:<52}{r['published']:>10,.0f}{r['planned']:>9,.0f}"
              f"{r['ratio']:>7.2f}{r['peak_gib']:>9.1f}  {'yes' if r['fits'] else 'NO'}")
        if args.detail:
            print("\n".join("    " + line for line in r["plan"].lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
