"""``glm5 generate``: offline generation from the command line (and ``glm5.generate`` for notebooks).

The last stdout line with ``--json`` is one JSON object (``token_ids``, ``text``, ``finish_reason``,
…; a list of such objects under ``outputs`` when several prompts are given), which scripted checks
parse. ``--stream`` prints text as it arrives.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from glm5.engine import EngineArgs, LLMEngine, PromptInput
from glm5.sampling_params import SamplingParams
from glm5.tiny_checkpoint import ensure_default_checkpoint


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", help="prompt text (raw, or a user message with --chat)")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the tiny checkpoint, created "
                   "on first use under ~/.cache/glm5/tiny-checkpoint)")
    p.add_argument("--prompt-ids", default=None, help="comma-separated prompt token ids instead of text")
    p.add_argument("--prompts-file", default=None, help="file with one prompt per line (JSON lines with "
                   "'prompt' / 'prompt_ids' / 'messages' also accepted)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--image", action="append", default=[], help="image file (repeatable; implies --chat)")
    p.add_argument("--video", action="append", default=[], help="video file (repeatable; implies --chat)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (default: 8192 on a CUDA GPU of 70 GiB or more, else 2048)")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--num-cache-blocks", type=int, default=None)
    p.add_argument("--num-speculative-tokens", type=int, default=0)
    p.add_argument("--quantization", choices=("auto", "fp8", "none"), default="auto",
                   help="fp8 weights: auto keeps an fp8 checkpoint's weights in fp8 on CUDA, fp8 also quantizes the "
                        "other projections at load, none dequantizes (docs/fp8.md)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse cached prompt prefixes between the prompts of this run (default: on)")
    p.add_argument("--speculative-policy", choices=("fixed", "adaptive"), default="fixed",
                   help="fixed: always --num-speculative-tokens drafts; adaptive: k per step (docs/speculative.md)")
    p.add_argument("--draft-vocab-size", type=int, default=0,
                   help="draft over the N most frequent tokens of <model>/draft_vocab.json (0: full vocabulary)")
    add_parallel_arguments(p)
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def add_parallel_arguments(p: argparse.ArgumentParser) -> None:
    """The several-device flags (vLLM's names; docs/parallelism.md)."""
    g = p.add_argument_group("several devices")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks (devices, or gloo processes with --device cpu) splitting heads, MLPs and vocabulary")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="partition the routed experts over the ranks instead of splitting each expert")
    g.add_argument("--expert-parallel-size", type=int, default=None,
                   help="experts over this many ranks (a multiple of TP; more than TP replicates the attention)")
    g.add_argument("--enable-eplb", action="store_true", help="expert-parallel load balancing")
    g.add_argument("--num-redundant-experts", type=int, default=0, help="EPLB: extra physical experts per layer")
    g.add_argument("--eplb-step-interval", type=int, default=1000, help="EPLB: engine steps between rebalances")
    g.add_argument("--ep-dispatch", default="allgather_reducescatter", choices=("allgather_reducescatter", "all2all"))
    g.add_argument("--distributed", action="store_true", help="use the distributed executor even on one device")
    g.add_argument("--nnodes", type=int, default=1, help="machines (the others run `glm5 worker`)")
    g.add_argument("--master-addr", default="127.0.0.1", help="rendezvous address the other machines reach")
    g.add_argument("--master-port", type=int, default=0, help="rendezvous port (0: any free one; fixed for nnodes > 1)")


def parallel_engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(tensor_parallel_size=args.tensor_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
                expert_parallel_size=args.expert_parallel_size, enable_eplb=args.enable_eplb,
                num_redundant_experts=args.num_redundant_experts, eplb_step_interval=args.eplb_step_interval,
                ep_dispatch=args.ep_dispatch, distributed=args.distributed, nnodes=args.nnodes,
                master_addr=args.master_addr, master_port=args.master_port)


def _prompts(args: argparse.Namespace) -> list[PromptInput]:
    media = {"images": [Path(f).read_bytes() for f in args.image], "videos": [Path(f).read_bytes() for f in args.video]}

    def chat(text: str) -> PromptInput:
        parts = [{"type": "image"} for _ in args.image] + [{"type": "video"} for _ in args.video]
        content = parts + [{"type": "text", "text": text}] if parts else text
        msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": content}]
        return PromptInput(messages=msgs, **media)

    use_chat = args.chat or bool(args.image or args.video)
    if args.prompt_ids:
        return [PromptInput(token_ids=[int(t) for t in args.prompt_ids.split(",") if t.strip()])]
    if args.prompts_file:
        out = []
        for line in Path(args.prompts_file).read_text().splitlines():
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                d = json.loads(line)
                if "prompt_ids" in d:
                    out.append(PromptInput(token_ids=list(d["prompt_ids"])))
                elif "messages" in d:
                    out.append(PromptInput(messages=d["messages"]))
                else:
                    out.append(chat(d["prompt"]) if use_chat else PromptInput(text=d["prompt"]))
            else:
                out.append(chat(line) if use_chat else PromptInput(text=line))
        return out
    if args.prompt is None:
        raise SystemExit("glm5 generate: give a prompt, --prompt-ids or --prompts-file")
    return [chat(args.prompt) if use_chat else PromptInput(text=args.prompt)]


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          seed=args.seed, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                          stop=args.stop, ignore_eos=args.ignore_eos, repetition_penalty=args.repetition_penalty,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          logprobs=args.logprobs)


