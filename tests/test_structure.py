"""The shape of the code, held: no product file over 600 lines, no function over 80 (its docstring aside), the
trainer's modules import each other without a circle (so every module has a layer below which it never reaches up),
and the formatter's output is the code (it is never switched off for a line: pyproject.toml has our settings).

Product: everything git tracks as Python outside the test suites (tests/, training/tests/, molecule/). A file that
would cross a limit is split along a seam instead; docs/architecture.md names the layers.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def product_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    tests = ("tests/", "molecule/")
    return [ROOT / f for f in listed if not f.startswith(tests) and "/tests/" not in f]


def function_lengths(path: Path):
    """(name, first line, lines without the docstring) of every function and method in a file."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0]
            docstring = (
                first.end_lineno - first.lineno + 1
                if isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
                else 0
            )
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1 - docstring


def test_the_product_is_listed():
    names = {p.relative_to(ROOT).as_posix() for p in product_files()}
    assert {"training/eagle3/spec.py", "library/gpu_cleanup.py", "plugins/filter/role_inputs.py"} <= names
    assert not any(n.startswith(("tests/", "training/tests/")) for n in names)


def test_no_product_file_is_over_600_lines():
    long = {
        p.relative_to(ROOT).as_posix(): n
        for p in product_files()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, f"over {MAX_FILE_LINES} lines (split along a seam): {long}"


def test_the_formatter_is_never_switched_off():
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    marker = "fmt: " + "skip"  # (spelled apart, so this file does not contain it)
    skipped = [f for f in listed.stdout.split() if marker in (ROOT / f).read_text()]
    assert not skipped, f"{marker} in {skipped}: write it the way the formatter keeps it"


def test_no_function_is_over_80_lines():
    long = [
        f"{p.relative_to(ROOT)}:{line} {name} ({n} lines)"
        for p in product_files()
        for name, line, n in function_lengths(p)
        if n > MAX_FUNCTION_LINES
    ]
    assert not long, f"over {MAX_FUNCTION_LINES} lines without the docstring: {long}"


def trainer_imports() -> dict[str, set[str]]:
    """eagle3 module -> the eagle3 modules it imports, at the top or inside a function (a lazy import is still an
    arrow: it runs, and it ties the two files together)."""
    package = ROOT / "training" / "eagle3"
    modules = {}
    for path in package.rglob("*.py"):
        rel = path.relative_to(package.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("eagle3"):
                for alias in node.names:  # `from eagle3 import config` names a module, `from eagle3.x import y` not
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.startswith("eagle3")}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycles_finds_a_circle_of_modules():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_trainers_modules_import_each_other_without_a_circle():
    graph = trainer_imports()
    assert {"eagle3.spec", "eagle3.loop", "eagle3.plan.model"} <= set(graph)
    assert "eagle3.spec" in graph["eagle3.plan.model"]  # the planner is a view of the resolved spec
    # the planner never reaches up into the training loop or the command line
    plan = {m for m in graph if m.startswith("eagle3.plan")}
    assert not {t for m in plan for t in graph[m]} & {"eagle3.train", "eagle3.loop", "eagle3.cli"}
    circles = cycles(graph)
    assert not circles, f"modules that import each other in a circle: {circles}"
