"""The house has one direction: no import circle anywhere in polybasic (function-level imports
counted, so no import inside a function hides one), function-level imports only where start-up time
asks for them, the layers checked by import-linter, and no file that reads the data folder beside
the development machines' checkouts (users have none)."""
import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "polybasic"
# modules whose function-level polybasic imports keep start-up cheap: the command line (`--help` and
# argument errors import no torch), the stage table's entries (pipelines.run loads a stage's module when it runs)
LAZY_OK = ("polybasic.cli", "polybasic._lazy")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def internal_imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported polybasic module, line, inside a function?) for every import statement in `path`."""
    tree = ast.parse(path.read_text())
    pkg = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            if t.split(".")[0] == "polybasic" and _exists(t):
                out.append((t, node.lineno, id(node) in in_function))
    return out


def _exists(module: str) -> bool:
    p = REPO.joinpath(*module.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def import_graph() -> dict[str, set[str]]:
    return {module_name(p): {t for t, _, _ in internal_imports(p)} - {module_name(p)}
            for p in PACKAGE.rglob("*.py")}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_even_through_function_level_imports():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_function_level_imports_only_where_start_up_time_asks_for_them():
    lazy = [f"{module_name(p)}:{line} -> {t}" for p in PACKAGE.rglob("*.py") for t, line, fn in internal_imports(p)
            if fn and not module_name(p).startswith(LAZY_OK)]
    assert lazy == []


def test_lint_imports_keeps_the_layer_contracts():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    if not Path(exe).exists():
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    r = subprocess.run([exe], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0 and "0 broken" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


def test_nothing_reads_the_development_machines_shared_folder():
    pattern = re.compile(re.escape("." + "./shared"))  # spelled so that this file does not match itself
    roots = [REPO / "polybasic", REPO / "recipes", REPO / "tests", REPO / "Makefile", REPO / ".ci"]
    files = [f for r in roots for f in ([r] if r.is_file() else r.rglob("*")) if f.is_file()]
    hits = [f"{f.relative_to(REPO)}:{n}" for f in files if f.suffix not in (".pyc", ".png", ".safetensors")
            for n, line in enumerate(f.read_text(errors="ignore").splitlines(), 1)
            if pattern.search(line)]
    assert len(files) > 50 and hits == []
