"""The layering ARCHITECTURE.md states, checked on the source: what may import
what, no import cycles between modules, no private name imported from another
package, no source file over 400 lines. Read from the files' syntax trees, so
imports inside functions count too."""
from __future__ import annotations

import ast
from pathlib import Path

from tests import REPO as ROOT

PACKAGES = ("common", "parallel", "model", "data", "zeropp", "training", "planner", "tools", "scenarios", "bench")
SCRIPTS = ("train", "generate")

# Who may import whom (top-level packages and scripts); tests/ may import anything.
ALLOWED = {
    "common": set(),
    "parallel": {"common"},
    "model": {"common"},
    "data": {"common"},
    "zeropp": {"common", "parallel"},
    "training": {"common", "parallel", "model", "data", "zeropp"},
    "planner": {"common", "parallel", "model", "data", "zeropp", "training"},
    "tools": {"common", "model", "data", "zeropp", "training"},
    "train": {"common", "parallel", "model", "data", "zeropp", "training", "planner"},
    "generate": {"common", "model", "data", "training", "tools"},
    # what the project verifies (scenarios/, its harness beneath it) and what it measures (bench/):
    # the product imports neither
    "scenarios": {"common", "parallel", "model", "data", "zeropp", "training", "planner", "tools", "train"},
    "bench": {"common", "parallel", "model", "data", "zeropp", "training", "planner", "tools", "train", "scenarios"},
}
MAX_LINES = 400
# Inside zeropp/, a folder imports only the folders before it here ("" is zeropp/'s own modules:
# initialize, the build of the parts, the memory report; fsdp/ the FSDP2 plug-in, outer/ streaming
# DiLoCo across groups). config/ composes the techniques' keys, so it comes after techniques/.
ZEROPP_LAYERS = ("kernels", "collectives", "techniques", "config", "stages", "fsdp", "outer", "")


def source_files() -> dict[str, Path]:
    """Module name -> file, for every non-test module of the product."""
    files = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            files[name] = path
    for script in SCRIPTS:
        files[script] = ROOT / f"{script}.py"
    return files


def imports_of(path: Path, modules: set[str]) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every import in the file;
    `from pkg import sub` names the submodule when pkg.sub is one."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub, []) if sub in modules else (base, [alias.name]))
    return out


def graph() -> tuple[dict[str, set[str]], list[str], list[str]]:
    files = source_files()
    modules = set(files)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    layering, private = [], []
    for mod, path in files.items():
        top = mod.split(".")[0]
        for target, names in imports_of(path, modules):
            target_top = target.split(".")[0]
            if target_top == "tests":
                layering.append(f"{mod} imports {target} (only tests may)")
                continue
            if target_top not in ALLOWED:
                continue  # a library
            if target in modules:
                edges[mod].add(target)
            if target_top != top:
                if target_top not in ALLOWED[top]:
                    layering.append(f"{mod} imports {target}")
                private += [f"{mod} imports {target}.{n}" for n in names if n.startswith("_")]
    return edges, layering, private


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges[v]:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_layers_import_only_downwards():
    _, layering, _ = graph()
    assert layering == []


def zeropp_layer(module: str) -> int:
    parts = module.split(".")
    sub = parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ZEROPP_LAYERS) else ""
    return ZEROPP_LAYERS.index(sub)


def test_zeropp_folders_import_only_downwards():
    edges, _, _ = graph()
    upward = [f"{m} imports {t}" for m, targets in edges.items() if m.startswith("zeropp.")
              for t in targets if t.startswith("zeropp.") and zeropp_layer(t) > zeropp_layer(m)]
    assert upward == []


def test_training_checkpoint_imports_nothing_else_of_training():
    """training/checkpoint/ is the layer below the rest of training/ (args, the trainer, the
    preflight and the outer loop import it)."""
    edges, _, _ = graph()
    inside = "training.checkpoint"
    upward = [f"{m} imports {t}" for m, targets in edges.items() if m == inside or m.startswith(inside + ".")
              for t in targets if t.startswith("training.") and not (t == inside or t.startswith(inside + "."))]
    assert upward == []


def test_the_harness_sits_beneath_the_scenarios_and_nothing_of_the_product_imports_either():
    """scenarios/harness/ imports no scenario and no benchmark (the scenarios, the benchmarks and
    the tests stand on it); no product package imports scenarios or bench; the rank pool and job
    launching live in the harness, not in the transport layer."""
    edges, _, _ = graph()
    product = {"common", "parallel", "model", "data", "zeropp", "training", "planner", "tools", *SCRIPTS}
    wrong = [f"{m} imports {t}" for m, targets in edges.items() for t in targets
             if (m.startswith("scenarios.harness") and not t.startswith("scenarios.harness")
                 and t.split(".")[0] in ("scenarios", "bench"))
             or (m.split(".")[0] in product and t.split(".")[0] in ("scenarios", "bench"))]
    assert not wrong, wrong
    assert not (ROOT / "parallel" / "spawn.py").exists() and (ROOT / "scenarios" / "harness" / "spawn.py").exists()


