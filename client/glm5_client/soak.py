"""``glm5-client soak``: N concurrent streams for T minutes against a running glm5 server.

    glm5-client soak --url 127.0.0.1:8001 --http-url 127.0.0.1:8000 --metrics-url http://127.0.0.1:8002/metrics \\
        --pid $(pgrep -f 'tritonserver --model-repository') --streams 64 --minutes 10 --hostile --cancel-fraction 0.1

What runs, all bounded in time (``--minutes``) and stopping by itself:

* ``--streams`` workers, each sending one streaming gRPC request after another (``--max-tokens``
  tokens, ``ignore_eos``); a ``--cancel-fraction`` of them are cancelled at a random token (that is
  not a failure); a good request fails if it errors or returns another token count;
* with ``--hostile``, one more worker sending ``glm5_client.hostile`` requests in turn (bad
  parameters, corrupt media, out-of-vocabulary token ids, an oversized HTTP body, a 10 MB prompt,
  an 8 s 720p video), checking each is refused (or, for the video, served or refused) and
  recording when the heavy ones ran;
* a sampler reading the server's RSS (``--pid`` and all its descendants: the stubs hold the
  engine) and ``/metrics`` (cache usage, running requests) every ``--sample-interval`` seconds.

At the end: failures of good requests, TTFT and inter-token gap percentiles, the largest gap
while a heavy hostile request was in flight against the median gap, RSS after warm-up vs after
the run (drift), and cache usage once the server is idle. The exit code is 1 when a target of
``--check`` is missed (0 failed good requests, drift <= 5 %, cache 0 after, heavy-request gap
<= 10x the median).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any

from .client import AsyncGlm5Client, Glm5ClientError
from .hostile import HEAVY_KINDS, KINDS, HostileFactory, HostileOutcome, oversized_http_body

TARGET_DRIFT = 0.05
TARGET_GAP_RATIO = 10.0


@dataclass
class StreamRecord:
    started: float
    arrivals: list[float] = field(default_factory=list)     # perf_counter of each token (per chunk, spread)
    tokens: int = 0
    cancelled: bool = False
    error: str | None = None


@dataclass
class Sample:
    t: float
    rss_bytes: int | None
    cache_usage: float | None
    running: float | None


@dataclass
class SoakResult:
    settings: dict[str, Any]
    streams: list[StreamRecord]
    hostile: list[HostileOutcome]
    samples: list[Sample]
    cache_after: float | None
    rss_baseline: int | None
    rss_final: int | None
    duration_s: float

    def summary(self) -> dict[str, Any]:
        good = [s for s in self.streams if not s.cancelled]
        failed = [s for s in good if s.error]
        ttft = [s.arrivals[0] - s.started for s in good if s.arrivals and not s.error]
        gaps = [b - a for s in self.streams for a, b in zip(s.arrivals, s.arrivals[1:])]
        heavy = [(h.started, h.finished) for h in self.hostile if h.kind in HEAVY_KINDS]
        during = [b - a for s in self.streams for a, b in zip(s.arrivals, s.arrivals[1:])
                  if any(a < end and b > start for start, end in heavy)]
        med = statistics.median(gaps) if gaps else None
        drift = None
        if self.rss_baseline and self.rss_final:
            drift = (self.rss_final - self.rss_baseline) / self.rss_baseline
        max_during = max(during) if during else None
        ratio = max_during / med if (max_during is not None and med) else None
        kinds: dict[str, dict[str, int]] = {}
        for h in self.hostile:
            k = kinds.setdefault(h.kind, {"sent": 0, "handled": 0})
            k["sent"] += 1
            k["handled"] += int(h.ok)
        rss = [s.rss_bytes for s in self.samples if s.rss_bytes]
        return {
            "duration_s": round(self.duration_s, 1),
            "good_requests": len(good), "failed_good_requests": len(failed),
            "failure_messages": sorted({s.error for s in failed if s.error})[:10],
            "cancelled_requests": sum(s.cancelled for s in self.streams),
            "output_tokens": sum(s.tokens for s in self.streams),
            "ttft_s": _pcts(ttft), "inter_token_gap_s": _pcts(gaps),
            "max_gap_during_heavy_hostile_s": max_during, "gap_ratio_heavy_vs_median": ratio,
            "hostile": kinds,
            "hostile_mishandled": [f"{h.kind}: {h.detail}" for h in self.hostile if not h.ok][:10],
            "rss_baseline_mb": _mb(self.rss_baseline), "rss_final_mb": _mb(self.rss_final),
            "rss_max_mb": _mb(max(rss)) if rss else None, "rss_drift": drift,
            "cache_usage_after": self.cache_after,
        }

    def verdict(self) -> dict[str, bool | None]:
        s = self.summary()
        return {
            "no_failed_good_requests": s["failed_good_requests"] == 0,
            "rss_drift_within_5pct": None if s["rss_drift"] is None else s["rss_drift"] <= TARGET_DRIFT,
            "cache_empty_after": None if s["cache_usage_after"] is None else s["cache_usage_after"] == 0,
            "heavy_gap_within_10x_median": (None if s["gap_ratio_heavy_vs_median"] is None
                                            else s["gap_ratio_heavy_vs_median"] <= TARGET_GAP_RATIO),
            "hostile_requests_handled": not s["hostile_mishandled"],
        }


def _pcts(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    ys = sorted(xs)

    def q(p: float) -> float:
        return ys[min(len(ys) - 1, int(p * (len(ys) - 1) + 0.5))]
    return {"n": len(ys), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": ys[-1]}


def _mb(x: int | None) -> float | None:
    return None if x is None else round(x / 2**20, 1)


# ---------------------------------------------------------------------------------------------
# Observing the server
# ---------------------------------------------------------------------------------------------

def tree_rss(pid: int) -> int | None:
    """RSS of ``pid`` and all its descendants (tritonserver + stub processes), or None if gone."""
    try:
        import psutil
    except ImportError as exc:
        raise RuntimeError("--pid needs psutil (pip install psutil)") from exc
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return None
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


_METRIC_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")


def scrape(metrics_url: str) -> dict[str, float]:
    """Metric family name → the sum over its label sets (enough for the gauges read here)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:  # noqa: S310 (operator-given URL)
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC_RE.match(line.strip())
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def _sample(args: argparse.Namespace) -> Sample:
    rss = tree_rss(args.pid) if args.pid else None
    cache = running = None
    if args.metrics_url:
        try:
            m = scrape(args.metrics_url)
            cache, running = m.get("glm5:kv_cache_usage_ratio"), m.get("glm5:num_requests_running")
        except OSError:
            pass
    return Sample(time.perf_counter(), rss, cache, running)


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------

