"""Admission validation and failure isolation in the engine (CPU, tiny checkpoint, no server).

* every prompt path is validated before the request is queued: preprocessed tensors (vocabulary,
  dtypes, shapes, finite pixels, grid <-> pixel rows <-> placeholders, caps), token ids, text and chat
  (media placeholders without media), and over-long text is refused by size without tokenizing it;
* a request whose step raises is isolated by bisection: it alone ends with ``finish_reason="error"``,
  the others finish with the tokens they would have produced without it, and no cache is leaked;
* an unrecoverable (CUDA-class) error kills the engine loudly: streams and later calls get
  ``EngineDeadError`` and the death callbacks run;
* preparing a prompt happens on the worker pool, never on the engine loop thread.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

from glm5.engine import AsyncLLMEngine, EngineArgs, EngineDeadError, LLMEngine, PromptInput, RequestFailedError
from glm5.engine.errors import is_unrecoverable
from glm5.multimodal import MediaError
from glm5.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from oracle import engine, random_prompt  # noqa: E402
from test_engine_core import assert_idle_and_empty, assert_matches_reference, drain, text_vocab, tokens_of  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def eng(tiny_checkpoint_dir: Path) -> LLMEngine:
    return engine(tiny_checkpoint_dir, max_model_len=256)


class Media:
    """Well-formed preprocessed inputs for the tiny checkpoint, to be broken one field at a time."""

    def __init__(self, eng: LLMEngine):
        c = eng.model_config
        v = c.vision
        self.c = c
        self.patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
        self.merge = v.spatial_merge_size
        self.text = random_prompt(5, text_vocab(eng), seed=1)

    def image(self, h: int = 4, w: int = 4) -> dict:
        n = h * w // self.merge ** 2
        ids = self.text + [self.c.image_start_token_id] + [self.c.image_token_id] * n + [self.c.image_end_token_id]
        return {"input_ids": np.array(ids, dtype=np.int64),
                "pixel_values": np.random.default_rng(0).standard_normal((h * w, self.patch_dim)).astype(np.float32),
                "image_grid_thw": np.array([[1, h, w]], dtype=np.int64)}

    def video(self, t: int = 2, h: int = 4, w: int = 4) -> dict:
        c, n = self.c, h * w // self.merge ** 2
        ids = self.text + [c.video_start_token_id]
        for _ in range(t):
            ids += [c.image_start_token_id] + [c.image_token_id] * n + [c.image_end_token_id]
        ids += [c.video_end_token_id]
        return {"input_ids": np.array(ids, dtype=np.int64),
                "pixel_values_videos": np.ones((t * h * w, self.patch_dim), dtype=np.float32),
                "video_grid_thw": np.array([[t, h, w]], dtype=np.int64)}


def _broken(media: Media, case: str) -> dict:
    d = media.image()
    c = media.c
    if case == "oov_id":
        d["input_ids"][0] = c.text.vocab_size
    elif case == "negative_id":
        d["input_ids"][1] = -3
    elif case == "float_ids":
        d["input_ids"] = d["input_ids"].astype(np.float32)
    elif case == "ids_2d":
        d["input_ids"] = np.stack([d["input_ids"], d["input_ids"]])
    elif case == "rows_vs_grid":
        d["pixel_values"] = d["pixel_values"][:-1]
    elif case == "patch_dim":
        d["pixel_values"] = d["pixel_values"][:, :-2]
    elif case == "nan_pixels":
        d["pixel_values"][3, 5] = np.nan
    elif case == "int_pixels":
        d["pixel_values"] = d["pixel_values"].astype(np.int64)
    elif case == "grid_width":
        d["image_grid_thw"] = np.array([[4, 4]], dtype=np.int64)
    elif case == "grid_not_merge_multiple":
        d["image_grid_thw"] = np.array([[1, 2, 8]], dtype=np.int64) * np.array([[1, 1, 1]])
        d["image_grid_thw"][0, 1] = 3
        d["pixel_values"] = d["pixel_values"][:24]
    elif case == "grid_zero":
        d["image_grid_thw"] = np.array([[0, 4, 4]], dtype=np.int64)
    elif case == "pixels_without_grid":
        del d["image_grid_thw"]
    elif case == "grid_without_pixels":
        del d["pixel_values"]
    elif case == "too_few_placeholders":
        d["input_ids"] = np.delete(d["input_ids"], np.nonzero(d["input_ids"] == c.image_token_id)[0][0])
    elif case == "no_placeholders":
        d["input_ids"] = np.array(media.text, dtype=np.int64)
    elif case == "unexpanded_video_token":
        d["input_ids"] = np.append(d["input_ids"], c.video_token_id)
    elif case == "unbalanced_video_span":
        d["input_ids"] = np.append(d["input_ids"], c.video_start_token_id)
    elif case == "too_many_visual_tokens":
        d = media.image(h=8, w=8)   # 16 tokens > the cap below
    else:
        raise AssertionError(case)
    return d


BROKEN = ["oov_id", "negative_id", "float_ids", "ids_2d", "rows_vs_grid", "patch_dim", "nan_pixels", "int_pixels",
          "grid_width", "grid_not_merge_multiple", "grid_zero", "pixels_without_grid", "grid_without_pixels",
          "too_few_placeholders", "no_placeholders", "unexpanded_video_token", "unbalanced_video_span",
          "too_many_visual_tokens"]


@pytest.fixture(scope="module")
def capped(tiny_checkpoint_dir: Path) -> LLMEngine:
    return engine(tiny_checkpoint_dir, max_model_len=256, media_caps={"max_visual_tokens": 8, "max_images": 2})


@pytest.mark.parametrize("case", BROKEN)
def test_preprocessed_tensors_are_validated_at_admission(capped: LLMEngine, case: str) -> None:
    """Each of these passed admission before and failed inside a step (killing the engine loop)."""
    media = Media(capped)
    with pytest.raises(ValueError) as err:
        capped.add_request(f"bad-{case}", PromptInput(mm_inputs=_broken(media, case)), GREEDY)
    assert str(err.value), case
    assert not capped.has_unfinished() and capped.stats().waiting == 0
    # the same engine still takes a well-formed image and video request and finishes them
    capped.add_request(f"ok-img-{case}", PromptInput(mm_inputs=media.image()), GREEDY)
    capped.add_request(f"ok-vid-{case}", PromptInput(mm_inputs={**media.video(t=1, h=4, w=4)}), GREEDY)
    outs = drain(capped)
    assert {r: o[-1].finish_reason for r, o in outs.items()} == {f"ok-img-{case}": "length",
                                                                 f"ok-vid-{case}": "length"}
    assert_idle_and_empty(capped)


def test_preprocessed_errors_name_the_tensor(capped: LLMEngine) -> None:
    media = Media(capped)
    expect = {"oov_id": "outside the vocabulary", "rows_vs_grid": "image_grid_thw describes 16 patch rows",
              "nan_pixels": "NaN", "too_few_placeholders": "placeholder", "grid_not_merge_multiple": "merge size 2",
              "pixels_without_grid": "without image_grid_thw", "too_many_visual_tokens": "max_visual_tokens"}
    for case, needle in expect.items():
        with pytest.raises(MediaError, match=needle):
            capped.add_request("x", PromptInput(mm_inputs=_broken(media, case)), GREEDY)


def test_media_placeholders_without_media_are_rejected(eng: LLMEngine) -> None:
    c = eng.model_config
    with pytest.raises(MediaError, match="no image or video was sent"):
        eng.add_request("t", PromptInput(text="look at <|begin_of_image|><|image|><|end_of_image|> this"), GREEDY)
    with pytest.raises(MediaError, match="no image or video was sent"):
        eng.add_request("c", PromptInput(messages=[{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "what is this?"}]}]), GREEDY)
    with pytest.raises(MediaError, match="placeholder"):  # the Triton input_ids tensor: placeholders mean media
        eng.add_request("i", PromptInput(mm_inputs={"input_ids": np.array([5, c.image_token_id, 7])}), GREEDY)
    assert not eng.has_unfinished()
    # raw token ids keep transformers' meaning (a placeholder id without pixels is an ordinary token)
    assert eng.generate([PromptInput(token_ids=[5, c.image_token_id, 7])], GREEDY)[0].finish_reason == "length"


def test_oversized_text_is_rejected_by_size_without_tokenizing(eng: LLMEngine, monkeypatch) -> None:
    """The bound is max_model_len x the longest token's bytes; text above it never reaches the tokenizer."""
    bound = eng.prompts.max_prompt_bytes
    assert bound == eng.max_model_len * eng.prompts.max_token_bytes
    calls = []
    real = eng.tokenizer.encode
    monkeypatch.setattr(eng.tokenizer, "encode", lambda *a, **k: calls.append(len(a[0])) or real(*a, **k))
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"10,485,760 bytes.*max_model_len=256"):
        eng.add_request("huge", "x" * (10 * 2**20), GREEDY)
    assert time.perf_counter() - start < 1.0 and calls == []
    # just under the bound is tokenized and then refused by its token count (or accepted if it fits)
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request("long", "word " * (bound // 5), GREEDY)
    assert calls and calls[-1] <= bound


# ---------------------------------------------------------------------- failure isolation
def _run_with_poison(ckpt: Path, poison_token: int, n_good: int) -> tuple[dict, LLMEngine, dict]:
    eng = engine(ckpt, max_num_seqs=8, test_faults={"request_error_token_id": poison_token})
    vocab = text_vocab(eng)
    good = {f"g{i}": [t for t in random_prompt(6 + i, vocab, seed=50 + i) if t != poison_token] for i in range(n_good)}
    params = {r: SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, seed=None if i % 2 == 0 else 7 + i,
                                max_tokens=10, ignore_eos=True) for i, r in enumerate(good)}
    outs: dict = defaultdict(list)
    for r, p in good.items():
        eng.add_request(r, p, params[r])
    for _ in range(3):   # the good requests are decoding (their caches hold state) when the poison arrives
        for o in eng.step():
            outs[o.request_id].append(o)
    eng.add_request("poison", [3, poison_token, 4], SamplingParams(temperature=0.0, max_tokens=10))
    drain(eng, outs)
    return outs, eng, {"prompts": good, "params": params}


def test_a_failing_request_is_isolated_and_the_others_finish_unchanged(tiny_checkpoint_dir: Path) -> None:
    poison = 11
    outs, eng, case = _run_with_poison(tiny_checkpoint_dir, poison, n_good=5)
    last = outs["poison"][-1]
    assert last.finished and last.finish_reason == "error" and "injected request fault" in last.error
    assert eng.stats().failed_total == 1
    ref = engine(tiny_checkpoint_dir, max_num_seqs=8)
    cases = []
    for r, prompt in case["prompts"].items():
        o = outs[r]
        assert o[-1].finish_reason == "length" and o[-1].error is None, r
        assert len(tokens_of(o)) == 10, r
        cases.append((r, prompt, case["params"][r], tokens_of(o),
                      ref.generate([prompt], case["params"][r])[0].token_ids))
    assert_matches_reference(tiny_checkpoint_dir, cases, max_sensitive=1)
    assert_idle_and_empty(eng)
    # the engine keeps serving, and the poisoned request could be retried once its input is fixed
    assert eng.generate([[3, 5, 4]], GREEDY)[0].finish_reason == "length"


def test_unrecoverable_errors_are_classified() -> None:
    assert is_unrecoverable(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_unrecoverable(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasGemmEx"))
    assert is_unrecoverable(torch.AcceleratorError("device-side assert triggered")) if hasattr(
        torch, "AcceleratorError") else True
    wrapped = ValueError("step failed")
    wrapped.__cause__ = RuntimeError("CUDA error: unspecified launch failure")
    assert is_unrecoverable(wrapped)
    assert not is_unrecoverable(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_unrecoverable(IndexError("index 99 is out of bounds"))
    assert not is_unrecoverable(RuntimeError("shape '[2, 3]' is invalid for input of size 5"))


def test_a_device_failure_kills_the_async_engine_loudly(tiny_checkpoint_dir: Path) -> None:
    fatal = 13
    args = EngineArgs(model=str(tiny_checkpoint_dir), device="cpu", dtype="float32", block_size=16,
                      num_cache_blocks=64, max_num_seqs=4, max_num_batched_tokens=64, load_progress=False,
                      test_faults={"fatal_error_token_id": fatal})
    eng = AsyncLLMEngine(args)
    died = threading.Event()
    seen: list[BaseException] = []
    eng.on_dead(lambda e: (seen.append(e), died.set()))
    ok = eng.add_request("ok", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert [o.finished for o in ok][-1]
    long = eng.add_request("long", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=5000, ignore_eos=True))
    it = iter(long)
    next(it)
    eng.add_request("killer", [4, fatal, 5], SamplingParams(max_tokens=4))
    assert died.wait(30), "the death callback did not run"
    assert isinstance(seen[0], EngineDeadError) and "CUDA error" in str(seen[0])
    with pytest.raises(EngineDeadError):
        list(it)                      # the in-flight stream ends with the error, it does not hang
    with pytest.raises(EngineDeadError, match="restart"):
        eng.add_request("later", [1, 2], SamplingParams(max_tokens=2))
    late = []
    eng.on_dead(late.append)          # registering after death calls back at once
    assert late and late[0] is eng.error
    eng.shutdown()


def test_a_failed_request_stream_raises_and_the_loop_serves_on(tiny_checkpoint_dir: Path) -> None:
    args = EngineArgs(model=str(tiny_checkpoint_dir), device="cpu", dtype="float32", block_size=16,
                      num_cache_blocks=64, max_num_seqs=4, max_num_batched_tokens=64, load_progress=False,
                      test_faults={"request_error_token_id": 17})
    eng = AsyncLLMEngine(args)
    bad = eng.add_request("bad", [4, 17, 5], SamplingParams(max_tokens=4))
    with pytest.raises(RequestFailedError, match="injected request fault"):
        list(bad)
    good = list(eng.add_request("good", [4, 18, 5], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)))
    assert good[-1].finish_reason == "length" and eng.error is None
    time.sleep(0.6)
    assert eng.stats().failed_total == 1 and eng.stats().cache_usage == 0.0
    eng.shutdown()


def test_prompts_are_prepared_on_the_worker_pool_not_the_engine_loop(tiny_checkpoint_dir: Path) -> None:
    """A slow prompt (a huge chat render, a long video) delays only itself: the engine loop keeps
    stepping the other streams while it is being prepared."""
    args = EngineArgs(model=str(tiny_checkpoint_dir), device="cpu", dtype="float32", block_size=16,
                      num_cache_blocks=64, max_num_seqs=4, max_num_batched_tokens=64, load_progress=False)
    eng = AsyncLLMEngine(args)
    threads: list[str] = []
    real = eng.engine.prompts.process

    def slow_process(prompt):
        threads.append(threading.current_thread().name)
        if prompt.text == "slow":
            time.sleep(2.0)
        return real(prompt)

    eng.engine.prompts.process = slow_process
    stream = eng.add_request("fast", "a", SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    got: dict = {}
    t = threading.Thread(target=lambda: got.setdefault("slow", list(eng.add_request(
        "slow-req", "slow", SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)))))
    stamps = []
    it = iter(stream)
    stamps.append(time.perf_counter())
    next(it)
    t.start()
    for _ in it:
        stamps.append(time.perf_counter())
    t.join(30)
    gaps = np.diff(stamps)
    assert got["slow"][-1].finish_reason == "length"
    assert all(n.startswith("glm5-prepare") for n in threads), threads
    # the fast stream's longest gap stays far below the 2 s the slow prompt took to prepare
    assert gaps.max() < 1.0, f"max inter-token gap {gaps.max():.3f}s while another prompt was being prepared"
    eng.shutdown()


# ---------------------------------------------------------------------- on the GPU
_DEVICE_ASSERT = """
import sys, torch
from glm5.engine.errors import is_unrecoverable
x = torch.zeros(4, device="cuda")
try:
    x[torch.tensor([10], device="cuda")].sum().item()    # out-of-bounds gather: device-side assert
    torch.cuda.synchronize()
except Exception as exc:
    print(type(exc).__name__, is_unrecoverable(exc))
    sys.exit(0)
print("no error")
"""


@pytest.mark.gpu
def test_a_real_device_side_assert_is_classified_unrecoverable() -> None:
    """On CUDA an out-of-bounds index poisons the context; the classification must call it fatal (run in
    a subprocess because the context stays broken for the life of the process)."""
    import subprocess

    proc = subprocess.run([sys.executable, "-c", _DEVICE_ASSERT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    name, verdict = proc.stdout.strip().splitlines()[-1].split()
    assert verdict == "True", proc.stdout


@pytest.mark.gpu
def test_cache_budget_above_free_device_memory_is_refused(tiny_checkpoint_dir: Path) -> None:
    from glm5.cache.memory import CacheBudgetError

    free = torch.cuda.mem_get_info()[0]
    with pytest.raises(CacheBudgetError, match="exceeds the free device memory"):
        engine(tiny_checkpoint_dir, device="cuda", dtype="bfloat16", num_cache_blocks=None,
               cache_memory_gb=2 * free / 2**30, enforce_eager=True)
