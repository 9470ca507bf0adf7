"""Prometheus metrics. Each app gets its own registry, so several apps (tests, Ray replicas) can live
in one process without clashing."""

from __future__ import annotations

import bisect
import collections

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Up to the longest --request-timeout-s the deployment files set (300 s): a slower request's latency is then still
# told apart from one at the timeout.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 180, 300)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tserve_requests_total", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.ttft = Histogram("tserve_time_to_first_token_seconds", "Time from arrival to the first token",
                              ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tserve_inter_token_latency_seconds", "Time between consecutive tokens of a request",
                             ["model"], buckets=_TOKEN_BUCKETS, registry=r)
        self.latency = Histogram("tserve_request_latency_seconds", "End-to-end request latency", ["route"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("tserve_queue_depth", "Requests waiting for a slot or a batch", ["model"], registry=r)
        self.running = Gauge("tserve_running_requests", "Requests being processed", ["model"], registry=r)
        self.kv_in_use = Gauge("tserve_kv_slots_in_use", "KV-cache slots in use", ["model"], registry=r)
        self.kv_total = Gauge("tserve_kv_slots_total", "KV-cache slots", ["model"], registry=r)
        self.kv_bytes_per_token = Gauge("tserve_kv_cache_bytes_per_token", "KV-cache bytes per token (every layer's "
                                        "keys and values; grouped-query models hold only their kv heads)", ["model"],
                                        registry=r)
        self.kv_bytes = Gauge("tserve_kv_cache_bytes", "KV-cache bytes allocated", ["model"], registry=r)
        self.kv_blocks_total = Gauge("tserve_kv_cache_blocks_total", "KV-cache blocks of a language model's or a translator decoder's pool",
                                     ["model"], registry=r)
        self.kv_blocks_in_use = Gauge("tserve_kv_cache_blocks_in_use", "KV-cache blocks held by running requests",
                                      ["model"], registry=r)
        self.kv_block_size = Gauge("tserve_kv_cache_block_size", "Positions per KV-cache block", ["model"], registry=r)
        self.prefix_hits = Counter("tserve_prefix_cache_hits_total", "Requests admitted with part of their prompt "
                                   "in the prefix cache", ["model"], registry=r)
        self.prefix_misses = Counter("tserve_prefix_cache_misses_total", "Requests admitted with none of their "
                                     "prompt in the prefix cache", ["model"], registry=r)
        self.prefix_cached_tokens = Counter("tserve_prefix_cache_cached_tokens_total", "Prompt tokens read from the "
                                            "prefix cache instead of computed", ["model"], registry=r)
        self.encoder_reuses = Counter("tserve_encoder_cache_hits_total", "Translations of a source identical to one "
                                      "encoded before, which read its encoder output instead of encoding again",
                                      ["model"], registry=r)
        self.preemptions = Counter("tserve_preemptions_total", "Running requests preempted because the KV cache "
                                   "was full (recomputed when admitted again)", ["model"], registry=r)
        self.memory_hits = Counter("tserve_translation_memory_hits_total", "Sentences answered from the translation "
                                   "memory without entering the engine", ["model"], registry=r)
        self.memory_misses = Counter("tserve_translation_memory_misses_total", "Sentences looked up in the "
                                     "translation memory and translated by the engine", ["model"], registry=r)
        self.memory_entries = Gauge("tserve_translation_memory_entries", "Sentence translations the translation "
                                    "memory holds", registry=r)
        self.file_jobs = Counter("tserve_translation_file_jobs_total", "File translations by how they ended",
                                 ["status"], registry=r)
        self.generated_tokens = Counter("tserve_generated_tokens_total", "Tokens generated", ["model"], registry=r)
        self.spec_drafted = Counter("tserve_speculative_draft_tokens_total", "Draft tokens scored by speculative "
                                    "decoding steps", ["model"], registry=r)
        self.spec_accepted = Counter("tserve_speculative_accepted_tokens_total", "Draft tokens kept (the model "
                                     "chose them too)", ["model"], registry=r)
        self.spec_acceptance = Gauge("tserve_speculative_acceptance_rate", "Draft tokens kept / scored, since start",
                                     ["model"], registry=r)
        self.spec_tokens_per_step = Histogram("tserve_speculative_tokens_per_step", "Tokens a request got from one "
                                              "speculative step (its kept draft + 1)", ["model"],
                                              buckets=(1, 2, 3, 4, 5, 6, 8, 12, 17), registry=r)
        self.images = Counter("tserve_images_classified_total", "Images classified", ["model"], registry=r)
        self.embeddings = Counter("tserve_embeddings_total", "Inputs embedded (/v1/embeddings)", ["model"], registry=r)
        self.calls = Counter("tserve_model_calls_total", "Model work other than token streams run by a worker "
                             "(attention maps, prompt scoring)", ["model"], registry=r)
        self.gc_pause = Histogram("tserve_gc_pause_seconds", "Garbage collections by generation (0-2), and how "
                                  "long each stopped the process", ["generation"],
                                  buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
                                  registry=r)
        self.batch_size = Histogram("tserve_batch_size", "Size of the batches run", ["model"],
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def forget_model(self, name: str) -> None:
        """Drop the series of model `name` and of its embedding batcher from every per-model metric: a model
        unloaded is not reported as if it still held rows and cache memory (a model loaded again under that name
        starts its series afresh)."""
        for metric in vars(self).values():
            if getattr(metric, "_labelnames", None) == ("model",):
                for label in (name, f"{name}/embeddings"):
                    try:
                        metric.remove(label)
                    except KeyError:  # no series of it in this metric
                        pass

    def for_model(self, name: str) -> ModelMetrics:
        return ModelMetrics(self, name)


class ModelMetrics:
    """One model's series of every per-model metric (`m.ttft` is `metrics.ttft.labels(name)`), each looked up
    on first use and kept: `labels()` takes a lock and a dict lookup, and the engines record several values
    per generated token."""

    def __init__(self, metrics: Metrics, name: str) -> None:
        self._metrics, self._name = metrics, name

    def __getattr__(self, attr: str):  # noqa: ANN204 (a prometheus child of whichever kind `attr` is)
        child = getattr(self._metrics, attr).labels(self._name)
        setattr(self, attr, child)
        return child

    def replaced(self) -> ModelMetrics:
        """The series of a model that another now serves under its name, while it drains: what it finishes still
        counts (counters, histograms), but the gauges (what runs, waits and is held now) are the new model's alone."""
        return _ReplacedModelMetrics(self._metrics, self._name)


# A gauge in no registry: what a replaced model's gauges are set to is never exported.
_UNREPORTED = Gauge("tserve_unreported", "not exported", registry=None)


class _ReplacedModelMetrics(ModelMetrics):
    def __getattr__(self, attr: str):  # noqa: ANN204
        metric = getattr(self._metrics, attr)
        child = _UNREPORTED if isinstance(metric, Gauge) else metric.labels(self._name)
        setattr(self, attr, child)
        return child


def observe_all(histogram, values: list[float]) -> None:  # noqa: ANN001 - a prometheus Histogram child
    """`histogram.observe(v)` for every value, with one update per bucket hit: an engine step observes one
    inter-token latency per running request, and per value observe() cost as much as the rest of its token."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None:  # another prometheus_client: the public way
        for v in values:
            histogram.observe(v)
        return
    hits = collections.Counter(bisect.bisect_left(bounds, v) for v in values)  # the first bound >= v, as observe()
    total.inc(sum(values))
    for i, n in hits.items():
        buckets[i].inc(n)