def run(args: argparse.Namespace) -> int:
    model = args.model or str(ensure_default_checkpoint())
    engine = LLMEngine(EngineArgs(model=model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  block_size=args.block_size, num_cache_blocks=args.num_cache_blocks,
                                  num_speculative_tokens=args.num_speculative_tokens,
                                  quantization=args.quantization,
                                  enable_prefix_caching=args.enable_prefix_caching,
                                  speculative_policy=args.speculative_policy, draft_vocab_size=args.draft_vocab_size,
                                  **parallel_engine_kwargs(args)))
    try:
        return _generate(engine, args)
    finally:
        engine.shutdown()


def _generate(engine: LLMEngine, args: argparse.Namespace) -> int:
    prompts, params = _prompts(args), _params(args)
    t0 = time.time()
    results: dict[str, dict] = {}
    order = []
    for i, p in enumerate(prompts):
        rid = f"cli-{i}"
        engine.add_request(rid, p, params)
        order.append(rid)
        results[rid] = {"token_ids": [], "text": "", "finish_reason": None}
    while engine.has_unfinished():
        for out in engine.step():
            r = results[out.request_id]
            r["token_ids"].extend(out.token_ids)
            r["text"] += out.text
            if out.logprobs:
                r.setdefault("logprobs", []).extend(out.logprobs)
            if args.stream and len(prompts) == 1 and out.text:
                sys.stdout.write(out.text)
                sys.stdout.flush()
            if out.finished:
                m = out.metrics
                r.update(finish_reason=out.finish_reason, num_prompt_tokens=out.num_prompt_tokens,
                         num_output_tokens=out.num_output_tokens, num_cached_tokens=out.num_cached_tokens,
                         ttft_s=None if m is None or m.ttft is None else round(m.ttft, 6))
    elapsed = time.time() - t0
    if args.stream and len(prompts) == 1:
        sys.stdout.write("\n")
    outs = [results[r] for r in order]
    n_tok = sum(len(o["token_ids"]) for o in outs)
    if args.json:
        summary = dict(outs[0]) if len(outs) == 1 else {"outputs": outs}
        summary.update(elapsed_s=round(elapsed, 4), output_tokens_per_s=round(n_tok / max(elapsed, 1e-9), 2))
        if engine.spec_stats is not None:
            summary["speculative"] = engine.spec_stats.to_dict()
        print(json.dumps(summary))
    elif not args.stream:
        for o in outs:
            print(o["text"] if o["text"] else o["token_ids"])
    return 0


def generate(prompts: list[str | list[int] | PromptInput], params: SamplingParams | None = None,
             model: str | None = None, **engine_kwargs) -> list:
    """Notebook API: ``glm5.generate(["Hello"], SamplingParams(max_tokens=8))`` → list of CompletionOutput."""
    engine = LLMEngine(EngineArgs(model=model or str(ensure_default_checkpoint()), **engine_kwargs))
    try:
        return engine.generate(prompts, params)
    finally:
        engine.shutdown()
