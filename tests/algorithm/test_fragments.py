"""Streaming fragments' pure functions: the partition of bucket groups and the schedule."""

import itertools

import pytest

from megatron_edit.algorithm.fragments import FragmentError, fragment_due, fragment_of_sync, partition


def _brute_force(sizes, fragments):
    """The smallest largest fragment over every contiguous split (independent of the DP)."""
    n, best = len(sizes), None
    for cuts in itertools.combinations(range(1, n), fragments - 1):
        bounds = (0,) + cuts + (n,)
        worst = max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("sizes,fragments", [
    ([5, 1, 1, 1, 1, 5], 2), ([5, 1, 1, 1, 1, 5], 3), ([1, 2, 3, 4, 5, 6, 7], 4), ([9, 1, 1, 1], 2),
    ([3, 3, 3, 3], 4), ([1] * 9, 3), ([100, 1, 1, 1, 1, 1, 1, 1], 4), ([4, 2, 2, 4, 1, 4], 1),
])
def test_partition_is_contiguous_complete_and_as_balanced_as_possible(sizes, fragments):
    parts = partition(sizes, fragments)
    assert len(parts) == fragments and all(parts)
    assert [g for p in parts for g in p] == list(range(len(sizes)))  # contiguous, in order, complete
    assert max(sum(sizes[g] for g in p) for p in parts) == _brute_force(sizes, fragments)


def test_partition_examples():
    assert partition([1, 1, 1, 1], 2) == [[0, 1], [2, 3]]
    assert partition([10, 1, 1, 1, 1, 10], 3) == [[0], [1, 2, 3, 4], [5]]


def test_too_few_groups_is_an_error_naming_the_count():
    with pytest.raises(FragmentError, match="3 bucket groups cannot make 4 fragments"):
        partition([1, 1, 1], 4)


def test_fragment_due_is_each_fragment_every_h_steps_in_turn():
    # W = 2, H = 8, F = 4: a sync every 2 steps after warmup, fragment f at s - W = 2f (mod 8)
    due = {s: fragment_due(s, 2, 8, 4) for s in range(0, 21)}
    assert {s: f for s, f in due.items() if f is not None} == {4: 1, 6: 2, 8: 3, 10: 0, 12: 1, 14: 2, 16: 3, 18: 0, 20: 1}
    # F = 1: the grid of W + kH, fragment 0
    assert [s for s in range(30) if fragment_due(s, 2, 8, 1) is not None] == [10, 18, 26]
    assert all(fragment_due(s, 2, 8, 1) in (None, 0) for s in range(30))


def test_fragment_of_sync_is_the_grid_s_order_counted_in_syncs():
    """A-EDiT's k-th real sync exchanges the fragment EDiT's grid syncs at W + k H/F."""
    assert [fragment_of_sync(k, 4) for k in range(1, 9)] == [1, 2, 3, 0, 1, 2, 3, 0]
    assert [fragment_of_sync(k, 4) for k in range(1, 9)] == [fragment_due(2 + 2 * k, 2, 8, 4) for k in range(1, 9)]
    assert fragment_of_sync(5, 1) == 0
