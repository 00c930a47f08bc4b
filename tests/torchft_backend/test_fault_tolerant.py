"""megatron_edit.exchange.fault_tolerant over real torchft (CPU, gloo): a Lighthouse in the test
process, each worker its own job. The quorum gives size and rank, the contributor count leaves
out a worker that did not train, every collective of the exchange is correct over it, and a
worker that dies makes the round fail (not raise) and the survivors go on without it.

torchft is the optional ``ft`` extra: installed in CI's default lane, skipped where it is not."""

import os

import pytest
import torch

pytest.importorskip("torchft")

import ft_jobs  # noqa: E402

# No megatron-core here: one_lane, as the tests of tests/exchange (marked by folder in conftest).
pytestmark = pytest.mark.one_lane

TIMEOUT = 240


def _connect(worker, lighthouse, min_replicas=1, timeout=30.0):
    from megatron_edit.exchange.fault_tolerant import FaultTolerantSyncGroup

    host, port = ft_jobs.job_store_address()
    group = FaultTolerantSyncGroup.connect(
        replica_id=worker, lighthouse=lighthouse, rank=torch.distributed.get_rank(),
        world_size=torch.distributed.get_world_size(), store_addr=host, store_port=port,
        min_replicas=min_replicas, timeout=timeout, quorum_timeout=90.0, connect_timeout=30.0)
    state = torch.tensor([float(worker)])
    group.register_state("test", lambda sd: state.copy_(sd["value"]), lambda: {"value": state.clone()})
    group.test_state = state
    return group


def state_of(group):
    return group.test_state[0]


def _collectives(rank, world_size, worker, workers, lighthouse, gate_dir):
    """One round over the quorum of ``workers`` one-rank jobs; what each collective gave."""
    group = _connect(worker, lighthouse)
    ft_jobs.gate(gate_dir, f"w{worker}", workers)  # every Manager is up: one quorum of all
    # The first round: at step 0 nobody heals (init_sync off): each keeps its own state.
    group.begin(contributed=True)
    out = dict(join=(group.contributors, group.healed, float(state_of(group)), group.commit()))
    group.begin(contributed=worker != workers - 1)  # the last one "did not train"
    out.update(size=group.size, rank=group.rank, contributors=group.contributors, replica_ids=group.replica_ids,
               trained=group.trained.tolist())
    W, me = group.size, group.rank
    t = torch.full((5,), float(me + 1))
    group.all_reduce_sum(t).wait()
    out["sum"] = t.tolist()
    x = torch.arange(W * 2, dtype=torch.float32) + 100 * me
    y = torch.empty_like(x)
    group.all_to_all(y, x).wait()
    out["all_to_all"] = y.tolist()
    xb = (torch.arange(W * 3) + 10 * me).to(torch.uint8)
    yb = torch.empty_like(xb)
    group.all_to_all(yb, xb, async_op=False)
    out["all_to_all_uint8"] = yb.tolist()
    g = torch.empty(W * 2, dtype=torch.uint8)
    group.all_gather_into(g, torch.tensor([me, 7], dtype=torch.uint8)).wait()
    out["all_gather_into"] = g.tolist()
    out["all_gather"] = group.all_gather(torch.tensor([me, -1.5], dtype=torch.float64)).tolist()
    out["collectives"] = group.counters.collectives
    out["commit"] = group.commit()
    out["step"] = group.step
    out["errored"] = group.manager.errored() is not None
    group.shutdown()
    return out


