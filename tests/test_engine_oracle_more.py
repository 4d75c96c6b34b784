"""More engine-vs-transformers oracle tests (fp32, CPU, tiny checkpoints with every parameter random).

What :mod:`test_engine_oracle` does not cover: continuous batching with staggered arrivals and
mixed prefill/decode steps (and recompute preemption), chunk boundaries at every offset modulo
``index_kpool``, long prompts over many non-contiguous, interleaved cache blocks (with a check that
a wrong pool-slot mapping would be caught), image and video inputs, the vision encoder cache, and
the ``glm5 generate`` command on the default tiny checkpoint and on a ``save_pretrained`` one.
Greedy references come from :func:`oracle.hf_greedy` (forward with its own cache, no mask).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from glm5.cache.hybrid_cache import HybridCache
from glm5.engine import LLMEngine, PromptInput
from glm5.tiny_checkpoint import random_tensor
from oracle import engine, engine_greedy, greedy, hf_greedy, make_pair, random_prompt


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def record_schedule(eng: LLMEngine) -> list[list[dict]]:
    """Wrap ``eng.scheduler.schedule`` so every step's chunks are logged (before they are computed).

    Each chunk: request id, number of tokens, the position of its first token, whether it is a
    decode step (it processes an already generated token) and the request's block table.
    """
    log: list[list[dict]] = []
    original = eng.scheduler.schedule

    def schedule():
        out = original()
        log.append([{"rid": c.seq.request_id, "n": c.num_tokens, "start": c.seq.num_computed_tokens,
                     "decode": c.seq.num_computed_tokens >= c.seq.num_prompt_tokens,
                     "blocks": list(c.seq.block_table)} for c in out.chunks])
        return out

    eng.scheduler.schedule = schedule
    return log


def run_staggered(eng: LLMEngine, prompts: list[list[int]], n_new: int, arrivals: list[int]) -> list[list[int]]:
    """Add prompt ``i`` just before step ``arrivals[i]`` and step until all finish; tokens per prompt."""
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    done: set[str] = set()
    step = 0
    while len(done) < len(prompts):
        for i, at in enumerate(arrivals):
            if at == step:
                eng.add_request(f"r{i}", prompts[i], greedy(n_new))
        for out in eng.step():
            tokens[out.request_id].extend(out.token_ids)
            if out.finished:
                done.add(out.request_id)
        step += 1
        assert step < 10_000, "engine did not finish"
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def is_contiguous(blocks: list[int]) -> bool:
    return all(b == a + 1 for a, b in zip(blocks, blocks[1:]))


#: Why 16 index heads instead of the tiny default's 4: a pool whose key has a negative dot product
#: with every head's query scores exactly 0 after the ReLU, so with 4 heads (1/16 of pool-query
#: pairs) exact score ties at the top-k boundary are common. transformers breaks them with
#: ``torch.topk``, whose order is unspecified and changes with the row length — its own full
#: forward then disagrees with its cached decode (and with itself on a longer input) by O(0.1) in
#: the logits, so it is no oracle there. With 16 heads such ties practically never occur and every
#: path (full, chunked, cached) of transformers agrees to ~1e-6.
NO_TIES = {"index_n_heads": 16}
#: KDA, two consecutive MLA layers, KDA; dense then MoE FFNs (half the default depth: faster).
STACK = {"layer_types": ["linear_attention", "deepseek_sparse_attention", "deepseek_sparse_attention",
                         "linear_attention"], "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
         "num_hidden_layers": 4}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices gain nothing from intra-op threads, and on a shared 2-core CI box OpenMP
    spinning made these tests several times slower; the previous setting is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def default_pair(tmp_path_factory):
    """A tiny checkpoint (kpool 4, topk 16, vision tower) and transformers on it."""
    return make_pair(tmp_path_factory.mktemp("default") / "ckpt", seed=1, text_overrides={**STACK, **NO_TIES})


# ---------------------------------------------------------------------------------------------
# 1. batching: staggered arrivals, mixed prefill/decode steps, preemption
# ---------------------------------------------------------------------------------------------
BATCH_LENGTHS = (5, 23, 50, 77)  # 77 > 3·topk: the sparse regime
BATCH_NEW = 16


@pytest.fixture(scope="module")
def batch_refs(default_pair):
    ckpt, hf = default_pair
    vocab = hf.config.text_config.vocab_size
    prompts = [random_prompt(n, vocab, seed=500 + n) for n in BATCH_LENGTHS]
    alone_eng = engine(ckpt)
    alone = [engine_greedy(alone_eng, [p], BATCH_NEW)[0] for p in prompts]  # one request at a time
    return prompts, alone, [hf_greedy(hf, p, BATCH_NEW) for p in prompts]


@pytest.mark.parametrize("budget,num_blocks", [(16, 256), (7, 256), (32, 10)],
                         ids=["budget16", "budget7", "budget32-preempting"])
def test_staggered_batch_equals_alone_and_transformers(default_pair, batch_refs, budget, num_blocks):
    ckpt, _ = default_pair
    prompts, alone, ref = batch_refs
    assert alone == ref, "each prompt alone must already match transformers"
    eng = engine(ckpt, max_num_batched_tokens=budget, num_cache_blocks=num_blocks)
    log = record_schedule(eng)
    got = run_staggered(eng, prompts, BATCH_NEW, arrivals=[0, 2, 3, 9])
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g == r, f"prompt {i} (length {len(prompts[i])}) differs from its solo / transformers tokens"
    # the schedule really mixed things: steps with a decode token and a prefill chunk of another request
    mixed = [s for s in log if any(c["decode"] for c in s) and any(not c["decode"] and c["n"] > 1 for c in s)]
    assert mixed, "no step mixed decode tokens with a prefill chunk"
    for p_idx, n in enumerate(BATCH_LENGTHS):
        chunks = [c for s in log for c in s if c["rid"] == f"r{p_idx}" and not c["decode"]]
        if n > budget:
            assert len(chunks) >= 2, f"prompt {p_idx} (length {n}) was not split into prefill chunks"
    if num_blocks < 256:
        assert eng.scheduler.num_preemptions > 0, "the small cache was meant to force a preemption"


# ---------------------------------------------------------------------------------------------
# 2. chunked prefill: chunk boundaries at every offset modulo kpool, in the sparse regime
# ---------------------------------------------------------------------------------------------
CHUNK_CASES = {
    # kpool: (topk, prompt length, budgets). topk = 2 pools, prompt ≥ 3·topk + 5 (sparse regime).
    4: (8, 45, [8, 9, 10, 11]),            # first boundary at every offset r = 0..3 (kp·2 + r)
    16: (32, 101, [16, 17, 22, 25, 29, 31]),  # boundaries k·budget < 101 hit every offset 0..15 together
}


@pytest.mark.parametrize("kp", sorted(CHUNK_CASES), ids=[f"kpool{k}" for k in sorted(CHUNK_CASES)])
def test_chunk_boundaries_at_every_offset_mod_kpool(tmp_path, kp):
    topk, length, budgets = CHUNK_CASES[kp]
    ckpt, hf = make_pair(tmp_path, seed=40 + kp, text_overrides={**STACK, **NO_TIES, "index_kpool": kp,
                                                                 "index_topk": topk})
    vocab = hf.config.text_config.vocab_size
    prompt = random_prompt(length, vocab, seed=kp)
    ref = hf_greedy(hf, prompt, 16)
    offsets_seen: set[int] = set()
    inside_pool_sparse: list[int] = []
    for budget in budgets:
        eng = engine(ckpt, max_num_batched_tokens=budget, block_size=max(16, kp))
        log = record_schedule(eng)
        assert engine_greedy(eng, [prompt], 16)[0] == ref, f"max_num_batched_tokens={budget}"
        starts = [c["start"] for s in log for c in s if not c["decode"]]
        assert starts[:2] == [0, budget], f"first prefill chunk boundary should be at {budget}, got {starts}"
        offsets_seen.update(b % kp for b in starts[1:])
        # a boundary inside a pool whose first query already ranks pools (more complete pools than
        # it may select): the chunk must resume the pool from the cached tail and score pools
        inside_pool_sparse += [b for b in starts[1:] if b % kp and (b + 1) // kp > topk // kp]
    assert offsets_seen == set(range(kp)), f"chunk boundaries covered offsets {sorted(offsets_seen)} of 0..{kp - 1}"
    assert inside_pool_sparse, "no chunk boundary fell inside a pool in the sparse regime"


# ---------------------------------------------------------------------------------------------
# 3. long prompts over many non-contiguous, interleaved blocks (the upstream pool-slot corruption)
# ---------------------------------------------------------------------------------------------
LONG_LENGTHS = (100, 131, 90)  # ≥ 8 blocks of 8 tokens and ≥ 16 pools (8 blocks' worth) each
LONG_NEW = 16
LONG_BLOCK = 8                 # = 2 × kpool
LONG_NUM_BLOCKS = 128


def long_run(ckpt: Path, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[dict]]]:
    """All long prompts together, small token budget, block free list shuffled (seeded) first."""
    eng = engine(ckpt, block_size=LONG_BLOCK, num_cache_blocks=LONG_NUM_BLOCKS, max_num_batched_tokens=24)
    # shuffle the low half only: ids stay small enough that the "contiguous" wrong mapping below
    # stays inside the pool-key tensor (an index error would not prove the test has teeth)
    low = list(range(LONG_NUM_BLOCKS // 2))
    random.Random(7).shuffle(low)
    eng.blocks.allocate(LONG_NUM_BLOCKS)
    eng.blocks.free(low + list(range(LONG_NUM_BLOCKS // 2, LONG_NUM_BLOCKS)))  # freed in this order = handed out so
    log = record_schedule(eng)
    return engine_greedy(eng, prompts, LONG_NEW), log


@pytest.fixture(scope="module")
def long_case(default_pair):
    ckpt, hf = default_pair
    vocab = hf.config.text_config.vocab_size
    prompts = [random_prompt(n, vocab, seed=900 + n) for n in LONG_LENGTHS]
    return prompts, [hf_greedy(hf, p, LONG_NEW) for p in prompts]


def test_long_prompts_on_interleaved_blocks_match_transformers(default_pair, long_case):
    ckpt, hf = default_pair
    kp = hf.config.text_config.index_kpool
    assert LONG_BLOCK == 2 * kp
    prompts, ref = long_case
    got, log = long_run(ckpt, prompts)
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g == r, f"long prompt {i} (length {len(prompts[i])})"
    final = {}
    for step in log:
        for c in step:
            final[c["rid"]] = c["blocks"]
    tables = list(final.values())
    assert len(tables) == len(prompts)
    for t, n in zip(tables, LONG_LENGTHS):
        assert len(t) >= 8 and n // kp >= 8 * (LONG_BLOCK // kp), "the prompt must span ≥ 8 blocks and their pools"
        assert not is_contiguous(t), f"block table {t} is contiguous: the test would not see a bad mapping"
    spans = sorted((min(t), max(t)) for t in tables)
    assert any(a[1] > b[0] for a, b in zip(spans, spans[1:])), "block ranges of the requests do not interleave"


def _contiguous_assumption(self, block_table, pools):
    """Wrong: assumes a request's blocks are consecutive from its first one."""
    return block_table[0] * self.pools_per_block + pools


