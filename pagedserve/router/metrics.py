"""The router's Prometheus metrics (`pagedserve_router:` prefix, in its own registry), and the
merge of several workers' /metrics texts into one exposition with a label per worker.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)


class RouterMetrics:
    """`worker` labels are worker labels (by default the worker's URL)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

        def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
            return Counter(f"pagedserve_router:{name}", doc, labels, registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pagedserve_router:{name}", doc, ["worker"], registry=self.registry)

        self.requests = counter("requests", "Requests sent to the worker (retries and P/D "
                                "prefills included).", ["worker"])
        self.affinity_hits = counter("affinity_hits", "cache_aware routed a request to the worker "
                                     "whose prefix tree matched it.")
        self.retries = counter("retries", "Requests retried on another worker.")
        self.stream_errors = counter("stream_errors", "Streams whose worker failed mid-stream.")
        self.pd_fallbacks = counter("pd_fallbacks", "P/D requests whose prefill failed: the "
                                    "decode worker computed the prompt itself.")
        self.worker_healthy = gauge("worker_healthy", "1 while the worker is in rotation.")
        self.in_flight = gauge("in_flight", "Requests the router has in flight to the worker.")

    def set_worker(self, label: str, healthy: bool, in_flight: int) -> None:
        self.worker_healthy.labels(label).set(int(healthy))
        self.in_flight.labels(label).set(in_flight)

    def remove_worker(self, label: str) -> None:
        for gauge in (self.worker_healthy, self.in_flight):
            try:
                gauge.remove(label)
            except KeyError:
                pass

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Families:
    """A collector over already-built families, for generate_latest."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def merge_metrics(texts: Sequence[tuple[str, str]], label_name: str) -> bytes:
    """(worker label, Prometheus text) pairs as one exposition: each family once (its first
    HELP/TYPE), every sample labelled `label_name="<worker label>"`. A text that does not parse
    is skipped."""
    families: dict[str, Metric] = {}
    for label, text in texts:
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError as error:
            logger.warning("worker %s serves metrics that do not parse: %s", label, error)
            continue
        for family in parsed:
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation,
                                                        family.type, family.unit)
            merged.samples.extend(sample._replace(labels={**sample.labels, label_name: label})
                                  for sample in family.samples)
    return generate_latest(_Families(list(families.values())))
