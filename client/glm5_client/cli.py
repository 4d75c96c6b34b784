"""``glm5-client``: talk to the glm5 Triton model from a shell.

    glm5-client "Describe the picture" --image cat.jpg --stream
    glm5-client --http --url 127.0.0.1:8000 "Hello" --max-tokens 32
    glm5-client bench --concurrency 16 --num-requests 64 "Hello"
    glm5-client soak --streams 64 --minutes 10 --hostile --cancel-fraction 0.1 --pid PID --metrics-url URL

Streaming prints each delta as it arrives; a summary line (TTFT, tokens/s, finish reason) goes to
stderr so stdout stays the generated text. ``--json`` prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from .client import Glm5Client, Glm5ClientError, collect

_SAMPLING_FLAGS: dict[str, type] = {
    "max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "min_p": float,
    "seed": int, "repetition_penalty": float, "presence_penalty": float, "frequency_penalty": float,
    "min_tokens": int,
}


def _add_sampling(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    for name, typ in _SAMPLING_FLAGS.items():
        g.add_argument("--" + name.replace("_", "-"), dest=name, type=typ)
    g.add_argument("--stop", action="append", dest="stop_strings", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", default=None)


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {k: getattr(args, k) for k in _SAMPLING_FLAGS if getattr(args, k) is not None}
    if args.stop_strings:
        out["stop"] = args.stop_strings
    if args.ignore_eos:
        out["ignore_eos"] = True
    return out


def _read_files(paths: list[str] | None) -> list[bytes]:
    out = []
    for p in paths or []:
        try:
            out.append(Path(p).read_bytes())
        except OSError as exc:
            raise SystemExit(f"glm5-client: cannot read {p}: {exc.strerror}") from exc
    return out


def _generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="glm5-client", description="Generate with the glm5 Triton model "
                                "(use 'glm5-client bench ...' for load tests)")
    p.add_argument("prompt", help="prompt text (with --chat: the user message)")
    p.add_argument("--image", action="append", help="image file (repeatable)")
    p.add_argument("--video", action="append", help="video file (repeatable)")
    p.add_argument("--chat", action="store_true", help="send the prompt (and media) as a chat message "
                   "rendered with the model's chat template")
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    p.add_argument("--json", action="store_true", help="print one JSON object with text and timings")
    p.add_argument("--logprobs", action="store_true", help="request per-token logprobs (with --json)")
    p.add_argument("--http", action="store_true", help="use HTTP /generate(_stream) instead of gRPC")
    p.add_argument("--url", help="server address host:port (default 127.0.0.1:8001 gRPC / :8000 HTTP)")
    p.add_argument("--model", default="glm5", help="model name (glm5, or glm5_multimodal for the ensemble)")
    p.add_argument("--request-id", default="", help="request id (lets 'glm5-client stop' abort it)")
    p.add_argument("--stop-key", default="", help="secret for 'glm5-client stop' (16+ characters; default with "
                   "--request-id: a random key, printed to stderr)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for each response")
    _add_sampling(p)
    return p


def _bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="glm5-client bench", description="N concurrent gRPC streams; "
                                "reports TTFT, ITL, output tok/s, request/s and errors")
    p.add_argument("prompt", nargs="?", default="Write a short story about a robot.")
    p.add_argument("--url", default="127.0.0.1:8001")
    p.add_argument("--model", default="glm5")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--image", action="append")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", action="store_true")
    _add_sampling(p)
    return p


def _stop_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="glm5-client stop", description="abort a running request by id "
                                "(the way to stop a request sent through the ensemble)")
    p.add_argument("request_id")
    p.add_argument("--stop-key", required=True, help="the stop key the request was sent with")
    p.add_argument("--url", default="127.0.0.1:8001")
    p.add_argument("--model", default="glm5")
    return p


def _main_generate(argv: list[str]) -> int:
    args = _generate_parser().parse_args(argv)
    images, videos = _read_files(args.image), _read_files(args.video)
    stop_key = args.stop_key
    if args.request_id and not stop_key:
        stop_key = secrets.token_hex(16)
        print(f"glm5-client: stop this request with: glm5-client stop {args.request_id} --stop-key {stop_key}",
              file=sys.stderr)
    kwargs: dict[str, Any] = dict(images=images, videos=videos, sampling=_sampling(args) or None,
                                  stream=bool(args.stream), return_logprobs=bool(args.logprobs),
                                  request_id=args.request_id, stop_key=stop_key)
    prompt = args.prompt
    # Media need placeholders in the prompt; unless the user wrote them into a raw prompt, send a
    # chat message (the chat template inserts one placeholder per image/video part).
    if (images or videos) and "<|image|>" not in prompt and "<|video|>" not in prompt:
        args.chat = True
    if args.chat:
        parts: list[dict[str, Any]] = [{"type": "image"} for _ in images] + [{"type": "video"} for _ in videos]
        parts.append({"type": "text", "text": args.prompt})
        kwargs["messages"] = [{"role": "user", "content": parts}]
    if args.stream:
        kwargs["exclude_input_in_output"] = True
    client = Glm5Client(args.url, model=args.model, protocol="http" if args.http else "grpc",
                        timeout_s=args.timeout)
    start = time.perf_counter()
    chunks = []
    try:
        for chunk in client.generate_stream(prompt, **kwargs):
            chunks.append(chunk)
            if args.stream and not args.json:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    except Glm5ClientError as exc:
        print(f"\nglm5-client: server error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nglm5-client: interrupted (request cancelled)", file=sys.stderr)
        return 130
    finally:
        client.close()
    result = collect(chunks, start)
    if args.json:
        out = {"text": result.text, "finish_reason": result.finish_reason,
               "num_input_tokens": result.num_input_tokens, "num_output_tokens": result.num_output_tokens,
               "ttft_s": result.ttft_s, "latency_s": result.latency_s, "tokens_per_s": result.tokens_per_s,
               "responses": len(result.chunks)}
        if args.logprobs:
            out["logprobs"] = [lp for c in result.chunks for lp in (c.logprobs or [])]
        print(json.dumps(out, ensure_ascii=False))
        return 0
    if args.stream:
        sys.stdout.write("\n")
    else:
        print(result.text)
    ttft = f"{result.ttft_s * 1000:.1f} ms" if result.ttft_s is not None else "n/a"
    tps = f"{result.tokens_per_s:.1f}" if result.tokens_per_s is not None else "n/a"
    print(f"[finish_reason={result.finish_reason} input_tokens={result.num_input_tokens} "
          f"output_tokens={result.num_output_tokens} ttft={ttft} tokens/s={tps} "
          f"latency={result.latency_s:.3f} s]", file=sys.stderr)
    return 0


def _main_bench(argv: list[str]) -> int:
    from .bench import run_bench

    args = _bench_parser().parse_args(argv)
    report = asyncio.run(run_bench(args.url, args.model, args.prompt, num_requests=args.num_requests,
                                   concurrency=args.concurrency, sampling=_sampling(args) or None,
                                   images=_read_files(args.image), timeout_s=args.timeout))
    d = report.as_dict()
    if args.json:
        print(json.dumps(d))
    else:
        def ms(key: str, stat: str) -> str:
            return "n/a" if d[key] is None else f"{d[key][stat] * 1000:.1f}"

        print(f"requests {d['requests']}  errors {d['errors']}  duration {d['duration_s']:.2f} s")
        print(f"output tokens {d['output_tokens']}  output tok/s {d['output_tokens_per_s']:.1f}  "
              f"requests/s {d['requests_per_s']:.2f}")
        for key, label in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("latency_s", "latency")):
            print(f"{label:8s} ms  mean {ms(key, 'mean')}  p50 {ms(key, 'p50')}  p90 {ms(key, 'p90')}  "
                  f"p99 {ms(key, 'p99')}  max {ms(key, 'max')}")
        for m in d["error_messages"]:
            print(f"error: {m}", file=sys.stderr)
    return 1 if report.errors else 0


def _main_stop(argv: list[str]) -> int:
    args = _stop_parser().parse_args(argv)
    with Glm5Client(args.url, model=args.model) as client:
        try:
            stopped = client.stop(args.request_id, args.stop_key)
        except Glm5ClientError as exc:
            print(f"glm5-client: server error: {exc}", file=sys.stderr)
            return 1
    if not stopped:
        print(f"glm5-client: no running request {args.request_id!r} with that stop key", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return _main_bench(argv[1:])
    if argv and argv[0] == "stop":
        return _main_stop(argv[1:])
    if argv and argv[0] == "soak":
        from .soak import main as soak_main

        return soak_main(argv[1:])
    return _main_generate(argv)


if __name__ == "__main__":
    sys.exit(main())