@pytest.mark.timeout(TIMEOUT + 60)
def test_a_round_over_three_workers(tmp_path):
    """3 workers x 1 rank: size and rank from the quorum (the workers' numeric order), every
    collective of the exchange correct, the contributor count leaves out the one that did not
    train, the round commits."""
    with ft_jobs.jobs_and_lighthouse() as (server, start):
        jobs = [start(_collectives, 1, w, 3, server.address(), str(tmp_path / "gate"), timeout=TIMEOUT)
                for w in range(3)]
        outs = [out[0] for out in ft_jobs.all_results(jobs)]
    for w, out in enumerate(outs):
        # The first round: nobody healed (nothing sent), all three count.
        assert out["join"] == (3, False, float(w), True)
        assert (out["size"], out["rank"], out["contributors"]) == (3, w, 2)
        assert (out["replica_ids"], out["trained"]) == ([0, 1, 2], [True, True, False])
        assert out["sum"] == [6.0] * 5
        assert out["all_to_all"] == [float(2 * w + k + 100 * r) for r in range(3) for k in range(2)]
        assert out["all_to_all_uint8"] == [3 * w + k + 10 * r for r in range(3) for k in range(3)]
        assert out["all_gather_into"] == [v for r in range(3) for v in (r, 7)]
        assert out["all_gather"] == [[float(r), -1.5] for r in range(3)]
        # who trained (twice), the sum, two all-to-alls, two all-gathers
        assert out["collectives"] == 7
        assert (out["commit"], out["step"], out["errored"]) == (True, 2, False)


def _survivor(rank, world_size, worker, lighthouse, gate_dir):
    """Worker 0: round 1 with worker 1; worker 1 dies inside round 2, after its quorum and
    before the exchange; round 2 fails here without raising; round 3 is worker 0 alone."""
    group = _connect(worker, lighthouse)
    ft_jobs.gate(gate_dir, f"w{worker}", 2)
    rounds = []
    for round_ in range(3):
        group.begin(contributed=True)
        if worker == 1 and round_ == 1:
            os._exit(3)  # dies inside a sync
        x = torch.ones(4) * (worker + 1)
        y = torch.full((4,), -7.0)
        group.all_to_all(y, x).wait()
        g = group.all_gather(torch.ones(2))
        rounds.append(dict(size=group.size, contributors=group.contributors, y=y.tolist(), gathered=g.tolist(),
                           errored=group.manager.errored() is not None, commit=group.commit(), step=group.step))
    group.shutdown()
    return rounds


@pytest.mark.timeout(TIMEOUT + 60)
def test_a_worker_dying_inside_a_sync_fails_the_round_and_the_survivor_goes_on(tmp_path):
    with ft_jobs.jobs_and_lighthouse(heartbeat_timeout_ms=3000) as (server, start):
        survivor = start(_survivor, 1, 0, server.address(), str(tmp_path / "gate"), timeout=TIMEOUT)
        start(_survivor, 1, 1, server.address(), str(tmp_path / "gate"), timeout=TIMEOUT)
        first, failed, alone = survivor.results()[0]
    # (at step 0 nobody heals: torchft's init_sync is off; both count)
    assert (first["size"], first["contributors"], first["commit"], first["step"]) == (2, 2, True, 1)
    assert first["y"] == [1.0, 1.0, 2.0, 2.0] and first["gathered"] == [[1.0, 1.0]] * 2
    # The round worker 1 died in: its collectives failed (outputs zeroed, not raised), no commit.
    assert (failed["size"], failed["errored"], failed["commit"], failed["step"]) == (2, True, False, 1)
    assert failed["y"] == [0.0] * 4 and failed["gathered"] == [[0.0, 0.0]] * 2
    # The next one is worker 0 alone, and commits.
    assert (alone["size"], alone["contributors"], alone["errored"], alone["commit"], alone["step"]) == (
        1, 1, False, True, 2)
    assert alone["y"] == [1.0] * 4


