"""training.optim.shard_owners: the deterministic owner assignment of a sharded optimizer state."""

import random

import pytest

from training.optim import assign_owners, newton_schulz_cost


@pytest.mark.parametrize("group_size", [1, 2, 3, 8])
def test_lpt_bound_and_determinism(group_size):
    rng = random.Random(group_size)
    costs = [rng.choice([1, 4, 16, 64, 256]) * rng.randint(1, 9) for _ in range(37)]
    owners = assign_owners(costs, group_size)
    assert owners == assign_owners(list(costs), group_size)
    assert set(owners) <= set(range(group_size))
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(group_size)]
    assert sum(loads) == sum(costs)
    assert max(loads) <= sum(costs) / group_size + max(costs)


def test_equal_items_spread_evenly_and_ties_go_to_lowest_rank():
    assert assign_owners([5, 5, 5, 5], 2) == [0, 1, 0, 1]
    assert assign_owners([1], 4) == [0]


def test_newton_schulz_cost_is_transpose_invariant_and_counts_batches():
    a, b, c = newton_schulz_cost((4, 8), steps=1), newton_schulz_cost((8, 4), steps=1), newton_schulz_cost((3, 4, 8), steps=1)
    assert a == b == 2 * 4 * 4 * 8 + 4 ** 3
    assert c == 3 * a
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        newton_schulz_cost((5,))
