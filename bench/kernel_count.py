"""How many kernels one batched decode step launches, counted on the CPU: a model of the GPU step.

The bench architecture (8 layers: KDA×3, MLA, KDA×3, MLA; dense×3 + MoE×5, mHC 4) with small widths runs one
batched decode step (the path CUDA graphs capture) on the CPU with the GPU backends chosen explicitly: the
Triton kernels run under ``TRITON_INTERPRET=1`` and each launch is counted (the KDA recurrence is our
``kda_step`` kernel, as on the GPU); every torch op that launches a CUDA kernel is counted by a dispatch mode
(views, reshapes and allocations launch none). Widths do not change the count, except that
cuBLAS may add a split-K reduction kernel to a GEMV, which this model does not see (the H200 profile of
``bench/bench.py`` shows them as ``splitKreduce``). Run it with the fusions on (auto) and off
(``--fuse torch --router torch``) to predict what they save; ``bench/kernel_check.py`` measures the same
step on the GPU with the torch profiler.

Usage: ``python bench/kernel_count.py [--fuse triton|torch] [--router triton|torch] [--batch N] [--json OUT]``
(CPU; about a minute).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

# aten ops that launch no kernel on CUDA (metadata, views, allocation, host scalars)
NO_KERNEL = {"view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "unsqueeze", "squeeze",
             "split", "split_with_sizes", "select", "slice", "as_strided", "detach", "alias", "empty", "empty_strided",
             "unbind", "lift_fresh", "_reshape_alias", "chunk", "narrow", "empty_like", "view_as", "expand_as",
             "_local_scalar_dense", "sym_size", "is_same_size", "_to_copy_noop", "numpy_T", "diagonal", "unfold",
             "resolve_conj", "resolve_neg", "is_pinned", "_pin_memory", "promote_types"}


class LaunchCounter(TorchDispatchMode):
    """Counts torch ops that launch a kernel and Triton launches, by the engine function they come from."""

    def __init__(self) -> None:
        super().__init__()
        self.by_site: collections.Counter = collections.Counter()
        self.by_op: collections.Counter = collections.Counter()
        self.active = False

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def site(self) -> str:
        for frame in reversed(traceback.extract_stack()[:-2]):
            f = frame.filename.replace("\\", "/")
            if "/glm5/layers/" in f or "/glm5_kernels/" in f:
                return f"{f.rsplit('/', 1)[-1][:-3]}.{frame.name}"
        return "?"

    def add(self, op: str) -> None:
        self.by_op[op] += 1
        self.by_site[self.site()] += 1

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name not in NO_KERNEL and not (name in ("_to_copy", "to", "clone") and _same_tensor(args, out)):
            self.add(name)
        return out


def _same_tensor(args, out) -> bool:
    return bool(args) and isinstance(args[0], torch.Tensor) and out is args[0]


@contextlib.contextmanager
def counting_triton(counter: LaunchCounter):
    """Count every interpreted Triton launch once (the interpreter's own torch ops are not counted)."""
    from triton.runtime import interpreter
    orig = interpreter.InterpretedFunction.run

    def run(self, *a, **kw):
        counter.add(f"triton:{self.fn.__name__}")
        with torch.utils._python_dispatch._disable_current_modes():
            return orig(self, *a, **kw)
    interpreter.InterpretedFunction.run = run
    try:
        yield
    finally:
        interpreter.InterpretedFunction.run = orig


def small_bench_config() -> dict:
    """The bench config's structure (layer kinds, mHC, kpool, top-k shape) at CPU-sized widths."""
    from bench import bench_config_dict
    d = bench_config_dict()
    t = d["text_config"]
    t.update(hidden_size=256, intermediate_size=512, moe_intermediate_size=64, n_routed_experts=32,
             num_attention_heads=8, num_key_value_heads=8, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
             v_head_dim=32, index_n_heads=16, index_head_dim=32, index_topk=64, vocab_size=1024)
    t["linear_attn_config"] = {**t["linear_attn_config"], "num_heads": 8, "head_dim": 16}
    d.pop("vision_config", None)
    return d


def count_step(fuse: str, router: str, batch: int = 1, ctx: int = 300) -> dict:
    """Launches of one batched decode step with the GPU backends (``fuse`` / ``router`` as given)."""
    from glm5.cache.hybrid_cache import CacheConfig, HybridCache
    from glm5.config import ModelConfig
    from glm5.engine.cuda_graph import DecodeRows, DecodeStager
    from glm5.layers import backends
    from glm5.layers.glm5 import Glm5ForCausalLM
    from glm5.weights import dummy_weights

    cfg = ModelConfig.from_dict(small_bench_config())
    weights = dummy_weights(cfg, "cpu", torch.bfloat16, include_mtp=False)   # bf16: casts count as on the GPU
    model = Glm5ForCausalLM(cfg, weights)
    bs, blocks = 16, ctx // 16 + 2
    cache = HybridCache(cfg.text, CacheConfig(block_size=bs, num_blocks=batch * blocks, num_state_slots=batch),
                        "cpu", torch.bfloat16)
    for group in (cache.latent, cache.pool_keys):
        for x in group.values():
            x.normal_()
    stager = DecodeStager(cache, batch, blocks, torch.device("cpu"))
    rows = DecodeRows(tokens=list(range(batch)), positions=[ctx] * batch, state_slots=list(range(batch)),
                      block_tables=[list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)])
    step = stager.stage(rows, batch)
    counter = LaunchCounter()
    try:
        backends.set_backends(index="triton", moe="triton", mhc="triton", decode_attn="triton", kda_step="triton",
                              fuse=fuse, router=router)
        with torch.no_grad():
            model.forward(step, cache)         # warm-up: one-time allocations (router semaphores) stay out
            step = stager.stage(rows, batch)
            with counting_triton(counter), counter:
                model.forward(step, cache)
    finally:
        backends.reset_backends()
    return {"fuse": fuse, "router": router, "batch": batch, "total": sum(counter.by_site.values()),
            "by_site": dict(counter.by_site.most_common()), "by_op": dict(counter.by_op.most_common())}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fuse", choices=("triton", "torch"), default="triton")
    ap.add_argument("--router", choices=("triton", "torch"), default="triton")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--json", type=Path, help="write the counts here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = count_step(args.fuse, args.router, args.batch)
    print(f"fuse={args.fuse} router={args.router} batch={args.batch}: {res['total']} launches per decode step")
    for site, n in res["by_site"].items():
        print(f"{n:5d}  {site}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
