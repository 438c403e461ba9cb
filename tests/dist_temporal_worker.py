"""Multi-rank worker for tests/test_temporal.py (gloo, CPU).

    python tests/dist_temporal_worker.py CASES.pt OUT_DIR WORLD

``CASES.pt`` holds a list of cases; each case has a name, the module state, the global inputs
``y [S, b, C]``, ``dV [S, b, K, C]`` (upstream gradient), optional ``pos [S, b]`` and a layout.
Every rank runs every case on its own rows and writes ``OUT_DIR/<name>.<rank>.pt`` with its
segments, local V, local dy, the all-reduced conv weight gradients, or the error message.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from models.sequence import distributed_sequence_context
from xhc.temporal import (
    TemporalAugmentation,
    cp_segments,
    sp_segments,
    take_segments,
    thd_cp_segments,
)


def _layout(case, rank, world):
    """(segments of this rank, segments passed to SequenceContext) for the case's layout."""
    S = case["y"].shape[0]
    kind = case["layout"]
    if kind == "sp":  # plain SP via the point-to-point halo exchange
        return sp_segments(S, world, rank), None
    if kind == "sp_general":  # the same layout through the general all-gather exchange
        segs = sp_segments(S, world, rank)
        return segs, segs
    if kind == "cp":  # load-balanced CP over all ranks
        segs = cp_segments(S, world, rank)
        return segs, segs
    if kind == "cp_sp":  # CP = 2 outer, SP = world/2 inner (Megatron rank order: tp fastest)
        sp = world // 2
        segs = cp_segments(S, 2, rank // sp, sp_size=sp, sp_rank=rank % sp)
        return segs, segs
    if kind == "thd_cp":
        segs = thd_cp_segments(case["cu_seqlens_padded"], world, rank)
        return segs, segs
    raise ValueError(kind)


def _run(rank, world, cases_path, out_dir, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    for case in torch.load(cases_path):
        segs, seq_segs = _layout(case, rank, world)
        m = TemporalAugmentation(case["y"].shape[-1], case["kernel_sizes"], case.get("conv_doc_reset", "auto"))
        m.load_state_dict(case["state"])
        m.double()
        y = take_segments(case["y"], segs).clone().requires_grad_(True)
        pos = take_segments(case["pos"], segs) if case.get("pos") is not None else None
        seq = distributed_sequence_context(pos, dist.group.WORLD, seq_segs)
        result = {"segments": segs}
        try:
            V = m(y, seq)
            (V * take_segments(case["dV"], segs)).sum().backward()
            grads = [w.grad.clone() for w in m.conv]
            for g in grads:  # conv weights are replicated: their gradients are all-reduced (§1.7)
                dist.all_reduce(g)
            result.update(V=V.detach(), dy=y.grad, dw=grads)
        except ValueError as e:
            result["error"] = str(e)
        torch.save(result, os.path.join(out_dir, f"{case['name']}.{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    cases_path, out_dir, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
    init_file = os.path.join(out_dir, "dist_init")
    mp.spawn(_run, args=(world, cases_path, out_dir, init_file), nprocs=world, join=True)
