"""One rank's shard of one bucket of parameters (EDiT, arXiv 2412.07210, Sec. 3.2).

Megatron's distributed optimizer cuts every bucket of the model into as many equal, contiguous
shards as the worker has ranks; each rank keeps the fp32 main parameters of its shard. EDiT's
per-shard state (the anchor, error feedback's residuals) is a flat fp32 tensor of the shard's
length, and a shard is described here by plain tensors and index ranges so that the exchange
can be run, and tested, without Megatron. A shard holds its layout and what persists across
syncs; what one sync holds while it runs is in :mod:`.in_flight`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Set, Tuple

import torch

Segment = Tuple[int, int, int, bool]
"""(start, end, layer, counts_in_norm): one parameter's elements inside the shard, the layer it
belongs to, and whether it counts in that layer's norm (False for a tensor-parallel duplicate
held by tensor-parallel rank > 0, e.g. a layer norm)."""

Run = Tuple[int, int, int, bool]
"""Adjacent segments of the same layer (and norm flag) merged: far fewer tensor operations."""


def merge_runs(segments: List[Segment]) -> List[Run]:
    """Adjacent segments with the same layer and norm flag, as one run each."""
    runs: List[Run] = []
    for s, e, layer, counts in sorted(segments):
        if runs and runs[-1][1] == s and runs[-1][2] == layer and runs[-1][3] == counts:
            runs[-1] = (runs[-1][0], e, layer, counts)
        elif e > s:
            runs.append((s, e, layer, counts))
    return runs


@dataclass
class BucketShard:
    """This rank's shard of one bucket, and the EDiT tensors of that shard."""

    numel: int
    """Shard length: the bucket's length / ranks per worker (padding included)."""
    mains: List[torch.Tensor]
    """The fp32 main parameters that fall in this shard (1-D views), in shard order."""
    local_ranges: List[Tuple[int, int]]
    """Each main's [start, end) inside the shard."""
    segments: List[Segment]
    """One entry per main: its range, layer and norm flag."""
    bucket_layers: Set[int] = field(default_factory=set)
    """Layers of every parameter in the whole bucket (the same on every rank of the worker)."""
    model: Optional[torch.Tensor] = None
    """This shard's slice of the model's (16-bit) parameter buffer, written after an outer step;
    None when the main parameters are the model (fp32 models)."""
    flat_mains: Optional[torch.Tensor] = None
    """A shard-length tensor of which every main is a view at its range (fp32 models: the
    shard's slice of the parameter buffer), or None (the mains are separate tensors). Lets a
    sync read and write all of them in one operation."""
    device: torch.device = torch.device("cpu")
    """Where the shard's parameters and gradients live (EDiT's working tensors go there too)."""
    bucket: object = None
    """The framework's bucket this shard belongs to (opaque here; Megatron's
    ``_ParamAndGradBucket``)."""
    index: int = 0
    """Position among the optimizer's shards (seeds GTA's random sparsification)."""
    dense: Set[int] = field(default_factory=set)
    """Indices of segments GTA never sparsifies: a weight with a copy elsewhere (tied word
    embeddings on the first and last pipeline stage) must get the same update in both places,
    and each copy is sharded differently, so a per-segment top-k or random mask would differ."""

    # --- persistent state (across syncs; what one sync holds while it runs is in .in_flight)
    anchor: Optional[torch.Tensor] = None
    """The shard's value at the last sync (fp32), stepped by the outer optimizer."""
    # --- error feedback of a quantized exchange (None without it)
    residual: Optional[torch.Tensor] = None
    """What quantization dropped from this worker's pseudo-gradient at the last sync (fp32)."""
    chunk_residual: Optional[torch.Tensor] = None
    """What requantization dropped from the chunk of the result this worker reduces."""

    def sparsifiable_segments(self) -> List[Segment]:
        return [seg for i, seg in enumerate(self.segments) if i not in self.dense]

    def __post_init__(self) -> None:
        self.runs: List[Run] = merge_runs(self.segments)
        covered = sorted(self.local_ranges)
        gaps, at = [], 0
        for s, e in covered:
            if s > at:
                gaps.append((at, s))
            at = max(at, e)
        if at < self.numel:
            gaps.append((at, self.numel))
        self.gaps: List[Tuple[int, int]] = gaps
        """Ranges of the shard no parameter covers (bucket padding): kept at 0."""
        spans: List[Tuple[int, int, Optional[int]]] = [(s, e, layer) for s, e, layer, _ in self.runs]
        spans += [(s, e, None) for s, e in gaps]
        merged: List[Tuple[int, int, Optional[int]]] = []
        for s, e, layer in sorted(spans, key=lambda span: span[0]):
            if merged and merged[-1][1] == s and merged[-1][2] == layer:
                merged[-1] = (merged[-1][0], e, layer)
            else:
                merged.append((s, e, layer))
        self.layer_spans: List[Tuple[int, int, Optional[int]]] = merged
        """The shard cut into contiguous [start, end) pieces of one layer each (None: padding),
        covering it whole: a per-layer factor folded into one elementwise pass per piece."""
        counted = [r for r in self.runs if r[3]]
        self._norm_runs = [(s, e) for s, e, _, _ in counted]
        # Built once here (not at each sync): a host -> device copy would wait for the device.
        self._norm_index = torch.tensor([r[2] for r in counted], dtype=torch.long, device=self.device)

    def relayer(self, segments: List[Segment], bucket_layers: Set[int]) -> None:
        """Take new layer indices (the same ranges; the layers were cut anew between syncs) and
        what is derived from them; tensors and EDiT state stay."""
        self.segments, self.bucket_layers = list(segments), set(bucket_layers)
        self.__post_init__()

    def main_views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """Views of ``flat`` (shard-length) at each main's range."""
        return [flat[s:e] for s, e in self.local_ranges]

    def read_current(self, out: torch.Tensor) -> torch.Tensor:
        """The current main parameters, as one flat tensor (0 where no parameter is)."""
        if self.flat_mains is not None:
            out.copy_(self.flat_mains)
        elif self.mains:
            torch._foreach_copy_(self.main_views(out), [m.view(-1) for m in self.mains])
        for s, e in self.gaps:
            out[s:e].zero_()
        return out

    def pseudo_gradient(self, anchor: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` := anchor - current main parameters (0 where no parameter is), reading each
        main once."""
        if self.flat_mains is not None:
            torch.sub(anchor, self.flat_mains, out=out)
        else:
            for main, (s, e) in zip(self.mains, self.local_ranges):
                torch.sub(anchor[s:e], main.view(-1), out=out[s:e])
        for s, e in self.gaps:
            out[s:e].zero_()
        return out

    def write_mains(self, values: torch.Tensor) -> None:
        """Main parameters := ``values`` (flat, shard-length)."""
        if self.flat_mains is not None:
            self.flat_mains.copy_(values)
        elif self.mains:
            torch._foreach_copy_([m.view(-1) for m in self.mains], self.main_views(values))

    def write_model(self, values: torch.Tensor) -> None:
        """Cast ``values`` into the model's parameter buffer (16-bit models; fp32 models'
        mains are the model already)."""
        if self.model is not None:
            self.model.copy_(values)

    def layer_sq_norms(self, tensor: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out[layer] +=`` the squared norm of ``tensor``'s elements of each layer (those that
        count in the layer's norm). One fused norm kernel per shard (fp32 accumulation), the
        squares summed in ``out``'s dtype; nothing waits for the device."""
        if not self._norm_runs:
            return out
        norms = torch._foreach_norm([tensor[s:e] for s, e in self._norm_runs])
        return out.index_add_(0, self._norm_index, torch.stack(norms).to(out.dtype).pow(2))

    def scale_layers(self, tensor: torch.Tensor, factors) -> None:
        """In place: each layer's elements times its factor (a 0 factor zeroes, even NaN/Inf).

        ``factors[layer]``: host floats, or 0-dim tensors on the device (clip factors: then
        nothing waits for the device)."""
        for s, e, layer, _ in self.runs:
            f = factors[layer]
            if torch.is_tensor(f) and f.device.type != "cpu":
                part = tensor[s:e]
                part.mul_(f).masked_fill_(f == 0, 0.0)
                continue
            f = float(f)
            if f == 0.0:
                tensor[s:e].zero_()
            elif f != 1.0:
                tensor[s:e].mul_(f)
