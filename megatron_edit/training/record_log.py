"""The per-sync record's figures (issue 59, :mod:`megatron_edit.mcore.sync_record`) as TensorBoard
scalars (and W&B values) through Megatron-LM's own writers, under ``local-sgd-record/`` at each
record's step: the one mapping of a record to numbers is
:func:`megatron_edit.exchange.record.scalars`. Only with ``--local-sgd-sync-record`` and a
TensorBoard writer (``--tensorboard-dir``, as for Megatron's own scalars); no flag of its own.

**Where the figures come from, and why this way.** A record is a worker's, made on the worker's
first rank from the parts its ranks leave in the job's store; Megatron's writer is on the job's
last rank, which is some worker's (the last one's), usually not its first rank. Three ways to
bring one to the other:

* the logging rank gathers the figures itself with a collective: refused, since nothing may cross
  workers or wait between syncs;
* the logging rank makes its worker's record again from the same parts: the writer deletes each
  part as it reads it, so two readers would race on the delete (or need a second protocol of
  deletion), and the waiting for late parts would be done twice, differently;
* (chosen) the writer hands each record it writes to its worker's reader: the logging rank says,
  before its first sync, that it reads (``SyncRecord(reader=True)``: :attr:`LocalSGDRuntime.record_reader`,
  set here before the model is built); the writer then sets each record in the store (one ``set``)
  and the logging rank takes them at Megatron's TensorBoard intervals (one ``check``, a ``get``
  and a ``delete_key`` per record). No collective, no wait, nothing across workers (the reader and
  the writer are one worker's ranks, on the job's store), one assembly, and the scalars come from
  the very record the file has (the test compares them).

A record comes at its sync's end or a later one's (once every rank's part is there): each is
written at its own step, so the plot does not depend on when it was taken. When Megatron's loop
ends (``train`` returns, or leaves with ``SystemExit`` at an exit condition) the logging rank
waits up to :data:`~megatron_edit.mcore.sync_record.END_WAIT_S` for the records of the syncs it
took part in, writes them and flushes the writer; a record still missing then is named in a
warning (it is in the file). The logging rank's figures are its own worker's, as Megatron's loss
and timers on that rank are; the other workers' records are in the file.

W&B takes only increasing steps, and a record comes at or after its step: at each TensorBoard
log point the newest record taken is logged to W&B at Megatron's iteration, with its own step as
``local-sgd-record/step`` (the others of that interval are in TensorBoard and the file).
"""

from __future__ import annotations

from typing import Callable, List, Optional

from ..exchange.record import SCALAR_PREFIX, scalars
from ..mcore.runtime import LocalSGDRuntime
from ..mcore.sync_record import END_WAIT_S


def write_records(records: List[dict], writer, wandb_writer, iteration: Optional[int]) -> None:
    """``records``' scalars to Megatron's TensorBoard ``writer`` at each record's step, and the
    newest one's to ``wandb_writer`` (either may be None) at ``iteration`` (None: W&B's own next
    step, after the loop)."""
    if writer is not None:
        for record in records:
            for tag, value in scalars(record).items():
                writer.add_scalar(tag, value, record["step"])
    if wandb_writer is not None and records:
        newest = dict(scalars(records[-1]), **{SCALAR_PREFIX + "step": float(records[-1]["step"])})
        if iteration is None:
            wandb_writer.log(newest)
        else:
            wandb_writer.log(newest, iteration)


def _writers():
    from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

    return get_tensorboard_writer(), get_wandb_writer()


class RecordLog:
    """The patches that make Megatron-LM's logging rank a reader of its worker's records and
    write the last ones after the loop (the ones in between: :func:`write_records` from
    ``training_log``, :func:`megatron_edit.training.metrics.training_log_fields`)."""

    def __init__(self, runtime_ref: Callable[[], Optional[LocalSGDRuntime]]):
        self.runtime_ref = runtime_ref

    def wrap_setup_model_and_optimizer(self, original):
        def setup_model_and_optimizer(*args, **kwargs):
            runtime = self.runtime_ref()
            if runtime is not None:  # Megatron's writers exist by now (initialize_megatron); the record not yet
                runtime.record_reader = _writers()[0] is not None
            return original(*args, **kwargs)

        return setup_model_and_optimizer

    def wrap_train(self, original):
        def train(*args, **kwargs):
            try:
                result = original(*args, **kwargs)
            except SystemExit:  # Megatron's exit conditions (--exit-interval, a signal) leave this way
                self.write_the_rest()
                raise
            self.write_the_rest()
            return result

        return train

    def write_the_rest(self) -> None:
        """After the loop: the records still to come, waited for (see the module)."""
        runtime = self.runtime_ref()
        record = None if runtime is None else runtime.sync_record
        if record is None or not record.reader:
            return
        writer, wandb_writer = _writers()
        write_records(record.take(wait=END_WAIT_S), writer, wandb_writer, None)
        if writer is not None:
            writer.flush()