def _first_round(rank, world_size, worker, lighthouse, gate_dir, start):
    """A fresh run's first round with ``start`` as what this worker starts from: (healed, the
    refusal's text or None)."""
    from megatron_edit.config import ConfigError

    group = _connect(worker, lighthouse)
    group.start_digest = lambda: list(start)
    ft_jobs.gate(gate_dir, f"w{worker}", 2)
    try:
        group.begin(contributed=False)
        return group.healed, None
    except ConfigError as error:
        return group.healed, str(error)
    finally:
        group.shutdown()


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("apart", [0.0, 1e-7, 1e-3], ids=["same", "within-1e-6", "different"])
def test_a_fresh_runs_workers_compare_their_start_instead_of_sending_it(tmp_path, apart):
    """Two workers at torchft step 0: nothing is sent (neither heals); what they start from is
    compared to a relative 1e-6 (another summation order passes), and workers that start apart
    are refused on both, naming them."""
    with ft_jobs.jobs_and_lighthouse(min_replicas=2) as (server, start):
        jobs = [start(_first_round, 1, w, server.address(), str(tmp_path / "gate"),
                      (5.0 + w * apart * 5.0, 40.0), timeout=TIMEOUT) for w in range(2)]
        outs = [out[0] for out in ft_jobs.all_results(jobs)]
    assert [healed for healed, _ in outs] == [False, False]
    if apart < 1e-6:
        assert [said for _, said in outs] == [None, None]
    else:
        for _, said in outs:
            assert said is not None and "start from different weights (worker 0's differ from worker(s) [1])" in said


@pytest.mark.timeout(120)
def test_no_lighthouse_at_the_address_is_one_line_after_a_bounded_wait():
    """A bound socket that does not listen: connecting is refused, nothing else can take the port."""
    import socket

    import torch.distributed as tdist
    from megatron_edit.exchange.fault_tolerant import FaultTolerantSyncGroup

    with socket.socket() as nothing:
        nothing.bind(("127.0.0.1", 0))
        address = f"http://127.0.0.1:{nothing.getsockname()[1]}"
        store = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        with pytest.raises(RuntimeError) as info:
            FaultTolerantSyncGroup.connect(replica_id=3, lighthouse=address, rank=0, world_size=1,
                                           store_addr="127.0.0.1", store_port=store.port, connect_timeout=2.0)
    message = str(info.value)
    assert "\n" not in message and address in message and "--local-sgd-lighthouse" in message
    assert "worker 3" in message and "within 2 s" in message


def _same_id(rank, world_size, lighthouse, gate_dir, name):
    # timeout 10 s: the quorum's group of two ranks 7 cannot connect; its setup gives up after it
    group = _connect(7, lighthouse, timeout=10.0)
    ft_jobs.gate(gate_dir, name, 2)
    try:
        group.begin(contributed=True)
        return None
    except RuntimeError as error:
        return str(error)
    finally:
        group.shutdown()


@pytest.mark.timeout(TIMEOUT + 60)
def test_two_workers_with_one_replica_id_are_refused(tmp_path):
    with ft_jobs.jobs_and_lighthouse(min_replicas=2) as (server, start):
        jobs = [start(_same_id, 1, server.address(), str(tmp_path / "gate"), f"job{j}", timeout=TIMEOUT)
                for j in range(2)]
        messages = [out[0] for out in ft_jobs.all_results(jobs)]
    for message in messages:
        assert message is not None and "\n" not in message
        assert "two workers of the sync have --local-sgd-replica-id 7" in message


@pytest.mark.timeout(60)
def test_the_start_gate_names_the_workers_that_did_not_arrive():
    from datetime import timedelta

    import torch.distributed as dist
    from megatron_edit.exchange.run_gate import start_gate, start_gate_value

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    value = start_gate_value("127.0.0.1", store.port, 3, 1.0)
    with pytest.raises(RuntimeError) as error:
        start_gate(value, 1, 0)
    assert "waited 1 s for worker(s) [0, 2] (rank 0)" in str(error.value) and "\n" not in str(error.value)
    store.set("start/0/0", "1"), store.set("start/0/2", "1")
    start_gate(value, 1, 0)  # every worker of rank 0 arrived: it passes at once
    start_gate(None, 1, 0)  # no supervisor: no gate
    with pytest.raises(RuntimeError, match="--local-sgd-replica-id 3 is not one of the supervisor's 3 workers"):
        start_gate(value, 3, 0)


