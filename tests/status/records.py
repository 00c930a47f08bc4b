"""Hand-written sync records (schema 1, every field of FIELDS) for the status tests."""

import json

from megatron_edit.exchange.record import FIELDS, SCHEMA

T0 = 1_700_000_000.0


def rec(worker, step, t, kind="sync", run="run-a", participants=(0, 1), committed=True, last=False, final=False,
        events=(), sync=None, excluded=(), bytes_sent=1000, exchange=0.5, exposed=0.2, arrival=0.1,
        residual_ratio=None):
    """One record of ``worker`` at ``step``, ``t`` seconds after :data:`T0`."""
    record = dict.fromkeys(FIELDS)
    record.update(schema=SCHEMA, kind=kind, run_id=run, worker=worker, sync=sync if kind == "sync" else None,
                  step=step, time=T0 + t, backend="torchft", mode="step_end",
                  participants=None if participants is None else list(participants),
                  trained=None if participants is None else list(participants), committed=committed,
                  exchanged=kind == "sync", final=final, last_sync=last, bytes_sent=bytes_sent,
                  bytes_received=bytes_sent,
                  exchange_seconds=exchange, exchange_seconds_sum=2 * exchange, exposed_wait_seconds=exposed,
                  arrival_wait_seconds=arrival, delay=0, fragments=1, exchange_dtype="fp32", auto_overlap=False,
                  outer_lr=0.7, excluded=[dict(worker=w, layers=2, anomalous=2, non_finite=0, not_trained=0)
                                          for w in excluded],
                  residual_ratio=residual_ratio, events=list(events), ranks=2, missing_ranks=[])
    return record


def heal(*from_workers, nbytes=4096, seconds=1.5):
    return dict(event="heal", from_workers=list(from_workers), ranks=2, bytes=nbytes, seconds=seconds)


def left(*workers):
    return dict(event="left", workers=list(workers))


def joined(*workers):
    return dict(event="joined", workers=list(workers))


def kill_and_heal(run="run-a"):
    """Two workers, H steps apart every 10 s: worker 1 is killed after step 4 (worker 0's sync 6
    goes on without it), relaunched (its join round at worker 0's step 8 heals nothing), heals at
    step 10; both finish at step 12."""
    return [
        rec(0, 0, 0, kind="join", run=run, bytes_sent=0), rec(1, 0, 0.1, kind="join", run=run, bytes_sent=0),
        rec(0, 2, 10, run=run, sync=1), rec(1, 2, 10.1, run=run, sync=1),
        rec(0, 4, 20, run=run, sync=2), rec(1, 4, 20.1, run=run, sync=2),
        rec(0, 6, 30, run=run, sync=3, participants=(0,), events=[left(1)]),
        rec(1, 0, 38, kind="join", run=run, committed=False, participants=None, bytes_sent=0),
        rec(0, 8, 40, run=run, sync=4, committed=False, participants=None),
        rec(0, 10, 50, run=run, sync=5, events=[joined(1)]),
        rec(1, 10, 50.1, run=run, sync=1, events=[heal(0)]),
        rec(0, 12, 60, run=run, sync=6, last=True), rec(1, 12, 60.1, run=run, sync=2, last=True),
    ]


def lines(records):
    return "".join(json.dumps(r) + "\n" for r in records)
