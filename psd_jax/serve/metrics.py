"""The server's Prometheus metrics (``GET /metrics``, the text format of ``prometheus-client``).

Each app has its own ``CollectorRegistry``, not the library's global one, so that several servers
in one process (the tests) count apart. Counts of tokens and model calls come from what each
answered request got (its ``usage``); the queue, running rows and compiled programs are read from
the batcher and the model when scraped, so they cannot drift from ``/health``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ..api import LoadedModel
from .batcher import Batcher

CONTENT_TYPE = CONTENT_TYPE_LATEST
OUTCOMES = ("ok", "bad_request", "unauthorized", "busy", "timed_out", "failed", "cancelled", "client_closed")
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TPF_BUCKETS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0)
OCCUPANCY_BUCKETS = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)


def outcome_of(status: int) -> str:
    """The ``outcome`` label of a refused or failed request's HTTP status."""
    if status == 401:
        return "unauthorized"
    if status == 503:
        return "busy"
    if status == 499:
        return "cancelled"
    if status == 504:
        return "timed_out"
    return "failed" if status >= 500 else "bad_request"


class _Live(Collector):
    """Gauges read at scrape time: the batcher's queue and running rows, the model's programs."""

    def __init__(self, batcher: Batcher, lm: LoadedModel):
        self.batcher, self.lm = batcher, lm

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self.batcher.stats()
        yield GaugeMetricFamily("psd_jax_queue_depth", "requests waiting for a batch", value=stats["queued"])
        yield GaugeMetricFamily("psd_jax_running_rows", "requests in the batch decoding now", value=stats["running"])
        yield GaugeMetricFamily(
            "psd_jax_compiled_programs", "decode programs the model has compiled", value=self.lm.compiled_programs
        )


class ServerMetrics:
    """One server's counters and histograms; ``render`` is the ``/metrics`` body."""

    def __init__(self, batcher: Batcher, lm: LoadedModel):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "psd_jax_requests", "requests by endpoint and outcome", ["endpoint", "outcome"], registry=r
        )
        self.prompt_tokens = Counter("psd_jax_prompt_tokens", "prompt tokens of answered requests", registry=r)
        self.tokens = Counter(
            "psd_jax_generated_tokens", "generated tokens of answered requests (usage completion_tokens)", registry=r
        )
        self.model_calls = Counter(
            "psd_jax_model_calls", "model calls of answered requests' rows (usage model_calls)", registry=r
        )
        self.latency = Histogram(
            "psd_jax_request_latency_seconds",
            "answered requests: from arrival to the whole answer (the stream's end)",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.first_chunk = Histogram(
            "psd_jax_time_to_first_chunk_seconds",
            "streamed requests: from arrival to the first block's chunk",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpf = Histogram(
            "psd_jax_tokens_per_forward",
            "answered requests' tokens per model call (usage tokens_per_forward)",
            buckets=TPF_BUCKETS,
            registry=r,
        )
        self.occupancy = Histogram(
            "psd_jax_batch_occupancy",
            "block calls: requests in the batch over its compiled batch size",
            buckets=OCCUPANCY_BUCKETS,
            registry=r,
        )
        r.register(_Live(batcher, lm))

    def batch(self, rows: int, size: int) -> None:
        """A block call of ``rows`` requests in a batch of ``size`` (the batcher's thread)."""
        self.occupancy.observe(rows / size)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Outcome:
    """One request's record: counted once, by whichever of answer, failure or departure comes first."""

    def __init__(self, metrics: ServerMetrics, endpoint: str):
        self.metrics, self.endpoint = metrics, endpoint
        self.started = time.monotonic()
        self.recorded = False
        self._chunks = 0

    def chunk(self) -> None:
        """A streamed chunk is about to be sent: the first one's time is the time to first chunk."""
        if not self._chunks:
            self.metrics.first_chunk.labels(self.endpoint).observe(time.monotonic() - self.started)
        self._chunks += 1

    def refused(self, status: int) -> None:
        self._record(outcome_of(status))

    def cancelled(self) -> None:
        """The client left while its request was queued or decoding."""
        self._record("cancelled")

    def client_closed(self) -> None:
        """The client left before it had sent its whole body: nothing was parsed or queued."""
        self._record("client_closed")

    def failed(self) -> None:
        """The server failed to answer (a bug: it is logged), as a 500 or a stream's error event."""
        self._record("failed")

    def answered(self, usage: dict[str, Any] | None = None) -> None:
        """An answer was sent in whole; ``usage`` (absent for ``/v1/models``) adds its tokens and calls."""
        if self.recorded:
            return
        self._record("ok")
        if usage is None:
            return
        m = self.metrics
        m.latency.labels(self.endpoint).observe(time.monotonic() - self.started)
        m.prompt_tokens.inc(usage["prompt_tokens"])
        m.tokens.inc(usage["completion_tokens"])
        m.model_calls.inc(usage["model_calls"])
        m.tpf.observe(usage["tokens_per_forward"])

    def _record(self, outcome: str) -> None:
        if not self.recorded:
            self.recorded = True
            self.metrics.requests.labels(self.endpoint, outcome).inc()
