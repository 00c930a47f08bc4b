"""Configuration of EDiT / A-EDiT (arXiv 2412.07210) as dataclasses.

The names and fields follow the authors' reference implementation (ATorch's ``LocalSGDConfig``,
``OuterOptimizerConfig``, ``GTAConfig``) so that its users find what they know. Every field is
validated in ``__post_init__``, its type first: a boolean must be ``True``/``False`` (the string
``'no'`` is not one), a count an integer (not ``True``), a number finite (not a string, inf or
NaN); the outer optimizer's keyword arguments are checked against its constructor's signature.
An option whose behaviour this version does not implement yet is accepted at its default and
rejected with :class:`NotSupportedYet` when turned on, never silently ignored.

Options that only matter with another one (A-EDiT's ``local_sgd_sync_time`` without
``use_async``, the EWMA settings without ``skip_anomaly``) are accepted here, so a program can
switch a feature off and keep its settings; on the command line such a flag does nothing and is
refused (:func:`megatron_edit.arguments.configs_from_args`).

Each field of :class:`LocalSGDConfig` and :class:`GTAConfig` declares its command-line flag
(:func:`megatron_edit.flags.flag`): :data:`FLAG_NAMES`, the parser of
:mod:`megatron_edit.arguments` and its args -> config mapping are generated from it.

The package: :class:`LocalSGDConfig` and :class:`OuterOptimizerConfig` with their checks here
(every field's checks next to it, the style of megatron-core's and torchtitan's configs);
:class:`GTAConfig` in ``megatron_edit.config.gta``; the exceptions, the value kinds and the type
checks in ``megatron_edit.config.values``; the outer optimizer's class and keyword checks in
``megatron_edit.config.outer_optimizer``. Every name is importable from ``megatron_edit.config``.
This module is long because each field's declaration, documentation and checks stay together.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

from ..flags import documented, field_docs, flag, flag_names  # noqa: F401 (field_docs: re-exported)
from .outer_optimizer import (  # noqa: F401 (re-exported)
    DEFAULT_OUTER_KWARGS,
    OUTER_OPTIMIZERS,
    TOPK_OUTER_KWARGS,
    _check_outer_kwargs,
    check_outer_numbers,
    resolve_optimizer_class,
)
from .gta import GTA_CONSENSUS, GTA_SPARSIFICATION, REDUCERS, GTAConfig  # noqa: F401 (re-exported)
from .values import (  # noqa: F401 (re-exported)
    FLAG_NAMES,
    ConfigError,
    NotSupportedYet,
    _got,
    _is_bool,
    _is_int,
    _is_number,
    _is_tensor,
    _check_types,
    _name,
    _require,
)


SYNC_MODES = ("layerwise", "step_end")
EXCHANGE_DTYPES = ("fp32", "bf16", "fp8", "int8", "int4", "int2")
TOPK_DTYPES = ("fp32", "int8", "int4", "int2")
"""Formats of the values a top-k exchange sends (megatron_edit.algorithm.topk)."""
TOPK_MAX_CHUNK = 1 << 16
"""The largest top-k chunk: its indices take 16 bits (megatron_edit.algorithm.topk.MAX_CHUNK)."""
SYNC_BACKENDS = ("torch", "torchft")
AUTO_FORMATS = ("fp32", "bf16", "fp8", "int8", "int4")  # the dense formats, most precise first


@documented
@dataclass
class LocalSGDConfig:
    """When and how data-parallel workers synchronise (EDiT / A-EDiT)."""

    use_async: bool = flag("--local-sgd-async", False,
                           help="A-EDiT: sync every --local-sgd-sync-time seconds instead of every H steps.")
    """A-EDiT: synchronise every ``local_sgd_sync_time`` seconds instead of every
    ``local_sgd_sync_interval`` steps, so fast workers are not held back by slow ones."""

    local_sgd_sync_interval: int = flag("--local-sgd-sync-interval", 1, first=True,
                                        help="H: optimizer steps between outer syncs after warmup.")
    """H: inner (optimizer) steps between two outer synchronisations after warmup."""

    local_sgd_sync_time: float = flag(
        "--local-sgd-sync-time", 600.0,
        help="A-EDiT (needs --local-sgd-async): seconds of training between syncs.")
    """A-EDiT only: seconds of training between two synchronisations."""

    async_time_budget: Optional[float] = flag(
        "--local-sgd-time-budget", None, show_default=False,
        help="A-EDiT: end after this many seconds of training after warmup (default: the step "
             "budget, --train-iters x workers worker-steps).")
    """A-EDiT only: end the run after this many seconds of training after warmup (at a final
    sync planned from the workers' speeds), instead of when the step budget is used."""

    min_total_global_steps: int = flag(
        "--local-sgd-min-total-global-steps", 100,
        help="A-EDiT (needs --local-sgd-async): skip a sync when all workers together took "
             "fewer steps since the last one.")
    """A-EDiT only: skip a time-triggered sync when all workers together took fewer steps than
    this since the last one."""

    use_step_weight: bool = flag(
        "--local-sgd-use-step-weight", False,
        help="A-EDiT (needs --local-sgd-async): blend averaging weights with each worker's "
             "share of the steps.")
    """A-EDiT only: blend the averaging weights with each worker's share of the steps since the
    last sync."""

    step_weight_ratio: float = flag(
        "--local-sgd-step-weight-ratio", 0.5,
        help="Weight of the step share in that blend (needs --local-sgd-use-step-weight).")
    """A-EDiT only: weight of the step share in that blend (0 = norm weights only, 1 = step
    share only)."""

    local_sgd_warmup_steps: int = flag("--local-sgd-warmup-steps", 0, first=True,
                                       help="W: ordinary synchronous steps before local training starts.")
    """W: the first W steps are ordinary synchronous data-parallel training; the anchor of the
    first outer step is the model after step W."""

    gradient_accumulation_steps: int = flag("--local-sgd-gradient-accumulation-steps", 1,
                                            help="Must be 1: Megatron accumulates micro-batches itself.")
    """Kept for compatibility with the reference implementation. Megatron accumulates
    micro-batches itself (``--global-batch-size`` / ``--micro-batch-size``) and EDiT counts
    optimizer steps, so this must stay 1."""

    clip_pseudo_grad: Optional[float] = flag(
        "--local-sgd-clip-pseudo-grad", None,
        help="tau: clip each layer's averaged pseudo-gradient to this L2 norm (None: no clipping).")
    """tau: clip each layer's averaged pseudo-gradient to this L2 norm (None: no clipping). With
    ``fragments`` a layer cut by a fragment boundary is clipped per piece (each piece to tau, up
    to sqrt(k) tau for k pieces; see ``fragments``)."""

    pseudo_gradnorm_reduce: bool = flag(
        "--local-sgd-pseudo-gradnorm-reduce", False,
        help="Weight workers by softmax(-pseudo-gradient norm / T) per layer.")
    """Weighted averaging: weights softmax(-||Delta_i|| / T) over workers instead of the mean."""

    weight_softmax_temperature: Optional[float] = flag(
        "--local-sgd-weight-softmax-temperature", None,
        help="T of those weights, None meaning 1 (needs --local-sgd-pseudo-gradnorm-reduce).")
    """T of the softmax weights (None: 1.0)."""

    skip_anomaly: bool = flag("--local-sgd-skip-anomaly", False,
                              help="Exclude a worker from a layer's average when its pseudo-gradient "
                                   "norm is anomalous (EWMA z-score).")
    """Anomaly elimination: exclude a worker's pseudo-gradient for a layer when the z-score of
    its norm against its running (EWMA) statistics exceeds ``ewma_threshold``."""

    ewma_alpha: float = flag(
        "--local-sgd-ewma-alpha", 0.02,
        help="Smoothing factor of the detector's EWMA statistics (needs --local-sgd-skip-anomaly).")
    """Smoothing factor of the EWMA mean/variance of pseudo-gradient norms."""

    ewma_warmup_steps: int = flag(
        "--local-sgd-ewma-warmup-steps", 120,
        help="Syncs before the detector may exclude anything (needs --local-sgd-skip-anomaly).")
    """Number of syncs before the anomaly detector may exclude anything."""

    ewma_threshold: float = flag(
        "--local-sgd-ewma-threshold", 3.0,
        help="z-score above which a worker is excluded (needs --local-sgd-skip-anomaly).")
    """z-score above which a worker's pseudo-gradient is anomalous."""

    cpu_offload: bool = flag("--local-sgd-cpu-offload", False,
                             help="Keep the anchor and the outer optimizer state in CPU memory.")
    """Keep the anchor and the outer optimizer state in (pinned, where CUDA is present) CPU
    memory instead of device memory."""

    is_debug: bool = flag(
        "--local-sgd-debug", False,
        help="Log every sync on every rank (through Python logging, logger 'megatron_edit', level INFO).")
    """Log every sync decision on every rank (verbose)."""

    sync_mode: str = flag("--local-sgd-sync-mode", "layerwise", choices=SYNC_MODES, first=True,
                          help="layerwise: sync each bucket during the next forward pass (needs "
                          "--overlap-param-gather); step_end: blocking sync after the optimizer step.")
    """``layerwise``: each bucket's exchange runs just before its parameters are all-gathered in
    the next forward pass, overlapped with compute (needs ``overlap_param_gather``).
    ``step_end``: one blocking exchange of all buckets right after the optimizer step. Both
    compute the same numbers."""

    outer_step_delay: int = flag(
        "--local-sgd-outer-step-delay", 0,
        help="tau: launch each sync's exchange tau steps before its sync step and apply it there, "
             "so the exchange runs behind tau inner steps (0: blocking, as without the flag; "
             "tau < --local-sgd-sync-interval). With --local-sgd-auto-overlap: the delay the run "
             "starts with, until its first decision.")
    """tau (Streaming DiLoCo's overlap, torchft's ``fragment_sync_delay``): the exchange of the
    sync due after step s = W + kH is launched after step s - tau with the pseudo-gradient
    ``anchor - theta_{s-tau}``; the worker keeps training; after the inner update of step s the
    exchange is completed, the outer step applied to the anchor and the worker's parameters
    merged with the new anchor (``outer_merge_alpha``). The sync steps stay on the grid of
    ``tau = 0`` (torchft's schedule: the launch moves, not the apply), so the run's last step is
    still a sync (which completes at once); a checkpoint while an exchange is in flight saves
    its result, and the resumed run applies it at the same step (the same number of workers,
    delay, merge rule and alpha and fragments only; another is refused). 0: today's blocking
    sync, bit for bit. Needs
    ``tau < local_sgd_sync_interval`` (one exchange in flight at a time); not with A-EDiT yet.
    With ``auto_overlap`` the delay its first, measured syncs run with (as ``exchange_dtype`` and
    ``fragments`` are the format and fragments it starts with); the rule chooses from then on."""

    outer_merge_alpha: Optional[float] = flag(
        "--local-sgd-outer-merge-alpha", None,
        help="alpha: after a delayed outer step theta <- alpha*theta + (1-alpha)*new anchor "
             "(default 0.5 with --local-sgd-outer-step-delay: the best of 0, 0.5 and keep_local "
             "at tau = H/2 in the convergence benchmark; 0: every worker takes the new anchor).")
    """alpha in [0, 1]: with a delay, the merge after the outer step is
    ``theta <- alpha * theta_s + (1 - alpha) * anchor'`` (torchft's ``fragment_update_alpha``).
    None (default): 0.5 with a delay (:attr:`merge_alpha`), chosen by the convergence benchmark
    (2 seeds, tau = H/2: 0.5 +0.65%, 0 +1.5% against the undelayed run). 0 makes every worker
    take the new anchor (replicas identical, the tau local steps taken during the exchange are
    dropped), larger values keep part of them (replicas then differ by alpha times their local
    drift until the next sync)."""

    outer_merge_rule: Optional[str] = flag(
        "--local-sgd-outer-merge-rule", None, choices=("lerp", "keep_local"), show_default=False,
        help="After a delayed outer step: lerp (the default): theta <- alpha*theta + "
             "(1-alpha)*new anchor (--local-sgd-outer-merge-alpha); keep_local: theta <- new "
             "anchor + the tau local steps taken during the exchange (either needs "
             "--local-sgd-outer-step-delay).")
    """The merge after a delayed outer step (tau > 0); None (default): ``lerp``. Given without a
    delay it is refused (there is nothing to merge), ``lerp`` too. ``lerp``:
    ``theta <- alpha * theta_s + (1 - alpha) * anchor'`` (``outer_merge_alpha``; torchft's
    rule). ``keep_local``: ``theta <- anchor' + (theta_s - theta_{s-tau})``: the new anchor
    plus the worker's own progress during the exchange (its tau inner steps), so nothing is
    dropped; replicas then differ by that progress until the next sync. It keeps the launch's
    parameters while the exchange is in flight (4 more B/param)."""

    fragments: int = flag(
        "--local-sgd-fragments", 1,
        help="F: split the model's bucket groups into F fragments synced in turn, one every "
             "H/F steps (each every H steps), so the link carries 1/F of the model at a time "
             "(1: the whole model at every sync).")
    """F (Streaming DiLoCo's fragments, torchft's ``_StreamingDiLoCoFragment``): the bucket
    groups, in forward order, are split into F contiguous fragments of about equal size;
    fragment f is synchronised after the steps s > W with s - W = f H/F (mod H). Each sync
    exchanges one fragment, with its own anchor; the run's last step syncs every fragment.
    Megatron's buckets do not follow layers, so a fragment boundary can cut a layer: each piece
    is then a layer of its own (``<layer>@fragment<f>``) for every per-layer decision, taken at
    its fragment's sync (the penalty's norms, weights, exclusions and anomaly statistics,
    clipping): a layer cut into k pieces is clipped per piece, so the pseudo-gradient its outer
    step takes over one interval can reach sqrt(k) times ``clip_pseudo_grad``, and a worker can
    be excluded from one piece and not another. With ``outer_step_delay`` each fragment's exchange is launched
    tau steps before its sync (tau < H/F: one fragment in flight at a time). Needs H divisible
    by F; not with A-EDiT yet. 1: today's sync of the whole model, bit for bit."""

    exchange_dtype: str = flag(
        "--local-sgd-exchange-dtype", "fp32", choices=EXCHANGE_DTYPES,
        help="Format of the pseudo-gradients sent between workers (int8: 0.25x the bytes of "
             "fp32, int4: 0.13x; int2 only with --local-sgd-exchange-topk-density).")
    """Format of the pseudo-gradients sent between workers: ``fp32`` (exact), ``bf16``, ``fp8``
    (e4m3), ``int8`` or ``int4`` with one fp32 scale per block of ``exchange_block_size``
    elements. Not fp32: a reduce-scatter of quantized chunks, a sum in fp32, and an all-gather
    of the requantized result (int8: 0.25x the bytes of fp32, int4: 0.13x); every worker applies
    the same bytes. With ``exchange_topk_density``: the format of the kept values (``fp32``,
    ``int8``, ``int4`` or ``int2``, one fp32 scale per top-k chunk); ``int2`` needs it."""

    exchange_block_size: int = flag(
        "--local-sgd-exchange-block-size", 256,
        help="Elements per quantization scale (needs --local-sgd-exchange-dtype fp8|int8|int4).")
    """Elements per quantization scale (fp8 / int8 / int4): smaller blocks follow the values'
    range more closely and cost 4 bytes of scale each."""

    exchange_error_feedback: Optional[bool] = flag(
        "--local-sgd-exchange-error-feedback", None, show_default=False,
        help="Add what the exchange dropped (quantization, top-k) to the next sync's pseudo-gradient "
             "(default: on with --local-sgd-exchange-topk-density, off otherwise).")
    """Keep what the exchange dropped (quantization; with top-k, every entry not sent) and add
    it to the next sync's pseudo-gradient (a residual sharded like the anchor, 4 bytes x params
    / shard size, saved in checkpoints). None (default): on with ``exchange_topk_density``
    (SparseLoCo's error feedback; :attr:`error_feedback`), off otherwise."""

    exchange_topk_density: Optional[float] = flag(
        "--local-sgd-exchange-topk-density", None, show_default=False,
        help="Sparse exchange (SparseLoCo): send only this fraction (0 < d <= 1) of each "
             "pseudo-gradient's entries, the largest per chunk, with their indices; the rest "
             "stays in the error-feedback residual (none: dense).")
    """d in (0, 1] (SparseLoCo, arXiv 2508.15706): each worker keeps the ``ceil(d x chunk)``
    largest-magnitude entries of each chunk of ``exchange_topk_chunk`` elements of its
    (error-feedback-corrected) pseudo-gradient shard and sends their indices (``ceil(log2
    chunk)`` bits each) and values (``exchange_dtype``: fp32, int8, int4 or int2, one fp32 scale
    per chunk); the workers' payloads are all-gathered, decoded and summed in fp32 in worker
    order, so every worker applies the same bytes. What is not sent stays in the residual
    (error feedback, on by default here). At d = 2% with int2 a sync sends 0.009x the bytes of
    the fp32 exchange with 2 workers, 0.018x with 4; an all-gather's bytes grow with the
    workers, and from 29 workers on (d = 2%, int2) a dense int4 exchange sends fewer: such a
    setting is refused. None (default): the dense exchange."""

    exchange_topk_chunk: int = flag(
        "--local-sgd-exchange-topk-chunk", 4096,
        help="Elements per top-k chunk: k = ceil(density x chunk) kept per chunk, indices in "
             "ceil(log2 chunk) bits, one scale per chunk (needs --local-sgd-exchange-topk-density).")
    """Elements per top-k chunk (2 to 65536): each chunk keeps ``ceil(d x chunk)`` entries, its
    indices take ``ceil(log2 chunk)`` bits (12 for 4096) and it has one fp32 scale. A shard
    smaller than a chunk is one chunk."""

    auto_overlap: bool = flag(
        "--local-sgd-auto-overlap", False,
        help="Choose the delay (with --local-sgd-auto-formats also the exchange format, with "
             "--local-sgd-auto-fragments the fragments) from the "
             "measured step and exchange times while the job runs (synchronous EDiT, torch backend).")
    """Settings from the measured link (:mod:`megatron_edit.mcore.auto_overlap`): the first syncs,
    and one sync every ``auto_every``, are timed with the settings in force (without a delay they
    block; a delayed one waits for its exchange right after its launch, its numbers unchanged);
    at each sync every rank's inner step time, exchange time per allowed format and exposed
    wait are agreed on (one all-reduce of a few numbers over every rank, right after the sync),
    and the rule of
    :func:`megatron_edit.algorithm.overlap_plan.choose` sets ``outer_step_delay`` tau (the
    smallest that covers the exchange with a 1.2 margin, tau < H/F) and the format, only at a
    sync with nothing in flight, the same on every worker; with ``auto_fragments`` also the
    fragments F (the fewest that let a delay hide the exchange). H stays the user's (it changes
    the algorithm, not only the schedule). The run starts with ``outer_step_delay`` (0: its first
    syncs block), in ``exchange_dtype``, with ``fragments``: start with the setting it will
    likely choose (``python -m megatron_edit.plan``), since the first syncs' algorithm is the
    start's (in the 20 Mbit/s benchmark two undelayed first syncs cost 7.6% of loss after 416
    steps against the delay it then chose; started with that delay it equals it bit for bit).
    Synchronous EDiT over the torch backend; not with error feedback, the top-k exchange or GTA
    (their state follows the format)."""

    auto_formats: Optional[str] = flag(
        "--local-sgd-auto-formats", None, type=str, show_default=False,
        help="Exchange formats --local-sgd-auto-overlap may choose, comma-separated, most precise "
             "taken first when it hides the exchange (e.g. fp32,int8,int4; default: "
             "--local-sgd-exchange-dtype only).")
    """Comma-separated formats (of fp32, bf16, fp8, int8, int4) that ``auto_overlap`` may
    choose; it takes the most precise one whose exchange it can hide. Must include
    ``exchange_dtype`` (the format the run starts with). None: ``exchange_dtype`` only (the
    delay alone is chosen)."""

    auto_fragments: Optional[str] = flag(
        "--local-sgd-auto-fragments", None, type=str, show_default=False,
        help="Numbers of fragments --local-sgd-auto-overlap may choose, comma-separated; it takes "
             "the fewest that let a delay hide the exchange (e.g. 1,2,4; each divides "
             "--local-sgd-sync-interval; default: --local-sgd-fragments only).")
    """Comma-separated numbers of streaming fragments F that ``auto_overlap`` may choose; it
    takes the fewest for which a delay tau < H/F covers the exchange. Each must divide
    ``local_sgd_sync_interval`` with H/F >= 2, and the list must include ``fragments`` (the F
    the run starts with). A change of F re-cuts the per-layer state: a layer that a fragment
    boundary cuts differently under the new F (``<layer>@fragment<f>``) starts its penalty
    statistics afresh. None: ``fragments`` only (F stays the user's)."""

    auto_every: int = flag(
        "--local-sgd-auto-every", 20,
        help="--local-sgd-auto-overlap re-measures (one sync timed with the settings in force) and "
             "re-decides every this many syncs, and sooner when the exposed wait grows.")
    """Syncs between two decisions of ``auto_overlap`` (>= 1); a decision is also taken when a
    sync's exposed wait exceeds the prediction by more than half an inner step and 50%."""

    sync_timeout: Optional[float] = flag(
        # type=float: "none" is refused, as it always was (None is the default, not a setting).
        "--local-sgd-sync-timeout", None, type=float, show_default=False,
        help="Seconds a worker waits at a sync for the others before the run stops naming the "
             "missing worker (default: --distributed-timeout-minutes).")
    """Seconds a worker waits at a sync for the others before the run stops with an error that
    names the missing worker(s) and the step (a hung, dead or far too slow worker); every
    minute of waiting is logged. None: the process group's timeout (Megatron-LM:
    ``--distributed-timeout-minutes``; torch's default otherwise)."""

    sync_backend: str = flag(
        "--local-sgd-sync-backend", "torch", choices=SYNC_BACKENDS,
        help="torch: all workers in one torch.distributed world; torchft: each worker its own job, "
             "the exchange across workers over torchft (a worker may die and come back; needs "
             "pip install torchft==0.2.0).")
    """How the workers meet at a sync. ``torch``: one ``torch.distributed`` world holds every
    worker (``num_distributed_optimizer_instances`` of them), one dead rank stops the run.
    ``torchft``: each worker is its own job (its own world, ``num_distributed_optimizer_instances``
    1); rank r of every worker meets over a torchft Manager (:mod:`megatron_edit.exchange.fault_tolerant`),
    so a worker may die, and a fresh job for it heals from a live peer."""

    lighthouse: Optional[str] = flag(
        "--local-sgd-lighthouse", None, type=str, show_default=False,
        help="torchft: the Lighthouse's address, e.g. http://host:29510 (default: $TORCHFT_LIGHTHOUSE).")
    """torchft backend: the address of the run's torchft Lighthouse (None: the environment
    variable ``TORCHFT_LIGHTHOUSE``)."""

    replica_id: Optional[int] = flag(
        "--local-sgd-replica-id", None, type=int, show_default=False,
        help="torchft: this worker's id (an integer >= 0, the same on all of its ranks; a relaunched "
             "worker keeps its id).")
    """torchft backend: this worker's id, an integer >= 0, the same on every rank of the worker
    and different from every other worker's; a fresh job for a dead worker keeps it."""

    min_replicas: int = flag(
        "--local-sgd-min-replicas", 1,
        help="torchft: a sync is committed only with at least this many workers in it that trained since the "
             "last one (the supervisor's Lighthouse forms no quorum with fewer).")
    """torchft backend: the fewest workers a sync may be committed with, counting only those that
    trained since the last sync (a worker that has just joined or healed brings nothing); with
    fewer, the sync is not committed and the workers keep their local progress for the next one.
    The supervisor's Lighthouse takes it from the workers' command (torchft's ``min_replicas``:
    no quorum forms with fewer workers)."""

    def __post_init__(self) -> None:
        _check_types(self)
        _require(self.local_sgd_sync_interval >= 1, "local_sgd_sync_interval",
                 f"must be an integer >= 1 (got {self.local_sgd_sync_interval!r}); "
                 "1 synchronises after every step.")
        _require(self.local_sgd_warmup_steps >= 0, "local_sgd_warmup_steps",
                 f"must be an integer >= 0 (got {self.local_sgd_warmup_steps!r}).")
        _require(self.gradient_accumulation_steps == 1, "gradient_accumulation_steps",
                 f"must be 1 (got {self.gradient_accumulation_steps!r}): Megatron accumulates "
                 "micro-batches itself; set --global-batch-size / --micro-batch-size instead.")
        _require(self.local_sgd_sync_time > 0, "local_sgd_sync_time",
                 f"must be a positive number of seconds (got {self.local_sgd_sync_time!r}).")
        _require(self.async_time_budget is None or self.async_time_budget > 0, "async_time_budget",
                 f"must be a positive number of seconds or None (got {self.async_time_budget!r}).")
        if self.async_time_budget is not None and not self.use_async:
            raise ConfigError(
                f"{_name('async_time_budget')}: a wall-clock budget is A-EDiT's; add "
                f"{FLAG_NAMES['use_async']} (synchronous EDiT ends at --train-iters).")
        _require(self.sync_timeout is None or self.sync_timeout > 0, "sync_timeout",
                 f"must be a positive number of seconds or None (got {self.sync_timeout!r}).")
        _require(self.min_total_global_steps >= 0, "min_total_global_steps",
                 f"must be an integer >= 0 (got {self.min_total_global_steps!r}).")
        _require(0.0 <= self.step_weight_ratio <= 1.0, "step_weight_ratio",
                 f"must be in [0, 1] (got {self.step_weight_ratio!r}).")
        _require(self.clip_pseudo_grad is None or self.clip_pseudo_grad > 0, "clip_pseudo_grad",
                 f"must be a positive norm or None (got {self.clip_pseudo_grad!r}).")
        _require(self.weight_softmax_temperature is None or self.weight_softmax_temperature > 0,
                 "weight_softmax_temperature", f"must be > 0 or None (got {self.weight_softmax_temperature!r}).")
        _require(0.0 < self.ewma_alpha <= 1.0, "ewma_alpha", f"must be in (0, 1] (got {self.ewma_alpha!r}).")
        _require(self.ewma_warmup_steps >= 0, "ewma_warmup_steps",
                 f"must be an integer >= 0 (got {self.ewma_warmup_steps!r}).")
        _require(self.ewma_threshold > 0, "ewma_threshold", f"must be > 0 (got {self.ewma_threshold!r}).")
        _require(isinstance(self.sync_mode, str) and self.sync_mode in SYNC_MODES, "sync_mode",
                 f"must be one of {SYNC_MODES} (got {self.sync_mode!r}).")
        _require(self.exchange_dtype in EXCHANGE_DTYPES, "exchange_dtype",
                 f"must be one of {EXCHANGE_DTYPES} (got {self.exchange_dtype!r}).")
        _require(self.exchange_block_size >= 2 and self.exchange_block_size % 2 == 0, "exchange_block_size",
                 f"must be an even integer >= 2 (got {self.exchange_block_size!r}); 256 is the default.")
        scaled = self.auto_overlap and any(f in ("fp8", "int8", "int4") for f in self.allowed_formats)
        if self.exchange_block_size != 256 and self.exchange_dtype in ("fp32", "bf16") and not scaled:
            raise ConfigError(
                f"{_name('exchange_block_size')}: only used by the scaled formats (fp8, int8, "
                f"int4); {FLAG_NAMES['exchange_dtype']} is {self.exchange_dtype}.")
        if self.exchange_error_feedback and self.exchange_dtype == "fp32" and self.exchange_topk_density is None:
            raise ConfigError(
                f"{_name('exchange_error_feedback')}: an fp32 exchange drops nothing; add "
                f"{FLAG_NAMES['exchange_dtype']} bf16|fp8|int8|int4 (or "
                f"{FLAG_NAMES['exchange_topk_density']}) or drop the flag.")
        self._check_topk()
        self._check_delay()
        self._check_sync_backend()
        self._check_auto()
        # Valid, but not built in this version: refuse rather than ignore.
        if self.use_step_weight and not self.use_async:
            raise ConfigError(
                f"{_name('use_step_weight')}: step weights only make sense when workers take "
                f"different numbers of steps; add {FLAG_NAMES['use_async']}.")
        if self.weight_softmax_temperature is not None and not self.pseudo_gradnorm_reduce:
            raise ConfigError(
                f"{_name('weight_softmax_temperature')}: only used with norm-weighted averaging; "
                f"add {FLAG_NAMES['pseudo_gradnorm_reduce']}.")

    @property
    def error_feedback(self) -> bool:
        """Whether error feedback is on: ``exchange_error_feedback``, or when it is None, whether
        the exchange is top-k (``exchange_topk_density``)."""
        if self.exchange_error_feedback is None:
            return self.exchange_topk_density is not None
        return self.exchange_error_feedback

    def _check_topk(self) -> None:
        """The sparse exchange's settings (``exchange_topk_density``, ``exchange_topk_chunk``)."""
        d, chunk, dtype = self.exchange_topk_density, self.exchange_topk_chunk, self.exchange_dtype
        _require(d is None or 0.0 < d <= 1.0, "exchange_topk_density",
                 f"must be in (0, 1] (got {d!r}): the fraction of each chunk's entries sent, e.g. 0.02; "
                 "None: the dense exchange.")
        _require(chunk >= 2, "exchange_topk_chunk", f"must be an integer >= 2 (got {chunk!r}); 4096 is the default.")
        _require(chunk <= TOPK_MAX_CHUNK, "exchange_topk_chunk",
                 f"{chunk} needs {(chunk - 1).bit_length()} index bits; indices take at most 16 bits "
                 f"(chunks of at most {TOPK_MAX_CHUNK} elements): use a smaller chunk, e.g. 4096.")
        if d is None:
            if chunk != 4096:
                raise ConfigError(
                    f"{_name('exchange_topk_chunk')}: only used by the top-k exchange; add "
                    f"{FLAG_NAMES['exchange_topk_density']} (e.g. 0.02) or drop the flag.")
            if dtype == "int2":
                raise ConfigError(
                    f"{_name('exchange_dtype')}: int2 is for the top-k exchange's kept values (a dense "
                    f"tensor in 2 bits loses most of its entries); add {FLAG_NAMES['exchange_topk_density']} "
                    "(e.g. 0.02), or use int4 for a dense exchange.")
            return
        if dtype not in TOPK_DTYPES:
            raise ConfigError(
                f"{_name('exchange_dtype')}: the top-k exchange sends its values in one of {TOPK_DTYPES}, "
                f"not {dtype}; choose one of them, or drop {FLAG_NAMES['exchange_topk_density']}.")
        if self.exchange_block_size != 256:
            raise ConfigError(
                f"{_name('exchange_block_size')}: the top-k exchange has one scale per chunk "
                f"({FLAG_NAMES['exchange_topk_chunk']}); drop {FLAG_NAMES['exchange_block_size']}.")

    @property
    def lighthouse_address(self) -> Optional[str]:
        """The torchft Lighthouse's address: ``lighthouse``, else ``$TORCHFT_LIGHTHOUSE``."""
        return self.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE") or None

    def _check_sync_backend(self) -> None:
        """``sync_backend`` and the torchft backend's settings (``lighthouse``, ``replica_id``,
        ``min_replicas``); what the torchft backend does not run yet is refused."""
        backend = self.sync_backend
        _require(isinstance(backend, str) and backend in SYNC_BACKENDS, "sync_backend",
                 f"must be one of {SYNC_BACKENDS} (got {backend!r}).")
        _require(_is_int(self.min_replicas) and self.min_replicas >= 1, "min_replicas",
                 f"must be an integer >= 1 (got {self.min_replicas!r}).")
        _require(self.replica_id is None or (_is_int(self.replica_id) and self.replica_id >= 0), "replica_id",
                 f"must be an integer >= 0 or None (got {self.replica_id!r}).")
        _require(self.lighthouse is None or (isinstance(self.lighthouse, str) and self.lighthouse), "lighthouse",
                 f"must be an address such as http://host:29510, or None (got {self.lighthouse!r}).")
        ft_only = [f for f, default in (("lighthouse", None), ("replica_id", None), ("min_replicas", 1))
                   if getattr(self, f) != default]
        if backend == "torch":
            if ft_only:
                raise ConfigError(
                    f"{_name(ft_only[0])}: only used by the torchft backend; add "
                    f"{FLAG_NAMES['sync_backend']} torchft or drop the flag.")
            return
        if importlib.util.find_spec("torchft") is None:
            raise ConfigError(
                f"{_name('sync_backend')} torchft: torchft is not installed; pip install torchft==0.2.0 "
                "(in a checkout: pip install -e '.[ft]').")
        if self.replica_id is None:
            raise ConfigError(
                f"{_name('replica_id')}: {FLAG_NAMES['sync_backend']} torchft needs this worker's id (an integer >= 0, "
                "the same on all its ranks, different for every worker).")
        if self.lighthouse_address is None:
            raise ConfigError(
                f"{_name('lighthouse')}: {FLAG_NAMES['sync_backend']} torchft needs the Lighthouse's address "
                "(http://host:port); give the flag or set TORCHFT_LIGHTHOUSE.")
        if self.local_sgd_warmup_steps > 0:
            raise NotSupportedYet(
                f"{_name('local_sgd_warmup_steps')} with {FLAG_NAMES['sync_backend']} torchft is not supported yet; "
                "drop one of the two (the torch backend runs it).")

    @property
    def allowed_formats(self) -> tuple:
        """The exchange formats ``auto_overlap`` may choose (``auto_formats``, else
        ``exchange_dtype`` alone), most precise first."""
        if self.auto_formats is None:
            return (self.exchange_dtype,)
        return tuple(f for f in AUTO_FORMATS if f in self._auto_format_names())

    def _auto_format_names(self) -> list:
        return [n.strip() for n in str(self.auto_formats).split(",")]

    @property
    def allowed_fragments(self) -> tuple:
        """The numbers of fragments ``auto_overlap`` may choose (``auto_fragments``, else
        ``fragments`` alone), fewest first."""
        if self.auto_fragments is None:
            return (self.fragments,)
        return tuple(sorted(int(n) for n in self._auto_fragment_names()))

    def _auto_fragment_names(self) -> list:
        return [n.strip() for n in str(self.auto_fragments).split(",")]

    def _check_auto(self) -> None:
        """``auto_overlap`` and its settings (``auto_formats``, ``auto_fragments``, ``auto_every``)."""
        _require(self.auto_every >= 1, "auto_every", f"must be an integer >= 1 (got {self.auto_every!r}).")
        if self.auto_formats is not None:
            names = self._auto_format_names()
            bad = [n for n in names if n not in AUTO_FORMATS]
            _require(not bad and len(set(names)) == len(names), "auto_formats",
                     f"must be a comma-separated list of distinct formats of {', '.join(AUTO_FORMATS)} "
                     f"(got {self.auto_formats!r}).")
        if self.auto_fragments is not None:
            names, h = self._auto_fragment_names(), self.local_sgd_sync_interval
            numbers = [int(n) for n in names if n.isdigit() and int(n) >= 1]
            _require(len(numbers) == len(names) == len(set(numbers)), "auto_fragments",
                     f"must be a comma-separated list of distinct integers >= 1 (got {self.auto_fragments!r}).")
            bad = [int(n) for n in names if h % int(n) or h // int(n) < 2]
            _require(not bad, "auto_fragments",
                     f"{bad[0] if bad else ''} must divide {FLAG_NAMES['local_sgd_sync_interval']} {h} and leave "
                     "H/F >= 2 (room for a delay tau < H/F); give divisors of H up to H/2.")
        if not self.auto_overlap:
            given = [f for f, default in (("auto_formats", None), ("auto_fragments", None), ("auto_every", 20))
                     if getattr(self, f) != default]
            if given:
                raise ConfigError(f"{_name(given[0])}: only used by {FLAG_NAMES['auto_overlap']}; add it "
                                  "or drop the flag.")
            return
        why = None
        if self.use_async:
            why = f"{FLAG_NAMES['use_async']} (A-EDiT plans its own syncs; it runs no delay)"
        elif self.sync_backend != "torch":
            why = f"{FLAG_NAMES['sync_backend']} {self.sync_backend} (the torch backend only, yet)"
        elif self.exchange_topk_density is not None:
            why = f"{FLAG_NAMES['exchange_topk_density']} (the top-k exchange's residual follows its format)"
        elif self.error_feedback:
            why = f"{FLAG_NAMES['exchange_error_feedback']} (the residual follows the format)"
        if why is not None:
            raise NotSupportedYet(f"{_name('auto_overlap')} with {why} is not supported yet; drop one of the two.")
        if self.exchange_dtype not in self.allowed_formats:
            raise ConfigError(
                f"{_name('auto_formats')}: the run starts in {FLAG_NAMES['exchange_dtype']} "
                f"{self.exchange_dtype}, which is not among {self.auto_formats}; add it, or start in one of them.")
        if self.fragments not in self.allowed_fragments:
            raise ConfigError(
                f"{_name('auto_fragments')}: the run starts with {FLAG_NAMES['fragments']} {self.fragments}, "
                f"which is not among {self.auto_fragments}; add it, or start with one of them.")
        if self.local_sgd_sync_interval // self.fragments < 2:
            raise ConfigError(
                f"{_name('auto_overlap')}: {FLAG_NAMES['local_sgd_sync_interval']} "
                f"{self.local_sgd_sync_interval} / {FLAG_NAMES['fragments']} {self.fragments} leaves no room "
                "for a delay (tau < H/F); drop the flag or sync less often.")

    @property
    def merge_alpha(self) -> float:
        """The lerp merge's alpha in effect: ``outer_merge_alpha``, or 0.5 when it is None."""
        return 0.5 if self.outer_merge_alpha is None else float(self.outer_merge_alpha)

    @property
    def merge_rule(self) -> str:
        """The merge rule in effect: ``outer_merge_rule``, or ``lerp`` when it is None."""
        return self.outer_merge_rule or "lerp"

    def _check_delay(self) -> None:
        """The delayed outer step's and the fragments' settings (``outer_step_delay``,
        ``outer_merge_alpha``, ``fragments``)."""
        tau, alpha = self.outer_step_delay, self.outer_merge_alpha
        _require(tau >= 0, "outer_step_delay", f"must be an integer >= 0 (got {tau!r}); 0: no delay.")
        _require(alpha is None or 0.0 <= alpha <= 1.0, "outer_merge_alpha", f"must be in [0, 1] (got {alpha!r}).")
        rule = self.outer_merge_rule
        _require(rule in (None, "lerp", "keep_local"), "outer_merge_rule",
                 f"must be 'lerp', 'keep_local' or None (got {rule!r}).")
        if rule is not None and tau == 0 and not self.auto_overlap:
            raise ConfigError(
                f"{_name('outer_merge_rule')}: the merge only follows a delayed outer step; add "
                f"{FLAG_NAMES['outer_step_delay']} (a number of steps >= 1) or drop the flag.")
        if rule == "keep_local" and alpha not in (None, 0.0):
            raise ConfigError(
                f"{_name('outer_merge_alpha')}: alpha is the lerp rule's; keep_local keeps the local "
                f"steps whole. Drop one of {FLAG_NAMES['outer_merge_alpha']} and "
                f"{FLAG_NAMES['outer_merge_rule']} keep_local.")
        if alpha is not None and tau == 0 and not self.auto_overlap:
            raise ConfigError(
                f"{_name('outer_merge_alpha')}: the merge only follows a delayed outer step; add "
                f"{FLAG_NAMES['outer_step_delay']} (a number of steps >= 1) or drop the flag.")
        if tau and self.use_async:
            raise NotSupportedYet(
                f"{_name('outer_step_delay')}: a delayed outer step with {FLAG_NAMES['use_async']} "
                "(A-EDiT) is not supported yet; drop one of the two.")
        if tau >= self.local_sgd_sync_interval:
            raise ConfigError(
                f"{_name('outer_step_delay')}: {tau} must be < {FLAG_NAMES['local_sgd_sync_interval']} "
                f"({self.local_sgd_sync_interval}): an exchange must be applied before the next one is "
                "launched (one in flight at a time).")
        f, h = self.fragments, self.local_sgd_sync_interval
        _require(f >= 1, "fragments", f"must be an integer >= 1 (got {f!r}); 1: no fragments.")
        if f > 1 and self.use_async:
            raise NotSupportedYet(
                f"{_name('fragments')}: streaming fragments with {FLAG_NAMES['use_async']} (A-EDiT) "
                "are not supported yet; drop one of the two.")
        if h % f:
            raise ConfigError(
                f"{_name('fragments')}: {f} must divide {FLAG_NAMES['local_sgd_sync_interval']} ({h}): "
                "one fragment is synchronised every H/F steps.")
        if f > 1 and tau >= h // f:
            raise ConfigError(
                f"{_name('outer_step_delay')}: {tau} must be < H/F = {h // f} with {f} fragments "
                f"({FLAG_NAMES['local_sgd_sync_interval']} {h}): a fragment's exchange must be applied "
                "before the next fragment's is launched (one in flight at a time).")


@documented
@dataclass
class OuterOptimizerConfig:
    """The outer optimizer: steps the anchor with the averaged pseudo-gradient as its gradient."""

    outer_optim_class: Union[str, type] = flag("--outer-optimizer", "torch.optim.SGD", by_hand=True)
    """Any torch optimizer class, as a class, a dotted path, or one of ``sgd``, ``adam``,
    ``adamw``. SGD with lr 1 and no momentum is plain parameter averaging."""

    outer_optim_kwargs: Dict[str, Any] = flag(
        "--outer-optimizer-lr / --outer-optimizer-momentum / --outer-optimizer-kwargs", by_hand=True,
        default_factory=lambda: dict(DEFAULT_OUTER_KWARGS))
    """Keyword arguments of the outer optimizer's constructor (default: the paper's Nesterov
    SGD, lr 0.7, momentum 0.9; with the sparse exchange, where no outer optimizer is given,
    :func:`default_outer_config`: SGD lr 1 without momentum)."""

    def __post_init__(self) -> None:
        cls = resolve_optimizer_class(self.outer_optim_class)
        kwargs = self.outer_optim_kwargs
        _require(
            isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs),
            "outer_optim_kwargs",
            f"must be a dict of keyword arguments (got {type(kwargs).__name__}).",
        )
        _check_outer_kwargs(cls, kwargs)  # no optimizer is built to check them

    @property
    def optimizer_class(self) -> type:
        return resolve_optimizer_class(self.outer_optim_class)


# Field -> flag, for every message (megatron_edit.config.values), from the fields' metadata.
FLAG_NAMES.update(flag_names(LocalSGDConfig, OuterOptimizerConfig, GTAConfig))


def replace(cfg, **changes):
    """dataclasses.replace that re-runs validation."""
    return dataclasses.replace(cfg, **changes)


def default_outer_config(local: Optional[LocalSGDConfig]) -> OuterOptimizerConfig:
    """The outer optimizer where none is given: the paper's Nesterov SGD, or with the sparse
    exchange SparseLoCo's SGD lr 1 without momentum (:data:`TOPK_OUTER_KWARGS`)."""
    if local is not None and local.exchange_topk_density is not None:
        return OuterOptimizerConfig(outer_optim_kwargs=dict(TOPK_OUTER_KWARGS))
    return OuterOptimizerConfig()


def check_combination(local: LocalSGDConfig, gta: GTAConfig) -> None:
    """Options of different configs that do not work together (ConfigError naming the flags)."""
    if gta.reducer == "gta" and local.exchange_topk_density is not None:
        raise ConfigError(
            f"{FLAG_NAMES['reducer']} gta with {FLAG_NAMES['exchange_topk_density']}: GTA sparsifies and "
            f"merges with sign consensus over a dense fp32 exchange; use one of the two."
        )
    if gta.reducer == "gta" and local.exchange_dtype != "fp32":
        raise ConfigError(
            f"{FLAG_NAMES['reducer']} gta with {FLAG_NAMES['exchange_dtype']} "
            f"{local.exchange_dtype}: GTA's sign consensus and masks need the fp32 exchange; use "
            f"the linear reducer with a quantized exchange, or GTA with fp32."
        )
    if gta.reducer == "gta" and local.auto_overlap and local.allowed_formats != ("fp32",):
        raise ConfigError(
            f"{FLAG_NAMES['reducer']} gta with {FLAG_NAMES['auto_formats']} {local.auto_formats}: GTA's sign "
            "consensus and masks need the fp32 exchange; drop the formats other than fp32."
        )
