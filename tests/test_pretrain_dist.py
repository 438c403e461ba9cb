"""xhc-pretrain under torchrun (2 ranks, gloo, CPU): DP=2, TP=2+SP, EP=2 and PP=2 each fit the
mock data (a repeated id pattern) far below the initial loss, in one torchrun launch
(tests/dist/pretrain_worker.py drives training.pretrain.Trainer for each layout), saving
asynchronously (``checkpoint.async_save``) on every layout."""

from __future__ import annotations

import json
import math

import pytest

pytestmark = pytest.mark.megatron  # the Python 3.12 / newest megatron-core CI stage runs these

pytest.importorskip("megatron.core")

INITIAL = math.log(128)  # vocab 128: a fresh model predicts about uniformly
THRESHOLD = 0.5          # nats/token after 24 steps (a fresh model: 4.85)


@pytest.fixture(scope="module")
def results(run_torchrun, tmp_path_factory):
    out = tmp_path_factory.mktemp("pretrain_dist")
    proc = run_torchrun("tests/dist/pretrain_worker.py", nproc=2, args=[str(out)], timeout=600)
    found = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            _, mode, payload = line.split(" ", 2)
            found[mode] = json.loads(payload)
    assert sorted(found) == ["dp", "ep", "pp", "tp_sp"], proc.stdout[-4000:]
    return found


@pytest.mark.parametrize("mode, dp", [("dp", 2), ("tp_sp", 1), ("ep", 2), ("pp", 1)])
@pytest.mark.slow
def test_layout_fits_the_mock_data(results, mode, dp):
    r = results[mode]
    assert r["dp"] == dp
    losses = r["losses"]
    assert len(losses) == 24 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - INITIAL) < 0.1, losses[0]
    assert losses[-1] < THRESHOLD, losses[-5:]
    assert r["eval"][-1] < THRESHOLD
    # saved by both ranks (8 and 16 in the background, checkpoint.async_save), manifests written and verified
    assert [c for c in r["checkpoints"] if c.startswith("step_")] == ["step_00000008", "step_00000016", "step_00000024"]
    assert r["verified"] == [8, 16, 24]
    assert r["hc"] > 0  # HC health hooks found the xHC modules
    if mode == "pp":  # one MTP depth on the last stage (models/mtp.py): logged per logging interval, learning
        assert r["mtp"] and all(len(m) == 1 and math.isfinite(m[0]) for m in r["mtp"])
        assert r["mtp"][-1][0] < r["mtp"][0][0] - 1.0, r["mtp"]
    else:
        assert not r["mtp"]


def test_dp_and_tp_sp_agree_on_the_first_step(results):
    # Same seed, same global batch, CPU initialisation independent of TP: the first loss is the
    # same whichever way the batch and the weights are split.
    assert abs(results["dp"]["losses"][0] - results["tp_sp"]["losses"][0]) < 1e-5
