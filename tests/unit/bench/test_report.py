"""Measured figures come from bench/results JSON, never from typing: the committed pages equal
what `python -m bench.report` renders from the JSON; every JSON the report reads exists, has a
command and is the only kind of file kept in bench/results/; no figure is typed in README.md,
docs/ or the product's docstrings and comments outside the generated blocks; no text names a
tracker's issue number. The checkers are tested on synthetic text first."""
from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

from bench import report
from tests import REPO as ROOT

FIGURE = re.compile(r"\d+\.\d+\s?(%|x\b|×|s\b|ms\b|min\b|MB/s|GB/s|MiB/s|GiB/s|Mbit/s|Gbit/s|MiB\b|GiB\b|MB\b|GB\b)"
                    r"|[+-]\d+(\.\d+)?\s?%")
ISSUE = re.compile(r"(?i)\bissues?(\s*|-)#?\d+\b|\bgoal\s+\d+\s+of\b")   # also across a line break
BLOCK = re.compile(r"<!-- bench\.report: [\w-]+ -->.*?<!-- /bench\.report -->", re.S)


# --- the checkers -------------------------------------------------------------------------------

def markdown_figures(text: str) -> list[tuple[int, str]]:
    """(line, text) of each line holding a typed figure outside the generated blocks."""
    text = BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if FIGURE.search(line)]


def python_figures(source: str) -> list[tuple[int, str]]:
    """(line, text) of each docstring or comment line holding a typed figure; code, f-strings
    and other strings are not read."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                for i, line in enumerate(first.value.value.splitlines()):
                    if FIGURE.search(line):
                        hits.append((first.lineno + i, line.strip()))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and FIGURE.search(tok.string):
            hits.append((tok.start[0], tok.string.strip()))
    return sorted(hits)


def issue_mentions(text: str) -> list[tuple[int, str]]:
    """(line, text) where each mention of an issue number starts."""
    lines = text.splitlines()
    starts = sorted({text.count("\n", 0, m.start()) for m in ISSUE.finditer(text)})
    return [(n + 1, lines[n].strip()) for n in starts]


def tracked(*patterns: str) -> list[Path]:
    """The checkout's tracked files matching the patterns (every file on disk if not a git checkout)."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", *patterns], capture_output=True,
                             text=True, check=True).stdout
        return sorted(ROOT / p for p in out.split("\0") if p and (ROOT / p).is_file())
    except (OSError, subprocess.CalledProcessError):
        return sorted(p for pat in patterns for p in ROOT.rglob(pat.lstrip("*/")) if ".venv" not in p.parts)


def product_sources() -> list[Path]:
    """The product's Python: every top-level package but tests/, and the scripts train.py, generate.py."""
    packages = [d for d in ROOT.iterdir() if (d / "__init__.py").is_file() and d.name != "tests"]
    return sorted([p for d in packages for p in d.rglob("*.py")] + [ROOT / "train.py", ROOT / "generate.py"])


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# --- the checkers on synthetic text -------------------------------------------------------------

def test_markdown_checker_flags_typed_figures_and_skips_generated_blocks():
    text = ("# Title\n"
            "ZeRO++ runs 5.47x faster at 100 Mbit/s.\n"
            "<!-- bench.report: headline -->\n| a | 5.47x | 0.5 GB |\n<!-- /bench.report -->\n"
            "It ended +0.15% above, in 2.5 s, 12.3 MB/step, 7.8 GiB, 3.2 min, 0.8 ×.\n"
            "Python 3.11, torch 2.13.0, 4 layers, seeds 1234 / 1235, hidden 128, 2 x 2 ranks.\n")
    assert markdown_figures(text) == [(2, "ZeRO++ runs 5.47x faster at 100 Mbit/s."),
                                      (6, "It ended +0.15% above, in 2.5 s, 12.3 MB/step, 7.8 GiB, 3.2 min, 0.8 ×.")]
    assert markdown_figures("No figures here: see [Convergence](docs/results.md#convergence), 4 ranks.\n") == []


def test_python_checker_reads_docstrings_and_comments_only():
    source = ('"""Module: 1.5x faster."""\n'
              "def f(x):\n"
              '    """Takes 12.5 ms a step."""\n'
              "    y = 2.5  # costs -3% here\n"
              '    label = f"{x:.2f}x at 1.0 GB"  # a clean comment\n'
              '    return "0.5 MB" + label\n'
              "class C:\n"
              '    """Clean: 4 layers, version 2.13."""\n')
    assert python_figures(source) == [(1, "Module: 1.5x faster."), (3, "Takes 12.5 ms a step."),
                                      (4, "# costs -3% here")]
    assert python_figures('"""Clean."""\nx = "3.5x"  # rendered by bench.report\n') == []


def test_issue_checker():
    text = ("see issue 24\nbefore the engine's issue-17 changes\nIssue #5 and issues 3\ngoal 2 of 5\n"
            "clean: tissue, 24 issues, goals\nsmall, issue\n  24's case\n")
    assert [n for n, _ in issue_mentions(text)] == [1, 2, 3, 4, 6]


# --- the repository -----------------------------------------------------------------------------

def test_committed_pages_equal_their_json():
    assert report.BEGIN in report.README.read_text(), "README.md lacks the headline block's marker lines"
    stale = [rel(path) for path, text in report.pages().items()
             if not path.is_file() or path.read_text() != text]
    assert not stale, f"out of date, run `python -m bench.report`: {', '.join(stale)}"


