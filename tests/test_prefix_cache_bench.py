"""``bench/prefix_cache_bench.py`` runs end to end on the CPU in small sizes (both sub-commands), and its
JSON says what the recorded runs rely on: hits only with the cache on, the follow-up TTFT ratio."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("prefix_cache_bench", ROOT / "bench" / "prefix_cache_bench.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules[spec.name]


def test_workloads_small(bench, tmp_path, tiny_checkpoint_dir):
    out = tmp_path / "w.json"
    assert bench.main(["workloads", "--model", str(tiny_checkpoint_dir), "--conversations", "3", "--turns", "2",
                       "--system-tokens", "40", "--user-tokens", "6", "--answer-tokens", "3", "--concurrency", "3",
                       "--questions", "3", "--document-tokens", "37", "--question-tokens", "5",
                       "--rag-concurrency", "1", "--block-size", "16", "--snapshot-memory-gb", "0.01",
                       "--designs", "off", "default", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("python bench/prefix_cache_bench.py workloads") and doc["date_utc"]
    chat, rag = doc["results"]["chat"], doc["results"]["rag"]
    assert chat["off"]["hit_rate_tokens"] == rag["off"]["hit_rate_tokens"] == 0.0
    assert chat["off"]["requests"] == chat["default"]["requests"] == 6
    assert chat["default"]["follow_up_reuse_of_previous_turn_min"] >= 0.9
    assert chat["default"]["first_turn_shared_reuse_from_third"] >= 0.9
    assert rag["default"]["shared_reuse_from_third_request"] >= 0.9      # one client at a time: 2nd plants, 3rd hits
    assert rag["default"]["snapshots_saved"]["junction"] == 1
    assert chat["default"]["ttft_p50_s"] > 0 and chat["default"]["ttft_p99_s"] >= chat["default"]["ttft_p50_s"]


def test_followup_tiny_shape(bench, tmp_path):
    out = tmp_path / "f.json"
    assert bench.main(["followup", "--device", "cpu", "--tiny", "--history", "48", "--answer-tokens", "4",
                       "--user-tokens", "4", "--reps", "1", "--cache-memory-gb", "0.01", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert res["config"] == "tiny" and res["history_tokens"] == 48
    assert res["runs"]["off"]["num_cached_tokens"] == [0]
    assert res["runs"]["on"]["num_cached_tokens"] == [48 + 4 - 1]   # the previous turn, minus its unfed last token
    assert res["ttft_speedup"] == pytest.approx(res["runs"]["off"]["ttft_median_s"] / res["runs"]["on"]["ttft_median_s"],
                                                rel=0.01)
