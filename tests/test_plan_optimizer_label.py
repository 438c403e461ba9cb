"""The plan's optimizer line says what the trainer builds (issue 52): on the CPU path
``optimizer.use_distributed_optimizer=true`` shards either optimizer's state over DP (the trainer's
``training.optim.shards_state``, which its start-up log reports as ``state sharded over dp=2``), so the plan
must neither call it replicated nor reuse the replicated bytes of another plan made in the same process."""

import warnings

import pytest

from training.config import load_config


def _cfg(optimizer: str, distributed: bool):
    return load_config(None, ["data.mock=true", "tokenizer.type=none", "tokenizer.vocab_size=256",
                              f"optimizer.name={optimizer}",
                              f"optimizer.use_distributed_optimizer={'true' if distributed else 'false'}",
                              "batch.micro_batch_size=2", "batch.global_batch_size=8"])


def _optimizer_line(plan) -> str:
    return next(line for line in plan.lines() if line.startswith("[plan]   optimizer"))


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_cpu_sharded_state_is_labelled_sharded_and_planned_apart_from_the_replicated(optimizer):
    from training.optim.core import shards_state
    from training.plan import make_plan
    from training.plan.model import _SPECS_CACHE

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _SPECS_CACHE.clear()
        alone = make_plan(_cfg(optimizer, False), 2, None).peak.state.optimizer  # replicated, fresh cache
        sharded = make_plan(_cfg(optimizer, True), 2, None)
        replicated = make_plan(_cfg(optimizer, False), 2, None)                  # after the sharded plan
    assert shards_state(_cfg(optimizer, True).optimizer, "torch")                 # what the trainer builds
    assert not shards_state(_cfg(optimizer, False).optimizer, "torch")
    line = _optimizer_line(sharded)
    assert "sharded over DP 2" in line and "replicated" not in line, line
    assert "replicated" in _optimizer_line(replicated) and "sharded" not in _optimizer_line(replicated)
    # the bytes: the replicated plan does not depend on what was planned before it, and each of the two
    # DP ranks owns a part of the state, so the fullest holds at least half of it and less than all
    assert replicated.peak.state.optimizer == alone
    assert alone / 2 <= sharded.peak.state.optimizer < alone
