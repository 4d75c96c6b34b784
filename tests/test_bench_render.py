"""bench/ as tools + results: bench/render_results.py on the recorded H200 run (the tables of
bench/results/RESULTS.md and the decode plot, which is drawn rather than committed), the results JSON's
schema, every bench tool's ``--help``, and imports that run one way only (bench.py -> render_results.py)."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def _render(tmp_path: Path) -> tuple[dict, str, Path]:
    """Render a copy of the recorded results (render writes the finalized JSON back) with its notes."""
    for name in ("results.json", "limits.md"):
        shutil.copy(RESULTS / name, tmp_path / name)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "render_results.py"), str(tmp_path / "results.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((tmp_path / "results.json").read_text()), (tmp_path / "RESULTS.md").read_text(), tmp_path


def test_render_results_writes_the_tables_and_draws_the_plot(tmp_path):
    res, text, out = _render(tmp_path)
    png = out / "decode.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"Run {res['date']} on {res['gpu']}" in text and f"Command: `{res['command']}`" in text
    for r in res["decode"]:   # one table row per decode point, with its graph step time and roofline share
        assert f"| {r['batch']} | {r['ctx']} | {r['step_s'] * 1e3:.2f} |" in text
        assert f"{100 * r['roofline_fraction']:.1f}% |" in text
    for r in res["prefill"]:
        assert f"| {r['tokens']} | {r['chunk']} | {r['time_s']:.3f} |" in text
    assert f"**{res['hf']['step_s'] * 1e3:.1f} ms**" in text
    for r in res["decode_flashinfer"]:   # the backend comparison names the run it came from
        assert f"| {r['decode_attn']} | {r['batch']} | {r['ctx']} | {r['step_s'] * 1e3:.2f} |" in text
    assert res["decode_flashinfer_run"] in text
    k = res["mla_kernels"]
    assert f"Run {k['date']} on {k['device']}" in text
    for r in k["rows"]:
        assert f"| {r['n']} | {r['triton_graph_us']:.1f} |" in text
    assert (RESULTS / "limits.md").read_text().rstrip() in text   # the notes beside the JSON, verbatim
    # the committed RESULTS.md is what this renderer makes of the committed results
    assert text == (RESULTS / "RESULTS.md").read_text()


def test_render_without_notes_beside_the_json_renders_only_the_tables(tmp_path):
    shutil.copy(RESULTS / "results.json", tmp_path / "results.json")
    md = tmp_path / "out.md"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "render_results.py"), str(tmp_path / "results.json"),
                           "--out", str(md), "--plot", str(tmp_path / "p.png")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = md.read_text()
    assert "## Decode" in text and "Targets and what limits" not in text


def test_recorded_results_keep_the_schema_and_say_what_was_measured():
    """Other tools extend results.json: these keys are its contract (bench.py writes them, the renderer and
    the tests read them)."""
    res = json.loads((RESULTS / "results.json").read_text())
    for key in ("date", "gpu", "torch", "command", "backends", "config", "ceilings", "decode", "prefill", "hf"):
        assert key in res, key
    assert {"copy_bw_Bps", "matmul_bf16_flops"} <= set(res["ceilings"])
    for r in res["decode"]:
        assert {"batch", "ctx", "step_s", "eager_step_s", "tok_s", "experts_touched", "bytes"} <= set(r), r.keys()
        assert r["bytes"]["total"] == sum(v for k, v in r["bytes"].items() if k != "total")
    for r in res["prefill"]:
        assert {"tokens", "chunk", "time_s", "tok_s", "flops", "tflops"} <= set(r)
    assert {"batch", "ctx", "step_s", "batches"} <= set(res["hf"])
    assert res["config"]["num_hidden_layers"] == 8


TOOLS = ["bench.py", "render_results.py", "kernel_bench.py", "flashinfer_bench.py", "step_anatomy.py",
         "tune_fused_moe.py", "bf16_diag.py", "fp8_check.py", "memory_table.py", "http_front_latency.py", "prefix_cache_bench.py",
         "spec_bench.py",
         "kernel_count.py", "kernel_check.py", "multigpu.py", "ep_dispatch.py", "distributed_order_check.py",
         "graph_gaps.py", "host_cost.py", "pdl_ab.py", "backend_ab.py", "gemv16_table.py"]


def test_every_bench_tool_is_listed_here():
    """A new tool in bench/ gets a --help check (add it to TOOLS)."""
    assert sorted(p.name for p in (ROOT / "bench").glob("*.py")) == sorted(TOOLS)


@pytest.mark.parametrize("tool", TOOLS)
def test_bench_tool_has_help_and_a_docstring(tool):
    path = ROOT / "bench" / tool
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and len(doc) > 80, f"{tool}: the module docstring must say what it measures"
    proc = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage:") and doc.split("\n")[0][:40] in proc.stdout.replace("\n", " ")


def test_shell_tools_have_help():
    for script in (ROOT / "bench" / "cpu_genai_perf.sh", ROOT / "scripts" / "gpu_check.sh"):
        proc = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0 and "Usage:" in proc.stdout, (script, proc.stderr)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "nonsense"], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2 and "unknown stage 'nonsense'" in proc.stderr


def _imports(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module.split(".")[0])
    return mods


def test_gpu_test_modules_need_no_serving_packages():
    """scripts/gpu_check.sh collects only the test modules with gpu-marked tests, because the GPU machine lacks
    the serving stack's packages: none of those modules may import them (directly or through the fixtures'
    conftest), or the GPU run stops at collection."""
    serving = {"uvicorn", "starlette", "fastapi", "openai", "tritonclient", "httpx", "aiohttp"}
    marker = "pytest.mark." + "gpu"   # (spelt apart so that this module is not one of them)
    gpu_modules = [p for p in (ROOT / "tests").glob("test_*.py") if marker in p.read_text()]
    assert len(gpu_modules) >= 10
    for path in [*gpu_modules, ROOT / "tests" / "conftest.py", ROOT / "tests" / "oracle.py"]:
        assert not (_imports(path) & serving), path
        modules = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                modules.append(node.module or "")
            elif isinstance(node, ast.Import):
                modules += [a.name for a in node.names]
        assert not [m for m in modules if m.startswith("glm5.serving")], path


def test_bench_imports_run_one_way():
    """bench.py (and step_anatomy.py) import render_results / bench; render_results imports no bench tool."""
    tools = {p.stem for p in (ROOT / "bench").glob("*.py")}
    assert not (_imports(ROOT / "bench" / "render_results.py") & tools)
    assert "render_results" in _imports(ROOT / "bench" / "bench.py")
    assert not (_imports(ROOT / "bench" / "bench.py") & (tools - {"render_results"}))


def test_graph_gaps_splits_idle_time_by_who_was_late():
    """A gap counts as host-late only when the next kernel's launch call returned after the previous kernel ended."""
    sys.path.insert(0, str(ROOT / "bench"))
    from graph_gaps import analyse, launch_ends
    kern = [{"name": "a", "cat": "kernel", "ts": 0.0, "dur": 10.0, "corr": 1},
            {"name": "b", "cat": "kernel", "ts": 14.0, "dur": 10.0, "corr": 2},   # launched at 5: queued gap of 4
            {"name": "c", "cat": "kernel", "ts": 40.0, "dur": 5.0, "corr": 3}]    # launched at 38: host-late gap of 16
    raw = [{"ph": "X", "cat": "cuda_runtime", "ts": 1.0, "dur": 2.0, "args": {"correlation": 1}},
           {"ph": "X", "cat": "cuda_driver", "ts": 4.0, "dur": 1.0, "args": {"correlation": 2}},
           {"ph": "X", "cat": "cuda_runtime", "ts": 30.0, "dur": 8.0, "args": {"correlation": 3}},
           {"ph": "X", "cat": "cpu_op", "ts": 0.0, "dur": 50.0, "args": {}}]
    assert launch_ends(raw) == {1: 3.0, 2: 5.0, 3: 38.0}
    r = analyse(kern, launch_ends(raw))
    assert (r["span_us"], r["busy_us"], r["idle_us"]) == (45.0, 25.0, 20.0)
    assert (r["host_late_idle_us"], r["queued_idle_us"]) == (16.0, 4.0)
    assert "host_late_idle_us" not in analyse(kern)
