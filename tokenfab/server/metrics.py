"""Prometheus metrics for `/metrics`: vLLM's names under the `tokenfab:` prefix (DESIGN.md §5).

Two sources:
- Gauges and engine counters (running/waiting, KV usage, prefix cache, the disk tier, preemptions,
  token totals, speculative decoding) are read from the EngineClient's latest stats snapshot (engine/client.py) at
  scrape time by a custom collector, so a scrape never waits for a step; `config_info` carries the
  labels of its ModelInfo.
- Latency histograms (TTFT, inter-token latency, end-to-end, queue time) and finished-request
  counters are observed as requests progress: this class is the EngineClient's listener.

- The process: prometheus_client's standard `process_*` families (resident and virtual memory, open
  file descriptors, CPU seconds, start time) plus `process_threads`, as the Rust client names it, so a
  soak (`tokenfab bench soak`) can watch a remote server's memory, threads and descriptors drift.

Each app gets its own registry, so several servers can live in one process (tests do this); the
process families then describe the one process they share.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from tokenfab.outputs import RequestOutput
from tokenfab.server.keys import KeyLimiter

PREFIX = "tokenfab:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket edges in seconds, as vLLM's (so dashboards' quantile panels line up).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]

# (name, help, EngineStats attribute). Missing attributes read as 0.
_GAUGES = [
    ("num_requests_running", "Sequences in the running batch.", "num_running"),
    ("num_requests_waiting", "Sequences waiting to be scheduled.", "num_waiting"),
    ("kv_cache_usage_perc", "Share of KV cache blocks in use (1 = full).", "kv_cache_usage"),
    ("kv_cache_used_blocks", "KV cache blocks held by live sequences, the sliding-window pool's included "
     "(0 whenever no request is in flight; a soak's leak check reads it).", "num_used_blocks"),
    ("kv_cache_num_blocks", "KV cache blocks in the pool.", "num_blocks"),
    ("kv_cache_touched_bytes", "Bytes of the KV pool used at least once since start: its resident pages, which "
     "grow until the whole pool has been used (docs/serving.md).", "kv_touched_bytes"),
    ("kv_disk_bytes_used", "Bytes of block files the disk tier holds (within --kv-disk-bytes).", "kv_disk_bytes_used"),
    ("engine_num_threads", "Threads the engine's steps run on (changed while other processes take the cores; "
     "above torch's count only for the C kernels' pool, docs/serving.md).", "num_threads"),
]
_COUNTERS = [
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    ("prefix_cache_hits", "Prompt tokens served by the prefix cache.", "prefix_cache_hits"),
    ("num_preemptions", "Sequences preempted (by recompute).", "num_preemptions"),
    ("prompt_tokens", "Prompt tokens processed.", "prompt_tokens"),
    ("generation_tokens", "Tokens generated.", "generation_tokens"),
    ("kv_disk_hit_blocks", "KV blocks loaded from the disk tier.", "kv_disk_hit_blocks"),
    ("kv_disk_hit_tokens", "Prompt tokens whose KV was loaded from the disk tier.", "kv_disk_hit_tokens"),
    ("kv_disk_miss_blocks", "Full prefix blocks asked of the disk tier that it did not hold.", "kv_disk_miss_blocks"),
    ("kv_disk_bytes_written", "Bytes of block files the disk tier wrote.", "kv_disk_bytes_written"),
    ("kv_disk_bytes_read", "Bytes of block files the disk tier read.", "kv_disk_bytes_read"),
    ("kv_disk_skipped_files", "Block files not loaded: corrupt, truncated, another model or layout, another "
     "version (each also logged).", "kv_disk_skipped_files"),
    ("kv_disk_dropped_saves", "Blocks not saved to the disk tier because its writer was behind.",
     "kv_disk_dropped_saves"),
    ("spec_decode_num_drafts", "Speculative draft rounds.", "spec_decode_num_drafts"),
    ("spec_decode_num_draft_tokens", "Speculative tokens proposed.", "spec_decode_num_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "Speculative tokens accepted.", "spec_decode_num_accepted_tokens"),
]


class _EngineCollector:
    def __init__(self, client, model_name: str) -> None:
        self.client = client
        self.model_name = model_name

    def collect(self):
        stats = self.client.stats()
        labels = (["model_name"], [self.model_name])
        for name, doc, attr in _GAUGES:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels[0])
            g.add_metric(labels[1], float(getattr(stats, attr, 0)))
            yield g
        for name, doc, attr in _COUNTERS:
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels[0])
            c.add_metric(labels[1], float(getattr(stats, attr, 0)))
            yield c
        m = SummaryMetricFamily(PREFIX + "kv_disk_load_seconds", "Reading and checking one disk tier block file.",
                                labels=labels[0])
        m.add_metric(labels[1], count_value=float(getattr(stats, "kv_disk_loads", 0)),
                     sum_value=float(getattr(stats, "kv_disk_load_seconds", 0.0)))
        yield m
        info = self.config_labels()
        if info:
            g = GaugeMetricFamily(PREFIX + "config_info", "The engine's settings, as labels (value 1); "
                                  "`tokenfab doctor` reads them.", labels=[*labels[0], *info])
            g.add_metric([*labels[1], *info.values()], 1.0)
            yield g
        # vLLM's per-position acceptance: position i counts verification rounds whose draft i was accepted.
        c = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                "Speculative tokens accepted, by position in the draft.",
                                labels=["model_name", "position"])
        for pos, n in enumerate(getattr(stats, "spec_decode_num_accepted_tokens_per_pos", ())):
            c.add_metric([self.model_name, str(pos)], float(n))
        yield c
        g = GaugeMetricFamily(PREFIX + "engine_alive", "1 while the engine loop runs, 0 once it has died.",
                              labels=labels[0])
        g.add_metric(labels[1], 1.0 if self.client.dead_reason is None else 0.0)
        yield g

    def config_labels(self) -> dict[str, str]:
        return dict(self.client.info.config_labels)


class _KeyCollector:
    """Per API key (server/keys.py), labelled by the key's name, never the key: requests let in, requests
    refused with 429, tokens charged, and the key's limits."""

    def __init__(self, owner: "ServerMetrics") -> None:
        self.owner = owner

    def collect(self):
        limiter, policies = self.owner.key_limiter, self.owner.key_policies
        for name, doc, counts in (("api_key_requests", "Requests let in, by API key name.", limiter.admitted),
                                  ("api_key_rate_limited", "Requests refused by the key's rate limits (429).",
                                   limiter.limited),
                                  ("api_key_tokens", "Prompt and generated tokens charged to the key.",
                                   limiter.tokens_total)):
            c = CounterMetricFamily(PREFIX + name, doc, labels=["key_name"])
            for p in policies:
                c.add_metric([p.name], float(counts[p.name]))
            yield c
        g = GaugeMetricFamily(PREFIX + "api_key_limit", "The key's limits (per minute; max_tokens per request).",
                              labels=["key_name", "limit"])
        for p in policies:
            for kind in ("requests_per_minute", "tokens_per_minute", "max_tokens"):
                if getattr(p, kind) is not None:
                    g.add_metric([p.name, kind], float(getattr(p, kind)))
        yield g


