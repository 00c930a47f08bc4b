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

The package: :class:`LocalSGDConfig`'s fields here (each with its flag and documentation) and
the checks of single fields in its ``__post_init__``; the checks of its groups of settings in
mixins, one concept each: the exchange (``megatron_edit.config.exchange``: formats, error
feedback, top-k), the penalty (``megatron_edit.config.penalty``), the overlap
(``megatron_edit.config.overlap``: the delayed outer step, its merge, fragments, the automatic
overlap, and the rule tau < H/F as :func:`delay_limit`), the sync backend
(``megatron_edit.config.backend``) and the sync record's path (``megatron_edit.config.record``);
:class:`OuterOptimizerConfig` with the outer optimizer's class and keyword checks in
``megatron_edit.config.outer_optimizer`` (and :func:`default_outer_config`);
:class:`GTAConfig` in ``megatron_edit.config.gta``, with the checks across it and
:class:`LocalSGDConfig` (:func:`check_combination`); the exceptions, the value kinds and the type
checks in ``megatron_edit.config.values``. Every name is importable from ``megatron_edit.config``.
This module is long because each field's declaration, documentation and flag stay together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..flags import documented, field_docs, flag, flag_names  # noqa: F401 (field_docs: re-exported)
from .outer_optimizer import (  # noqa: F401 (re-exported)
    DEFAULT_OUTER_KWARGS, OUTER_OPTIMIZERS, TOPK_OUTER_KWARGS, OuterOptimizerConfig, _check_outer_kwargs,
    check_outer_numbers, default_outer_config, resolve_optimizer_class)
from .gta import GTA_CONSENSUS, GTA_SPARSIFICATION, REDUCERS, GTAConfig, check_combination  # noqa: F401 (re-exported)
from .backend import SYNC_BACKENDS, BackendSettings  # noqa: F401 (re-exported)
from .exchange import EXCHANGE_DTYPES, TOPK_DTYPES, TOPK_MAX_CHUNK, ExchangeSettings  # noqa: F401 (re-exported)
from .overlap import OverlapSettings, delay_limit  # noqa: F401 (re-exported)
from .penalty import PenaltySettings
from .record import RecordSettings, check_record_path, record_path  # noqa: F401 (re-exported)
from .values import (  # noqa: F401 (re-exported)
    FLAG_NAMES, ConfigError, NotSupportedYet, _check_types, _got, _is_bool, _is_int, _is_number, _is_tensor,
    _name, _require, replace)


SYNC_MODES = ("layerwise", "step_end")


