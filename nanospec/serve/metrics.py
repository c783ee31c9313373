"""Prometheus metrics of a running server, named as vLLM names them (``vllm:`` prefix), so vLLM's dashboards and
scrapers read nanospec unchanged; every series carries a ``model_name`` label, as vLLM's do.

Updated by the engine thread only (prometheus-client is thread-safe; ``/metrics`` renders from the HTTP side):

    after every step      vllm:num_requests_running, vllm:num_requests_waiting (gauges), vllm:kv_cache_usage_perc
                          (used target KV blocks / all of them, 0..1), vllm:num_preemptions_total,
                          vllm:prefix_cache_queries_total and vllm:prefix_cache_hits_total (tokens looked up in
                          the prefix cache at admission, and of those found there: hit rate = hits / queries)
    every output          vllm:prompt_tokens_total (once per request), vllm:generation_tokens_total
                          vllm:time_to_first_token_seconds   arrival -> first token
                          vllm:inter_token_latency_seconds   gap between two outputs of a request (a step may bring
                                                             several tokens under speculation, as in vLLM)
                          speculation, per step that verified guesses for the request:
                          vllm:spec_decode_num_drafts_total            +1
                          vllm:spec_decode_num_draft_tokens_total      + the guesses verified
                          vllm:spec_decode_num_accepted_tokens_total   + those accepted (a)
                          vllm:spec_decode_num_accepted_tokens_per_pos_total{position=i}   +1 for i < a
    the last output       vllm:e2e_request_latency_seconds, vllm:request_time_per_output_token_seconds
                          ((e2e - ttft) / (tokens - 1)), vllm:request_success_total{finished_reason}

Every series the README lists exists from the start, at zero: each metric with its ``model_name``, the finish reasons
(stop, length, abort, error) and, when the server speculates, each position a guess can be accepted at.

Reading speculation off a running server: acceptance rate = accepted_tokens / draft_tokens; tokens per verify step
(tau) = 1 + accepted_tokens / num_drafts; position i's acceptance = accepted_tokens_per_pos{i} / num_drafts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from nanospec.engine import EngineLoad
from nanospec.outputs import CompletionOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0)


@dataclass
class RequestProgress:
    """What the metrics have seen of one request so far (its outputs are cumulative)."""
    arrival: float
    num_outputs: int = 0
    num_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    first_token: float | None = None
    last_token: float | None = None


FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    def __init__(self, model_name: str, num_positions: int = 0):
        """``num_positions``: how deep a guess can be accepted (0: the server does not speculate)."""
        disable_created_metrics()  # no *_created series (vLLM turns them off too)
        self.registry = CollectorRegistry()
        label = {"labelnames": ["model_name"], "registry": self.registry}

        def counter(name, doc, extra=()):
            return Counter(name, doc, labelnames=["model_name", *extra], registry=self.registry)

        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", **label)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", **label)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of the target's KV blocks in use (0..1).", **label)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions (a request recomputed later).")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Tokens looked up and found in the prefix cache.")
        self.success = counter("vllm:request_success", "Finished requests by finish reason.", ["finished_reason"])
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first token.", buckets=TTFT_BUCKETS,
                              **label)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between two outputs of a request.",
                             buckets=ITL_BUCKETS, **label)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds", "A request's (e2e - ttft) / (tokens - 1).",
                              buckets=ITL_BUCKETS, **label)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to the last token.", buckets=E2E_BUCKETS,
                             **label)
        self.num_drafts = counter("vllm:spec_decode_num_drafts", "Verify steps with guesses, per request.")
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Guesses verified.")
        self.num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Guesses accepted.")
        self.accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Guesses accepted at each depth (0: the first guess).", ["position"])
        self.model_name = model_name
        self._counted = {"num_preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0}
        for metric in (self.running, self.waiting, self.kv_usage, self.prompt_tokens, self.generation_tokens,
                       self.preemptions, self.prefix_queries, self.prefix_hits, self.ttft, self.itl, self.tpot,
                       self.e2e, self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens):
            metric.labels(model_name)
        for reason in FINISH_REASONS:
            self.success.labels(model_name, reason)
        for position in range(num_positions):
            self.accepted_per_pos.labels(model_name, str(position))

    def observe_load(self, load: EngineLoad) -> None:
        """After a step: the batch, the queue, the KV pool, the prefix cache (the engine's ``load()``)."""
        m = self.model_name
        self.running.labels(m).set(load.num_running)
        self.waiting.labels(m).set(load.num_waiting)
        self.kv_usage.labels(m).set(load.kv_cache_usage)
        for name, counter in (("num_preemptions", self.preemptions), ("prefix_cache_queries", self.prefix_queries),
                              ("prefix_cache_hits", self.prefix_hits)):
            total = getattr(load, name)  # the engine's count so far
            if total > self._counted[name]:
                counter.labels(m).inc(total - self._counted[name])
                self._counted[name] = total

    def observe_output(self, progress: RequestProgress, out: CompletionOutput, now: float | None = None) -> None:
        """One output of a request (its counts are cumulative): what is new since the last one."""
        m = self.model_name
        now = time.perf_counter() if now is None else now
        if progress.num_outputs == 0:
            self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
        progress.num_outputs += 1
        new_tokens = len(out.token_ids) - progress.num_tokens
        if new_tokens > 0:
            self.generation_tokens.labels(m).inc(new_tokens)
            if progress.first_token is None:
                progress.first_token = now
                self.ttft.labels(m).observe(now - progress.arrival)
            else:
                self.itl.labels(m).observe(now - progress.last_token)
            progress.last_token = now
            progress.num_tokens = len(out.token_ids)
        drafted = out.num_draft_tokens - progress.num_draft_tokens
        accepted = out.num_accepted_tokens - progress.num_accepted_tokens
        if drafted > 0:
            self.num_drafts.labels(m).inc()
            self.num_draft_tokens.labels(m).inc(drafted)
            self.num_accepted_tokens.labels(m).inc(accepted)
            for position in range(accepted):
                self.accepted_per_pos.labels(m, str(position)).inc()
        progress.num_draft_tokens, progress.num_accepted_tokens = out.num_draft_tokens, out.num_accepted_tokens
        if out.finished:
            self.success.labels(m, out.finish_reason).inc()
            self.e2e.labels(m).observe(now - progress.arrival)
            if progress.num_tokens > 1:
                self.tpot.labels(m).observe((progress.last_token - progress.first_token) / (progress.num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
