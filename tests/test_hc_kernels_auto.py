"""``HCConfig.kernels='auto'`` on CPU: the measured choice between the fused ops and the eager
reference (xhc.kernels.autoselect), its override, and its agreement across ranks."""

import os
import tempfile

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from xhc import kernels
from xhc.kernels import autoselect


@pytest.fixture
def fresh(monkeypatch):
    """No decision yet and no env override (conftest fixes one for the rest of the suite)."""
    monkeypatch.delenv(autoselect.ENV, raising=False)
    autoselect.reset()
    yield monkeypatch
    autoselect.reset()


@pytest.mark.parametrize("faster", ["compile", "eager"])
def test_auto_takes_the_faster_backend(fresh, faster):
    slower = "eager" if faster == "compile" else "compile"
    fresh.setattr(autoselect, "measure", lambda reps=3: {faster: 1.0, slower: 2.5})
    assert kernels.resolve_backend("auto", "cpu") == faster
    c = autoselect.current()
    assert c.backend == faster and c.source == "measured" and c.ms[slower] == 2.5
    # decided once: a later (different) measurement is not taken without refresh
    fresh.setattr(autoselect, "measure", lambda reps=3: {faster: 9.0, slower: 1.0})
    assert kernels.resolve_backend("auto", "cpu") == faster
    assert autoselect.decide(broadcast=False, refresh=True).backend == slower
    # explicit backends are never affected
    assert kernels.resolve_backend("eager", "cpu") == "eager"
    assert kernels.resolve_backend("compile", "cpu") == "compile"


def test_env_override_and_its_error(fresh):
    fresh.setattr(autoselect, "measure", lambda reps=3: pytest.fail("the override must not measure"))
    fresh.setenv(autoselect.ENV, "eager")
    assert kernels.resolve_backend("auto", "cpu") == "eager"
    assert autoselect.current().source == "env"
    autoselect.reset()
    fresh.setenv(autoselect.ENV, "fast")
    with pytest.raises(ValueError, match="XHC_HC_KERNELS_AUTO='fast' is invalid: allowed values are compile, eager"):
        kernels.resolve_backend("auto", "cpu")


def test_ties_go_to_compile():
    assert autoselect.pick({"compile": 1.0, "eager": 1.0}) == "compile"
    assert autoselect.pick({"compile": 1.1, "eager": 1.0}) == "eager"


def test_distributed_without_decide_does_not_measure(fresh):
    fresh.setattr(autoselect, "_distributed_world", lambda: 2)
    fresh.setattr(autoselect, "measure", lambda reps=3: pytest.fail("must not measure per rank"))
    with pytest.warns(UserWarning, match="distributed job without xhc.kernels.autoselect.decide"):
        assert kernels.resolve_backend("auto", "cpu") == "compile"


def test_probe_really_runs_both_backends(fresh):
    ms = autoselect.measure(reps=1)
    assert set(ms) == {"compile", "eager"} and all(v > 0 for v in ms.values())
    assert "probe compile" in autoselect.decide(broadcast=False).describe()


def _rank_main(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    os.environ.pop(autoselect.ENV, None)
    autoselect.reset()
    # rank 1 would measure the opposite answer: every rank must take rank 0's
    autoselect.measure = (lambda reps=3: {"compile": 1.0, "eager": 3.0}) if rank == 0 else \
        (lambda reps=3: {"compile": 5.0, "eager": 1.0})
    c = autoselect.decide(broadcast=True)
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(f"{c.backend} {c.source} {kernels.resolve_backend('auto', 'cpu')}")
    dist.destroy_process_group()


def test_ranks_take_rank_zeros_measurement():
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank_main, args=(os.path.join(d, "init"), d), nprocs=2, join=True)
        got = [open(os.path.join(d, f"rank{r}")).read().split() for r in range(2)]
    assert got[0] == ["compile", "measured", "compile"]
    assert got[1] == ["compile", "rank", "0", "compile"]