def test_every_cited_json_exists_and_has_a_command():
    missing, no_command = [], []
    for key, fig in report.FIGURES.items():
        assert fig["section"] in report.SECTIONS, key
        for name in fig["files"]:
            if not (report.RESULTS / name).is_file():
                missing.append(f"{key}: {name}")
            elif not report.provenance(name, report.load(name), fig)["command"].strip():
                no_command.append(f"{key}: {name}")
    assert not missing and not no_command, f"missing: {missing}; without a command: {no_command}"


def runnable(module: str) -> bool:
    """A benchmark module that is there and runs as `python -m` (it has a __main__ block)."""
    import importlib.util
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return False
    if spec.submodule_search_locations:   # a family's folder: its __main__.py
        return (Path(spec.origin).parent / "__main__.py").is_file()
    return "__main__" in Path(spec.origin).read_text()


def test_every_figure_names_an_entry_point_that_exists():
    """The command a page gives to run a figure again names a benchmark or scenario module that is there."""
    import importlib.util
    gone = []
    for key, fig in report.FIGURES.items():
        module = re.search(r"python -m ((?:bench|scenarios)\.\w+)", fig["command"])
        if module is None or not runnable(module.group(1)):
            gone.append(f"{key}: {fig['command']}")
    assert not gone, "figures whose command no longer runs:\n" + "\n".join(gone)


def test_every_benchmark_command_in_the_text_exists():
    """`python -m bench.NAME` in a page, docstring, comment or script names a module that is there."""
    import importlib.util
    gone = sorted({f"{rel(p)}: {m}" for p in tracked("*.py", "*.md", "*.sh", "*.yaml")
                   if not rel(p).startswith("bench/results/") and p.name != "results.md"
                   for m in re.findall(r"python -m ((?:bench|scenarios)\.[a-z][a-z0-9_]{2,})", p.read_text(errors="replace"))
                   if not runnable(m)})
    assert not gone, "benchmark commands naming a module that is gone:\n" + "\n".join(gone)


def test_results_hold_only_what_the_pages_cite():
    kept = sorted(p.name for p in report.RESULTS.iterdir())
    extra = sorted(set(kept) - set(report.cited_files()))
    assert not extra, f"bench/results/ files no page cites (git rm them or add them to bench.report.FIGURES): {extra}"


def test_provenance_prefers_the_stamped_key():
    data = {"command": "old", "provenance": {"command": "python -m bench.x --y", "commit": "abc1234",
                                             "machine": {"cpu": "CPU", "cpu_capability": "AVX2", "torch": "t",
                                                         "loadavg_1min": 1.25}}}
    p = report.provenance("x.json", data, {"command": "documented"})
    assert (p["command"], p["commit"], p["capability"]) == ("python -m bench.x --y", "abc1234", "AVX2")
    p = report.provenance("x.json", {}, {"command": "python -m bench.x"})
    assert (p["command"], p["commit"]) == ("python -m bench.x", "(commit not recorded)")


def test_no_typed_figure_outside_generated_blocks():
    pages = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "bench" / "README.md",
             *sorted(p for p in (ROOT / "docs").glob("*.md") if p != report.PAGE)]
    found = [f"{rel(p)}:{n}: {line}" for p in pages if p.is_file() for n, line in markdown_figures(p.read_text())]
    found += [f"{rel(p)}:{n}: {line}" for p in product_sources() for n, line in python_figures(p.read_text())]
    assert not found, (f"{len(found)} typed figures (render them with bench.report from a JSON, or delete "
                       "them):\n" + "\n".join(found))


def test_no_issue_numbers():
    files = [p for p in tracked("*.py", "*.md", "*.sh", "*.yaml", "*.yml")
             if not rel(p).startswith(("bench/results/", "tests/"))]
    found = [f"{rel(p)}:{n}: {line}" for p in files for n, line in issue_mentions(p.read_text(errors="replace"))]
    assert not found, f"{len(found)} issue numbers in the text:\n" + "\n".join(found)


def test_readme_is_short_and_reaches_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250, "README.md is over 250 lines: move the detail into docs/"
    linked = set(re.findall(r"\(docs/([\w.-]+\.md)", readme))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages - linked == set(), f"docs pages the README does not link: {sorted(pages - linked)}"
    assert linked - pages == set(), f"README links missing docs pages: {sorted(linked - pages)}"


def test_every_result_named_in_the_text_exists():
    """A path into bench/results named by a page or by the product's code points at a file kept there
    (bench/ names its default output files, which a run writes)."""
    named = re.compile(r"bench/results/[\w.-]+\.(?:json|md|png|txt)")
    missing = [f"{rel(p)}: {m}" for p in tracked("*.py", "*.md", "*.sh")
               if not rel(p).startswith(("bench/results/", "bench/")) or rel(p).endswith(".md")
               for m in named.findall(p.read_text(errors="replace")) if not (ROOT / m).exists()]
    assert not missing, "results named but not kept (cite docs/results.md or a kept JSON):\n" + "\n".join(missing)


def test_every_test_file_named_in_the_text_exists():
    """A test file named by a page, a script or the product's code is there (the suite moves
    between folders; a pointer to a file that left is worse than none)."""
    named = re.compile(r"tests/[\w/]+\.py")
    missing = [f"{rel(p)}: {m}" for p in tracked("*.py", "*.md", "*.sh") if not rel(p).startswith("bench/results/")
               for m in named.findall(p.read_text(errors="replace")) if not (ROOT / m).exists()]
    assert not missing, "test files named but not there:\n" + "\n".join(missing)
