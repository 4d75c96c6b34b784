"""Prometheus families under vLLM's names, for dashboards built for vllm_backend / vLLM.

vllm_backend (``src/utils/metrics.py``) exports, labelled ``model`` and ``version``:
``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total`` (counters),
``vllm:time_to_first_token_seconds``, ``vllm:time_per_output_token_seconds``,
``vllm:e2e_request_latency_seconds``, ``vllm:request_prompt_tokens``,
``vllm:request_generation_tokens``, ``vllm:request_params_n`` (histograms; older releases also
``vllm:request_params_best_of``), with the bucket boundaries copied below. vLLM's own server adds
the scheduler gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:gpu_cache_usage_perc`` (0..1; ``vllm:kv_cache_usage_perc`` in vLLM v1) and the counters
``vllm:num_preemptions_total`` and ``vllm:request_success_total{finished_reason}``; they are
exported here under the same labels. The family factory is passed in (``pb_utils.MetricFamily``
inside Triton), so this module has no Triton import and can be tested with a stand-in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
N_BUCKETS = [1, 2, 5, 10, 20]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exponent
            if v > max_value:
                return out
            out.append(v)
        exponent += 1


@dataclass
class FinishedRequest:
    """What the metrics need of one finished engine request (one sequence)."""

    metrics: Any                 # glm5.engine.sequence.RequestMetrics
    num_prompt_tokens: int
    num_generation_tokens: int
    finish_reason: str | None


class VllmMetrics:
    """The vLLM-named families. ``family(name, description, kind)`` creates (and keeps alive) a
    family; ``kinds`` has ``COUNTER`` / ``GAUGE`` / ``HISTOGRAM`` (``pb_utils.MetricFamily``)."""

    def __init__(self, family: Callable[[str, str, Any], Any], kinds: Any, labels: dict[str, str],
                 max_model_len: int) -> None:
        C, G, H = kinds.COUNTER, kinds.GAUGE, kinds.HISTOGRAM
        self._labels = labels
        self.prompt_tokens = family("vllm:prompt_tokens_total", "Number of prefill tokens processed.", C).Metric(labels)
        self.generation_tokens = family("vllm:generation_tokens_total", "Number of generation tokens processed.",
                                        C).Metric(labels)
        self.preemptions = family("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.",
                                  C).Metric(labels)
        self._success_family = family("vllm:request_success_total", "Count of successfully processed requests.", C)
        self._success: dict[str, Any] = {}
        self.running = family("vllm:num_requests_running", "Number of requests currently running on GPU.",
                              G).Metric(labels)
        self.waiting = family("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                              G).Metric(labels)
        self.gpu_cache_usage = family("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.",
                                      G).Metric(labels)
        self.kv_cache_usage = family("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                     G).Metric(labels)
        self.ttft = family("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                           H).Metric(labels, buckets=TTFT_BUCKETS)
        self.tpot = family("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                           H).Metric(labels, buckets=TPOT_BUCKETS)
        self.e2e = family("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                          H).Metric(labels, buckets=E2E_BUCKETS)
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = family("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                            H).Metric(labels, buckets=token_buckets)
        self.request_generation_tokens = family("vllm:request_generation_tokens",
                                                "Number of generation tokens processed.", H).Metric(
                                                    labels, buckets=token_buckets)
        self.request_n = family("vllm:request_params_n", "Histogram of the n request parameter.", H).Metric(
            labels, buckets=N_BUCKETS)
        self.request_best_of = family("vllm:request_params_best_of", "Histogram of the best_of request parameter.",
                                      H).Metric(labels, buckets=N_BUCKETS)
        self._last: dict[str, float] = {}

    def _counter(self, metric: Any, key: str, total: float) -> None:
        delta = total - self._last.get(key, 0.0)
        if delta > 0:
            metric.increment(delta)
        self._last[key] = total

    def update_stats(self, st: Any) -> None:
        """Gauges and token counters from the engine's ``EngineStats`` (totals since start)."""
        self.running.set(float(st.running))
        self.waiting.set(float(st.waiting))
        self.gpu_cache_usage.set(float(st.cache_usage))
        self.kv_cache_usage.set(float(st.cache_usage))
        self._counter(self.prompt_tokens, "prompt", float(st.prompt_tokens_total))
        self._counter(self.generation_tokens, "gen", float(st.generation_tokens_total))
        self._counter(self.preemptions, "preempted", float(st.preempted_total))

    def observe_finished(self, ev: FinishedRequest) -> None:
        m = ev.metrics
        arrival, first, fin = (getattr(m, "arrival_time", None), getattr(m, "first_token_time", None),
                               getattr(m, "finished_time", None))
        if arrival is not None and first is not None:
            self.ttft.observe(max(0.0, first - arrival))
        if arrival is not None and fin is not None:
            self.e2e.observe(max(0.0, fin - arrival))
        for gap in getattr(m, "inter_token_latencies", None) or ():
            self.tpot.observe(max(0.0, float(gap)))
        self.request_prompt_tokens.observe(float(ev.num_prompt_tokens))
        self.request_generation_tokens.observe(float(ev.num_generation_tokens))
        reason = ev.finish_reason or "abort"
        if reason not in self._success:
            self._success[reason] = self._success_family.Metric({**self._labels, "finished_reason": reason})
        self._success[reason].increment(1)

    def observe_params(self, n: int, best_of: int) -> None:
        self.request_n.observe(float(n))
        self.request_best_of.observe(float(best_of))
