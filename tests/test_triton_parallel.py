"""End-to-end: tritonserver serving the glm5 model with ``tensor_parallel_size=2`` on the CPU — the model instance
(the python-backend stub) starts a worker process and the two gloo ranks serve requests whose text equals the
single-process engine's; stopping the server leaves no worker behind."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from glm5.serving.launcher import TritonServerProcess
from glm5_client import Glm5Client

pytestmark = pytest.mark.slow
SETTINGS = {"cache_memory_gb": "0.05", "max_num_seqs": "8", "max_model_len": "512", "device": "cpu",
            "dtype": "float32"}
GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


def worker_pids() -> set[int]:
    out = set()
    for cmd in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"glm5.engine.worker" in cmd.read_bytes():
                out.add(int(cmd.parent.name))
        except OSError:
            continue
    return out


def test_tp2_server_matches_single_process_and_stops_its_workers(tiny_checkpoint_dir: Path, tmp_path: Path):
    from glm5.engine import EngineArgs, LLMEngine, PromptInput
    from glm5.sampling_params import SamplingParams

    prompts = ["The quick brown fox", "Le café est très bon"]
    eng = LLMEngine(EngineArgs.from_dict({"model": str(tiny_checkpoint_dir), **SETTINGS}))
    want = [o.text for o in eng.generate([PromptInput(text=p) for p in prompts], SamplingParams.from_dict(GREEDY))]
    before = worker_pids()
    with TritonServerProcess(model_dir=str(tiny_checkpoint_dir), models=("glm5",), log_file=tmp_path / "server.log",
                             engine_overrides={**SETTINGS, "tensor_parallel_size": "2"}, ready_timeout_s=300) as srv:
        started = worker_pids() - before
        assert len(started) == 1, "the model instance should have started one worker (rank 1)"
        with Glm5Client(srv.grpc_url) as c:
            got = [c.generate(p, sampling=GREEDY, exclude_input_in_output=True).text for p in prompts]
    assert got == want
    deadline = time.monotonic() + 20
    while started & worker_pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not started & worker_pids(), "a worker outlived the server"