@pytest.mark.timeout(60)
def test_a_worker_that_comes_after_the_runs_last_sync_stops_on_every_rank():
    """Worker 0 has passed the run's last sync (one rank of it said so: it counts for the whole
    worker). Worker 1 then does not start at the start gate, even on a rank that read the store
    before it was written (its ranks agree: ``agree``), and stops at a round whose quorum lacks
    worker 0 (its relaunch joined after that sync, or it was left out of it); a round with worker 0
    in it (worker 1 in the last sync itself) goes on. One line each."""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist
    from megatron_edit.exchange.run_gate import RunAlreadyOver, RunEnd, past_the_last_sync, start_gate, start_gate_value

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    value = start_gate_value("127.0.0.1", store.port, 2, 1.0)
    for w in (0, 1):
        store.set(f"start/0/{w}", "1")
    late = []
    start_gate(value, 1, 0, agree=lambda mine: late.append(mine) or mine)  # nobody passed it: it starts
    round_of = lambda *ids: SimpleNamespace(in_quorum=list(ids), worker_min_max=lambda v: (v, v))  # noqa: E731
    one = RunEnd(value, 1)
    one.stop_if_left_behind(round_of(1), "its join")
    RunEnd(value, 0).passed(12)  # worker 0's last sync, after step 12
    assert past_the_last_sync(store, 2) == [0] and late == [False]
    with pytest.raises(RunAlreadyOver) as error:  # another rank of worker 1 found it: this one stops too
        start_gate(value, 1, 0, agree=lambda mine: True)
    assert str(error.value) == ("megatron_edit: worker 1 arrives after the run's last sync (worker(s) [0] passed it): "
                                "it would train the run alone from its own start, so it does not start.")
    one.stop_if_left_behind(round_of(0, 1), "its sync after step 12")  # in the last sync with worker 0: it goes on
    with pytest.raises(RunAlreadyOver) as error:
        one.stop_if_left_behind(round_of(1), "its join")
    assert one.stopped and "\n" not in str(error.value) and str(error.value).startswith(
        "megatron_edit: worker 1 came to its join after worker(s) [0] had passed the run's last sync without it")


def test_the_supervisors_workers_come_from_the_gate():
    from megatron_edit.exchange.run_gate import START_GATE_ENV, start_gate_value, supervised_workers

    assert supervised_workers(start_gate_value("host", 5, 3, 600.0)) == 3 and supervised_workers(None) is None
    with pytest.raises(RuntimeError, match=f"{START_GATE_ENV}='nonsense' is not host:port:workers:timeout_s"):
        supervised_workers("nonsense")


# ------------------------------------------------ what a worker advertises (several nodes)

def test_a_worker_advertises_its_address_on_the_route_to_the_lighthouse(monkeypatch):
    """torchft advertises socket.gethostname() and torchrun --standalone sets MASTER_ADDR=localhost:
    neither reaches a worker on another node. The Manager's host and the heal server's become this
    machine's address on its route to the Lighthouse; the job's store address too where it is a
    loopback one (a job over several nodes keeps its head's)."""
    from megatron_edit.exchange import addresses as ft

    assert ft.route_address("http://127.0.0.1:29510") == "127.0.0.1"
    assert ft.is_loopback("localhost") and ft.is_loopback("127.0.0.1") and not ft.is_loopback("10.201.0.2")
    assert ft.advertised_addresses("http://127.0.0.1:1", "localhost") == ("127.0.0.1", "127.0.0.1")
    monkeypatch.setattr(ft, "route_address", lambda address: "10.201.0.2")
    assert ft.advertised_addresses("http://10.201.0.1:29510", "localhost") == ("10.201.0.2", "10.201.0.2")
    assert ft.advertised_addresses("http://10.201.0.1:29510", "127.0.0.1") == ("10.201.0.2", "10.201.0.2")
    assert ft.advertised_addresses("http://10.201.0.1:29510", "10.201.0.7") == ("10.201.0.2", "10.201.0.7")
    transport = ft.heal_transport("10.201.0.2", ft.timedelta(seconds=5))
    try:
        assert transport.metadata().startswith("http://10.201.0.2:")
    finally:
        transport.shutdown(wait=False)



