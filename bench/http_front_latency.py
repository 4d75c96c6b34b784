"""What the HTTP front costs: TTFT and inter-token gap of ``generate_stream`` through the front vs
straight to tritonserver's own (loopback) HTTP port, on one server, requests alternating.

    .venv/bin/python bench/http_front_latency.py [--requests 40] [--max-tokens 32] [--model CKPT]

Starts ``glm5 serve``'s server (text-only, tiny checkpoint unless ``--model``), sends the same
greedy streaming request ``--requests`` times each way (sequentially, so the engine is otherwise
idle), then ``10 x --requests`` health checks each way (the front's own cost without model
work), and prints the medians and p90s and their differences as one JSON object.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import time


def stream_once(host_port: str, body: bytes) -> tuple[float, list[float]]:
    """(TTFT, inter-token gaps) in seconds of one generate_stream request, timed at the client."""
    host, port = host_port.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    t0 = time.perf_counter()
    conn.request("POST", "/v2/models/glm5/generate_stream", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[:200]
    arrivals = []
    for line in resp:
        if line.startswith(b"data: ") and b'"text_output"' in line:
            arrivals.append(time.perf_counter())
    conn.close()
    return arrivals[0] - t0, [b - a for a, b in zip(arrivals, arrivals[1:])]


def health_once(host_port: str) -> float:
    """Seconds for one GET /v2/health/ready on a fresh connection: the front's own cost, no model work."""
    host, port = host_port.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    t0 = time.perf_counter()
    conn.request("GET", "/v2/health/ready")
    resp = conn.getresponse()
    resp.read()
    dt = time.perf_counter() - t0
    conn.close()
    assert resp.status == 200
    return dt


def pct(xs: list[float], p: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(p * (len(ys) - 1) + 0.5))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model", help="checkpoint (default: the tiny random one)")
    args = ap.parse_args()
    from glm5.serving.server_process import TritonServerProcess
    from glm5.tiny_checkpoint import ensure_default_checkpoint

    body = json.dumps({"text_input": "Tell me about the sea.", "stream": True, "exclude_input_in_output": True,
                       "parameters": {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}}).encode()
    with TritonServerProcess(model_dir=args.model or str(ensure_default_checkpoint()), models=("glm5",),
                             log_file="/dev/null", engine_overrides={"cache_memory_gb": "0.05"}) as srv:
        ways = {"front": srv.http_url, "direct": srv.triton_http_url}
        for url in ways.values():                     # warm-up
            stream_once(url, body)
        ttft: dict[str, list[float]] = {k: [] for k in ways}
        gaps: dict[str, list[float]] = {k: [] for k in ways}
        health: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(args.requests):
            for way, url in ways.items():
                t, g = stream_once(url, body)
                ttft[way].append(t)
                gaps[way].extend(g)
        import psutil

        front = psutil.Process(srv.front_proc.pid)
        cpu0 = sum(front.cpu_times()[:2])
        for _ in range(10 * args.requests):
            for way, url in ways.items():
                health[way].append(health_once(url))
        # CPU the front spent per proxied request: its cost independent of how busy the machine is
        front_cpu_ms = 1e3 * (sum(front.cpu_times()[:2]) - cpu0) / (10 * args.requests)
    out: dict[str, object] = {"requests_each_way": args.requests, "max_tokens": args.max_tokens}
    for way in ways:
        out[way] = {"ttft_ms_p50": 1e3 * statistics.median(ttft[way]), "ttft_ms_p90": 1e3 * pct(ttft[way], 0.9),
                    "gap_ms_p50": 1e3 * statistics.median(gaps[way]), "gap_ms_p90": 1e3 * pct(gaps[way], 0.9),
                    "health_ms_p50": 1e3 * statistics.median(health[way])}
    f, d = out["front"], out["direct"]  # type: ignore[assignment]
    out["added_by_front_ms"] = {k.replace("_ms", ""): f[k] - d[k] for k in f}  # type: ignore[index]
    out["front_cpu_ms_per_request"] = front_cpu_ms
    out["load_average_1min"] = os.getloadavg()[0]
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
