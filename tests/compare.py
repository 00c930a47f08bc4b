"""Comparisons of the tests' results, one helper per comparison: dicts of tensors by name (a
run's parameters, a snapshot of them). Used in the test process and inside ranks (tests/ is on
the path of both)."""

import torch


def max_difference(a, b):
    """The largest absolute difference between two dicts of tensors with the same names, as a
    Python float; different names fail."""
    assert a.keys() == b.keys(), f"different tensors: {sorted(a.keys() ^ b.keys())}"
    return max((a[k] - b[k]).abs().max().item() for k in a)


def all_equal(a, b):
    """Whether every tensor of ``a`` equals (``torch.equal``) the one of the same name in ``b``."""
    return all(torch.equal(a[k], b[k]) for k in a)