async def _good_stream(client: AsyncGlm5Client, args: argparse.Namespace, rng: random.Random) -> StreamRecord:
    rec = StreamRecord(started=time.perf_counter())
    cancel_at = rng.randint(1, args.max_tokens - 1) if rng.random() < args.cancel_fraction else None
    sampling = {"max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0.8, "seed": rng.randrange(2**31)}
    gen = client.generate_stream(args.prompt, sampling=sampling, exclude_input_in_output=True)
    try:
        async for chunk in gen:
            n = int(chunk.num_output_tokens or (1 if chunk.text else 0))
            if n:                       # one arrival per delivered chunk (MTP may deliver several tokens)
                rec.arrivals.append(chunk.received_at)
                rec.tokens += n
            if cancel_at is not None and rec.tokens >= cancel_at:
                rec.cancelled = True
                break
        if not rec.cancelled and rec.tokens != args.max_tokens:
            rec.error = f"{rec.tokens} tokens instead of {args.max_tokens}"
    except Glm5ClientError as exc:
        rec.error = str(exc)[:200]
    except Exception as exc:  # noqa: BLE001 (a transport failure of a good request is a failure, not a crash)
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        await gen.aclose()
    return rec


async def _stream_worker(args: argparse.Namespace, deadline: float, out: list[StreamRecord], seed: int) -> None:
    rng = random.Random(seed)
    async with AsyncGlm5Client(args.url, model=args.model, timeout_s=args.request_timeout) as client:
        while time.perf_counter() < deadline:
            rec = await _good_stream(client, args, rng)
            out.append(rec)
            if rec.error:
                await asyncio.sleep(0.05)        # a broken server answers at once: do not spin


async def _send_raw(args: argparse.Namespace, tensors: list) -> None:
    """Stream a request built from raw tensors; raise Glm5ClientError on an error response."""
    import tritonclient.grpc.aio as aio

    inputs = []
    for name, arr, dtype in tensors:
        inp = aio.InferInput(name, list(arr.shape), dtype)
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    done = asyncio.Event()

    async def requests():
        yield {"model_name": args.model, "inputs": inputs, "request_id": str(uuid.uuid4()),
               "enable_empty_final_response": True}
        await done.wait()

    async with aio.InferenceServerClient(args.url) as client:
        call = client.stream_infer(requests(), stream_timeout=args.request_timeout)
        try:
            async for result, error in call:
                if error is not None:
                    raise Glm5ClientError(str(error))
                final = result.get_response().parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    return
        finally:
            done.set()


async def _hostile_worker(args: argparse.Namespace, deadline: float, out: list[HostileOutcome]) -> None:
    factory = HostileFactory()
    kinds = [k for k in KINDS if k in args.hostile_kinds]
    i = 0
    async with AsyncGlm5Client(args.url, model=args.model, timeout_s=args.request_timeout) as client:
        while time.perf_counter() < deadline - args.hostile_interval:
            await asyncio.sleep(args.hostile_interval)
            kind = kinds[i % len(kinds)]
            i += 1
            if kind == "oversized_http":
                if not args.http_url:
                    continue
                t0 = time.perf_counter()
                ok, detail = await asyncio.to_thread(oversized_http_body, args.http_url, args.model)
                out.append(HostileOutcome(kind, ok, detail, t0, time.perf_counter()))
                continue
            req = await asyncio.to_thread(factory.build, kind)          # first video/prompt build is slow
            t0 = time.perf_counter()
            try:
                if req.raw_inputs is not None:
                    await _send_raw(args, req.raw_inputs())
                else:
                    await client.generate(**req.kwargs)
                ok, detail = (not req.must_fail), f"served {json.dumps(req.kwargs.get('sampling'))}"
            except Glm5ClientError as exc:
                # refused for a reason, not because the server broke while handling it
                msg = str(exc)
                ok = not any(w in msg.lower() for w in ("internal error", "engine loop", "not healthy"))
                detail = f"refused: {msg[:160]}"
            except Exception as exc:  # noqa: BLE001
                ok, detail = False, f"{type(exc).__name__}: {exc}"[:200]
            out.append(HostileOutcome(kind, ok, detail, t0, time.perf_counter()))


async def _sampler(args: argparse.Namespace, stop: asyncio.Event, out: list[Sample]) -> None:
    while not stop.is_set():
        out.append(await asyncio.to_thread(_sample, args))
        try:
            await asyncio.wait_for(stop.wait(), args.sample_interval)
        except TimeoutError:
            pass


async def run_soak(args: argparse.Namespace) -> SoakResult:
    start = time.perf_counter()
    deadline = start + args.minutes * 60.0
    streams: list[StreamRecord] = []
    hostile: list[HostileOutcome] = []
    samples: list[Sample] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sampler(args, stop, samples))
    tasks = [asyncio.create_task(_stream_worker(args, deadline, streams, args.seed + i)) for i in range(args.streams)]
    if args.hostile:
        tasks.append(asyncio.create_task(_hostile_worker(args, deadline, hostile)))
    await asyncio.gather(*tasks)
    # Idle now: give the server a moment to free the cache, then take the final readings.
    cache_after = None
    rss_final = None
    idle_deadline = time.perf_counter() + args.drain_seconds
    while True:
        s = await asyncio.to_thread(_sample, args)
        cache_after, rss_final = s.cache_usage, s.rss_bytes
        if cache_after in (None, 0.0) or time.perf_counter() > idle_deadline:
            break
        await asyncio.sleep(0.5)
    stop.set()
    await sampler
    warm = [x.rss_bytes for x in samples if x.rss_bytes and x.t >= start + args.warmup_seconds]
    baseline = warm[0] if warm else None
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    return SoakResult(settings, streams, hostile, samples, cache_after, baseline, rss_final,
                      time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="glm5-client soak", description=__doc__,
                                epilog="Targets checked with --check: " + ", ".join(
                                    ["0 failed good requests", "RSS drift <= 5%", "cache usage 0 after",
                                     "gap during heavy hostile requests <= 10x median"]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="127.0.0.1:8001", help="gRPC address (default %(default)s)")
    p.add_argument("--http-url", help="HTTP address, for the oversized-body hostile request")
    p.add_argument("--metrics-url", help="metrics URL, e.g. http://127.0.0.1:8002/metrics (cache usage)")
    p.add_argument("--pid", type=int, help="tritonserver's pid: RSS of it and its stub processes is sampled")
    p.add_argument("--model", default="glm5")
    p.add_argument("--streams", type=int, default=16, help="concurrent good streams (default %(default)s)")
    p.add_argument("--minutes", type=float, default=1.0, help="how long to run (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per good request (default %(default)s)")
    p.add_argument("--prompt", default="Tell me about the sea.")
    p.add_argument("--cancel-fraction", type=float, default=0.0, help="share of good requests cancelled "
                   "at a random token (default %(default)s)")
    p.add_argument("--hostile", action="store_true", help="add the hostile-request worker")
    p.add_argument("--hostile-kinds", default=",".join(KINDS), help="comma-separated subset of: %(default)s")
    p.add_argument("--hostile-interval", type=float, default=5.0, help="seconds between hostile requests")
    p.add_argument("--sample-interval", type=float, default=2.0)
    p.add_argument("--warmup-seconds", type=float, default=30.0, help="RSS baseline is the first sample after this")
    p.add_argument("--drain-seconds", type=float, default=10.0, help="how long to wait for the cache to empty")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    return p


def _print_summary(s: dict[str, Any], verdict: dict[str, bool | None]) -> None:
    def ms(d: dict | None, key: str) -> str:
        return "n/a" if not d else f"{d[key] * 1000:.1f}"
    print(f"duration {s['duration_s']} s  good requests {s['good_requests']}  failed {s['failed_good_requests']}  "
          f"cancelled {s['cancelled_requests']}  output tokens {s['output_tokens']}")
    for key, label in (("ttft_s", "TTFT"), ("inter_token_gap_s", "gap")):
        d = s[key]
        print(f"{label:5s} ms  p50 {ms(d, 'p50')}  p90 {ms(d, 'p90')}  p99 {ms(d, 'p99')}  max {ms(d, 'max')}")
    if s["max_gap_during_heavy_hostile_s"] is not None:
        print(f"max gap while a 10 MB prompt / 720p video ran: {s['max_gap_during_heavy_hostile_s'] * 1000:.1f} ms "
              f"= {s['gap_ratio_heavy_vs_median']:.1f}x the median gap")
    for kind, c in s["hostile"].items():
        print(f"hostile {kind}: {c['handled']}/{c['sent']} handled")
    drift = "n/a" if s["rss_drift"] is None else f"{s['rss_drift'] * 100:+.1f} %"
    print(f"RSS MB  after warm-up {s['rss_baseline_mb']}  final {s['rss_final_mb']}  max {s['rss_max_mb']}  "
          f"drift {drift}")
    print(f"cache usage after: {s['cache_usage_after']}")
    for m in s["failure_messages"] + s["hostile_mishandled"]:
        print(f"  ! {m}")
    print("targets: " + ", ".join(f"{k}={'n/a' if v is None else ('ok' if v else 'MISSED')}" for k, v in verdict.items()))


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    args.hostile_kinds = [k.strip() for k in args.hostile_kinds.split(",") if k.strip()]
    unknown = sorted(set(args.hostile_kinds) - set(KINDS))
    if unknown:
        print(f"glm5-client soak: unknown hostile kinds {unknown}; choose from {', '.join(KINDS)}", file=sys.stderr)
        return 2
    if args.streams < 1 or args.minutes <= 0 or args.max_tokens < 2 or not 0 <= args.cancel_fraction <= 1:
        print("glm5-client soak: need --streams >= 1, --minutes > 0, --max-tokens >= 2, 0 <= --cancel-fraction <= 1",
              file=sys.stderr)
        return 2
    result = asyncio.run(run_soak(args))
    summary, verdict = result.summary(), result.verdict()
    if args.json:
        print(json.dumps({"summary": summary, "targets": verdict}, indent=2))
    else:
        _print_summary(summary, verdict)
    return 1 if args.check and any(v is False for v in verdict.values()) else 0
