"""The package's modules form layers: no module imports, at any depth of its code (function-level
and type-checking imports included), a module that imports it back. A circle means two modules
each need the other's internals, so neither can be read, tested or changed alone."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("psd_jax", "models", "convert")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The project modules that module ``name`` (its ``source``) imports anywhere in its code (a
    name imported from a package that is itself a module counts as that module)."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def import_graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {module_name(p) for p in files}
    return {
        module_name(p): imported_modules(p.read_text(), module_name(p), p.name == "__init__.py", modules) for p in files
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every module-level import circle, as the list of modules around it (one per circle found)."""
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt.startswith(node + "."):  # a package's __init__ re-exporting its own submodules
                continue
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_the_graph_sees_function_level_and_type_checking_imports():
    source = """
from typing import TYPE_CHECKING
from . import b
if TYPE_CHECKING:
    from .c import Thing
def later():
    from ..top import d
    import pkg.e
"""
    modules = {"pkg.a", "pkg.b", "pkg.c", "top", "top.d", "pkg.e", "pkg.unused"}
    assert imported_modules(source, "pkg.a", False, modules) == {"pkg.b", "pkg.c", "top", "top.d", "pkg.e"}
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert circles({"p": {"p.x"}, "p.x": {"p"}}) == []  # a package re-exporting its submodule


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circles(package):
    graph = import_graph()
    found = [c for c in circles(graph) if c[0].startswith(package)]
    assert found == [], "import circles: " + "; ".join(" -> ".join(c) for c in found)


# The layers from the bottom up. A layer holds one or more groups (module names and the packages
# under them); a module imports only from its own group and from the layers below its own, so groups
# of one layer (the backends, the front ends) never import one another.
LAYERS: tuple[tuple[tuple[str, ...], ...], ...] = (
    (("models",),),  # the Flax modules of every family
    (("convert",),),  # Hugging Face checkpoints into those modules
    (("psd_jax.parallel",),),  # device meshes, sharding and processes
    (("psd_jax.core",),),  # settings, rules, decoders, layouts, the compiled loop and its session
    (  # the library: a loaded model, its tokenizer, named and recommended settings, scoring, costs
        (
            "psd_jax",
            "psd_jax.api",
            "psd_jax.diffusion_gemma_api",
            "psd_jax.model_dir",
            "psd_jax.prompts",
            "psd_jax.tokenizer",
            "psd_jax.recommended",
            "psd_jax.names",
            "psd_jax.scoring",
            "psd_jax.costs",
        ),
    ),
    (("psd_jax.torch_backend",), ("psd_jax.cli",)),  # PyTorch for parity; the commands and their flags
    (("psd_jax.tuning",), ("psd_jax.evaluate",), ("psd_jax.serve",)),  # the front ends over them
    (("psd_jax.generate", "psd_jax.bench", "psd_jax.tune"),),  # `python -m` entry points
)


def group_of(module: str) -> tuple[int, int]:
    """(layer, group) of ``module``: the group naming it or the nearest package above it."""
    best = None
    for layer, groups in enumerate(LAYERS):
        for group, names in enumerate(groups):
            for name in names:
                if (module == name or module.startswith(name + ".")) and (best is None or len(name) > best[0]):
                    best = (len(name), layer, group)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[1], best[2]


def downward_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in graph.items():
        here = group_of(module)
        for target in targets:
            there = group_of(target)
            if there != here and there[0] >= here[0]:
                found.append(f"{module} -> {target}")
    return sorted(found)


def test_the_layer_rule_flags_upward_and_sideways_imports():
    graph = {
        "psd_jax.core.engine": {"psd_jax.parallel.sharding", "psd_jax.core.rules"},  # down, own group
        "psd_jax.serve.app": {"psd_jax.api", "psd_jax.cli.flags"},  # down
        "psd_jax.core.rules": {"psd_jax.api"},  # up
        "psd_jax.serve.cli": {"psd_jax.tuning.space"},  # sideways, between front ends
        "psd_jax.cli.bench": {"psd_jax.torch_backend.api"},  # sideways, within one layer
    }
    assert downward_violations(graph) == [
        "psd_jax.cli.bench -> psd_jax.torch_backend.api",
        "psd_jax.core.rules -> psd_jax.api",
        "psd_jax.serve.cli -> psd_jax.tuning.space",
    ]


def test_each_module_imports_only_from_its_group_and_the_layers_below():
    graph = import_graph()
    found = downward_violations(graph)
    assert found == [], "imports against the layers: " + "; ".join(found)