@documented
@dataclass
class LocalSGDConfig(ExchangeSettings, PenaltySettings, BackendSettings, OverlapSettings, RecordSettings):
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
        help="A-EDiT (needs --local-sgd-async): seconds of training between syncs (with "
             "--local-sgd-fragments F: between two syncs of one fragment, a sync every T/F s).")
    """A-EDiT only: seconds of training between two synchronisations (with ``fragments`` F, of one
    fragment: a sync every ``local_sgd_sync_time / F`` s, :mod:`megatron_edit.mcore.async_sync`)."""

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
             "tau < --local-sgd-sync-interval). With --local-sgd-async: launched at each sync and "
             "applied tau of the worker's own steps later (tau >= H allowed). With --local-sgd-auto-overlap: the delay "
             "the run starts with, until its first decision.")
    """tau (Streaming DiLoCo's overlap, torchft's ``fragment_sync_delay``): the exchange of the
    sync due after step s = W + kH is launched after step s - tau with the pseudo-gradient
    ``anchor - theta_{s-tau}``; the worker keeps training; after the inner update of step s the
    exchange is completed, the outer step applied to the anchor and the worker's parameters
    merged with the new anchor (``outer_merge_alpha``). The sync steps stay on the grid of
    ``tau = 0`` (torchft's schedule: the launch moves, not the apply), so the run's last step is
    still a sync (which completes at once); a checkpoint while an exchange is in flight saves
    its result, and the resumed run applies it at the same step (the same number of workers,
    delay, merge rule and alpha and fragments only; another is refused). 0: today's blocking
    sync, bit for bit. EDiT needs
    ``tau < local_sgd_sync_interval`` (one exchange in flight at a time). With A-EDiT
    (``use_async``) the exchange is launched at each sync, where the workers meet, and applied tau
    of each worker's own steps later; every interval but the last is planned at least tau + 1
    steps, the final sync is not delayed (:mod:`megatron_edit.mcore.async_delayed`).
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
             "H/F steps (each every H steps; A-EDiT: one every --local-sgd-sync-time/F seconds), so "
             "the link carries 1/F of the model at a time (1: the whole model at every sync).")
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
    by F. With A-EDiT each sync exchanges one fragment in turn, one every ``local_sgd_sync_time / F``
    seconds (the first interval H/F steps), its step weights since its own last sync, the final
    sync of every fragment (:mod:`megatron_edit.mcore.async_sync`). 1: today's sync, bit for bit."""

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
    (SparseLoCo's error feedback; :attr:`error_feedback`), or with ``auto_overlap`` when
    ``auto_formats`` has a top-k format; off otherwise. With ``auto_overlap`` it is one setting
    for every format the run may choose; at a change of format the residual is carried on
    (:mod:`megatron_edit.algorithm.residual`)."""

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
             "measured step and exchange times while the job runs (EDiT or A-EDiT; over torchft a decision is "
             "in force one sync later).")
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
    the algorithm, not only the schedule). With ``use_async`` (A-EDiT) the agreement rides on the
    schedule's all-reduce at each sync, H is the fewest steps the plan gives a worker (times the
    fragments in force), and a decision is in force from the next sync
    (:mod:`megatron_edit.mcore.auto_overlap_async`). The run starts with ``outer_step_delay`` (0: its first
    syncs block), in ``exchange_dtype``, with ``fragments``: start with the setting it will
    likely choose (``python -m megatron_edit.plan``), since the first syncs' algorithm is the
    start's (in the 20 Mbit/s benchmark two undelayed first syncs cost 7.6% of loss after 416
    steps against the delay it then chose; started with that delay it equals it bit for bit).
    Synchronous EDiT over the torch backend; with error feedback the residual is carried from
    one format to the next (:mod:`megatron_edit.algorithm.residual`); GTA with fp32 only."""

    auto_formats: Optional[str] = flag(
        "--local-sgd-auto-formats", None, type=str, show_default=False,
        help="Exchange formats --local-sgd-auto-overlap may choose, comma-separated, most precise "
             "taken first when it hides the exchange (e.g. fp32,int8,int4 or int8,topk0.02-int2; "
             "default: the format the run starts in only).")
    """Comma-separated formats that ``auto_overlap`` may choose: fp32, bf16, fp8, int8, int4, and
    the top-k exchange's ``topk<density>-<values>`` (e.g. ``topk0.02-int2``: density 0.02,
    int2 values; chunks of ``exchange_topk_chunk``). It takes the most precise one whose
    exchange it can hide (:func:`megatron_edit.algorithm.formats.precision_order`: the dense
    ones, then the top-k ones by the bits they send per element). Must include the format the
    run starts in (``exchange_dtype``, with ``exchange_topk_density`` a top-k one). None: that
    format only (the delay alone is chosen)."""

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

    sync_record: Optional[str] = flag(
        "--local-sgd-sync-record", None, type=str, show_default=False,
        help="Append one JSON line per sync per worker to this file (each worker's first rank "
             "writes its own; {worker} in the path: a file per worker). Fields: docs/reference/sync-record.md.")
    """The per-sync record (:mod:`megatron_edit.mcore.sync_record`; fields: docs/reference/sync-record.md):
    one JSON line per sync (and torchft join) per worker, appended by the worker's first rank
    from what the sync agreed and what its ranks left in the job's store (no collective of its
    own); ``{worker}`` in the path: a file per worker. The directory must exist and the file be
    writable (refused at once otherwise). None: no record."""

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
        self._check_penalty()
        _require(isinstance(self.sync_mode, str) and self.sync_mode in SYNC_MODES, "sync_mode",
                 f"must be one of {SYNC_MODES} (got {self.sync_mode!r}).")
        self._check_exchange()
        self._check_delay()
        self._check_sync_backend()
        self._check_auto()
        self._check_sync_record()
        # Valid, but not built in this version: refuse rather than ignore.
        if self.use_step_weight and not self.use_async:
            raise ConfigError(
                f"{_name('use_step_weight')}: step weights only make sense when workers take "
                f"different numbers of steps; add {FLAG_NAMES['use_async']}.")

# Field -> flag, for every message (megatron_edit.config.values), from the fields' metadata.
FLAG_NAMES.update(flag_names(LocalSGDConfig, OuterOptimizerConfig, GTAConfig))
