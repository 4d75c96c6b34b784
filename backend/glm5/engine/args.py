"""Engine settings (also what ``config.pbtxt`` parameters and CLI flags map to)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from glm5.distributed import ParallelConfig

#: Prefill token budget of one step when ``max_num_batched_tokens`` is unset: on a CUDA device of at least
#: LARGE_GPU_GIB (H100 / H200 class) the larger budget, as vLLM's API server defaults on such GPUs; else the smaller.
#: Each prefill chunk reads every routed expert's weights once, so at the bench config an 8K prompt took 175 ms in
#: 2048-token chunks, 134 ms in 4096 and 120 ms in 8192 (bf16, H200, 2026-12-04; docs/benchmarks.md). The price is
#: a longer step for the decodes that share it.
BATCHED_TOKENS_LARGE_GPU, BATCHED_TOKENS_DEFAULT, LARGE_GPU_GIB = 8192, 2048, 70


def default_max_num_batched_tokens(device: torch.device, total_memory_bytes: int | None = None) -> int:
    """The step's token budget for ``device`` when the setting is unset (:data:`BATCHED_TOKENS_LARGE_GPU`)."""
    if device.type != "cuda":
        return BATCHED_TOKENS_DEFAULT
    if total_memory_bytes is None:
        total_memory_bytes = torch.cuda.get_device_properties(device).total_memory
    return BATCHED_TOKENS_LARGE_GPU if total_memory_bytes >= LARGE_GPU_GIB * 2 ** 30 else BATCHED_TOKENS_DEFAULT


#: where the prefix cache can take state snapshots (glm5.engine.kv_cache_manager explains each)
SNAPSHOT_POINTS = ("request_end", "preempted", "prompt_end", "junction")


