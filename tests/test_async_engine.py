"""AsyncLLMEngine on the tiny checkpoint: concurrent streams from threads and asyncio agree with
the synchronous engine, streams end after their finished output, abort frees the cache, bad
requests fail at ``add_request`` without hurting the loop, and shutdown ends cleanly."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest

from glm5.engine import AsyncLLMEngine, EngineArgs, RequestOutput
from glm5.sampling_params import SamplingParams, SamplingParamsError

sys.path.insert(0, str(Path(__file__).parent))
from oracle import engine, random_prompt  # noqa: E402
from test_engine_core import assert_matches_reference, text_vocab, tokens_of  # noqa: E402

TIMEOUT = 120.0


def make_async(ckpt: Path, **kw) -> AsyncLLMEngine:
    args = dict(model=str(ckpt), device="cpu", dtype="float32", block_size=16, num_cache_blocks=128,
                max_num_seqs=4, max_num_batched_tokens=64, load_progress=False)
    args.update(kw)
    return AsyncLLMEngine(EngineArgs(**args))


def wait_for(cond, what: str, timeout: float = TIMEOUT) -> None:
    end = time.time() + timeout
    while not cond():
        if time.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def check_stream(rid: str, outs: list[RequestOutput]) -> None:
    assert outs and outs[-1].finished, f"{rid}: stream ended without a finished output"
    assert not any(o.finished for o in outs[:-1]), f"{rid}: outputs after the finished one"


def test_concurrent_thread_and_asyncio_streams_match_sync_engine(tiny_checkpoint_dir: Path) -> None:
    ckpt = tiny_checkpoint_dir
    sync = engine(ckpt)
    vocab = text_vocab(sync)
    reqs = {}
    for i in range(12):
        params = (SamplingParams(temperature=0.0, max_tokens=5 + i % 4) if i % 2 == 0 else
                  SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=5 + i % 4, ignore_eos=True))
        reqs[f"q{i}"] = (random_prompt(3 + 2 * i, vocab, seed=600 + i), params)
    ref = {rid: sync.generate([p], sp)[0] for rid, (p, sp) in reqs.items()}

    eng = make_async(ckpt)
    results: dict[str, list[RequestOutput]] = {}
    errors: list[BaseException] = []

    def thread_worker(rids: list[str]) -> None:
        try:
            streams = [(rid, eng.add_request(rid, *reqs[rid])) for rid in rids]
            for rid, stream in streams:
                results[rid] = list(stream)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    async def consume(rid: str) -> None:
        stream = eng.add_request(rid, *reqs[rid])
        results[rid] = [o async for o in stream]

    async def async_main(rids: list[str]) -> None:
        await asyncio.gather(*(consume(r) for r in rids))

    def asyncio_worker(rids: list[str]) -> None:
        try:
            asyncio.run(async_main(rids))
        except BaseException as e:
            errors.append(e)

    rids = list(reqs)
    workers = [threading.Thread(target=thread_worker, args=(rids[k:k + 2],)) for k in range(0, 6, 2)]
    workers.append(threading.Thread(target=asyncio_worker, args=(rids[6:],)))
    for w in workers:
        w.start()
    seen_running = seen_waiting = 0
    while any(w.is_alive() for w in workers):
        s = eng.stats()
        assert s.running <= 4
        seen_running, seen_waiting = max(seen_running, s.running), max(seen_waiting, s.waiting)
        time.sleep(0.005)
    for w in workers:
        w.join(TIMEOUT)
    assert not errors, errors
    assert seen_running > 0 and seen_waiting > 0, "stats() never showed running and waiting requests"

    cases = []
    for rid, (prompt, params) in reqs.items():
        check_stream(rid, results[rid])
        got = tokens_of(results[rid])
        cases.append((rid, prompt, params, got, ref[rid].token_ids))
        if got == ref[rid].token_ids:
            assert "".join(o.text for o in results[rid]) == ref[rid].text
            assert results[rid][-1].finish_reason == ref[rid].finish_reason
    assert_matches_reference(ckpt, cases, max_sensitive=1)

    wait_for(lambda: eng.stats().finished_total == 12, "stats to show 12 finished requests")
    s = eng.stats()
    assert (s.running, s.waiting, s.cache_usage, s.free_state_slots) == (0, 0, 0.0, 4)
    eng.shutdown()
    assert not eng._thread.is_alive()


def test_async_abort_running_and_waiting(tiny_checkpoint_dir: Path) -> None:
    ckpt = tiny_checkpoint_dir
    eng = make_async(ckpt, max_num_seqs=2)
    vocab = text_vocab(eng.engine)
    long = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
    prompts = {r: random_prompt(6 + i, vocab, seed=700 + i) for i, r in enumerate("ABCD")}
    params = {"A": long, "B": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), "C": long,
              "D": SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)}
    streams = {r: eng.add_request(r, prompts[r], params[r]) for r in "ABCD"}
    it_a = iter(streams["A"])
    first = next(it_a)  # A is generating; C cannot start before A or B finishes (max_num_seqs=2)
    assert not first.finished
    eng.abort("A")
    eng.abort("C")
    outs = {"A": [first, *it_a]}
    for r in "BCD":
        outs[r] = list(streams[r])
    for r in "ABCD":
        check_stream(r, outs[r])
    assert outs["A"][-1].finish_reason == "abort" and outs["C"][-1].finish_reason == "abort"
    assert tokens_of(outs["C"]) == []
    assert outs["B"][-1].finish_reason == "length" and len(tokens_of(outs["B"])) == 24
    assert outs["D"][-1].finish_reason == "length" and len(tokens_of(outs["D"])) == 5
    ref = engine(ckpt)
    assert_matches_reference(ckpt, [(r, prompts[r], params[r], tokens_of(outs[r]),
                                     ref.generate([prompts[r]], params[r])[0].token_ids) for r in "BD"],
                             max_sensitive=1)
    wait_for(lambda: eng.stats().finished_total + eng.stats().aborted_total == 4, "all requests to end")
    s = eng.stats()
    assert (s.running, s.waiting, s.cache_usage, s.free_state_slots, s.aborted_total) == (0, 0, 0.0, 2, 2)
    eng.shutdown()


def test_async_rejects_bad_requests_and_keeps_serving(tiny_checkpoint_dir: Path) -> None:
    eng = make_async(tiny_checkpoint_dir, max_model_len=32)
    bad = SamplingParams(temperature=0.0, max_tokens=3)
    bad.top_p = 1.5
    with pytest.raises(SamplingParamsError, match="'top_p'"):
        eng.add_request("bad", [1, 2, 3], bad)
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request("long", list(range(1, 41)), SamplingParams(max_tokens=3))
    stream = eng.add_request("ok", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    with pytest.raises(ValueError, match="ok"):
        eng.add_request("ok", [4, 5], SamplingParams(max_tokens=3))
    outs = list(stream)
    check_stream("ok", outs)
    assert len(tokens_of(outs)) == 3
    eng.shutdown()


def test_shutdown_ends_inflight_streams_and_refuses_new_requests(tiny_checkpoint_dir: Path) -> None:
    eng = make_async(tiny_checkpoint_dir)
    stream = eng.add_request("long", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True))
    it = iter(stream)
    assert not next(it).finished
    eng.shutdown()
    assert not eng._thread.is_alive()
    rest = list(it)  # must end, not hang
    assert rest and rest[-1].finished and rest[-1].finish_reason == "abort"
    box: dict = {}

    def late_add() -> None:
        try:
            eng.add_request("late", [1, 2], SamplingParams(max_tokens=2))
        except RuntimeError as e:
            box["error"] = e

    t = threading.Thread(target=late_add, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "add_request after shutdown blocked forever"
    assert "shut down" in str(box.get("error"))


def test_cancelled_async_consumer_does_not_steal_outputs(tiny_checkpoint_dir: Path) -> None:
    """Cancelling an ``async for`` while it waits must not leave a waiter behind that swallows a
    later output: a new iteration of the same stream still receives every output."""
    eng = make_async(tiny_checkpoint_dir, max_num_seqs=1)
    blocker = eng.add_request("blocker", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True))
    stream = eng.add_request("c", [9, 8, 7, 6], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))

    async def main() -> list[RequestOutput]:
        task = asyncio.ensure_future(stream.__aiter__().__anext__())  # "c" is queued: this waits
        await asyncio.sleep(0.2)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        eng.abort("blocker")  # now "c" runs
        return [o async for o in stream]

    outs = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    check_stream("c", outs)
    assert len(tokens_of(outs)) == 6
    assert list(blocker)[-1].finish_reason == "abort"
    eng.shutdown()
