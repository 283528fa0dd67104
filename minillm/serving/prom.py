"""``GET /metrics``: the server's counters in Prometheus' text format, under vLLM's names.

Same names, same labels, same buckets as vLLM, so that vLLM's example Grafana dashboard and any
alert written for ``vllm serve`` work against ``minillm serve`` unchanged.

Where the names come from (checked by hand; re-check when vLLM moves):

* ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``) as of vLLM 0.12.x (its comments:
  "Deprecated in 0.11", "With 0.12.x you can enable ...", "TODO: remove in 0.13.0"), checked
  against a later main-branch revision of the same file (``create_metric_per_engine``,
  ``vllm:prompt_tokens_by_source``): the names, types, ``documentation`` strings, label names
  ``["model_name", "engine"]`` and buckets used here are identical in both.
  ``vllm:time_per_output_token_seconds`` is deprecated there ("Renamed as
  vllm:inter_token_latency_seconds" in 0.11, shown only with ``--show-hidden-metrics-for-version``,
  removed in 0.13), and ``vllm:gpu_cache_usage_perc`` was renamed ``vllm:kv_cache_usage_perc`` in 0.9.
* ``vllm/v1/metrics/stats.py`` (``IterationStats.update_from_finished_request``, the main-branch
  revision with ``ScheduledTiming``/``CompletedTiming``): what the request
  histograms measure (queue = QUEUED → first SCHEDULED, prefill = SCHEDULED → first token, decode
  = first → last token, inference = SCHEDULED → last token, per-request TPOT = decode / (n − 1),
  only for n > 1; queue/prefill/decode only for requests that got that far).
* ``vllm/v1/engine/__init__.py``: ``FINISH_REASON_STRINGS = ("stop", "length", "abort", "error",
  "repetition")``, the values of the ``finished_reason`` label.
* The dashboard ``examples/observability/prometheus_grafana/grafana.json`` (vLLM commit
  ``4b5c627c``): it queries exactly the names in :data:`DASHBOARD_NAMES`, filtered by
  ``model_name``, with ``label_values(model_name)`` as its model picker. It queries the *current*
  names (``vllm:inter_token_latency_seconds``, ``vllm:kv_cache_usage_perc``). Copies of the older
  ``examples/online_serving/prometheus_grafana/grafana.json`` query
  ``vllm:time_per_output_token_seconds`` and ``vllm:gpu_cache_usage_perc`` instead: pass
  ``legacy_names=True`` to export those two as well (the same observations under the old name,
  as vLLM itself did while they were deprecated). That older dashboard's ``num_requests_swapped``
  and ``cpu_cache_usage_perc`` are vLLM v0 only (no swapping, no CPU cache) and are not exported,
  exactly as vLLM v1 does not.

Counters are created without ``_total``: prometheus_client appends it, so ``vllm:prompt_tokens``
is exposed as ``vllm:prompt_tokens_total``, the name vLLM exposes and the dashboard queries (it
also adds a ``..._created`` sample, as vLLM's does in single-process mode). Every series exists
from the start at zero (vLLM creates its labelled children up front too), so a panel shows 0, not
"no data", before the first request.

What we measure, and how it lines up with vLLM (minillm's definitions, ``minillm.metrics.definitions``):

* TTFT, ITL, E2E, TPOT are :class:`~minillm.metrics.definitions.RequestMetrics`' ``ttft_s``, ``itl_s``
  (engine-side token gaps), ``e2e_s``, ``tpot_s``. TTFT ends at the first *non-empty* token, as
  ``vllm bench serve`` sees it; vLLM's histogram ends at the first token out of the engine. E2E
  ends at the last token (vLLM: at the finishing step), so both differ from vLLM's by at most the
  detokenizer's hold-back and the last bookkeeping step.
* Queue / prefill / decode / inference time come from the TTFT breakdown
  (:func:`~minillm.metrics.definitions.ttft_breakdown`): queue = its ``queue`` stage (enqueued and
  scheduled close it; preemptions count as queueing), prefill = ``prefill`` + ``first_token``
  stages (scheduled → first token, vLLM's SCHEDULED → first NEW_TOKEN), decode = first → last
  ``token`` event (= the sum of the ITLs), inference = prefill + decode.
* vLLM observes TTFT and ITL as the tokens come out and counts prompt/generation tokens per engine
  step; here everything about a request is recorded once, when it ends (:meth:`observe_request`).
  Rates over minutes (what the dashboard plots) are the same; a long request shows up at its end.
* Prefix cache queries and hits count *tokens*, as vLLM's (:meth:`add_prefix_cache`).

Not exported (vLLM has them; minillm has no such thing or the server does not know it yet):
``vllm:iteration_tokens_total``, ``vllm:num_preemptions``, ``vllm:request_params_n``,
``vllm:cache_config_info``, ``vllm:engine_sleep_state``, LoRA, speculative decoding, KV connector,
multi-modal and KV-residency metrics.

Each :class:`ServingMetrics` has its own ``CollectorRegistry`` (never the global one): tests start
many servers in one process, and the global registry refuses a second metric of the same name.

Serve :meth:`ServingMetrics.render` as it is. Do not mount ``prometheus_client.make_asgi_app``:
it negotiates the format from the ``Accept`` header, and with Prometheus 2's default header
prometheus_client (0.26) picks OpenMetrics with ``escaping=underscores``, which rewrites
``vllm:prompt_tokens_total`` to ``vllm_prompt_tokens_total``, a name no vLLM dashboard queries.
"""
from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from minillm.core.trace import Trace
from minillm.metrics.definitions import RequestMetrics, request_metrics

