"""Load client: N concurrent gRPC streams against the glm5 model, with latency statistics.

Reports time to first token (TTFT), inter-token latency (ITL), output tokens/s, requests/s and
the error count. Each worker keeps one request in flight at a time, so ``concurrency`` is the
number of simultaneous streams the server sees.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from .client import AsyncGlm5Client, GenerationResult, collect


@dataclass
class BenchReport:
    """Aggregate results of one load run (latencies in seconds)."""

    requests: int
    errors: int
    duration_s: float
    output_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    error_messages: list[str] = field(default_factory=list)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return (self.requests - self.errors) / self.duration_s if self.duration_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        def stats(xs: list[float]) -> dict[str, float] | None:
            if not xs:
                return None
            s = sorted(xs)
            pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
            return {"mean": statistics.fmean(s), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99),
                    "max": s[-1]}

        return {"requests": self.requests, "errors": self.errors, "duration_s": self.duration_s,
                "output_tokens": self.output_tokens, "output_tokens_per_s": self.output_tokens_per_s,
                "requests_per_s": self.requests_per_s, "ttft_s": stats(self.ttft_s),
                "itl_s": stats(self.itl_s), "latency_s": stats(self.latency_s),
                "error_messages": self.error_messages[:5]}


async def run_bench(url: str, model: str, prompt: str, *, num_requests: int, concurrency: int,
                    sampling: dict[str, Any] | None = None, images: list[bytes] | None = None,
                    timeout_s: float | None = None) -> BenchReport:
    """Send ``num_requests`` streaming requests with ``concurrency`` in flight; measure them."""
    if num_requests < 1 or concurrency < 1:
        raise ValueError(f"num_requests and concurrency must be >= 1, got {num_requests}, {concurrency}")
    results: list[GenerationResult] = []
    errors: list[str] = []
    counter = iter(range(num_requests))

    async def worker(client: AsyncGlm5Client) -> None:
        for _ in counter:
            start = time.perf_counter()
            try:
                chunks = [c async for c in client.generate_stream(
                    prompt, images=images or (), sampling=sampling, stream=True,
                    exclude_input_in_output=True)]
                results.append(collect(chunks, start))
            except Exception as exc:  # noqa: BLE001 (every failure is counted and reported)
                errors.append(str(exc))

    clients = [AsyncGlm5Client(url, model=model, timeout_s=timeout_s) for _ in range(min(concurrency, num_requests))]
    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker(c) for c in clients))
    finally:
        for c in clients:
            await c.close()
    duration = time.perf_counter() - t0
    return BenchReport(
        requests=num_requests, errors=len(errors), duration_s=duration,
        output_tokens=sum(r.num_output_tokens or 0 for r in results),
        ttft_s=[r.ttft_s for r in results if r.ttft_s is not None],
        itl_s=[x for r in results for x in r.inter_token_latencies_s],
        latency_s=[r.latency_s for r in results], error_messages=errors)
