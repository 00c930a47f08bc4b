"""The torchft backend of the EDiT controllers of one process (``LocalSGDConfig.sync_backend ==
"torchft"``).

Each worker is its own job: its ``torch.distributed`` world holds one worker
(``num_distributed_optimizer_instances`` 1), and rank r meets rank r of every other worker over
:class:`~megatron_edit.exchange.fault_tolerant.FaultTolerantSyncGroup` (one torchft Manager per
rank; the job's TCP store, ``MASTER_ADDR:MASTER_PORT``, hosts the worker's Manager server).

A sync is one torchft round: :meth:`TorchftBackend.begin` before its first collective (the
quorum; a worker behind the others heals there), then the exchange as over the torch backend,
then :meth:`TorchftBackend.commit` before the outer step is applied (``OuterSync.commit_gate``):
applied only where the round is committed and some worker trained since the last sync. A
worker whose commit fails keeps its local progress and its error-feedback residuals from before
the round (it sends that progress again at the next sync); if the others committed, it heals
from them at the next sync.

Joining: when the controller is built, its worker takes part in one round (:meth:`join`) with a
zero pseudo-gradient. In a fresh run every worker does so together; a fresh job for a worker
that died waits there for the others' next sync, heals from its same rank in a live peer (the
anchor, the outer optimizer's state, the step counters, the penalty's statistics;
:meth:`save` / :meth:`load`), and
applies that sync's outer step with them: it is then bit-identical to them. The inner
optimizer's state is not sent (it restarts), nor are error-feedback residuals (zero).

Several controllers in one process (a MoE model with expert parallelism: the dense optimizer and
the expert one) share one Manager and one round per sync: :mod:`.torchft_round`.

Checkpoints: each worker's job saves its own; :meth:`TorchftBackend.state_dict` adds the
Manager's counters (committed syncs) and every worker's penalty statistics to EDiT's state, so a
resume continues exactly, and a worker resuming from an older checkpoint than the others is
behind them and heals at its first sync. A checkpoint of the torch backend (N workers in one
world) or of synchronous training starts a torchft run too: every job loads it as one worker
(:mod:`~megatron_edit.mcore.checkpoint.resume`), and its Manager counts one committed round, as
after a fresh run's join (:meth:`TorchftBackend.start_from_torch_backend`).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ..algorithm.penalty import EWMAStats
from ..config import ConfigError
from ..exchange.fault_tolerant import CountedView, FaultTolerantSyncGroup
from ..exchange.torchft_manager import LighthouseUnreachable
from ..exchange.job_processes import watch_launcher
from ..exchange.run_gate import START_GATE_ENV, claim_replica_id, start_gate, supervised_workers
from ..exchange.sparse import check_sparse_workers
from .auto_overlap_ft import heal_state, load_heal_state
from .process_state import PROCESS
from .torchft_round import TorchftRound, expected_controllers



class TorchftBackend:
    """The torchft sync group of ``controller`` (a :class:`~megatron_edit.mcore.controller.LocalSGD`),
    its part of the process's rounds (:class:`TorchftRound`), and the state a healing worker
    receives of it (the interface: :mod:`.sync_backend`)."""

    dynamic = True
    gates_outer_step = True
    """The commit gates every group's outer step: no overlap of a sync with the next step yet."""

    def __init__(self, controller, optimizer=None):
        config = controller.config
        if controller.layout.num_workers != 1:
            raise RuntimeError(
                f"megatron_edit: --local-sgd-sync-backend torchft runs each worker as its own job: "
                f"give it num_distributed_optimizer_instances 1 (got {controller.layout.num_workers}) and start "
                "one job per worker, each with its own --local-sgd-replica-id.")
        self.controller = controller
        shared = PROCESS.torchft_round
        if shared is not None:
            if len(shared.members) >= shared.expected or shared.joined:
                raise RuntimeError(
                    "megatron_edit: --local-sgd-sync-backend torchft with more EDiT optimizers in one process than "
                    "a MoE model's dense and expert ones (one model per job) is not supported.")
            self.round, self.group = shared, shared.group
            self.sync_group = CountedView(self.group)
            shared.members.append(self)
            return
        watch_launcher()  # a worker's processes live and die together
        workers = supervised_workers(os.environ.get(START_GATE_ENV))
        if workers is not None and config.min_replicas > workers:
            raise RuntimeError(
                f"megatron_edit: --local-sgd-min-replicas {config.min_replicas} is more than the supervisor's "
                f"{workers} workers: no sync could ever commit; lower it.")
        if workers is not None and config.exchange_topk_density is not None:
            check_sparse_workers(workers, config.exchange_topk_density, config.exchange_topk_chunk,
                                 config.exchange_dtype)
        expected = expected_controllers(optimizer)
        if dist.get_rank() == 0:  # two live jobs with one replica id: refused within seconds, named
            try:
                self.claim = claim_replica_id(os.environ.get(START_GATE_ENV), config.replica_id)
            except RuntimeError as error:
                raise ConfigError(str(error)) from None
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port:
            raise RuntimeError(
                "megatron_edit: --local-sgd-sync-backend torchft needs the job's store in MASTER_ADDR / "
                "MASTER_PORT (torchrun sets them) for the worker's torchft Manager.")
        timeout = config.sync_timeout if config.sync_timeout is not None else dist.default_pg_timeout.total_seconds()
        # The worker's ranks agree on each heal and vote over a gloo group of the job (see
        # FaultTolerantSyncGroup): a few numbers, off the training's NCCL groups.
        worker_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout)) \
            if dist.get_world_size() > 1 else None
        try:  # an unreachable Lighthouse: one line within about 20 s, and exit code 2 (the supervisor stops)
            self.group = FaultTolerantSyncGroup.connect(
                replica_id=config.replica_id, lighthouse=config.lighthouse_address, rank=dist.get_rank(),
                world_size=dist.get_world_size(), store_addr=addr, store_port=int(port),
                min_replicas=config.min_replicas, timeout=timeout, quorum_timeout=max(timeout, 1800.0),
                connect_timeout=min(timeout, 20.0), worker_group=worker_group)
        except LighthouseUnreachable as error:
            raise ConfigError(str(error)) from None
        self.sync_group = CountedView(self.group)
        """What the controller's exchange runs over: the group, with this controller's own counters."""
        self.round = TorchftRound(self.group, expected)
        self.round.members.append(self)
        # A supervised run's first sync holds every worker (this rank's Manager is up now).
        # (after the run's last sync, every rank of the worker stops there: RunAlreadyOver)
        start_gate(os.environ.get(START_GATE_ENV), config.replica_id, dist.get_rank(),
                   agree=lambda late: self.group.worker_min_max([float(late)])[1][0] > 0)
        PROCESS.torchft_round = self.round

    # ------------------------------------------------------------------ rounds
    def begin(self, step: int, contributed: bool = True) -> Optional[int]:
        """Before a sync's first collective: the quorum (this worker may heal here; a later
        controller of the process joins the round its first one opened) and the count of the
        workers that trained since the last sync. Returns the others' sync step this worker
        healed into (None: it did not heal)."""
        self.round.begin(self, step, contributed)
        return self.healed_sync_step

    @property
    def healed_sync_step(self) -> Optional[int]:
        """The step of the others' sync this worker healed into at the process's latest round
        (its join round included; None: it did not heal): its own sync step was another (it was
        behind)."""
        return self.round.healed_sync_step

    @property
    def joining(self) -> bool:
        """The round in progress is this worker's join (:meth:`TorchftRound.join`): not one of the
        run's syncs (the sync record writes it as a join)."""
        return self.round.joining

    @property
    def last_heal(self) -> Optional[dict]:
        """What this rank received if its worker healed at the latest round (the sync record's
        heal event; :attr:`TorchftRound.last_heal`), else None."""
        return self.round.last_heal

    @property
    def arrival_wait(self) -> Optional[float]:
        """Seconds the latest round's quorum took on this rank: the wait for the last worker (and a
        heal's transfer), the sync record's arrival wait (:attr:`TorchftRound.quorum_seconds`)."""
        return self.round.quorum_seconds

    @property
    def commit_gate(self):
        """Whether this sync's outer step is applied (:meth:`commit`)."""
        return self.commit

    @staticmethod
    def budget_workers(controller) -> int:
        """A-EDiT: the run's workers (each job is one worker; the supervisor's count, or what a
        heal brought)."""
        return controller.async_plan.budget_workers

    @property
    def waits_for_others(self) -> bool:
        """This controller's sync has begun and a later controller of the process has not yet:
        its outer step waits for the round's commit (:meth:`defer`)."""
        return self.round.waits_for_others

    def defer(self, action) -> None:
        """Run ``action`` (this controller's outer step) right after the round's commit."""
        self.round.defer(action)

    def commit(self) -> bool:
        """Whether this sync's outer step is applied: the round is committed and some worker
        trained since the last sync (:meth:`TorchftRound.commit`, once for all the process's
        controllers)."""
        return self.round.commit()

    def settle_last_sync(self) -> None:
        """After a sync: where it was the run's last and did not commit, try it again
        (:meth:`TorchftRound.settle_last_sync`)."""
        self.round.settle_last_sync()

    def ready(self) -> None:
        """The controller is built: join the others (with the process's other controllers, once
        they are built too)."""
        self.round.member_built(self)

    def ensure_joined(self) -> None:
        """Before the first step: a process that built fewer controllers than its model's
        (a MoE model whose expert optimizer was not built) joins with those it has."""
        if not self.round.joined:
            self.round.join()

    def close_skipped(self) -> None:
        """A-EDiT skipped this sync's exchange (too few steps in all; every worker decides the
        same from the shared schedule): the round commits with nothing applied."""
        self.round.close_skipped()

    def close(self) -> None:
        """Shut this rank's Manager down (the end of the run)."""
        self.round.close()

    # ------------------------------------------------------------------ healing
    def save(self) -> dict:
        """What a healing peer's same rank receives of this controller (torchft's quorum thread,
        at the round's quorum; served by reference: nothing here changes before the round's
        commit). The round adds its sync step."""
        c = self.controller
        c.outer_state.synchronize()
        return dict(
            anchors=[shard.anchor for shard in c.shards],
            outer=c.outer_state.optimizer.state_dict(),
            step=c.steps_done,  # step-end: the sync's step - 1; a delayed launch: its step - tau
            last_sync_step=c.last_sync_step,
            last_step=c.last_step,
            ewma=self._ledger(),
            plan=c.async_plan.dynamic_state() if c.config.use_async else None,
            budget_steps=c.async_plan.budget_steps if c.config.use_async else None,
            global_progress=c.global_progress,
            fragments=c.async_fragments.state_dict() if c.config.use_async else None,  # (a copy: served later)
            auto=None if c.auto is None else heal_state(c.auto),  # the settings in force (auto_overlap_ft)
        )

    def load(self, state: dict) -> None:
        """Become the peer's replica (in :meth:`begin`, on the main thread): its anchors, which
        the parameters restart from, its outer optimizer's state, its step counters, the
        penalty's statistics of every worker (so every worker takes the same decisions) and, with
        ``auto_overlap``, the settings in force (:mod:`.auto_overlap_ft`). A
        worker that was behind (an older checkpoint, a failed commit) is then at the peer's
        point of the sync: the controller goes on with the peer's sync step
        (:attr:`TorchftRound.healed_sync_step`), its fragment and its apply."""
        c = self.controller
        anchors = state["anchors"]
        if len(anchors) != len(c.shards) or any(a.numel() != s.numel for a, s in zip(anchors, c.shards)):
            raise RuntimeError(
                "megatron_edit: the peer this worker heals from holds other shards (its model or its "
                "parallel layout differs): every worker of a torchft run needs the same model and layout.")
        if c.auto is not None and state.get("auto") is not None:  # first: a change of format folds residuals
            load_heal_state(c.auto, state["auto"])
        c.heal_anchor(anchors, state["outer"])
        self._set_ledger(state["ewma"])
        self.load_counters(state)

    def load_counters(self, state: dict) -> None:
        """The counters of a heal state (:data:`~megatron_edit.mcore.torchft_round.COUNTERS`):
        where the worker it came from stands in the run."""
        self.controller.heal_to(state["step"], state["last_sync_step"], state["global_progress"],
                                state["last_step"], state["plan"], state["budget_steps"], state["fragments"])

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """What this worker's checkpoint carries of the backend: its Manager's counters (the
        committed syncs: a worker that resumes from an older checkpoint than the others is behind
        them and heals at its first sync) and every worker's penalty statistics. A delayed sync
        in flight is committed first (:meth:`OuterSync.settle_commit`), so the counters include it."""
        self.controller.sync.settle_commit()
        return dict(manager=dict(self.group.manager.state_dict()), ewma=self._ledger())

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (a resume; the join round at the build has run already)."""
        self.group.manager.load_state_dict({k: int(v) for k, v in state["manager"].items()})
        self._set_ledger(state["ewma"])

    def start_from_torch_backend(self) -> None:
        """After loading a checkpoint of the torch backend (or of synchronous training): this
        worker's Manager counts one committed round, a fresh run's join (torchft's step 0 would
        make every worker but one heal from that one at the next quorum), so that a worker that
        loads it while others have synced since is behind them and heals at its first sync, and
        jobs that load it together are level and none heals; the penalty's statistics restart,
        as in a fresh run."""
        counters = dict(self.group.manager.state_dict())
        self.group.manager.load_state_dict({**counters, "step": 1})
        self._set_ledger({})

    def _ledger(self) -> dict:
        """Every worker's penalty statistics (by replica id), as tensors."""
        return {w: stats.state_dict() for w, stats in self.controller.sync.decisions.ewma_by_worker.items()}

    def _set_ledger(self, ledger: dict) -> None:
        decisions = self.controller.sync.decisions
        decisions.ewma_by_worker = {int(w): EWMAStats.from_state_dict(s) for w, s in ledger.items()}


def backend_of(controller) -> Optional[TorchftBackend]:
    """The controller's torchft backend (None: the torch backend)."""
    backend = getattr(controller, "backend", None)
    return backend if isinstance(backend, TorchftBackend) else None
