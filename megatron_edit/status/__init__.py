"""Watching a run (issue 59): a live status page and ``/metrics`` from the per-sync record files
alone (``--local-sgd-sync-record``; docs/watching-a-run.md), so a finished run replays the same.

* :mod:`.tail`: reading the files while they grow (offsets kept, a line not ended yet left for the
  next read);
* :mod:`.state`: the records of each run to its workers' states, its syncs and its timeline (pure);
* :mod:`.metrics`: that state for Prometheus (the optional ``metrics`` extra);
* :mod:`.server`: the HTTP server (``/``, ``/state.json``, ``/metrics``) in a thread;
* ``python -m megatron_edit.status RECORD_PATH_OR_GLOB...`` (:mod:`.__main__`), and the
  supervisor's ``--status-port``.

It reads the record's schema from :mod:`megatron_edit.exchange.record` and nothing of the
training side (no torch).
"""