class _ThreadsCollector:
    """`process_threads`: the OS threads of this process (Linux /proc; nothing elsewhere, as the standard
    process collector does)."""

    def collect(self):
        try:
            with open("/proc/self/status") as f:
                threads = next((int(line.split()[1]) for line in f if line.startswith("Threads:")), None)
        except OSError:
            return
        if threads is not None:
            g = GaugeMetricFamily("process_threads", "OS threads of the process.")
            g.add_metric([], float(threads))
            yield g


class ServerMetrics:
    """The registry behind /metrics, and the EngineClient listener that fills its histograms."""

    def __init__(self, client, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.collector = _EngineCollector(client, model_name)
        self.registry.register(self.collector)
        self.key_limiter = KeyLimiter()
        self.key_policies: list = []          # set by build_app when the server has keys
        self.registry.register(_KeyCollector(self))
        ProcessCollector(registry=self.registry)
        self.registry.register(_ThreadsCollector())

        def hist(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first generated token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Gap between successive tokens of a sequence.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to the last token, for finished requests.",
                        LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS)
        self._success = Counter(PREFIX + "request_success", "Requests finished, by finish reason "
                                "(stop, length, abort, error).", ["model_name", "finished_reason"],
                                registry=self.registry)

    # -- EngineListener ----------------------------------------------------------------------
    def on_first_token(self, output: RequestOutput) -> None:
        m = output.metrics
        if m is None:
            return
        if m.first_token_time is not None:
            self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.first_scheduled_time is not None:
            self.queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))

    def on_itl(self, gap_s: float, count: int) -> None:
        for _ in range(count):
            self.itl.observe(gap_s)

    def on_finished(self, reason: str, output: RequestOutput | None) -> None:
        self._success.labels(self.model_name, reason).inc()
        m = output.metrics if output is not None else None
        if reason in ("stop", "length") and m is not None and m.finished_time is not None:
            self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))

    def config_labels(self) -> dict[str, str]:
        return self.collector.config_labels()

    # -- exposition --------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)
