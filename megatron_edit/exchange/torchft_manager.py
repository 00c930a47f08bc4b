"""A worker rank's torchft ``Manager``: started with the Lighthouse (one line when it cannot be
reached), its quorum order, its heal server and its log lines (what :class:`~megatron_edit.exchange.
fault_tolerant.FaultTolerantSyncGroup` runs its rounds over).

torchft is an optional dependency (``pip install torchft==0.2.0``): imported only by
:func:`start_manager`.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from .addresses import advertised_addresses, heal_transport, url_host


def replica_name(replica_id: int) -> str:
    """The Manager's replica id for worker ``replica_id``: zero-padded, so that torchft's order
    of the quorum (sorted strings) is the workers' numeric order."""
    return f"{replica_id:06d}"


class _WithoutFlightRecorderLine(logging.Filter):
    """torchft's Manager warns at every quorum of a torch build without NCCL (a CPU build) that it
    cannot reset NCCL's flight recorder: nothing a worker's sync over gloo uses."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Unable to reset NCCL flight recorder" not in record.getMessage()


_QUIET = _WithoutFlightRecorderLine()


class LighthouseUnreachable(RuntimeError):
    """A rank's torchft Manager could not start with the Lighthouse (its address, or the
    Lighthouse is down): the message says which and where."""


def start_manager(*, replica_id: int, lighthouse: str, rank: int, world_size: int, store_addr: str,
                  store_port: int, min_replicas: int, timeout: float, quorum_timeout: float,
                  connect_timeout: float):
    """This rank's Manager (see :meth:`FaultTolerantSyncGroup.connect
    <megatron_edit.exchange.fault_tolerant.FaultTolerantSyncGroup.connect>`): the worker's ranks
    advertise this machine's address on its route to the Lighthouse; a fresh run's first round
    sends no state (``init_sync`` off: the workers compare their start instead); raises
    :class:`LighthouseUnreachable` with one line."""
    from torchft import Manager, ProcessGroupGloo

    logging.getLogger("torchft.manager").addFilter(_QUIET)  # (once: a filter is added once)
    try:
        host, store_addr = advertised_addresses(lighthouse, store_addr)
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=timeout)), min_replica_size=min_replicas,
            init_sync=False,  # a fresh run's workers compare their start instead (_check_same_start)
            load_state_dict=None, state_dict=None, use_async_quorum=False,
            replica_id=replica_name(replica_id), store_addr=store_addr, store_port=store_port, rank=rank,
            world_size=world_size, lighthouse_addr=lighthouse, timeout=timedelta(seconds=timeout),
            quorum_timeout=timedelta(seconds=quorum_timeout),
            connect_timeout=timedelta(seconds=connect_timeout), hostname=url_host(host),
            checkpoint_transport=heal_transport(host, timedelta(seconds=timeout)),
        )
    except Exception as error:  # noqa: BLE001 (torchft raises plain RuntimeErrors)
        raise LighthouseUnreachable(
            f"megatron_edit: torchft's Manager for worker {replica_id} (rank {rank}) could not start "
            f"with the Lighthouse at {lighthouse} (--local-sgd-lighthouse / TORCHFT_LIGHTHOUSE) within "
            f"{connect_timeout:g} s: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
        ) from error
    return manager
