"""``/metrics``: the runs' state (:mod:`.state`) in Prometheus' text format, through
``prometheus_client`` (the optional ``metrics`` extra: ``pip install megatron_edit[metrics]``).

A custom collector reads the current state at each scrape, in a registry of its own (nothing is
registered in ``prometheus_client``'s global one). Every series has the labels ``run_id`` and
``worker``; ``megatron_edit_worker_state`` is 1 for the worker's state (:data:`.state.STATES`)
and 0 for the others (one series per state, the ``state`` label).
"""

from __future__ import annotations

from typing import Callable, List, Optional

from .state import STATES

INSTALL = "pip install megatron_edit[metrics]"
PREFIX = "megatron_edit_"

# name, what it counts, the row's value
COUNTERS = (
    ("syncs", "sync records of the worker (the run's syncs it took part in or tried)", lambda r: r["syncs"]),
    ("syncs_not_committed", "its syncs that did not commit (the workers kept their local progress)",
     lambda r: r["not_committed"]),
    ("bytes_sent", "bytes it sent across workers", lambda r: r["totals"]["bytes_sent"]),
    ("bytes_received", "bytes it received across workers", lambda r: r["totals"]["bytes_received"]),
    ("exchange_seconds", "seconds its slowest rank spent in EDiT code for the syncs",
     lambda r: r["totals"]["exchange_seconds"]),
    ("exposed_wait_seconds", "seconds the syncs exposed (not hidden behind compute)",
     lambda r: r["totals"]["exposed_wait_seconds"]),
    ("arrival_wait_seconds", "seconds it waited for the other workers to arrive at the syncs",
     lambda r: r["totals"]["arrival_wait_seconds"]),
    ("heals", "heals it received from live workers", lambda r: r["heals"]),
    ("heal_bytes", "bytes of the states it healed from", lambda r: r["heal_bytes"]),
    ("excluded", "syncs at which the penalty excluded it from some layers", lambda r: r["excluded"]),
    ("missing_ranks", "ranks whose part never came, over its records", lambda r: r["missing_ranks"]),
)
GAUGES = (
    ("step", "the step of its latest record", lambda r: r["step"]),
    ("last_record_timestamp_seconds", "when its latest record's sync ended (Unix time)", lambda r: r["last_time"]),
    ("arrival_wait_last_seconds", "its wait for the others at its latest sync", lambda r: r["arrival_wait_seconds"]),
    ("participants", "workers in its latest round",
     lambda r: None if r["participants"] is None else len(r["participants"])),
    ("excluded_workers", "workers the penalty excluded at its latest sync", lambda r: len(r["excluded_workers"])),
    ("residual_ratio", "its error-feedback residual / pseudo-gradient norm at its latest sync",
     lambda r: r["residual_ratio"]),
    ("pseudo_grad_norm", "its pseudo-gradient norm at its latest sync", lambda r: r["pseudo_grad_norm"]),
)


def prometheus_missing() -> Optional[str]:
    """Why ``/metrics`` cannot answer (one line), or None: prometheus_client is installed."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return f"/metrics needs prometheus_client, which is not installed: {INSTALL} (or pip install prometheus_client)"
    return None


class StatusCollector:
    """The collector of every run's view that ``views()`` returns (:meth:`.state.RunState.view`'s)."""

    def __init__(self, views: Callable[[], List[dict]], skipped: Callable[[], int]):
        self.views, self.skipped = views, skipped

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = ["run_id", "worker"]
        families = [(CounterMetricFamily(PREFIX + name, doc, labels=labels), value) for name, doc, value in COUNTERS]
        families += [(GaugeMetricFamily(PREFIX + name, doc, labels=labels), value) for name, doc, value in GAUGES]
        state = GaugeMetricFamily(PREFIX + "worker_state", "1 for the worker's state (the status page's rule), "
                                  "0 for the others", labels=labels + ["state"])
        for view in self.views():
            for row in view["workers"]:
                key = [view["run_id"], str(row["worker"])]
                for family, value in families:
                    number = value(row)
                    if number is not None:
                        family.add_metric(key, float(number))
                for name in STATES:
                    state.add_metric(key + [name], float(row["state"] == name))
        yield from (family for family, _ in families)
        yield state
        yield CounterMetricFamily(PREFIX + "status_lines_skipped", "record lines the status server left out "
                                  "(not JSON, another schema, a field missing)", value=float(self.skipped()))


def registry_of(collector: StatusCollector):
    """A registry of its own holding ``collector`` (prometheus_client must be installed)."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def exposition(registry) -> bytes:
    """The registry's metrics in Prometheus' text format."""
    from prometheus_client import generate_latest

    return generate_latest(registry)
