"""The sync backend: what an EDiT controller (:class:`~megatron_edit.mcore.controller.LocalSGD`)
drives at each sync, and nothing else does. Two implementations:

* :class:`TorchBackend` (``--local-sgd-sync-backend torch``, the default): every worker in one
  ``torch.distributed`` world, the same workers at every sync; a round always commits.
* :class:`~megatron_edit.mcore.fault_tolerant.TorchftBackend` (``torchft``): each worker its own
  job; workers leave and come back, a behind one heals at a round's quorum, a round commits or
  not (its rounds: :mod:`.torchft_round`; a worker as one unit:
  :class:`~megatron_edit.exchange.fault_tolerant.FaultTolerantSyncGroup`).

The interface, in the order of one sync (the controller calls each at one place):

``sync_group``
    what the exchange runs over (:class:`~megatron_edit.exchange.groups.SyncGroup` or a view of
    a torchft group); ``dynamic``: whether the workers may change from one sync to the next.
``ready()`` / ``ensure_joined()``
    the controller is built / before its first step (torchft: join the others' next sync).
``begin(step) -> Optional[int]``
    before a sync's first collective (torchft: the quorum). Returns the others' sync step where
    this worker healed into it (it was behind), else None; kept as ``healed_sync_step``.
``waits_for_others`` / ``defer(action)``
    this sync's outer step must wait for a later controller of the process (torchft: one round
    for a MoE model's dense and expert optimizers): run ``action`` after the round's commit.
``commit_gate``
    None (every round commits), or a callable: whether this sync's outer step is applied
    (``OuterSync.commit_gate``); ``gates_outer_step``: the same as a flag.
``close_skipped()``
    A-EDiT skipped the exchange (the round ends with nothing applied).
``settle_last_sync()``
    after a sync's end: where it was the run's last and did not commit, the backend has the
    controller sync again (:meth:`~megatron_edit.mcore.controller.LocalSGD.sync_again`), for a
    bounded time (torchft: a new quorum among the workers still there).
``budget_workers(controller)``
    A-EDiT: the workers whose steps the budget and global progress count.
``state_dict()`` / ``load_state_dict(state)``
    what a checkpoint carries of the backend (None: nothing), under :data:`STATE_KEY`.
``close()``
    the end of the run.
``joining`` / ``last_heal`` / ``arrival_wait``
    for the sync record (:mod:`.sync_record`): the round in progress is the worker's join (torchft;
    its report is not one of the run's syncs); what this rank received if it healed at the latest
    round (``from_worker``, ``bytes``, ``seconds``), else None; how long the latest round waited
    for the last worker (torchft: its quorum; None: the controller's arrival checks measure it).

A backend never writes the controller's counters itself except through a heal's state
(:meth:`TorchftBackend.load <megatron_edit.mcore.fault_tolerant.TorchftBackend.load>`).
"""

from __future__ import annotations

from typing import Callable, Optional

from ..exchange.groups import SyncGroup

STATE_KEY = "torchft"
"""The key of the backend's state in the controller's checkpoint extras (only torchft has one)."""


def backend_for(controller, optimizer, inter, num_workers: int):
    """The sync backend ``controller`` drives (``LocalSGDConfig.sync_backend``): the torch one
    over ``inter`` (Megatron's group across instances), or torchft's (each worker its own job)."""
    if controller.config.sync_backend == "torchft":
        from .fault_tolerant import TorchftBackend

        return TorchftBackend(controller, optimizer)
    backend = TorchBackend(inter, num_workers)
    backend.controller = controller
    return backend


class TorchBackend:
    """Every worker in this ``torch.distributed`` world (the default backend): the same workers
    at every sync, every round committed, nothing to join or heal."""

    dynamic = False
    healed_sync_step: Optional[int] = None
    waits_for_others = False
    commit_gate: Optional[Callable[[], bool]] = None
    gates_outer_step = False
    joining = False
    last_heal: Optional[dict] = None
    arrival_wait: Optional[float] = None
    controller = None

    def __init__(self, inter, num_workers: int):
        self.sync_group = SyncGroup(inter)
        if self.sync_group.size != num_workers:
            raise RuntimeError(
                f"megatron_edit: the DDP config says {num_workers} EDiT worker(s) "
                "(num_distributed_optimizer_instances) but the buckets' group across instances "
                f"holds {self.sync_group.size} ranks (parallel_state.initialize_model_parallel("
                "num_distributed_optimizer_instances=...)): give both the same number of workers."
            )

    def ready(self) -> None:
        pass

    def ensure_joined(self) -> None:
        pass

    def begin(self, step: int) -> Optional[int]:
        auto = getattr(self.controller, "auto", None)
        if getattr(auto, "rides_on_rounds", False):  # (a test's comparison with torchft's agreement)
            auto.agree_on_torch()
        return None

    def defer(self, action: Callable[[], None]) -> None:
        raise RuntimeError("megatron_edit: the torch backend's outer steps never wait for another optimizer's.")

    def close_skipped(self) -> None:
        pass

    def settle_last_sync(self) -> None:
        pass

    @staticmethod
    def budget_workers(controller) -> int:
        return controller.num_workers

    def state_dict(self) -> Optional[dict]:
        return None

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        pass
