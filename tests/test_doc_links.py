"""Every relative link and every cited repository path in the documentation exists.

Checked files: ``README.md``, ``docs/*.md`` and the markdown in ``bench/results/``. Two kinds of
reference:

* markdown links ``[text](target)`` with a relative target (no URL scheme): the file or directory must
  exist relative to the linking file; a ``#anchor`` into a markdown file must name one of its headings
  (GitHub's slug rule);
* inline code spans (not fenced blocks, which hold commands and layouts): each whitespace-separated
  token that starts with a top-level entry of the repository followed by ``/`` (``bench/bench.py``,
  ``tests/fixtures/``, ``.ci/run``) must exist relative to the repository root; a glob (``*``) must match
  something; ``path.py::name`` must also define ``name``; ``python -m glm5...`` names a module that must
  exist in ``backend/``, ``kernels/`` or ``client/``.

Tokens with placeholders (``{i}``, ``<grpc>``, ``…``, ``$VAR``) are not paths and are skipped, and a path
that ``.gitignore`` covers (``bench/out/``, the drawn ``bench/results/decode.png``, ``.venv/``) is a
generated output: it is allowed without existing.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE_ROOTS = ("backend", "kernels", "client")

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_CODE = re.compile(r"(`+)(.+?)\1", re.S)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
_PLACEHOLDER = re.compile(r"[{}<>…$|]")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "bench" / "results").glob("*.md"))]


def _gitignore_patterns() -> list[str]:
    path = ROOT / ".gitignore"
    lines = path.read_text().splitlines() if path.exists() else []
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#") and not ln.startswith("!")]


def is_ignored(rel: str, patterns: list[str]) -> bool:
    """``rel`` (repo-relative, ``/``-separated) or one of its parent directories matches a ``.gitignore``
    pattern (the subset of the syntax this repository uses: globs, a leading ``/`` anchors, a trailing
    ``/`` matches directories only)."""
    parts = rel.rstrip("/").split("/")
    for i in range(1, len(parts) + 1):
        prefix = "/".join(parts[:i])
        is_dir = i < len(parts) or rel.endswith("/") or (ROOT / prefix).is_dir()
        for pat in patterns:
            dir_only, core = pat.endswith("/"), pat.strip("/")
            if dir_only and not is_dir:
                continue
            anchored = pat.startswith("/") or "/" in core
            if fnmatch.fnmatch(prefix if anchored else parts[i - 1], core):
                return True
    return False


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    text = _FENCE.sub("", md.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M)}


def _module_exists(module: str) -> bool:
    rel = Path(*module.split("."))
    return any((ROOT / src / rel).with_suffix(".py").is_file() or (ROOT / src / rel / "__init__.py").is_file()
               for src in SOURCE_ROOTS)


def _top_level() -> set[str]:
    return {p.name for p in ROOT.iterdir() if p.name != ".git"}


def _check_path(token: str, ignore: list[str]) -> str | None:
    """Why the repo path ``token`` (from a code span) is broken, or ``None``."""
    path, _, name = token.partition("::")
    if is_ignored(path, ignore):
        return None
    if "*" in path or "?" in path:
        return None if any(ROOT.glob(path)) else f"`{token}`: the glob matches nothing"
    target = ROOT / path
    if not target.exists():
        return f"`{token}`: {path} does not exist"
    if path.endswith("/") and not target.is_dir():
        return f"`{token}`: {path} is not a directory"
    if name and not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(name.split('[')[0])}\b",
                              target.read_text(), re.M):
        return f"`{token}`: {path} defines no {name}"
    return None


def broken_references(md: Path, text: str | None = None) -> list[str]:
    """Every broken relative link and cited repo path in the markdown file ``md`` (``text`` overrides its
    content), as readable messages."""
    text = md.read_text() if text is None else text
    prose = _FENCE.sub("", text)
    top, ignore = _top_level(), _gitignore_patterns()
    problems = []
    for m in _LINK.finditer(prose):
        target = m.group(1)
        if _SCHEME.match(target) or target.startswith("#") and not target[1:]:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (md.parent / file_part).resolve() if file_part else md
        rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
        if not dest.exists():
            if not (dest.is_relative_to(ROOT) and is_ignored(rel, ignore)):
                problems.append(f"link ({target}): {rel} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            problems.append(f"link ({target}): {rel} has no heading #{anchor}")
    for m in _CODE.finditer(_LINK.sub(lambda x: x.group(0).split("](")[0], prose)):
        tokens = m.group(2).split()
        for i, raw in enumerate(tokens):
            if i > 0 and tokens[i - 1] == "-m" and raw.startswith("glm5"):
                if not _module_exists(raw):
                    problems.append(f"`{m.group(2)}`: no module {raw} under {', '.join(SOURCE_ROOTS)}")
                continue
            token = raw.lstrip("('\"").rstrip(",;:.)'\"")
            if "/" not in token or _PLACEHOLDER.search(token) or token.split("/")[0] not in top:
                continue
            why = _check_path(token, ignore)
            if why:
                problems.append(why)
    return problems


@pytest.mark.parametrize("md", doc_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_and_cited_paths_exist(md):
    assert broken_references(md) == []


def test_readme_is_short_and_links_every_doc():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{doc.name})" in readme, f"README does not link docs/{doc.name}"


def test_the_checker_reports_broken_links_and_paths():
    """The rule itself: broken targets are reported, good and generated ones are not."""
    md = ROOT / "docs" / "_probe.md"   # never written: the text is passed in, resolved as if it lived in docs/
    text = "\n".join([
        "[good](serving.md) [good dir](../bench/) [good anchor](serving.md#start-a-server) [web](https://x.org/a)",
        "[broken](missing.md) [bad anchor](serving.md#no-such-heading) [gone](../bench/nothing.py)",
        "`bench/bench.py --out DIR` `tests/test_bench_render.py::test_bench_imports_run_one_way` `tests/test_*.py`",
        "`bench/results/decode.png` `bench/out/anything.json` `layers.{i}.mlp` `src/not/ours.cc` `DIR/results.json`",
        "`bench/not_a_tool.py` `tests/test_doc_links.py::no_such_test` `kernels/nothing_*.py` `.ci/run` `.ci/nope`",
        "`python -m glm5.trained_tiny_checkpoint DIR` `python -m glm5.not_a_module`",
        "```", "bench/in_a_fence.py is a command, not a citation", "```",
    ])
    problems = broken_references(md, text)
    assert sorted(problems) == sorted([
        "link (missing.md): docs/missing.md does not exist",
        "link (serving.md#no-such-heading): docs/serving.md has no heading #no-such-heading",
        "link (../bench/nothing.py): bench/nothing.py does not exist",
        "`bench/not_a_tool.py`: bench/not_a_tool.py does not exist",
        "`tests/test_doc_links.py::no_such_test`: tests/test_doc_links.py defines no no_such_test",
        "`kernels/nothing_*.py`: the glob matches nothing",
        "`.ci/nope`: .ci/nope does not exist",
        "`python -m glm5.not_a_module`: no module glm5.not_a_module under backend, kernels, client",
    ]), problems
