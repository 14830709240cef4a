"""Prometheus metrics of one server (prometheus_client, on a registry of its own: ``GET /metrics``).

Every name starts with ``magnetar_``:

* ``requests_total{endpoint, outcome}`` -- finished requests; outcome ``stop`` / ``length`` (OpenAI's finish
  reasons), ``cancelled`` (the client left), ``error`` (5xx), ``rejected`` (4xx, 503), ``out_of_memory`` (it did not
  fit the device's memory: :mod:`magnetar.engine.memory`);
* ``http_refused_total{status}`` -- requests the gate refused before any route (:mod:`magnetar.serve.gate`:
  400 Host, 401 key, 408 slow body, 413 too large, 415 not JSON);
* ``prompt_tokens_total``, ``completion_tokens_total``, ``cached_prompt_tokens_total`` (context tokens whose
  Phase 1 came from the context cache);
* ``time_to_first_token_seconds`` (from the request's arrival to its first token, Phase 1 and queueing
  included) and ``time_per_output_token_seconds`` (between a request's tokens) histograms;
* ``active_requests`` (decoding), ``queued_requests`` (waiting for a slot or their Phase 1);
* ``kv_bytes{rank}`` -- the KV bytes each rank of the replica held for the last finished request;
* ``context_cache_{hits,misses,evictions,prefix_hits}_total`` (a prefix hit: a miss whose context started with a
  cached one, so only its new tokens were encoded), ``context_cache_bytes``, ``context_cache_handles``,
  ``pinned_contexts`` -- the engine's context cache, as of the last tick;
* with ``--context-store``: ``context_store_{loads,writes,evictions,refused}_total``, ``context_store_bytes``,
  ``context_store_contexts`` -- the disk tier of the serving rank; with ``--host-cache-mb`` the same as
  ``context_host_*`` for the host-memory tier;
* on a GPU, ``device_memory_bytes{kind}`` -- the serving rank's device: ``free`` and ``total`` (the driver's),
  ``allocated`` and ``reserved`` (torch's allocator), read when scraped (a request that runs out of it:
  :mod:`magnetar.engine.memory`).

The engine loop writes; the HTTP thread reads (prometheus_client is thread-safe; the cache figures are a
snapshot the loop replaces whole).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _CacheCollector:
    def __init__(self):
        self.snapshot = {"hits": 0, "misses": 0, "evictions": 0, "prefix_hits": 0, "bytes": 0, "handles": 0,
                         "pinned": 0}

    def collect(self):
        s = self.snapshot
        for name in ("hits", "misses", "evictions", "prefix_hits"):
            yield CounterMetricFamily(f"magnetar_context_cache_{name}", f"Context cache {name} (the engine's count)",
                                      value=s[name])
        yield GaugeMetricFamily("magnetar_context_cache_bytes", "KV bytes held by the context cache (largest rank)",
                                value=s["bytes"])
        yield GaugeMetricFamily("magnetar_context_cache_handles", "Encoded contexts in the cache", value=s["handles"])
        yield GaugeMetricFamily("magnetar_pinned_contexts", "Contexts pinned by POST /v1/contexts", value=s["pinned"])
        for tier, name, what in (("host", "context_host", "host-memory tier"), ("store", "context_store", "disk tier")):
            t = s.get(tier)
            if t is None:  # --host-cache-mb, --context-store: the leader's rank
                continue
            for count in ("loads", "writes", "evictions", "refused"):
                yield CounterMetricFamily(f"magnetar_{name}_{count}", f"Context {what} {count} (this rank's)",
                                          value=t[count])
            yield GaugeMetricFamily(f"magnetar_{name}_bytes", f"Bytes the context {what} holds (largest rank's count "
                                    f"per context)", value=t["bytes"])
            yield GaugeMetricFamily(f"magnetar_{name}_contexts", f"Contexts in the {what}", value=t["contexts"])


class _DeviceCollector:
    """The serving rank's CUDA memory, read at each scrape (from the HTTP thread: nothing on the engine loop)."""

    def __init__(self, device):
        self.device = device

    @staticmethod
    def _family():
        return GaugeMetricFamily("magnetar_device_memory_bytes", "The serving rank's device memory (free, total: the "
                                 "driver's; allocated, reserved: torch's allocator)", labels=["kind"])

    def describe(self):  # what registering asks (auto_describe): the name, without reading the device
        return [self._family()]

    def collect(self):
        import torch

        free, total = torch.cuda.mem_get_info(self.device)
        g = self._family()
        for kind, value in (("free", free), ("total", total), ("allocated", torch.cuda.memory_allocated(self.device)),
                            ("reserved", torch.cuda.memory_reserved(self.device))):
            g.add_metric([kind], value)
        yield g


class Metrics:
    def __init__(self, model: str = ""):
        from magnetar.version import __version__

        self.registry = r = CollectorRegistry(auto_describe=True)
        # magnetar_build_info{version, model} 1: what a dashboard groups a fleet's series by
        Info("magnetar_build", "Magnetar's version and the served model", registry=r).info(
            {"version": __version__, "model": model})
        self.requests = Counter("magnetar_requests", "Finished requests", ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("magnetar_prompt_tokens", "Prompt tokens (context + query)", registry=r)
        self.completion_tokens = Counter("magnetar_completion_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter("magnetar_cached_prompt_tokens", "Context tokens served from the context cache",
                                     registry=r)
        self.ttft = Histogram("magnetar_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("magnetar_time_per_output_token_seconds", "Time between a request's tokens",
                              buckets=_TOKEN_BUCKETS, registry=r)
        self.active = Gauge("magnetar_active_requests", "Requests decoding", registry=r)
        self.queued = Gauge("magnetar_queued_requests", "Requests waiting for a slot or their Phase 1", registry=r)
        self.decode_threads = Gauge("magnetar_decode_threads", "Intra-op CPU threads of the last decode step",
                                    registry=r)
        self.http_refused = Counter("magnetar_http_refused", "Requests refused at the gate (by HTTP status)",
                                    ["status"], registry=r)
        self.kv_bytes = Gauge("magnetar_kv_bytes", "KV bytes per rank of the last finished request", ["rank"],
                              registry=r)
        self._cache = _CacheCollector()
        r.register(self._cache)

    def cache(self, stats: dict, pinned: int) -> None:
        """The engine's ``cache.stats()`` and the number of pinned contexts (called by the engine loop)."""
        self._cache.snapshot = {"hits": stats["hits"], "misses": stats["misses"], "evictions": stats["evictions"],
                                "prefix_hits": stats["prefix_hits"], "bytes": stats["bytes"],
                                "handles": stats["handles"], "pinned": pinned, "store": stats.get("store"),
                                "host": stats.get("host")}

    def watch_device(self, device) -> None:
        """Report ``device``'s memory at each scrape (a CUDA device; nothing for a CPU, whose memory is the host's)."""
        if device.type == "cuda":
            self.registry.register(_DeviceCollector(device))

    def refused(self, status: int) -> None:
        self.http_refused.labels(status=str(status)).inc()

    def finished(self, result) -> None:
        """A finished request's :class:`~magnetar.engine.engine.GenerationResult`."""
        self.prompt_tokens.inc(result.context_tokens + result.query_tokens)
        self.completion_tokens.inc(len(result.token_ids))
        self.cached_tokens.inc(result.cached_context_tokens)
        for rank, nbytes in enumerate(result.kv_bytes_per_rank):
            self.kv_bytes.labels(rank=str(rank)).set(nbytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)
