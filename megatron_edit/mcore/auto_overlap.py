"""Settings from the measured link (``LocalSGDConfig.auto_overlap``): the delay tau, the
exchange format and the fragments F chosen while the job runs, for one :class:`~megatron_edit.mcore.controller.LocalSGD`.

What is measured, on every rank:

* the inner step's time: the median time between optimizer steps since the last sync;
* the whole exchange's time: the first :data:`MEASURE_SYNCS` syncs, and one again at each
  re-decision, are *timed* with the settings in force (at the start the user's: delay, format
  and fragments). Without a delay such a sync blocks (a layer-wise sync completes right after
  the optimizer step, not in the next forward pass) and the time this rank spent in it is the
  exchange's, in the format in force; with a delay its exchange is launched tau steps early as
  always and waited for right after the launch
  (:meth:`~megatron_edit.exchange.outer_sync.OuterSync.wait_at_launch`), its outer step applied
  tau steps later with the same numbers, and the time from the sync's start to the exchange's
  end is the exchange's. So measuring changes the time of a sync, never the algorithm: an auto
  run that starts with the setting it keeps choosing equals that fixed setting's run bit for
  bit. (Before, the timed syncs ran undelayed, full outer steps without the merge; at 20
  Mbit/s the first two cost 7.6% of validation loss after 416 steps against the delay chosen,
  the re-measures 0.1% more.) The other formats' times are predicted from it
  (:func:`~megatron_edit.algorithm.overlap_plan.predict_formats`): an exchange is its codec
  (this rank's compute: timed at the sync for every allowed format against a loopback group,
  :func:`~megatron_edit.exchange.codec_clock.codec_seconds`, no collective), the latency of its
  messages and its bytes (:mod:`~megatron_edit.algorithm.wire`: a top-k format's all-gather of
  the W - 1 other workers' payloads against a dense format's 2 (W - 1) / W) over the link's
  rate, both probed on the torch backend (:mod:`~megatron_edit.exchange.link_probe`; over
  torchft the rate is what the bytes leave of the measured time: :mod:`.format_times`); the
  rest of the sync's time (its decisions, pseudo-gradients, outer step) is the same in any
  format. (Before, the whole time was scaled by bytes: measured in a top-k
  format, mostly codec and latency on a fast link, a dense format was predicted ~90x too slow
  and never chosen.) A fragment's exchange counts for the whole model's in proportion to its
  elements. With a delay in force, a sync that exposes a wait tells more: the exchange took
  tau steps plus that wait;
* the wait each sync exposed (not hidden behind compute).

Agreement: one all-reduce of MAX over every rank of every worker (the controller's
``schedule_group``) of those few numbers gives every rank the same measurements: the fastest
step, the slowest exchange and the largest exposed wait
(:func:`~megatron_edit.algorithm.overlap_plan.agreed`). It is read at the optimizer step after
a sync (after the sync has completed and with nothing in flight, the same logical time on every
rank); every rank then applies the same rule
(:func:`~megatron_edit.algorithm.overlap_plan.choose`, the run's own H, the allowed formats
and numbers of fragments), so every worker takes the same settings at the same step. Where the
sync was applied inside an optimizer step (a delayed sync, or a step-end one) the all-reduce is
started asynchronously at the end of that step and read one step later: a delayed sync's
apply does not bring the workers together, and a blocking all-reduce there was a second
meeting per interval that paid their skew and the link (8 % of the tokens/s at 10 Mbit/s, its
decisions fixed). A layer-wise sync without a delay completes in the next forward pass, one
blocking all-reduce follows it; that sync has just met the other workers.

When: the first decision after :data:`MEASURE_SYNCS` timed syncs; then every ``auto_every``
syncs one timed sync re-measures and the rule decides again. Sooner when a sync's exposed wait
grew past the prediction (:func:`~megatron_edit.algorithm.overlap_plan.exposure_grew`): with a
delay in force that sync has measured its exchange (tau steps plus the wait), and the rule
decides again from it at once (a timed sync after it would wait out a whole exchange on the
link that just slowed; with the link slowed from 27 to 10 Mbit/s mid-run the decision came 4
steps sooner, and the auto run went from 0.87 to 0.99 of the best fixed setting's tokens/s);
without a delay the next sync is timed first. It takes more fragments only where the setting in force no longer covers
the exchange (:func:`~megatron_edit.algorithm.overlap_plan.keep_fragments`: hysteresis). A change is applied between two syncs, with nothing in flight
(:meth:`LocalSGD.apply_settings`), logged on one line (rank 0) with the measurements that led
to it, and every sync's report carries the settings in force (``local-sgd/outer-step-delay``,
``local-sgd/exchange-bits``, ``local-sgd/exposed-wait-seconds`` in TensorBoard).

On A-EDiT's time-based schedule (``use_async``; :mod:`.auto_overlap_async`, whose docstring
says why): the inner step is each worker's own, agreed by MAX as here (the fastest: tau steps of
every worker must hide the exchange); H is the fewest steps the plan just agreed gives any worker
to its next sync (so tau <= H/2 leaves every interval the tau + 1 steps
:func:`~megatron_edit.algorithm.asynchronous.min_interval` asks); the measurements ride on the
schedule's all-reduce at each sync (the one point every worker reaches at the same logical time;
the all-reduce above, started after a worker's own apply, would make a fast worker wait out a
slow one's tau steps); a decision is in force from the next sync (the exchange launched at the
deciding sync keeps its settings), never at the final sync, which is not delayed; no fragments.

The formats (``auto_formats``) may be dense or top-k (``topk0.02-int2``), tried most precise
first (:func:`~megatron_edit.algorithm.formats.precision_order`). Error feedback is one setting
for the run (on by default when a top-k format may be chosen) and its residual crosses a change
of format: the worker's residual is carried on, the quantized exchange's chunk residual is
folded into it, and an fp32 exchange sends a residual it finds once
(:mod:`megatron_edit.algorithm.residual`). A top-k format whose all-gather would send more
than the dense int4 exchange with the run's workers is refused before the first step
(:meth:`AutoOverlap.check_workers`).

Over the torchft backend (workers that change between syncs) the agreement rides on each round
and a decision is in force one sync later: :mod:`.auto_overlap_ft`.

Checkpoints record the settings in force (the run record's config); a resume continues with
them (:meth:`AutoOverlap.resume`) and measures again: a run saved before its first decision
starts measuring from scratch, a later one re-decides within ``auto_every`` syncs, or at the
first sync that exposes a wait.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..algorithm import overlap_plan, quantize
from ..algorithm.formats import topk_format
from ..algorithm.overlap_plan import Choice, Measurement
from ..config import LocalSGDConfig, delay_limit
from ..exchange.codec_clock import codec_seconds
from ..exchange.sparse import check_sparse_workers
from .format_times import FormatTimes

logger = logging.getLogger(__name__)

MEASURE_SYNCS = 2
"""Blocking syncs measured before the first decision (the first one also pays one-time set-up)."""

class AutoOverlap:
    """Measures, agrees and decides the delay and format of one controller's syncs."""

    def __init__(self, controller, user_config: LocalSGDConfig):
        self.controller = controller
        self.user = user_config
        """The run's own settings (``auto_overlap`` on); the controller's ``config`` is the
        settings in force (:meth:`config_for`)."""
        self.formats: Tuple[str, ...] = user_config.allowed_formats
        self.fragments: Tuple[int, ...] = user_config.allowed_fragments
        """The numbers of fragments it may choose (fewest first)."""
        self.clock: Callable[[], float] = time.perf_counter
        self.measure: Callable[[], Measurement] = self._measure
        """This rank's measurement at a sync (replaceable in tests)."""
        self.codec = codec_seconds
        """Each format's codec seconds on this rank (replaceable in tests)."""
        self.timed = True
        """The next sync is timed with the settings in force (without a delay it blocks; with
        one its exchange is waited for right after the launch)."""
        self._to_measure = MEASURE_SYNCS
        self._since_decision = 0
        self._predicted: Optional[float] = None
        """Exposed wait per sync the last decision predicted (None: none yet this run)."""
        self._last_end: Optional[float] = None
        self._step_times: List[float] = []
        self._report = None
        self._agreement = None
        """The agreement's all-reduce in flight, started at the end of the step that applied a
        sync (:meth:`step_ended`), read at the next optimizer step (:meth:`after_sync`)."""
        self._local_exchange: Optional[dict] = None
        self.format_times = FormatTimes(self.formats, user_config.exchange_block_size, user_config.exchange_topk_chunk)
        self._not_stepping = 0.0
        """Seconds since the last step's end spent timing the codecs (not an inner step's)."""
        self.decisions: List[Tuple[int, Choice, Measurement]] = []
        """(step after which it was taken, the choice, the agreed measurement), in order."""

    # ------------------------------------------------------------------ settings
    def config_for(self, delay: int, dtype: str, fragments: Optional[int] = None) -> LocalSGDConfig:
        """The settings in force: the run's, with this delay, format (a name of
        :mod:`~megatron_edit.algorithm.formats`: dense, or ``topk<density>-<values>``) and number
        of fragments (None: the run's own), and no automation. Error feedback is the run's
        (:attr:`~megatron_edit.config.LocalSGDConfig.error_feedback`) in every format that drops
        something (fp32 drops nothing)."""
        u = self.user
        sparse = topk_format(dtype)
        return dataclasses.replace(
            u, auto_overlap=False, auto_formats=None, auto_fragments=None, auto_every=20, outer_step_delay=delay,
            exchange_dtype=dtype if sparse is None else sparse[1],
            exchange_topk_density=None if sparse is None else sparse[0],
            exchange_topk_chunk=4096 if sparse is None else u.exchange_topk_chunk,
            exchange_error_feedback=None if dtype == "fp32" else u.error_feedback,
            fragments=u.fragments if fragments is None else fragments,
            outer_merge_alpha=u.outer_merge_alpha if delay else None,
            outer_merge_rule=u.outer_merge_rule if delay else None,
            exchange_block_size=u.exchange_block_size if sparse is None and quantize.has_scales(dtype) else 256)

    def initial_config(self) -> LocalSGDConfig:
        """The settings the run starts with, until its first decision: the user's delay (0: the
        first syncs block), format and fragments."""
        return self.config_for(self.user.outer_step_delay, self.user.start_format)

    def check_workers(self, workers: int) -> None:
        """Refuse, before the first step, one worker (nothing to hide), and a top-k format it may
        choose whose all-gather sends more bytes than the dense int4 exchange with ``workers``
        workers (as a run that starts in it is refused:
        :func:`~megatron_edit.exchange.sparse.check_sparse_workers`)."""
        if self.user.sync_backend == "torchft":  # a job is one worker; the others come to each sync's quorum
            return
        if workers == 1:
            raise RuntimeError("megatron_edit: --local-sgd-auto-overlap with one EDiT worker: nothing is "
                               "exchanged, so there is nothing to hide; drop the flag.")
        for name in self.formats:
            sparse = topk_format(name)
            if sparse is not None:
                check_sparse_workers(workers, sparse[0], self.user.exchange_topk_chunk, sparse[1])

    def before_save(self) -> None:
        """Before a checkpoint's state is read: nothing to do on EDiT's grid (A-EDiT's puts a
        decision taken at the sync in force, :mod:`.auto_overlap_async`)."""

    def resume(self, delay: int, dtype: str, fragments: Optional[int] = None) -> Optional[str]:
        """A checkpoint's settings in force: continue with them (an error message when this run
        cannot, or None). Before its first decision the run measures from scratch. ``dtype``:
        the checkpoint's format (its name: dense, or ``topk<density>-<values>``); ``fragments``:
        its number of fragments (None: the run's own)."""
        f = self.user.fragments if fragments is None else fragments
        if f not in self.fragments:
            return (f"megatron_edit: the checkpoint was saved with --local-sgd-fragments {f}, which this run's "
                    f"--local-sgd-auto-fragments ({','.join(map(str, self.fragments))}) does not allow; add it, "
                    f"or resume with --local-sgd-fragments {f} alone.")
        if dtype not in self.formats:
            return (f"megatron_edit: the checkpoint was saved exchanging in {dtype}, which this run's "
                    f"--local-sgd-auto-formats ({','.join(self.formats)}) does not allow; add it to the "
                    "formats, or resume without --local-sgd-auto-overlap.")
        h = self.user.local_sgd_sync_interval
        if delay >= delay_limit(h, f) and not self.user.use_async:  # (A-EDiT plans tau + 1 steps an interval)
            return (f"megatron_edit: the checkpoint was saved with --local-sgd-outer-step-delay {delay}, which "
                    f"this run's H/F = {delay_limit(h, f)} does not allow (tau < H/F); resume with the saved "
                    "--local-sgd-sync-interval and --local-sgd-fragments.")
        self.controller.apply_settings(delay, dtype, f)
        fresh = (delay, dtype, f) == (self.user.outer_step_delay, self.user.start_format, self.user.fragments)
        self.timed, self._to_measure = fresh, MEASURE_SYNCS if fresh else 0
        self._since_decision, self._predicted = 0, None
        self._step_times, self._last_end, self._report, self._agreement = [], None, None, None
        return None

    # ------------------------------------------------------------------ measurements
    def step_ended(self) -> None:
        self._time_step()
        if self._report is not None and self._agreement is None and not self._at_end():
            # A sync was applied in this step: agree on its measurements from now on, read at
            # the next optimizer step (no decision follows the run's last step).
            self._agreement = self._start_agreement(self.measure())

    def _time_step(self) -> None:
        now = self.clock()
        if self._last_end is not None:
            self._step_times.append(now - self._last_end - self._not_stepping)
        self._last_end, self._not_stepping = now, 0.0

    @property
    def completes_now(self) -> bool:
        """A layer-wise sync without a delay completes right after its optimizer step (not in
        the next forward pass): a timed one."""
        return self.timed

    @property
    def probes(self) -> bool:
        """Whether the next sync probes the link (:meth:`~megatron_edit.exchange.outer_sync.
        OuterSync.start`): a timed sync, on the torch backend. Over torchft a worker whose heal
        failed on one of its ranks keeps its own rule's state for a round (it may be timing where
        the others are not), and a collective only some workers of a round make would fail it:
        there no probe (:mod:`.format_times`)."""
        return self.timed and self.user.sync_backend != "torchft"

    def _at_end(self) -> bool:
        c = self.controller
        return getattr(c, "last_step", None) is not None and c.steps_done >= c.last_step

    def sync_done(self, report) -> None:
        report.auto_overlap = True
        if report.committed and not report.skipped_sync:
            self._report = report
        if self.timed and not report.delay and self._last_end is not None:
            self._last_end = self.clock()  # the timed exchange is not an inner step's

    def waited(self) -> None:
        """A timed delayed sync has waited for its exchange right after its launch
        (:meth:`~megatron_edit.exchange.outer_sync.OuterSync.wait_at_launch`): that wait is not
        an inner step's time."""
        if self._last_end is not None:
            self._last_end = self.clock()

    def _measure(self) -> Measurement:
        """This rank's measurement of the sync just done (see the module's docstring)."""
        report, c = self._report, self.controller
        exposed = report.exposed_wait_seconds if report.delay else report.seconds
        if not self._step_times:  # no inner step timed since the load (resumed one step before a sync)
            return Measurement(0.0, self._local_exchange or {f: 0.0 for f in self.formats}, exposed, fresh=False)
        step_s = statistics.median(self._step_times)  # H/F >= 2: at least one step since the last sync
        measured = None
        if self.timed and (not report.delay or report.launch_wait_seconds is not None):
            # timed: a sync without a delay blocks; a delayed one waited at its launch. Of its
            # time, the codec and the wire depend on the format; the rest is the same in any.
            measured = report.launch_wait_seconds if report.delay else report.seconds
            wire_part = min(report.exchange_seconds, measured)
        elif report.delay and exposed > 0.5 * step_s:  # the exchange outlasted its tau steps
            measured = wire_part = report.delay * step_s + exposed
        if measured is not None:
            numel = sum(s.numel for s in c.shards)
            scale = 1.0
            if report.fragment is not None:  # one fragment's exchange: the whole model's is that per element
                scale = numel / max(sum(s.numel for s in c.sync_shards.fragments[report.fragment]), 1)
            own = (measured - wire_part) * scale
            self._local_exchange = {f: own + t for f, t in self._predict(wire_part * scale, report, numel).items()}
        exchange = self._local_exchange or {f: 0.0 for f in self.formats}
        return Measurement(step_s, exchange, exposed, fresh=measured is not None)

    def _predict(self, measured: float, report, numel: int) -> dict:
        """Every allowed format's codec and wire time from ``measured``, those of the format in
        force (:mod:`.format_times`), with each format's codec timed now on this rank."""
        c, u = self.controller, self.user
        # torchft: the workers of the sync (its quorum), each job being one
        workers = max(c.sync.num_workers, 2) if u.sync_backend == "torchft" else c.num_workers
        t0 = self.clock()
        device = c.shards[0].device if c.shards else torch.device("cpu")
        codec = self.codec(lambda fmt: self.config_for(0, fmt), self.formats, [s.numel for s in c.shards] or [numel],
                           workers, device)
        self._not_stepping += self.clock() - t0
        return self.format_times.predict(measured, c.config.start_format, numel, workers, report, codec,
                                         len(c.shards))

    def _start_agreement(self, mine: Measurement):
        """Start the all-reduce of MAX of this rank's numbers over every rank (asynchronous)."""
        c = self.controller
        device = c.shards[0].device if c.shards else torch.device("cpu")
        numbers = torch.tensor(mine.pack(self.formats), dtype=torch.float64, device=device)
        return numbers, dist.all_reduce(numbers, op=dist.ReduceOp.MAX, group=c.schedule_group, async_op=True)

    def _finish_agreement(self, pending) -> Measurement:
        numbers, work = pending
        work.wait()
        return overlap_plan.agreed(numbers.tolist(), self.formats)

    def _agree(self, mine: Measurement) -> Measurement:
        """The agreement, blocking (a sync completed outside an optimizer step)."""
        return self._finish_agreement(self._start_agreement(mine))

    # ------------------------------------------------------------------ decisions
    def after_sync(self) -> None:
        """At the optimizer step after a sync (nothing in flight): agree on the measurements and
        decide. Called on every rank of every worker at the same step."""
        if self._report is None:
            return
        c = self.controller
        assert not c.sync.in_progress and (c.delayed is None or not c.delayed.in_flight), \
            "auto overlap: settings change with an exchange in flight"
        pending, self._agreement = self._agreement, None
        mine = self.measure() if pending is None else None
        step, delayed = self._report.step, bool(self._report.delay)
        self._report, self._step_times = None, []
        self._judge(step, delayed, self._agree(mine) if pending is None else self._finish_agreement(pending))

    def _judge(self, step: int, delayed: bool, m: Measurement) -> None:
        """The agreed measurement ``m`` of the sync after ``step`` (every rank alike): count a
        timed sync, decide, or have the next sync timed."""
        was_timed = self.timed
        if m.step_s <= 0:  # a rank timed no inner step since its load: this sync measured nothing
            return
        if was_timed:
            self._to_measure -= 1
            if self._to_measure > 0:
                return
            return self._decide(step, m)
        self._since_decision += 1
        grew = self._predicted is not None and overlap_plan.exposure_grew(m.exposed_s, self._predicted, m.step_s)
        unknown = self._predicted is None and m.exposed_s > 0.5 * m.step_s  # resumed: nothing predicted
        if (grew or unknown) and delayed and m.fresh:
            # A delayed sync that exposed more than half a step measured its exchange: tau steps
            # plus that wait (on the rank that waited most; the agreement's MAX takes it). Decide
            # from it now: a timed sync would wait out a whole exchange the link just slowed.
            # (No rank measured, each waiting less than half its own step: the next is timed.)
            return self._decide(step, m)
        if self._since_decision >= self.user.auto_every or grew or unknown:
            # The next sync re-measures, with the settings in force: the same numbers, its
            # exchange waited for at once (a delayed one right after its launch).
            self.timed, self._to_measure = True, 1

    def _interval(self) -> int:
        """H of the rule: the run's ``local_sgd_sync_interval`` (A-EDiT's: :mod:`.auto_overlap_async`)."""
        return self.user.local_sgd_sync_interval

    def _take(self, choice: Choice) -> None:
        """Put a decision in force: now, between two syncs (A-EDiT's: once its exchange is applied)."""
        self.controller.apply_settings(choice.outer_step_delay, choice.exchange_dtype, choice.fragments)

    def _decide(self, step: int, m: Measurement) -> None:
        u, h = self.user, self._interval()
        choice = overlap_plan.choose(m.step_s, m.exchange_s, h, self.formats,
                                     fragments=self.fragments, chunk=u.exchange_topk_chunk)
        if self.decisions:  # a re-decision: no more fragments while those in force still cover the exchange
            choice = overlap_plan.keep_fragments(self.decisions[-1][1], choice, m.step_s, m.exchange_s, h)
        self.timed, self._since_decision = False, 0
        self._predicted = choice.exposed_s / choice.fragments  # per sync: one fragment's
        self.decisions.append((step, choice, m))
        self._take(choice)
        if not dist.is_initialized() or dist.get_rank() == 0:
            times = ", ".join(f"{f} {s * 1e3:.1f} ms" for f, s in m.exchange_s.items())
            logger.info(
                "megatron_edit: auto overlap after step %d: inner step %.1f ms, exchange %s (slowest rank), "
                "exposed %.1f ms -> --local-sgd-outer-step-delay %d %s "
                "--local-sgd-fragments %d: predicted exposed %.1f ms per sync, %.2f of the no-communication bound%s",
                step, m.step_s * 1e3, times, m.exposed_s * 1e3, choice.outer_step_delay,
                overlap_plan.format_flags(choice.exchange_dtype),
                choice.fragments, self._predicted * 1e3, choice.bound_fraction, "" if choice.hidden else " (not hidden)")
