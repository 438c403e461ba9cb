"""A CUDA machine without Transformer Engine (the GPU check's image), simulated on CPU.

Megatron-Core 0.16.x imports its TE-only MoE helpers (``te_general_gemm``, ``fused_*``) in one
``try/except ImportError``; without TE they stay unbound and the router's gating GEMM raises
``NameError`` at the first MoE forward.  ``models.cpu_compat`` binds them to ``None`` when TE is
absent, whether or not CUDA is (docs/gpu.md).  Each case runs in a fresh interpreter in which
``torch.cuda.is_available()`` answers True and ``import transformer_engine`` fails, so the
process sees what the GPU image shows Megatron; the gating GEMM itself runs on CPU tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.megatron]  # also run by the Python 3.12 / megatron-core 0.19 stage (names bound there)

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = r"""
import json, sys
import torch
torch.cuda.is_available = lambda: True          # a CUDA machine ...
sys.modules["transformer_engine"] = None         # ... without Transformer Engine (its import fails)
from megatron.core.transformer.moe import moe_utils

def gate():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 8, generator=g), torch.randn(3, 8, generator=g)
    try:
        out = moe_utils.router_gating_linear(x, w, None, torch.float32)
    except NameError as e:
        return "NameError: " + str(e)
    return "ok" if torch.allclose(out, x @ w.t()) else "wrong values"

report = {"have_te": bool(getattr(moe_utils, "HAVE_TE", False)),
          "unbound_before": "te_general_gemm" not in vars(moe_utils), "gate_before": gate()}
"""


def run_case(body: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", PRELUDE + body + "\nprint(json.dumps(report))"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_importing_the_trainer_modules_binds_the_te_names_on_a_cuda_machine_without_te():
    """``models.parallel`` (imported by the trainer and every check) imports cpu_compat, which binds
    the names; the CPU-only patches stay off (``enable_cpu_mode`` is a no-op with CUDA)."""
    rep = run_case(r"""
import models.parallel  # noqa: F401  (what training.pretrain and bench.gpu_checks import)
from models import cpu_compat
report["gate_after"] = gate()
report["te_general_gemm"] = repr(getattr(moe_utils, "te_general_gemm", "UNBOUND"))
report["enable_cpu_mode"] = cpu_compat.enable_cpu_mode()
report["current_device_patched"] = torch.cuda.current_device is cpu_compat._cpu_current_device
report["bound_again"] = cpu_compat.bind_te_less_moe_names()
""")
    assert rep["have_te"] is False
    if rep["unbound_before"]:  # 0.16.x: the bug, reproduced before the fix is imported
        assert rep["gate_before"].startswith("NameError") and "te_general_gemm" in rep["gate_before"], rep
    else:  # 0.17+ bind the names themselves
        assert rep["gate_before"] == "ok", rep
    assert rep["gate_after"] == "ok", rep
    assert rep["te_general_gemm"] == "None", rep
    assert rep["enable_cpu_mode"] is False and rep["current_device_patched"] is False, rep
    assert rep["bound_again"] == [], rep  # idempotent


@pytest.mark.slow
def test_nothing_is_bound_where_transformer_engine_imported():
    """With ``HAVE_TE`` true the module's own names are kept (a stand-in for TE's GEMM here)."""
    rep = run_case(r"""
from models import cpu_compat
sentinel = object()
fake = type(sys)("fake_moe_utils")
fake.HAVE_TE = True
report["with_te"] = cpu_compat.bind_te_less_moe_names(fake)
report["with_te_attrs"] = sorted(n for n in cpu_compat.TE_ONLY_MOE_NAMES if hasattr(fake, n))
fake2 = type(sys)("fake_moe_utils_2")
fake2.HAVE_TE = False
fake2.fused_permute = sentinel
report["without_te"] = cpu_compat.bind_te_less_moe_names(fake2)
report["kept"] = fake2.fused_permute is sentinel
""")
    assert rep["with_te"] == [] and rep["with_te_attrs"] == [], rep
    assert "te_general_gemm" in rep["without_te"] and "fused_permute" not in rep["without_te"], rep
    assert rep["kept"] is True, rep