__all__ = [
    "DASHBOARD_NAMES",
    "FINISH_REASONS",
    "ITL_BUCKETS",
    "LABELNAMES",
    "LEGACY_DASHBOARD_NAMES",
    "REQUEST_LATENCY_BUCKETS",
    "TTFT_BUCKETS",
    "VLLM_FINISH_REASON",
    "ServingMetrics",
    "build_1_2_5_buckets",
]

# vLLM's label names (``labelnames = ["model_name", "engine"]``); ``engine`` is the data-parallel
# engine index, always "0" here (one engine).
LABELNAMES = ("model_name", "engine")
# vLLM's ``FINISH_REASON_STRINGS``: the ``finished_reason`` values created up front.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
# minillm's finish reasons that vLLM spells differently: the server ends a request whose client
# went away with reason "disconnected"; vLLM calls that "abort" ("aborted by client").
VLLM_FINISH_REASON = {"disconnected": "abort"}

# vLLM's buckets (loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# Every metric name that examples/observability/prometheus_grafana/grafana.json (vLLM @4b5c627c)
# queries, as exposed (histograms by their family name: the panels read _bucket, _sum, _count).
DASHBOARD_NAMES = (
    "vllm:e2e_request_latency_seconds",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_max_num_generation_tokens",
)
# The older examples/online_serving/prometheus_grafana/grafana.json queries these instead of
# vllm:inter_token_latency_seconds and vllm:kv_cache_usage_perc (``legacy_names=True``).
LEGACY_DASHBOARD_NAMES = ("vllm:time_per_output_token_seconds", "vllm:gpu_cache_usage_perc")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value`` inclusive."""
    buckets, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10 ** exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class ServingMetrics:
    """vLLM-named Prometheus metrics of one served model, in a registry of their own.

    The server calls :meth:`observe_request` once per finished request, :meth:`set_load` after
    engine steps (or before each scrape), :meth:`add_prefix_cache` whenever a request is
    scheduled, and serves :meth:`render` at ``GET /metrics``.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, *,
                 max_model_len: int = 4096, engine: str | int = 0, legacy_names: bool = False):
        if not model_name:
            raise ValueError("model_name must be the served model name (the `model` of the API)")
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be ≥ 1, got {max_model_len}")
        self.model_name = str(model_name)
        self.engine = str(engine)
        self.registry = CollectorRegistry() if registry is None else registry
        self.legacy_names = legacy_names
        labels = (self.model_name, self.engine)
        reg = self.registry
        tokens_buckets = build_1_2_5_buckets(max_model_len)

        def gauge(name, doc):
            return Gauge(name, doc, LABELNAMES, registry=reg).labels(*labels)

        def counter(name, doc):
            return Counter(name, doc, LABELNAMES, registry=reg).labels(*labels)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, LABELNAMES, buckets=buckets, registry=reg).labels(*labels)

        # Scheduler state
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.gpu_cache_usage = (gauge("vllm:gpu_cache_usage_perc",
                                      "GPU KV-cache usage. 1 means 100 percent usage."
                                      "DEPRECATED: Use vllm:kv_cache_usage_perc instead.")
                                if legacy_names else None)
        # Prefix cache, in tokens
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        # Token counters (exposed with _total)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          LABELNAMES + ("finished_reason",), registry=reg)
        self._success_family = success
        self.request_success = {r: success.labels(*labels, r) for r in FINISH_REASONS}
        # Not vLLM's: requests the gateway turned away, by code (401s included: a stranger's
        # request is counted here and never stored as a trace)
        self._rejected_family = Counter("minillm:rejected_requests",
                                        "Requests the gateway rejected, by code.",
                                        LABELNAMES + ("code",), registry=reg)
        # Histograms of counts
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens_buckets)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens_buckets)
        self.request_max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", tokens_buckets)
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            tokens_buckets)
        # Histograms of timing intervals
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.time_per_output_token = (histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds."
            "DEPRECATED: Use vllm:inter_token_latency_seconds instead.", ITL_BUCKETS)
            if legacy_names else None)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds",
                                      "Histogram of time_per_output_token_seconds per request.",
                                      ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.",
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.",
                                     REQUEST_LATENCY_BUCKETS)

    def count_rejected(self, code: str) -> None:
        self._rejected_family.labels(self.model_name, self.engine, str(code)[:64]).inc()

    # -----------------------------------------------------------------------------------------
    def observe_request(self, m: RequestMetrics | Trace, *, max_tokens: int | None = None) -> bool:
        """Record one finished request (its :class:`RequestMetrics`, or its :class:`Trace`).

        Only requests that reached the engine and finished count (those with a
        ``finish_reason``): a request the gateway rejected never reached vLLM's engine either,
        and is left out; returns whether the request was recorded. Then, as vLLM:

        * ``request_success{finished_reason}`` +1 (the server's ``"disconnected"`` counts as
          vLLM's ``"abort"``; any other reason is used as it is), E2E, prompt/generation length histograms for
          every finished request (E2E without any token: received → finished);
        * for a request with at least one token: prompt tokens and generation tokens counters,
          TTFT, every ITL gap, queue/prefill/decode/inference time;
        * per-request TPOT only with at least two tokens; ``max_tokens`` if the caller knows it.

        Only engine-side metrics make sense here: client-side ``itl_s`` are chunk gaps (ICL) and
        a client cannot see the queue, so those raise ``ValueError``.
        """
        if isinstance(m, Trace):
            m = request_metrics(m)
        if not isinstance(m, RequestMetrics):
            raise TypeError(f"observe_request needs RequestMetrics or a Trace, got {type(m).__name__}")
        if m.side != "engine":
            raise ValueError(f"request {m.request_id!r}: {m.side}-side metrics cannot feed /metrics "
                             "(their gaps are chunk gaps and they have no queue/prefill split)")
        if not m.finish_reason:
            return False
        self._success(m.finish_reason).inc()
        e2e = m.e2e_s if m.e2e_s is not None else max(0, m.t_end_ns - m.t_start_ns) / 1e9
        self.e2e.observe(e2e)
        self.request_prompt_tokens.observe(m.prompt_tokens)
        self.request_generation_tokens.observe(m.output_tokens)
        self.request_max_num_generation_tokens.observe(m.output_tokens)   # n = 1: the request's own
        if max_tokens:
            self.request_params_max_tokens.observe(max_tokens)
        if not m.deliveries:                     # never got a token: no TTFT, no prefill/decode split
            return True
        self.prompt_tokens.inc(m.prompt_tokens)
        self.generation_tokens.inc(m.output_tokens)
        if m.ttft_s is not None:
            self.ttft.observe(m.ttft_s)
        for gap in m.itl_s:
            self.itl.observe(gap)
            if self.time_per_output_token is not None:
                self.time_per_output_token.observe(gap)
        if m.tpot_s is not None:
            self.request_tpot.observe(m.tpot_s)
        queue, prefill, decode = self.phase_times(m)
        self.queue_time.observe(queue)
        self.prefill_time.observe(prefill)
        self.decode_time.observe(decode)
        self.inference_time.observe(prefill + decode)
        return True

    @staticmethod
    def phase_times(m: RequestMetrics) -> tuple[float, float, float]:
        """(queue, prefill, decode) seconds of a request with at least one token, from its TTFT
        breakdown and its token times: queue = the ``queue`` stage; prefill = ``prefill`` +
        ``first_token`` stages (scheduled → first token); decode = first → last token."""
        bd = m.breakdown
        queue = bd.get("queue", 0.0)
        prefill = bd.get("prefill", 0.0) + bd.get("first_token", 0.0)
        decode = (m.deliveries[-1][0] - m.deliveries[0][0]) / 1e9 if m.deliveries else 0.0
        return queue, prefill, decode

    def observe_requests(self, ms: Iterable[RequestMetrics | Trace]) -> int:
        """:meth:`observe_request` for each; returns how many were recorded."""
        return sum(self.observe_request(m) for m in ms)

    def set_load(self, running: int, waiting: int, kv_usage: float) -> None:
        """The scheduler's state now: requests running (in the batch), waiting (queued, not yet
        scheduled), and the fraction of KV cache in use (0–1, as vLLM: 1 means 100 percent)."""
        if running < 0 or waiting < 0:
            raise ValueError(f"running/waiting must be ≥ 0, got {running}/{waiting}")
        if not 0.0 <= kv_usage <= 1.0:
            raise ValueError(f"kv_usage is a fraction in [0, 1] (1 = 100 %), got {kv_usage}")
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        if self.gpu_cache_usage is not None:
            self.gpu_cache_usage.set(kv_usage)

    def add_prefix_cache(self, queries_tokens: int, hit_tokens: int) -> None:
        """Add prefix-cache lookups, in tokens as vLLM counts them: ``queries_tokens`` prompt
        tokens looked up, ``hit_tokens`` of them served from the cache. (``SlotAllocator.queries``
        counts *requests*; per scheduled request pass ``len(prompt_ids)`` and the ``cached``
        tokens that ``allocate`` returned, i.e. the ``scheduled`` event's ``cached_tokens``.)"""
        if queries_tokens < 0 or hit_tokens < 0:
            raise ValueError("prefix cache counts must be ≥ 0")
        if hit_tokens > queries_tokens:
            raise ValueError(f"more hit tokens ({hit_tokens}) than queried tokens ({queries_tokens})")
        self.prefix_cache_queries.inc(queries_tokens)
        self.prefix_cache_hits.inc(hit_tokens)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) for ``GET /metrics``: Prometheus' text format, whatever the
        ``Accept`` header says (see the module docstring for why not to negotiate)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # -----------------------------------------------------------------------------------------
    def _success(self, reason: str):
        reason = VLLM_FINISH_REASON.get(reason, reason)
        child = self.request_success.get(reason)
        if child is None:                         # a reason vLLM does not have: still counted
            child = self.request_success[reason] = self._success_family.labels(
                self.model_name, self.engine, reason)
        return child