def test_only_train_py_imports_the_launcher():
    """parallel/launch.py is `python -m parallel.launch` and what train.py's workers report to it;
    the product starts up through parallel/startup.py."""
    edges, _, _ = graph()
    assert sorted(m for m, targets in edges.items() if "parallel.launch" in targets) == ["train"]


def test_no_private_name_crosses_a_package():
    _, _, private = graph()
    assert private == []


def test_no_import_cycles():
    edges, _, _ = graph()
    assert cycles(edges) == []


def test_cycle_finder_finds_a_cycle():
    """The check above can fail: a two-module and a self loop are found."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert cycles({"a": {"a"}}) == [["a"]]


MAX_CLASS_LINES = 200   # inside zeropp/: a part that grows past this is two parts
MAX_WIRING_LINES = 200  # train.py wires the job; the work is in training/ and zeropp/


def test_no_zeropp_class_over_200_lines():
    long = {f"{path.relative_to(ROOT)}:{node.name}": node.end_lineno - node.lineno + 1
            for mod, path in source_files().items() if mod.startswith("zeropp")
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
            and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES}
    assert long == {}


def test_train_py_wiring_stays_short():
    assert len((ROOT / "train.py").read_text().splitlines()) < MAX_WIRING_LINES


def test_no_source_file_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in source_files().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_bench_is_one_folder_per_family_each_run_as_a_module():
    """bench/ holds a folder per family (slow link, memory, convergence, report, kernels,
    communication, groups), each run as `python -m bench.FAMILY` (its __main__.py)."""
    bench = ROOT / "bench"
    loose = sorted(p.name for p in bench.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules outside a family's folder: {loose}"
    families = [p for p in bench.iterdir() if p.is_dir() and (p / "__init__.py").is_file()]
    assert families and all((p / "__main__.py").is_file() for p in families), families


def test_training_reads_the_engine_through_its_faces_not_its_parts():
    """The trainer reaches the DiLoCo mode through the engine's `outer` (zeropp/outer/diloco.py
    OuterFace), never by digging into `engine.parts`."""
    digging = [f"{p.relative_to(ROOT)}:{n}" for p in [*(ROOT / "training").rglob("*.py"), ROOT / "train.py"]
               for n, line in enumerate(p.read_text().splitlines(), 1) if ".parts." in line or '"parts"' in line]
    assert not digging, digging


def test_tests_live_in_folders_by_package_and_by_scenario():
    """tests/unit/<package>/ tests one package of the product (or bench/, scenarios/' harness);
    tests/integration/<scenario>/ runs train.py, the scripts and the jobs as their users do. At the
    top of tests/ only the shared helpers and this file; every folder is a package (the files'
    names may repeat across folders and pooled ranks import them by module name)."""
    tests = ROOT / "tests"
    loose = sorted(p.name for p in tests.glob("test_*.py") if p.name != "test_structure.py")
    assert not loose, f"test files at the top of tests/ (move them to unit/<package>/ or " \
                      f"integration/<scenario>/): {loose}"
    for path in tests.rglob("test_*.py"):
        parts = path.relative_to(tests).parts
        if len(parts) == 1:
            continue
        assert len(parts) == 3 and parts[0] in ("unit", "integration"), f"{path}: not in unit/X/ or integration/X/"
        if parts[0] == "unit":
            assert (ROOT / parts[1]).is_dir() or (ROOT / "zeropp" / parts[1]).is_dir(), \
                f"{path}: tests/unit/{parts[1]}/ names no package of the product (nor a folder of zeropp/)"
        for folder in path.relative_to(ROOT).parents[:-1]:
            assert (ROOT / folder / "__init__.py").is_file(), f"{folder}/ has no __init__.py"


def test_the_loop_and_the_outer_wiring_read_typed_configs_not_the_command_line():
    """training/trainer.py (LoopConfig) and training/outer.py (GroupsJob, made in training/outer_args.py)
    read typed configs made at the edge: argparse's namespace only in a `from_args`."""
    for path in (ROOT / "training" / "trainer.py", ROOT / "training" / "outer.py"):
        tree = ast.parse(path.read_text())
        allowed = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "from_args"
                   for n in ast.walk(f)}
        reads = sorted({n.lineno for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "args"
                        and id(n) not in allowed})
        assert not reads, f"{path.relative_to(ROOT)} reads argparse's namespace on lines {reads}"