def test_a_failed_commit_vote_is_not_committed_says_why_and_counts_no_round():
    # torchft's should_commit raises when the reply to a rank's vote is lost or a peer stalls
    # in it (TimeoutError): that rank must not die of it, and the round is not committed; the
    # Manager's counters stay as before the vote (here a worker of one rank; the ranks of a
    # worker agree: tests/torchft_backend/test_torchft_megatron.py).
    from megatron_edit.exchange.fault_tolerant import FaultTolerantSyncGroup

    class Manager:
        def __init__(self, outcome):
            self.outcome, self.counters = outcome, {"step": 3, "batches_committed": 6}

        def state_dict(self):
            return dict(self.counters)

        def load_state_dict(self, state):
            self.counters = dict(state)

        def should_commit(self):
            if isinstance(self.outcome, BaseException):
                self.counters["step"] += 1  # whatever it did before raising is undone
                raise self.outcome
            self.counters["step"] += int(self.outcome)
            return self.outcome

    group = FaultTolerantSyncGroup(Manager(TimeoutError("timed out after 60 s")))
    assert group.commit() is False and isinstance(group.commit_error, TimeoutError)
    assert group.manager.counters["step"] == 3
    group.manager.outcome = True
    assert group.commit() is True and group.commit_error is None and group.manager.counters["step"] == 4
    group.manager.outcome = ValueError("a defect, not a peer's failure")
    with pytest.raises(ValueError):
        group.commit()


def test_min_replicas_counts_the_workers_that_trained():
    # torchft counts the workers in the round; a worker that has just joined or healed brought
    # nothing: a round with fewer trained workers than --local-sgd-min-replicas does not commit.
    from megatron_edit.exchange.fault_tolerant import FaultTolerantSyncGroup

    class Manager:
        errors = []

        def state_dict(self):
            return {"step": 1, "batches_committed": 2}

        def load_state_dict(self, state):
            pass

        def report_error(self, error):
            self.errors.append(error)

        def should_commit(self):
            return not self.errors

    group = FaultTolerantSyncGroup(Manager(), min_replicas=2)
    group.size, group.contributors = 2, 2
    assert group.commit() is True
    group.contributors = 0  # a join round: nothing to apply, commits
    assert group.commit() is True
    group.contributors = 1
    assert group.commit() is False and "only 1 of its 2 workers trained" in str(Manager.errors[0])


def test_two_live_jobs_with_one_replica_id_are_found_within_seconds_and_a_dead_ones_claim_is_not():
    # Each supervised job's rank 0 holds its replica id in the supervisor's store and renews it;
    # a second job with the same id sees the claim renewed and refuses, naming the id; a claim
    # left by a dead job (no longer renewed) is taken over after three intervals, and one the
    # supervisor released at once.
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from megatron_edit.exchange.run_gate import ReplicaClaim, release_claim

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    # (1 s intervals: the live claim is renewed within the 3 s its rival waits, even on a loaded machine)
    first = ReplicaClaim(store, 3, interval=1.0)
    first.take()
    with pytest.raises(RuntimeError, match=r"another job holds --local-sgd-replica-id 3 \(.*\) and is alive"):
        ReplicaClaim(store, 3, interval=1.0).take()
    other = ReplicaClaim(store, 4, interval=0.2)
    other.take()  # another id: at once
    first.stop()  # the first job dies: its claim is no longer renewed
    time.sleep(0.5)
    second = ReplicaClaim(store, 3, interval=0.2)
    second.take()  # taken over after three intervals
    second.stop()  # (it dies, and the supervisor releases its claim)
    release_claim(store, 3)
    start = time.monotonic()
    third = ReplicaClaim(store, 3, interval=60.0)
    third.take()  # released by the supervisor: no wait (a wait would be 3 intervals, 180 s)
    assert time.monotonic() - start < 60
    for claim in (other, third):
        claim.stop()
