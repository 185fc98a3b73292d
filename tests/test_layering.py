"""The package's imports point one way (DESIGN.md): no cycle, function-level imports included, and
the lower layers never reach up (data below models below methods)."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fv_accel"


@functools.lru_cache(maxsize=None)
def parsed(path: Path) -> ast.Module:
    """A file's syntax tree, parsed once for all the tests here."""
    return ast.parse(path.read_text(), filename=str(path))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the fv_accel modules it imports anywhere in its body (module or function level)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(parsed(path)):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import sub` imports the submodule when there is one.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target.startswith("fv_accel") and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_graph_sees_function_level_imports():
    graph = import_graph()
    # fv_accel/build.py imports the methods inside a function only (_build_student_and_method).
    assert "fv_accel.methods" in graph["fv_accel.build"]
    assert "fv_accel.seeding" in graph["fv_accel.data.loader"]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_lower_layers_never_import_upper_ones():
    graph = import_graph()
    upper = {
        # layer prefix: what it must never import
        "fv_accel.data": ("fv_accel.methods", "fv_accel.models", "fv_accel.build", "fv_accel.trainer",
                          "fv_accel.validation", "fv_accel.tiny", "fv_accel.cli", "fv_accel.schedulers"),
        "fv_accel.schedulers": ("fv_accel.methods", "fv_accel.models", "fv_accel.build", "fv_accel.trainer"),
        "fv_accel.models": ("fv_accel.methods", "fv_accel.build", "fv_accel.trainer", "fv_accel.validation"),
        "fv_accel.methods": ("fv_accel.build", "fv_accel.trainer", "fv_accel.validation"),
        "fv_accel.trainer": ("fv_accel.methods", "fv_accel.models", "fv_accel.build"),
    }
    bad = [
        f"{module} imports {target}"
        for module, targets in graph.items()
        for layer, forbidden in upper.items()
        if module == layer or module.startswith(layer + ".")
        for target in targets
        if any(target == f or target.startswith(f + ".") for f in forbidden)
    ]
    assert not bad, "\n".join(bad)


# A function reads on one screen (DESIGN.md): name the phases instead.
MAX_FUNCTION_LINES = 100
MAX_LOOP_LINES = 80


def function_lengths() -> dict[str, int]:
    """'<file>:<Class.>function' -> its lines (def to last line; decorators and nested functions
    count inside the function that holds them), for every function and method in fv_accel/."""
    lengths: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lengths[f"{rel}:{prefix}{child.name}"] = child.end_lineno - child.lineno + 1
                    visit(child, f"{prefix}{child.name}.")
                elif isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")
                else:
                    visit(child, prefix)

        visit(parsed(path), "")
    return lengths


def test_no_function_over_100_lines_and_the_loop_on_one_screen():
    lengths = function_lengths()
    assert len(lengths) > 500  # the walk sees the whole package, methods and nested functions included
    assert lengths["fv_accel/trainer.py:Trainer.run"] > 1  # methods are counted under their class
    long = {name: n for name, n in lengths.items() if n > MAX_FUNCTION_LINES}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
    loop = lengths["fv_accel/trainer.py:Trainer._train"]
    assert loop <= MAX_LOOP_LINES, f"Trainer._train is {loop} lines (at most {MAX_LOOP_LINES})"


def door_names() -> set[str]:
    """The names in fv_accel/tiny/__init__.py's `__all__`, each a function defined there."""
    tree = ast.parse((PACKAGE / "tiny" / "__init__.py").read_text())
    (names,) = [
        ast.literal_eval(node.value) for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
    ]
    defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert set(names) <= defined, f"door names without a function: {set(names) - defined}"
    return set(names)


def tiny_uses_outside_the_package() -> tuple[list[str], list[str]]:
    """(uses through the door, uses past it): every import of fv_accel.tiny or its modules, and every
    string naming one of them, in fv_accel/ outside fv_accel/tiny/, function-level imports included."""
    door = door_names()
    through, past = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.is_relative_to(PACKAGE / "tiny"):
            continue
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(parsed(path)):
            where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Import):
                past += [f"{where} import {a.name}" for a in node.names if a.name.split(".")[:2] == ["fv_accel", "tiny"]]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    base = ".".join(anchor[: len(anchor) - (node.level - 1)] + ([base] if base else []))
                names = [a.name for a in node.names]
                if base == "fv_accel" and "tiny" in names:
                    past.append(f"{where} from fv_accel import tiny")
                elif base == "fv_accel.tiny" and set(names) <= door:
                    through.append(f"{where} {', '.join(names)}")
                elif base.split(".")[:2] == ["fv_accel", "tiny"]:
                    past.append(f"{where} from {base} import {', '.join(names)}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.match(r"fv_accel\.tiny\.\w", node.value):
                if " " not in node.value:  # a module name in a string (importlib), not prose
                    past.append(f"{where} {node.value!r}")
    return through, past


def test_production_code_uses_the_tiny_world_only_through_its_door():
    through, past = tiny_uses_outside_the_package()
    assert not past, "uses of fv_accel.tiny past its door (fv_accel/tiny/__init__.py):\n" + "\n".join(past)
    # The data source (build, validation), the caption check (user_data) and the model builder's CLI.
    used = {use.split(":")[0] for use in through}
    assert {"fv_accel/build.py", "fv_accel/validation.py", "fv_accel/user_data.py", "fv_accel/tiny_model.py"} <= used, used
