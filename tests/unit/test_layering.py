"""The package's import structure, read from the source (ast): no import circles between
modules, and no import that runs upward in the layering of DESIGN.md section 1. Imports under
`if TYPE_CHECKING:` and inside functions count too: a circle hidden that way is still one."""

from __future__ import annotations

import ast
from pathlib import Path

import srt_ascend

ROOT = Path(srt_ascend.__file__).parent

# Subpackage -> subpackages it must never import (directly, at any place in a module).
FORBIDDEN = {
    "platforms": {
        "entrypoints", "managers", "decoding", "speculative", "model_executor", "models",
        "layers", "mem_cache", "sampling",
    },
    "distributed": {
        "entrypoints", "managers", "decoding", "speculative", "model_executor", "models",
        "layers", "mem_cache", "sampling",
    },
    "mem_cache": {"entrypoints", "managers", "decoding", "speculative", "models"},
    "constrained": {
        "entrypoints", "managers", "decoding", "speculative", "model_executor", "models",
        "layers", "mem_cache", "sampling",
    },
    "sampling": {"entrypoints", "managers", "decoding", "speculative", "models"},
    "layers": {"entrypoints", "managers", "decoding", "speculative"},
    "models": {"entrypoints", "managers", "decoding", "speculative"},
    "model_executor": {"entrypoints", "managers", "decoding", "speculative"},
    "decoding": {"entrypoints", "managers", "speculative"},
    "speculative": {"entrypoints", "managers"},
    "disaggregation": {"entrypoints", "managers"},
    "managers": {"entrypoints"},
}  # fmt: skip
OUTSIDE = {"benchmark", "python", "tests", "conftest"}  # never imported by the package


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py") if "checkpoints" not in p.parts}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package (or outside roots) that `name` imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from a import b` imports module a.b when b is one, else names of a
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            root = target.split(".")[0]
            if root in OUTSIDE:
                found.add(target)
            elif root == "srt_ascend":
                while target not in known and "." in target:
                    target = target.rpartition(".")[0]
                if target != name:
                    found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_circles():
    assert find_cycle(import_graph()) is None


def test_no_upward_imports_and_nothing_from_outside_the_package():
    bad = []
    for module, targets in import_graph().items():
        forbidden = FORBIDDEN.get(subpackage(module), set())
        for target in targets:
            if target.split(".")[0] in OUTSIDE or subpackage(target) in forbidden:
                bad.append(f"{module} -> {target}")
    assert not bad, "\n".join(sorted(bad))


def test_the_checks_can_fail():
    """The cycle finder and the import reader see what they must."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    graph = import_graph()
    assert "srt_ascend.decoding.base" in graph["srt_ascend.speculative.mtp_decoder"]
    assert "srt_ascend.registry" in graph["srt_ascend.platforms.base"]
    # a TYPE_CHECKING-only import is read too
    assert "srt_ascend.model_executor.forward_batch" in graph["srt_ascend.layers.attention.base"]
