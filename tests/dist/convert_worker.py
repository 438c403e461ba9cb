"""torchrun worker: zoo checkpoints saved under TP=2+SP, EP=2, PP=2 and PP=2+VPP=2 for the HF export tests.

Run (2 ranks, gloo, CPU)::

    python -m torch.distributed.run --nproc_per_node 2 tests/dist/convert_worker.py <out_dir> [mode...]

Each mode builds a tiny-moe model of the zoo under its layout, moves every parameter (and the
expert bias) off its init with the same seeded noise on every rank, and saves it with
``training.checkpoint.Checkpointer`` into ``<out_dir>/<mode>/checkpoints`` next to a
``config.yaml`` naming the preset (a run directory as ``training.pretrain`` lays it out).

- ``tp_sp``: xHC (temporal conv across the SP rank boundary), TP=2 + sequence parallel;
- ``ep``: mHC, EP=2 (DP=2 for the dense tensors);
- ``pp``: xHC-Flash-4sub, PP=2 (each stage holds one Flash-4sub window);
- ``vpp``: xHC, PP=2 with two virtual stages per rank (interleaved; saved as ``model0``/``model1``).

``tp_sp`` and ``ep`` also write the parallel model's own full-vocabulary logits for the batch of
:func:`batch` to ``<out_dir>/<mode>/logits.pt`` (the reference the exported model must match).
"""

from __future__ import annotations

import os
import sys

if __name__ in ("__main__", "__mp_main__"):  # run as the worker, not imported by a test: no dynamo
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

VOCAB, SEQ = 256, 32
NOISE = 0.05
MODES = {"tp_sp": ("tiny-moe:xhc", dict(tp=2), dict(tensor_model_parallel_size=2, sequence_parallel=True)),
         "ep": ("tiny-moe:mhc", dict(ep=2), dict(expert_model_parallel_size=2)),
         "pp": ("tiny-moe:xhc-flash4", dict(pp=2), dict(pipeline_model_parallel_size=2)),
         # interleaved: rank r holds virtual stages r and r + 2 (layers r and r + 2 of 4), as model0/model1
         "vpp": ("tiny-moe:xhc", dict(pp=2, vpp=2), dict(pipeline_model_parallel_size=2,
                                                          virtual_pipeline_model_parallel_size=2))}


def batch():
    import torch

    g = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g)


def run(mode: str, out_dir: str) -> int:
    import torch
    import torch.distributed as dist
    import yaml
    from megatron.core import parallel_state as ps

    from models.parallel import destroy_parallel, initialize_parallel
    from models.zoo import build_model, build_transformer_config, load_preset
    from training.checkpoint import Checkpointer, build_state

    preset_name, layout, parallel = MODES[mode]
    vp = layout.get("vpp", 1)
    initialize_parallel(timeout_minutes=2.0, **{k: v for k, v in layout.items() if k != "vpp"})
    preset = load_preset(preset_name)
    extra = {"pipeline_dtype": torch.float32} if layout.get("pp", 1) > 1 else {}
    if vp > 1:
        ps.set_virtual_pipeline_model_parallel_world_size(vp)  # as training.pretrain does
    cfg = build_transformer_config(preset, parallel=parallel, cpu=True, **extra)
    chunks = []
    for i in range(vp):
        if vp > 1:
            ps.set_virtual_pipeline_model_parallel_rank(i)
        chunks.append(build_model(preset, cfg, pre_process=ps.is_pipeline_first_stage(ignore_virtual=True) and i == 0,
                                  post_process=ps.is_pipeline_last_stage(ignore_virtual=True) and i == vp - 1,
                                  vp_stage=i if vp > 1 else None, use_transformer_engine=False, vocab_size=VOCAB,
                                  seq_length=SEQ))
    if vp > 1:
        ps.set_virtual_pipeline_model_parallel_rank(0)
    model = chunks[0]
    from tests.tiny_zoo import perturb

    perturb(chunks, torch.Generator().manual_seed(11), NOISE)  # the same noise on every rank: DP replicas agree
    run_dir = os.path.join(out_dir, mode)
    if dist.get_rank() == 0:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            yaml.safe_dump({"model": {"preset": preset_name}, "parallel": layout}, f)
    dist.barrier()
    state = build_state(chunks, trainer={"step": 1, "consumed_samples": 0, "skipped_steps": 0}, rng=False)
    Checkpointer(os.path.join(run_dir, "checkpoints")).save(1, state, {"world_size": dist.get_world_size(),
                                                                       "preset": preset_name, "parallel": layout})
    if vp > 1:  # which global layer each chunk holds, by Megatron's own layer numbering (1-based)
        norms = {layer.layer_number - 1: layer.input_layernorm.weight.detach().clone()
                 for chunk in chunks for layer in chunk.decoder.layers}
        torch.save(norms, os.path.join(run_dir, f"layer_norms_rank{dist.get_rank()}.pt"))
    if mode not in ("pp", "vpp"):
        tokens = batch()
        pos = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
        model.eval()
        with torch.no_grad():
            logits = model(tokens, pos, None)  # [b, s, V / tp]
        if ps.get_tensor_model_parallel_world_size() > 1:
            parts = [torch.empty_like(logits) for _ in range(ps.get_tensor_model_parallel_world_size())]
            dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
            logits = torch.cat(parts, -1)
        if dist.get_rank() == 0:
            torch.save(logits, os.path.join(run_dir, "logits.pt"))
    destroy_parallel()
    return 1


def main(argv):
    import functools

    import torch

    torch.set_num_threads(1)
    from tests.dist.launch import run_modes

    out_dir, modes = argv[0], argv[1:]
    run_modes({m: functools.partial(run, m, out_dir) for m in MODES}, modes, "checkpoints")


if __name__ == "__main__":
    main(sys.argv[1:])