@dataclass
class EngineArgs:
    model: str
    dtype: str = "auto"                 # auto | float32 | bfloat16 | float16 (auto: bf16 on CUDA, fp32 on CPU)
    device: str = "auto"                # auto | cpu | cuda | cuda:N
    max_model_len: int = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # tokens per step; None: default_max_num_batched_tokens(device)
    num_cache_blocks: int | None = None  # None: sized from cache_memory_gb
    cache_memory_gb: float = 1.0
    block_size: int = 64
    num_speculative_tokens: int = 0      # MTP drafts per step (the most, with the adaptive policy)
    speculative_policy: str = "fixed"    # fixed (always num_speculative_tokens) | adaptive (k per step, 0 included)
    speculative_cost_table: str | None = None  # adaptive: measured round times (bench/spec_bench.py); else bytes
    speculative_max_batch: int = 64      # batched speculative steps up to this many requests (verify buffers, graphs)
    draft_vocab_size: int = 0            # >0: the MTP drafts over the N most frequent tokens (EAGLE-3 style)
    draft_vocab_file: str | None = None  # JSON token ids, most frequent first (default: <model>/draft_vocab.json)
    seed: int = 0
    media_caps: dict | None = None
    load_progress: bool = True
    index_cache: str = "exact"          # exact (model dtype, selects what transformers does) | fp8
    decode_path: str = "auto"           # auto (batched on CUDA) | batched | per_request (the reference loops)
    enforce_eager: bool = False         # True: no decode CUDA graphs (vLLM's flag name)
    cuda_graph_max_batch: int | None = None  # largest captured decode batch (default max_num_seqs)
    load_format: str = "auto"           # auto (the checkpoint's safetensors) | dummy (random weights made on the
                                        # device, sharded per rank; config.json only: benchmarks)
    # ---- several devices (docs/parallelism.md); vLLM's names where vLLM has the setting
    tensor_parallel_size: int = 1       # ranks splitting heads, dense MLPs, shared experts and the vocabulary
    enable_expert_parallel: bool = False  # routed experts partitioned over the ranks (EP = TP) instead of split
    expert_parallel_size: int | None = None  # EP explicitly (a multiple of TP; > TP replicates the attention)
    enable_eplb: bool = False           # expert-parallel load balancing (redundant hot experts, periodic moves)
    num_redundant_experts: int = 0      # EPLB: extra physical experts per MoE layer
    eplb_step_interval: int = 1000      # EPLB: engine steps between rebalances
    ep_dispatch: str = "allgather_reducescatter"  # or all2all (eager only)
    distributed: bool = False           # run through the distributed executor even at world size 1
    nnodes: int = 1                     # machines the world spans (the others run `glm5 worker`)
    master_addr: str = "127.0.0.1"      # rendezvous address (this machine's, reachable by the other nodes)
    master_port: int = 0                # rendezvous port (0: a free one; fixed when nnodes > 1)
    quantization: str = "auto"          # auto (fp8 checkpoint weights stay fp8 on CUDA) | fp8 (also quantize the
    #                                     other projections at load) | none (dequantize to dtype); docs/fp8.md
    # prefix caching (docs/prefix-caching.md): reuse cached MLA blocks + KDA state snapshots across requests
    enable_prefix_caching: bool = True  # vLLM's flag name
    prefix_cache_snapshot_memory_gb: float | None = None  # state-snapshot pool, inside cache_memory_gb (default 10 %)
    prefix_cache_checkpoint_interval: int = 0     # also snapshot every N blocks of a prefill (0: off)
    # where state snapshots are taken (comma-separated subset of SNAPSHOT_POINTS)
    prefix_cache_snapshot_points: str = "request_end,preempted,prompt_end,junction"
    encoder_cache_mb: float | None = None  # vision embedding cache, inside cache_memory_gb (default: 5% of it)
    preprocess_workers: int = 2         # threads that tokenize / render chat / decode media (AsyncLLMEngine)
    test_faults: dict | None = None     # tests only: make steps fail on purpose (glm5.engine.faults)

    def __post_init__(self) -> None:
        checks = [("max_model_len", self.max_model_len, 1), ("max_num_seqs", self.max_num_seqs, 1),
                  ("block_size", self.block_size, 1)]
        if self.max_num_batched_tokens is not None:
            checks.append(("max_num_batched_tokens", self.max_num_batched_tokens, 1))
        for name, value, low in checks:
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r}: must be an integer >= {low}")
        if self.num_cache_blocks is not None and self.num_cache_blocks < 1:
            raise ValueError(f"num_cache_blocks={self.num_cache_blocks}: must be >= 1 (or unset to size from memory)")
        if not (self.cache_memory_gb > 0 and math.isfinite(self.cache_memory_gb)):
            raise ValueError(f"cache_memory_gb={self.cache_memory_gb}: must be a positive number")
        if not 0 <= self.num_speculative_tokens <= 5:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens}: must be in 0..5")
        if self.speculative_policy not in ("fixed", "adaptive"):
            raise ValueError(f"speculative_policy={self.speculative_policy!r}: use fixed or adaptive")
        if self.speculative_max_batch < 1:
            raise ValueError(f"speculative_max_batch={self.speculative_max_batch}: must be >= 1")
        if self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size}: must be >= 0 (0 = the full vocabulary)")
        if self.index_cache not in ("exact", "fp8"):
            raise ValueError(f"index_cache={self.index_cache!r}: use exact or fp8")
        if self.decode_path not in ("auto", "batched", "per_request"):
            raise ValueError(f"decode_path={self.decode_path!r}: use auto, batched or per_request")
        if self.cuda_graph_max_batch is not None and self.cuda_graph_max_batch < 1:
            raise ValueError(f"cuda_graph_max_batch={self.cuda_graph_max_batch}: must be >= 1 (or unset)")
        if self.quantization not in ("auto", "fp8", "none"):
            raise ValueError(f"quantization={self.quantization!r}: use auto (keep the checkpoint's fp8 weights in fp8 "
                             "on CUDA), fp8 (also quantize the other projections at load) or none (dequantize)")
        snap = self.prefix_cache_snapshot_memory_gb
        if snap is not None and not (snap > 0 and math.isfinite(snap)):
            raise ValueError(f"prefix_cache_snapshot_memory_gb={self.prefix_cache_snapshot_memory_gb}: must be a "
                             "positive number (or set enable_prefix_caching=false)")
        if not isinstance(self.prefix_cache_checkpoint_interval, int) or self.prefix_cache_checkpoint_interval < 0:
            raise ValueError(f"prefix_cache_checkpoint_interval={self.prefix_cache_checkpoint_interval!r}: must be an "
                             "integer >= 0 (blocks between prefill snapshots; 0 = off)")
        bad = sorted(set(self.snapshot_points) - set(SNAPSHOT_POINTS))
        if bad:
            raise ValueError(f"prefix_cache_snapshot_points={self.prefix_cache_snapshot_points!r}: unknown {bad}; "
                             f"use a comma-separated subset of {', '.join(SNAPSHOT_POINTS)}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching={self.enable_prefix_caching!r}: must be true or false")
        mb = self.encoder_cache_mb
        if mb is not None and not (mb >= 0 and math.isfinite(mb)):
            raise ValueError(f"encoder_cache_mb={self.encoder_cache_mb}: must be a number >= 0 (or unset)")
        if not isinstance(self.preprocess_workers, int) or self.preprocess_workers < 1:
            raise ValueError(f"preprocess_workers={self.preprocess_workers!r}: must be an integer >= 1")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r}: use auto, float32, bfloat16 or float16")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format={self.load_format!r}: use auto (the checkpoint) or dummy (random weights)")
        pc = self.parallel_config  # validates the layout (ParallelConfigError names the fix)
        if self.nnodes < 1 or pc.world_size % self.nnodes:
            raise ValueError(f"nnodes={self.nnodes}: must be >= 1 and divide the world of {pc.world_size} ranks")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("nnodes > 1 needs a fixed master_port (and a master_addr the other nodes reach), given "
                             "to the workers too: glm5 worker --master-addr A --master-port P ...")

    @property
    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig.from_args(
            tensor_parallel_size=self.tensor_parallel_size, enable_expert_parallel=self.enable_expert_parallel,
            expert_parallel_size=self.expert_parallel_size, enable_eplb=self.enable_eplb,
            num_redundant_experts=self.num_redundant_experts, eplb_step_interval=self.eplb_step_interval,
            ep_dispatch=self.ep_dispatch)

    @property
    def uses_executor(self) -> bool:
        """True when the engine runs its model through worker processes / a process group."""
        return self.distributed or self.parallel_config.world_size > 1

    @property
    def snapshot_points(self) -> frozenset[str]:
        return frozenset(p.strip() for p in self.prefix_cache_snapshot_points.split(",") if p.strip())

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} but no CUDA device is available; use device=cpu")
        return dev

    def batched_tokens_budget(self, device: torch.device) -> int:
        """``max_num_batched_tokens``, or when unset the default for ``device`` (the engine's, once it is known)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return default_max_num_batched_tokens(device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    @property
    def load_quantization(self) -> str:
        """What the loader does with fp8 (``glm5.weights.load_weights(quantization=...)``): ``auto`` keeps the
        checkpoint's fp8 on CUDA but dequantizes on the CPU, which has no fp8 GEMM (``fp8`` keeps fp8 storage
        there too, run by the reference path that dequantizes per call)."""
        if self.quantization == "auto" and self.torch_device.type != "cuda":
            return "none"
        return self.quantization

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EngineArgs":
        """Build from string-valued settings (Triton ``config.pbtxt`` parameters), coercing by field type."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(fields))
        if unknown:
            raise ValueError(f"unknown engine setting(s) {unknown}; valid: {sorted(fields)}")
        kwargs: dict[str, Any] = {}
        for name, raw in d.items():
            ftype = str(fields[name].type)
            if isinstance(raw, str):
                s = raw.strip()
                optional = "None" in ftype
                if s == "" or (optional and s.lower() == "none"):
                    if optional:
                        kwargs[name] = None
                    continue  # empty: the engine default ("none" is a value of non-optional settings)
                try:
                    if ftype.startswith("int"):
                        kwargs[name] = int(s)
                    elif ftype.startswith("float"):
                        kwargs[name] = float(s)
                    elif ftype.startswith("bool"):
                        if s.lower() not in ("true", "false", "1", "0", "yes", "no"):
                            raise ValueError(s)
                        kwargs[name] = s.lower() in ("true", "1", "yes")
                    elif ftype.startswith("dict"):
                        import json
                        kwargs[name] = json.loads(s)
                    else:
                        kwargs[name] = s
                except ValueError as e:
                    raise ValueError(f"engine setting {name}={raw!r}: expected {ftype}") from e
            else:
                kwargs[name] = raw
        return cls(**kwargs)