def _forgot_pool_stride(self, block_table, pools):
    """Wrong: indexes pools by block id without the pools-per-block stride (neighbouring blocks collide)."""
    first = pools * self.kpool
    return block_table[first // self.block_size] + (first % self.block_size) // self.kpool


@pytest.mark.parametrize("wrong", [_contiguous_assumption, _forgot_pool_stride], ids=["contiguous", "no-stride"])
def test_wrong_pool_slot_mapping_is_caught(default_pair, long_case, monkeypatch, wrong):
    """The long-prompt test has teeth: a plausible wrong pool-slot formula changes the tokens."""
    ckpt, _ = default_pair
    prompts, ref = long_case
    monkeypatch.setattr(HybridCache, "pool_slots", wrong)
    got, _ = long_run(ckpt, prompts)
    assert got != ref, f"pool_slots={wrong.__name__} went unnoticed"


# ---------------------------------------------------------------------------------------------
# 4. images and video
# ---------------------------------------------------------------------------------------------
class MMPrompts:
    """Builds GLM placeholder prompts and pixel tensors for the tiny checkpoint."""

    def __init__(self, ckpt: Path, hf):
        from tokenizers import Tokenizer
        from transformers import AutoImageProcessor

        self.tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
        self.proc = AutoImageProcessor.from_pretrained(str(ckpt))
        cfg = hf.config
        ids = {name: self.tok.token_to_id(name) for name in (
            "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>", "<|image|>")}
        assert ids["<|image|>"] == cfg.image_token_id and ids["<|begin_of_image|>"] == cfg.image_start_token_id
        assert ids["<|begin_of_video|>"] == cfg.video_start_token_id
        assert ids["<|end_of_video|>"] == cfg.video_end_token_id
        self.ids = ids
        self.merge = cfg.vision_config.spatial_merge_size ** 2
        vc = cfg.vision_config
        self.patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
        self.text_vocab = self.tok.token_to_id("<|endoftext|>")  # BPE ids lie below the special tokens

    def text(self, n: int, seed: int) -> list[int]:
        return random_prompt(n, self.text_vocab, seed)

    def image(self, width: int, height: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image

        rng = np.random.default_rng(seed)
        im = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        out = self.proc(images=[im], return_tensors="pt")
        return out["pixel_values"].float(), out["image_grid_thw"]

    def video(self, t: int, h: int, w: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(t * h * w, self.patch_dim, generator=g), torch.tensor([[t, h, w]])

    def image_tokens(self, grid: torch.Tensor) -> list[int]:
        n = int(grid.prod()) // self.merge
        return [self.ids["<|begin_of_image|>"]] + [self.ids["<|image|>"]] * n + [self.ids["<|end_of_image|>"]]

    def video_tokens(self, grid: torch.Tensor) -> list[int]:
        t, h, w = (int(x) for x in grid.view(-1))
        out = [self.ids["<|begin_of_video|>"]]
        for i in range(t):
            out += [self.ids["<|begin_of_image|>"]] + [self.ids["<|image|>"]] * (h * w // self.merge)
            out += [self.ids["<|end_of_image|>"]] + self.tok.encode(f"{i * 1.0:.1f} seconds",
                                                                     add_special_tokens=False).ids
        return out + [self.ids["<|end_of_video|>"]]


def mm_request(ids: list[int], images: list[tuple[torch.Tensor, torch.Tensor]] = (),
               video: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[PromptInput, dict]:
    """The engine's preprocessed prompt and transformers' forward kwargs for the same inputs."""
    hf_kw: dict = {}
    if images:
        hf_kw["pixel_values"] = torch.cat([p for p, _ in images])
        hf_kw["image_grid_thw"] = torch.cat([g for _, g in images])
    if video is not None:
        hf_kw["pixel_values_videos"], hf_kw["video_grid_thw"] = video
    ours = PromptInput(mm_inputs={"input_ids": torch.tensor(ids), **{k: v.clone() for k, v in hf_kw.items()}})
    return ours, hf_kw


@pytest.fixture(scope="module")
def mm_case(default_pair):
    ckpt, hf = default_pair
    b = MMPrompts(ckpt, hf)
    img_a, img_b = b.image(56, 56, seed=1), b.image(84, 56, seed=2)
    vid = b.video(2, 4, 4, seed=3)
    two_images = b.text(3, 1) + b.image_tokens(img_a[1]) + b.text(4, 2) + b.image_tokens(img_b[1]) + b.text(5, 3)
    image_video = b.text(6, 4) + b.image_tokens(img_b[1]) + b.text(2, 5) + b.video_tokens(vid[1]) + b.text(7, 6)
    reqs = [mm_request(two_images, images=[img_a, img_b]), mm_request(image_video, images=[img_b], video=vid)]
    refs = [hf_greedy(hf, p.mm_inputs["input_ids"].tolist(), 16, **kw) for p, kw in reqs]
    return b, reqs, refs, img_a


@pytest.mark.parametrize("budget", [256, 7], ids=["one-chunk", "chunked-through-placeholders"])
def test_image_and_video_prompts_match_transformers(default_pair, mm_case, budget):
    ckpt, _ = default_pair
    _, reqs, refs, _ = mm_case
    eng = engine(ckpt, max_num_batched_tokens=budget)
    log = record_schedule(eng)
    got = engine_greedy(eng, [p for p, _ in reqs], 16)
    assert got[0] == refs[0], "two-image request"
    assert got[1] == refs[1], "image + video request"
    # media are encoded when their request is first scheduled: one batched tower call per such step
    first_steps = {min(i for i, s in enumerate(log) if any(c["rid"] == rid for c in s))
                   for rid in {c["rid"] for s in log for c in s}}
    assert eng.runner.vision_calls == len(first_steps)
    if budget == 256:
        assert len(first_steps) == 1, "both requests should start in the same step"
    else:
        assert any(0 < c["start"] and not c["decode"] for s in log for c in s), "no chunked prefill happened"


def test_same_image_in_one_batch_uses_encoder_cache(default_pair, mm_case):
    ckpt, hf = default_pair
    b, _, _, img = mm_case
    prompts = [b.text(4, 10) + b.image_tokens(img[1]) + b.text(3, 11),
               b.text(9, 12) + b.image_tokens(img[1]) + b.text(2, 13)]
    reqs = [mm_request(p, images=[img]) for p in prompts]
    eng = engine(ckpt)
    got = engine_greedy(eng, [p for p, _ in reqs], 12)
    for (p, kw), g in zip(reqs, got):
        assert g == hf_greedy(hf, p.mm_inputs["input_ids"].tolist(), 12, **kw)
    assert eng.runner.vision_calls == 1, "both requests' image should go through one tower call"
    assert eng.runner.encoder_cache.hits == 1, "the repeated image should be served from the encoder cache"
    assert eng.runner.encoder_cache.misses == 1
    # a later request with the same image: no tower call at all
    hits = eng.runner.encoder_cache.hits
    assert engine_greedy(eng, [mm_request(prompts[0], images=[img])[0]], 12)[0] == got[0]
    assert eng.runner.vision_calls == 1 and eng.runner.encoder_cache.hits == hits + 1


# ---------------------------------------------------------------------------------------------
# 5. the `glm5 generate` command
# ---------------------------------------------------------------------------------------------
def glm5_generate(args: list[str], home: Path) -> dict:
    """Run ``glm5 generate ... --json`` in a subprocess (HOME redirected) and parse its last stdout line."""
    script = Path(sys.executable).with_name("glm5")
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "glm5.cli"]
    env = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"), "OMP_NUM_THREADS": "1"}  # see one_thread
    proc = subprocess.run(cmd + ["--log-level", "WARNING", "generate", *args, "--temperature", "0", "--dtype",
                                 "float32", "--device", "cpu", "--json"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"glm5 generate failed:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cli_generate_on_default_tiny_checkpoint(tmp_path):
    from transformers import Glm5NextForConditionalGeneration

    from glm5.tokenizer import load_tokenizer

    n = 12
    by_ids = glm5_generate(["--prompt-ids", "1,2,3", "--max-tokens", str(n), "--ignore-eos"], tmp_path)
    ckpt = tmp_path / ".cache" / "glm5" / "tiny-checkpoint"
    assert (ckpt / "config.json").is_file(), "glm5 generate should create the default checkpoint"
    hf = Glm5NextForConditionalGeneration.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    hf.config.text_config._attn_implementation = "eager"
    assert by_ids["token_ids"] == hf_greedy(hf, [1, 2, 3], n)
    assert by_ids["finish_reason"] == "length"

    text = "Hello world!"  # short, like --prompt-ids 1,2,3: the default checkpoint's 4 index heads tie in the
    # sparse regime (see NO_TIES); prompt + output stay ≤ index_topk + kpool - 1 tokens (dense selection)
    by_text = glm5_generate([text, "--max-tokens", str(n), "--ignore-eos"], tmp_path)
    tok = load_tokenizer(ckpt)
    ids = tok.encode(text, add_special_tokens=False)
    assert by_text["token_ids"] == hf_greedy(hf, ids, n)
    assert by_text["finish_reason"] == "length"
    assert by_text["text"] == tok.decode(by_text["token_ids"], skip_special_tokens=True)


#: model-spec §11.1: the tiny config transformers itself builds (its own layer_types default).
SPEC_TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=8,
                 num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                 num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=2.5, kv_lora_rank=32,
                 q_lora_rank=48, qk_rope_head_dim=0, qk_nope_head_dim=32, v_head_dim=32, index_topk=8,
                 index_head_dim=32, index_kpool=4, linear_head_dim=16, linear_num_heads=4,
                 linear_conv_kernel_dim=4, hc_mult=4, pad_token_id=0, mlp_layer_types=["dense"] * 2 + ["sparse"] * 6,
                 **NO_TIES)  # §11.1 has 4 index heads; 16 keep the sparse-regime oracle well defined
SPEC_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                   projection_intermediate_size=48)


def test_cli_generate_on_save_pretrained_checkpoint(tmp_path):
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    torch.manual_seed(0)
    hf = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=SPEC_TEXT, vision_config=SPEC_VISION))
    with torch.no_grad():  # §11.1: randomize every parameter (and the router bias buffer)
        for name, t in list(hf.named_parameters()) + [(n, b) for n, b in hf.named_buffers()
                                                       if n.endswith("e_score_correction_bias")]:
            t.copy_(random_tensor(name, t.shape, seed=5).to(t.dtype))
    hf.config.text_config._attn_implementation = "eager"
    hf.eval()
    ckpt = tmp_path / "hf_saved"
    hf.save_pretrained(str(ckpt))
    prompt = random_prompt(40, SPEC_TEXT["vocab_size"], seed=4)  # 40 > 3·topk: sparse regime
    n = 16
    out = glm5_generate(["--model", str(ckpt), "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", str(n),
                         "--ignore-eos", "--block-size", "16"], tmp_path)
    assert out["token_ids"] == hf_greedy(hf, prompt, n)
    assert out["finish_reason"] == "length"
    assert out["text"] == "", "a checkpoint without tokenizer produces token ids only"


def test_one_token_chunks_of_a_media_prompt_on_the_batched_decode_path(default_pair, mm_case):
    """A media prompt scheduled one token per step (budget 1) looks like a decode step to the batched path;
    its placeholders must still get their vision embeddings (the batched path defers to prepare())."""
    ckpt, _ = default_pair
    _, reqs, refs, _ = mm_case
    eng = engine(ckpt, max_num_batched_tokens=1, decode_path="batched")
    got = engine_greedy(eng, [reqs[0][0]], 16)
    assert got[0] == refs[0]
    assert eng.runner.vision_calls == 1
