"""One MoE layer under expert parallelism, timed with both dispatch modes on the same inputs.

``allgather_reducescatter`` (every rank runs its experts on the pairs routed to them; partials combined by a
reduce-scatter + all-gather) against ``all2all`` (pairs sent to their experts' ranks and back, then the token
slices all-gathered): routing, dispatch, the fused MoE on the rank's local experts and the combine, per token
count. Both modes' outputs are checked to agree. The layer is :class:`glm5.layers.moe.MoE` itself with random
weights made on each rank (the rank's ``E / world`` experts and its shared-expert slice).

CPU (gloo; what was measured here)::

    python bench/ep_dispatch.py --world 2 --device cpu --out bench/results/ep_dispatch_cpu.json

GPUs (NCCL, the real layer: hidden 4096, 288 experts top-8 of 2048)::

    python bench/ep_dispatch.py --world 8 --device cuda --hidden 4096 --experts 288 --intermediate 2048 \\
        --tokens 1 8 64 256 1024 4096 --out ep_dispatch_h200x8.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch


def rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    import torch.distributed as dist

    from glm5.config import ModelConfig
    from glm5.distributed import ParallelConfig
    from glm5.distributed.parallel_state import build_context, destroy_parallel_context, join_world
    from glm5.layers.moe import MoE

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    store = dist.TCPStore("127.0.0.1", port, args.world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=300))
    backend, control = join_world(rank, args.world, device, store)
    pc = ParallelConfig(tensor_parallel_size=args.world, expert_parallel_size=args.world)
    par = build_context(pc, rank, backend, control)
    text = dict(hidden_size=args.hidden, moe_intermediate_size=args.intermediate, n_routed_experts=args.experts,
                num_experts_per_tok=args.topk, n_shared_experts=1, num_hidden_layers=1, layer_types=["linear_attention"],
                mlp_layer_types=["sparse"], num_attention_heads=args.world, num_key_value_heads=args.world,
                linear_attn_config={"num_heads": args.world, "head_dim": 16}, index_n_heads=args.world,
                intermediate_size=args.world * 16)
    cfg = ModelConfig.from_dict({"model_type": "glm5_next", "text_config": text}).text
    g = torch.Generator(device=device).manual_seed(100 + rank)
    e_loc, h, i = args.experts // args.world, args.hidden, args.intermediate
    si = i // args.world

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * scale).to(dtype)
    shared_g = torch.Generator(device=device).manual_seed(7)  # router identical on every rank
    w = {"m.gate.weight": (torch.randn(args.experts, h, generator=shared_g, device=device) / h ** 0.5),
         "m.gate.e_score_correction_bias": torch.zeros(args.experts, device=device),
         "m.experts.gate_proj": rnd(e_loc, i, h, scale=h ** -0.5), "m.experts.up_proj": rnd(e_loc, i, h, scale=h ** -0.5),
         "m.experts.down_proj": rnd(e_loc, h, i, scale=i ** -0.5),
         "m.shared_experts.gate_proj.weight": rnd(si, h, scale=h ** -0.5),
         "m.shared_experts.up_proj.weight": rnd(si, h, scale=h ** -0.5),
         "m.shared_experts.down_proj.weight": rnd(h, si, scale=i ** -0.5)}
    moe = MoE(w, "m", cfg, par)
    modes = {m: dataclasses.replace(par, config=dataclasses.replace(pc, ep_dispatch=m))
             for m in ("allgather_reducescatter", "all2all")}
    rows = []
    for t in args.tokens:
        x = torch.randn(t, h, generator=torch.Generator(device=device).manual_seed(t), device=device).to(dtype)
        outs, row = {}, {"tokens": t}
        for mode, ctx in modes.items():
            moe.par = ctx
            with torch.no_grad():
                outs[mode] = moe(x)
                for _ in range(2):
                    moe(x)
                times = []
                for _ in range(args.reps):
                    par.barrier()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    moe(x)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
            row[f"{mode}_s"] = sorted(times)[len(times) // 2]
        diff = (outs["all2all"].float() - outs["allgather_reducescatter"].float()).abs().max().item()
        row["max_abs_diff"] = diff
        row["all2all_vs_allgather"] = row["all2all_s"] / row["allgather_reducescatter_s"]
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0:
        res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "command": " ".join(sys.argv), "device": torch.cuda.get_device_name() if device.type == "cuda" else
               f"cpu ({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f})", "backend": backend, "world": args.world, "hidden": h,
               "experts": args.experts, "topk": args.topk, "intermediate": i, "dtype": str(dtype), "rows": rows}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))
    destroy_parallel_context(par)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    from glm5.engine.worker_processes import free_port
    mp.spawn(rank_main, args=(args, free_port("127.0.0.1")), nprocs=args.world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
