"""Streaming fragments (Streaming DiLoCo, arXiv 2501.18512; torchft's ``_StreamingDiLoCoFragment``):
the model's bucket groups split into F fragments that are synchronised in turn, so the link
carries about 1/F of the model at a time.

Pure functions over sizes and layer sets; the controller applies them to its bucket groups
(:mod:`megatron_edit.mcore.fragments`).

* :func:`partition`: contiguous fragments (in the forward order of the bucket groups) of about
  equal size. (A layer cut by a fragment boundary becomes one layer per fragment for the
  per-layer decisions: :func:`megatron_edit.mcore.fragments.split_layers`.)
* :func:`fragment_due`: which fragment is synchronised after a step. Fragment f is synchronised
  after the steps s > W with s - W = f H/F (mod H): every H/F steps one fragment, each
  fragment every H steps, fragment 0 on the grid of F = 1 (W + kH).
* :func:`fragment_of_sync`: the same order counted in syncs (the k-th sync exchanges fragment
  k mod F), which A-EDiT's time-based syncs follow (:mod:`megatron_edit.mcore.async_sync`).
"""

from __future__ import annotations

from typing import List, Optional, Sequence


class FragmentError(ValueError):
    """The bucket groups cannot make the fragments asked for."""


def partition(sizes: Sequence[float], fragments: int) -> List[List[int]]:
    """Split bucket groups ``0..n-1`` (sizes ``sizes``) into ``fragments`` non-empty lists of
    consecutive group indices, the largest fragment as small as possible (ties: the earlier
    split). Raises :class:`FragmentError` when there are fewer groups than fragments."""
    u, f = len(sizes), fragments
    if f < 1:
        raise FragmentError(f"fragments must be >= 1 (got {f})")
    if u < f:
        raise FragmentError(f"{u} bucket group{'s' if u != 1 else ''} cannot make {f} fragments")
    prefix = [0.0]
    for w in sizes:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[k][j]: the smallest largest fragment when groups[:j] make k fragments; cut: where the
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
    return [list(range(a, b)) for a, b in reversed(bounds)]


def fragment_due(steps_done: int, warmup_steps: int, sync_interval: int, fragments: int) -> Optional[int]:
    """The fragment synchronised after the optimizer step that brought the count to
    ``steps_done`` (None: no sync). Needs ``sync_interval % fragments == 0``."""
    period = sync_interval // fragments
    since = steps_done - warmup_steps
    if since <= 0 or since % period:
        return None
    return fragment_of_sync(since // period, fragments)


def fragment_of_sync(sync: int, fragments: int) -> int:
    """The fragment the ``sync``-th sync (1, 2, ...) exchanges when each sync exchanges one
    fragment in turn: ``sync mod F`` (fragment 1 first, fragment 0 at the F-th)."""
    return sync % fragments
