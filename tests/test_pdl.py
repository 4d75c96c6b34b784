"""Programmatic dependent launch: when it is on, and the rule every PDL kernel must keep.

A kernel launched with ``launch_pdl=True`` may start while its predecessor still runs; it is correct only if
every program executes ``pdl_enter`` (``griddepcontrol.wait``) before touching activations and before it can
return. The structural test below reads our kernel modules and fails for a launch with :func:`pdl_kwargs`
whose kernel lacks the ``USE_PDL`` constexpr, or calls ``pdl_enter`` only conditionally or after an early
return. The GPU test (``tests/test_gpu_pdl.py``) checks results with PDL on and off are bit-identical.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch

from glm5_kernels import device, pdl

KERNELS = Path(__file__).resolve().parent.parent / "kernels" / "glm5_kernels"


def test_pdl_on_by_default_on_hopper_only(monkeypatch):
    monkeypatch.delenv(pdl.ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(device, "_capability", lambda index: (9, 0))
    assert pdl.pdl_kwargs(torch.device("cuda", 0)) == {"USE_PDL": True, "launch_pdl": True}   # the default
    monkeypatch.setattr(device, "_capability", lambda index: (8, 0))
    assert pdl.pdl_kwargs(torch.device("cuda", 0)) == {}                 # before Hopper: no griddepcontrol
    monkeypatch.setattr(device, "_capability", lambda index: (9, 0))
    monkeypatch.setenv(pdl.ENV, "1")
    assert pdl.pdl_kwargs(torch.device("cpu")) == {}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.pdl_enabled(torch.device("cuda", 0))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv(pdl.ENV, "0")
    assert not pdl.pdl_enabled(torch.device("cuda", 0))


def test_pdl_on_for_sm90_unless_turned_off(monkeypatch):
    monkeypatch.setenv(pdl.ENV, "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(device, "_capability", lambda index: (9, 0))
    assert pdl.pdl_kwargs(torch.device("cuda", 0)) == {"USE_PDL": True, "launch_pdl": True}
    monkeypatch.setenv(pdl.ENV, "0")
    assert pdl.pdl_kwargs(torch.device("cuda", 0)) == {}


def _pdl_launches(tree: ast.Module) -> set[str]:
    """Names of the kernels launched as ``name[grid](..., **pdl_kwargs(...))`` in a module."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) \
                and isinstance(node.func.value, ast.Name):
            for kw in node.keywords:
                if kw.arg is None and isinstance(kw.value, ast.Call) and getattr(kw.value.func, "id", "") == "pdl_kwargs":
                    out.add(node.func.value.id)
    return out


def _enters_unconditionally(fn: ast.FunctionDef) -> bool:
    """``pdl_enter(USE_PDL)`` is a top-level statement of the body, with no ``return`` before it."""
    for stmt in fn.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) \
                and getattr(stmt.value.func, "id", "") == "pdl_enter":
            return [getattr(a, "id", None) for a in stmt.value.args] == ["USE_PDL"]
        if any(isinstance(n, ast.Return) for n in ast.walk(stmt)):
            return False
    return False


def test_every_pdl_launch_waits_first():
    checked = 0
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        launched = _pdl_launches(tree)
        defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        module = importlib.import_module(f"glm5_kernels.{path.stem}") if launched else None
        for name in launched:
            assert name in defs, f"{path.name}: {name} launched with pdl_kwargs but not defined there"
            params = [p.name for p in getattr(module, name).params]
            assert "USE_PDL" in params, f"{path.name}: {name} is launched with PDL but has no USE_PDL constexpr"
            assert _enters_unconditionally(defs[name]), \
                f"{path.name}: {name} must call pdl_enter(USE_PDL) as a top-level statement before any return"
            checked += 1
        # the converse: a kernel with a USE_PDL switch that no launcher turns on would be a dead option
        for name, fn in defs.items():
            if any(a.arg == "USE_PDL" for a in fn.args.args) and name != "pdl_enter":
                assert name in launched, f"{path.name}: {name} has USE_PDL but no launch passes pdl_kwargs"
    assert checked >= 26, checked


@pytest.mark.parametrize("src,ok", [
    ("def k(x, USE_PDL):\n    pdl_enter(USE_PDL)\n    return\n", True),
    ("def k(x, USE_PDL):\n    w = load(x)\n    pdl_enter(USE_PDL)\n", True),
    ("def k(x, USE_PDL):\n    if x:\n        return\n    pdl_enter(USE_PDL)\n", False),
    ("def k(x, USE_PDL):\n    if x:\n        pdl_enter(USE_PDL)\n", False),
    ("def k(x, USE_PDL):\n    pass\n", False)])
def test_structural_rule_itself(src, ok):
    """The checker above accepts a wait before any return and rejects a conditional or missing one."""
    assert _enters_unconditionally(ast.parse(src).body[0]) is ok


def test_old_triton_without_griddepcontrol_keeps_pdl_off(monkeypatch):
    """A Triton without ``gdc_wait`` (before 3.4): the module still imports, ``pdl_enter`` compiles to nothing and
    no launch asks for PDL, whatever ``GLM5_PDL`` says."""
    import importlib
    import sys
    import types

    monkeypatch.setitem(sys.modules, "triton.language.extra.cuda", types.ModuleType("triton.language.extra.cuda"))
    try:
        importlib.reload(pdl)
        assert not pdl.HAVE_GDC
        monkeypatch.setenv(pdl.ENV, "1")
        monkeypatch.setattr(device, "_capability", lambda index: (9, 0))
        assert pdl.pdl_kwargs(torch.device("cuda", 0)) == {}
    finally:
        monkeypatch.undo()
        importlib.reload(pdl)
    assert pdl.HAVE_GDC
