"""Streaming fragments (Streaming DiLoCo, arXiv 2501.18512; torchft's ``_StreamingDiLoCoFragment``):
the model's bucket groups split into F fragments that are synchronised in turn, so the link
carries about 1/F of the model at a time.

Pure functions over sizes and layer sets; the controller applies them to its bucket groups
(:mod:`megatron_edit.mcore.fragments`).

* :func:`partition`: contiguous fragments (in the forward order of the bucket groups) of about
  equal size; *closed over layers* when asked (no layer's parameters in two fragments, so a
  per-layer norm, and every decision of the penalty or of clipping taken from it, belongs to
  one fragment's sync).
* :func:`fragment_due`: which fragment is synchronised after a step. Fragment f is synchronised
  after the steps s > W with s - W = f H/F (mod H): every H/F steps one fragment, each
  fragment every H steps, fragment 0 on the grid of F = 1 (W + kH).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Set


class FragmentError(ValueError):
    """The bucket groups cannot make the fragments asked for."""


def _units(layers: Sequence[Set[int]], closed: bool) -> List[List[int]]:
    """Groups that must stay in one fragment, ordered by their first group: with ``closed``,
    the groups sharing a layer (transitively), otherwise one group each."""
    n = len(layers)
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    if closed:
        owner = {}
        for i, ls in enumerate(layers):
            for layer in ls:
                if layer in owner:
                    a, b = root(owner[layer]), root(i)
                    parent[max(a, b)] = min(a, b)
                else:
                    owner[layer] = i
    units = {}
    for i in range(n):
        units.setdefault(root(i), []).append(i)
    return [units[r] for r in sorted(units)]


def partition(sizes: Sequence[float], layers: Sequence[Set[int]], fragments: int, closed: bool) -> List[List[int]]:
    """Split bucket groups ``0..n-1`` (sizes ``sizes``, layer indices ``layers``) into
    ``fragments`` non-empty lists of group indices: consecutive units (see :func:`_units`),
    the largest fragment as small as possible (ties: the earlier split). Raises
    :class:`FragmentError` when there are fewer units than fragments."""
    if len(sizes) != len(layers):
        raise ValueError("one size and one layer set per bucket group")
    units = _units(layers, closed)
    if fragments < 1:
        raise FragmentError(f"fragments must be >= 1 (got {fragments})")
    if len(units) < fragments:
        raise FragmentError(
            f"{len(units)} bucket group{'s' if len(units) != 1 else ''}"
            f"{' closed over layers' if closed else ''} cannot make {fragments} fragments")
    weight = [float(sum(sizes[g] for g in unit)) for unit in units]
    u, f = len(units), fragments
    prefix = [0.0]
    for w in weight:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][j]: the smallest largest fragment when units[:j] make k fragments; cut: where the
    # last of them starts.
    best = [[inf] * (u + 1) for _ in range(f + 1)]
    cut = [[0] * (u + 1) for _ in range(f + 1)]
    best[0][0] = 0.0
    for k in range(1, f + 1):
        for j in range(k, u - (f - k) + 1):
            for i in range(k - 1, j):
                cost = max(best[k - 1][i], prefix[j] - prefix[i])
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    bounds, j = [], u
    for k in range(f, 0, -1):
        bounds.append((cut[k][j], j))
        j = cut[k][j]
    return [sorted(g for unit in units[a:b] for g in unit) for a, b in reversed(bounds)]


def fragment_due(steps_done: int, warmup_steps: int, sync_interval: int, fragments: int) -> Optional[int]:
    """The fragment synchronised after the optimizer step that brought the count to
    ``steps_done`` (None: no sync). Needs ``sync_interval % fragments == 0``."""
    period = sync_interval // fragments
    since = steps_done - warmup_steps
    if since <= 0 or since % period:
        return None
    return (since // period) % fragments
