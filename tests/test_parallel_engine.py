"""The distributed engine on the CPU (gloo), 2 and 4 processes, against the single-process engine.

Every run uses the tiny checkpoint (every parameter random) with chunked prefill (16-token budget) and a cache
small enough that requests are preempted, and compares greedy tokens with one single-process reference run. One
engine per layout: TP=2 (through the async engine, then a worker is killed), TP=4 (then prefix-cache hits), TP=2 + EP
with the all-to-all dispatch and MTP drafts, EP alone (TP=1, EP=2) with EPLB rebalancing, and two "machines" (the second a separate
process tree started by ``glm5 worker``). After each engine no worker process is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from glm5.engine import AsyncLLMEngine, EngineArgs, LLMEngine
from glm5.engine.errors import EngineDeadError, RequestFailedError
from glm5.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

N_NEW = 20
FAULT_TOKEN = 500   # test_faults trigger of the TP=2 async engine (in no reference prompt)
PROMPTS = [[5, 17, 33, 2, 9, 100, 7] * 6, [3, 4, 5], list(range(40, 110))]
SETTINGS = dict(device="cpu", dtype="float32", block_size=16, num_cache_blocks=11, max_num_seqs=4,
                max_num_batched_tokens=16, load_progress=False)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie (/proc)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


@pytest.fixture(scope="module")
def reference(tiny_checkpoint_dir):
    eng = LLMEngine(EngineArgs(model=str(tiny_checkpoint_dir), **SETTINGS))
    tokens = [o.token_ids for o in eng.generate(PROMPTS, greedy())]
    assert eng.stats().preempted_total > 0, "the settings must make the scheduler preempt"
    return tokens


def run_distributed(ckpt: Path, **kw) -> tuple[list[list[int]], LLMEngine]:
    eng = LLMEngine(EngineArgs(model=str(ckpt), **SETTINGS, **kw))
    return [o.token_ids for o in eng.generate(PROMPTS, greedy())], eng


def shut_and_check(eng: LLMEngine) -> None:
    pids = eng.runner.worker_pids()
    eng.shutdown()
    assert pids and not any(alive(p) for p in pids), "a worker outlived its engine"


def test_tp4_matches_single_process(tiny_checkpoint_dir, reference):
    tokens, eng = run_distributed(tiny_checkpoint_dir, tensor_parallel_size=4)
    try:
        assert tokens == reference
        assert eng.stats().preempted_total > 0
        # the same prompts again: prefix-cache hits resume from state snapshots, which every rank holds for its
        # own KDA heads (the driver's snapshot copies are replayed on the workers)
        assert [o.token_ids for o in eng.generate(PROMPTS, greedy())] == reference
        assert sum(eng.kv.hits_by_kind.values()) > 0
        for rank in (1, 2, 3):   # every worker rank froze its start-up heap once ready (glm5.heap)
            assert "start-up heap frozen" in eng.runner.workers.log_tail(rank, 400), rank
    finally:
        shut_and_check(eng)


def test_tp2_ep_all2all_with_mtp_drafts_matches_single_process(tiny_checkpoint_dir, reference):
    tokens, eng = run_distributed(tiny_checkpoint_dir, tensor_parallel_size=2, enable_expert_parallel=True,
                                  ep_dispatch="all2all", num_speculative_tokens=2)
    try:
        assert tokens == reference
        spec = eng.spec_stats.to_dict()
        assert spec["steps"] > 0 and sum(spec["proposed"]) > 0   # verification steps (and their rollbacks) ran
    finally:
        shut_and_check(eng)


def test_ep_alone_eplb_rebalances_without_changing_tokens(tiny_checkpoint_dir, reference):
    tokens, eng = run_distributed(tiny_checkpoint_dir, tensor_parallel_size=1, expert_parallel_size=2,
                                  enable_eplb=True, num_redundant_experts=2, eplb_step_interval=7)
    try:
        assert tokens == reference
        moe = eng.runner.moe_layers()
        start = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
        assert any(m.experts.placement() != start for m in moe), "the periodic rebalance did not move an expert"
        report = eng.runner.rebalance_experts()          # and one on demand, then the same prompts again
        assert report.layers == len(moe)
        assert [o.token_ids for o in eng.generate(PROMPTS, greedy())] == reference
    finally:
        shut_and_check(eng)


def test_two_machines_through_glm5_worker_match_single_process(tiny_checkpoint_dir, reference):
    """Rank 1 lives in its own process tree (``glm5 worker``), joined through the env:// rendezvous."""
    from glm5.engine.worker_processes import free_port

    port = free_port("127.0.0.1")
    node = subprocess.Popen([sys.executable, "-m", "glm5.cli", "worker", "--nnodes", "2", "--node-rank", "1",
                             "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)],
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        tokens, eng = run_distributed(tiny_checkpoint_dir, tensor_parallel_size=2, nnodes=2, master_port=port)
        assert eng.runner.worker_pids() == []            # this machine started no worker: node 1 did
        assert tokens == reference
        worker_pids = children(node.pid)
        eng.shutdown()
        assert node.wait(timeout=60) == 0
        assert not any(alive(p) for p in worker_pids)
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()


@pytest.fixture(scope="module")
def tp2_async(tiny_checkpoint_dir):
    eng = AsyncLLMEngine(EngineArgs(model=str(tiny_checkpoint_dir), tensor_parallel_size=2,
                                    test_faults={"request_error_token_id": FAULT_TOKEN}, **SETTINGS))
    yield eng
    eng.shutdown()


def test_tp2_async_engine_matches_single_process(tp2_async, reference):
    streams = [tp2_async.add_request(f"r{i}", p, greedy()) for i, p in enumerate(PROMPTS)]
    tokens = [[t for out in s for t in out.token_ids] for s in streams]
    assert tokens == reference
    assert tp2_async.stats().preempted_total > 0


def test_a_request_failing_after_the_forward_is_isolated_under_tp(tp2_async, reference):
    """A request-level failure outside the distributed forward (test_faults: after the model ran) fails that
    request only; the engine re-runs the step's other requests on every rank and they keep their tokens."""
    bad = tp2_async.add_request("bad", [FAULT_TOKEN, 7, 8, 9], greedy())
    good = tp2_async.add_request("good", PROMPTS[0], greedy())
    with pytest.raises(RequestFailedError, match="injected request fault"):
        list(bad)
    assert [t for out in good for t in out.token_ids] == reference[0]


def test_killed_worker_fails_in_flight_requests_and_leaves_no_process(tp2_async):
    runner = tp2_async.engine.runner
    pids = runner.worker_pids()
    stream = tp2_async.add_request("long", list(range(5, 60)), SamplingParams(temperature=0.0, max_tokens=400,
                                                                              ignore_eos=True))
    got = []
    with pytest.raises(EngineDeadError, match=r"worker rank 1 \(pid \d+\) was killed by signal 9"):
        for out in stream:
            got.extend(out.token_ids)
            if len(got) >= 3:
                os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)
    with pytest.raises(EngineDeadError, match="the engine is dead"):
        tp2_async.add_request("after", [1, 2, 3], greedy())
    tp2_async.shutdown()
    workers_left = [c for c in children(os.getpid())
                    if b"glm5.engine.worker" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert workers_left == []


def test_cli_generate_tp2_ep_spec_matches_single_process(tiny_checkpoint_dir, reference):
    """``glm5 generate --tensor-parallel-size 2 --enable-expert-parallel --num-speculative-tokens 2 --device cpu``
    prints the single-process tokens."""
    cmd = [sys.executable, "-m", "glm5.cli", "generate", "--model", str(tiny_checkpoint_dir), "--prompt-ids",
           ",".join(map(str, PROMPTS[0])), "--max-tokens", str(N_NEW), "--temperature", "0", "--ignore-eos",
           "--device", "cpu", "--dtype", "float32", "--block-size", "16", "--num-cache-blocks", "11",
           "--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--json",
           "--tensor-parallel-size", "2", "--enable-expert-parallel", "--num-speculative-tokens", "2"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["token_ids"] == reference[0]
    assert out["speculative"]["steps"] > 0


def test_world_of_one_through_the_executor_matches_single_process(tiny_checkpoint_dir, reference):
    """``distributed=True`` at world size 1: the process group and the step messages run (collectives over one
    rank are the identity: test_parallel_units.test_one_rank_groups_skip_their_collectives_unless_asked)."""
    tokens, eng = run_distributed(tiny_checkpoint_dir, distributed=True)
    try:
        assert tokens == reference and eng.runner.worker_pids() == [] and eng.runner.par.distributed
    finally:
        eng.shutdown()


def test_a_split_that_does_not_divide_fails_before_any_process_starts(tiny_checkpoint_dir):
    from glm5.distributed.parallel_state import ParallelConfigError

    before = children(os.getpid())
    with pytest.raises(ParallelConfigError, match="tensor_parallel_size=3 does not divide num_attention_heads=4"):
        LLMEngine(EngineArgs(model=str(tiny_checkpoint_dir), tensor_parallel_size=3, **SETTINGS))
    assert children(os.getpid()) == before


def test_a_worker_dying_while_idle_stops_the_engine_before_the_next_request(tiny_checkpoint_dir):
    eng = AsyncLLMEngine(EngineArgs(model=str(tiny_checkpoint_dir), tensor_parallel_size=2, **SETTINGS))
    try:
        pids = eng.engine.runner.worker_pids()
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                eng.add_request("probe", [1, 2, 3], greedy())
            except EngineDeadError as e:
                assert "worker rank 1" in str(e)
                break
            time.sleep(0.2)
        else:
            pytest.fail("the engine kept accepting requests after its worker died")
    finally:
        eng.shutdown()
    assert not any(alive(p) for p in pids)
