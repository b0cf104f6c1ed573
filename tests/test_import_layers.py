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


# A core module reaches the library above it without importing it when it names one of the upper
# layers' classes (``LoadedModel``, say in an annotation) or reads a private attribute of an object
# passed in (``lm._compile_with``): the layer rule above would not see either.
CORE = "psd_jax.core"
OWN_PRIVATE = {"self", "cls"}  # a class's own private attributes
NAMED_TUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}  # public, underscore and all


def module_sources() -> dict[str, str]:
    return {module_name(p): p.read_text() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def upper_classes(sources: dict[str, str]) -> set[str]:
    """The classes defined at the top of the modules above core's layer, less any name core or a
    layer below it also defines (such a name says nothing of where it comes from)."""
    core = group_of(CORE)[0]
    above, below = set(), set()
    for module, source in sources.items():
        names = {n.name for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}
        (above if group_of(module)[0] > core else below).update(names)
    return above - below


def own_names(tree: ast.Module) -> set[str]:
    """Names a module binds itself: its classes and functions, and what it imports from outside the
    project (``typing.Protocol`` is not a front end's ``Protocol``)."""
    names = {n.name for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] not in PACKAGES:
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def reaches_up(source: str, upper: set[str]) -> list[str]:
    """Where ``source`` names one of ``upper`` (in code or a string annotation, not in prose) or
    reads a private attribute of anything but ``self``/``cls`` (a named tuple's ``_replace`` and the
    like are public): one ``line: what`` each."""
    tree = ast.parse(source)
    upper = upper - own_names(tree)
    nodes = list(ast.walk(tree))
    for node in list(nodes):  # string annotations ("LoadedModel") are code too
        for ann in (getattr(node, "annotation", None), getattr(node, "returns", None)):
            if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
                nodes += [at_line(n, ann.lineno) for n in ast.walk(ast.parse(ann.value, mode="eval"))]
    found = []
    for node in nodes:
        if isinstance(node, ast.Name) and node.id in upper:
            found.append(f"{node.lineno}: {node.id}")
        elif isinstance(node, ast.alias) and node.name.rpartition(".")[2] in upper:
            found.append(f"{node.lineno}: import {node.name}")
        elif isinstance(node, ast.Attribute):
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            others = private and node.attr not in NAMED_TUPLE_API and ast.unparse(node.value) not in OWN_PRIVATE
            if node.attr in upper or others:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(set(found), key=lambda f: (int(f.partition(":")[0]), f))


def at_line(node: ast.AST, line: int) -> ast.AST:
    """``node`` (parsed from a string annotation) numbered as the annotation's line."""
    for n in ast.walk(node):
        if hasattr(n, "lineno"):
            n.lineno = line
    return node


def test_reaching_up_is_flagged_by_name_and_by_private_attribute():
    source = '''
"""The session on a ``LoadedModel`` (prose names it freely)."""
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from psd_jax.api import LoadedModel
class Run:
    def __init__(self, lm: "LoadedModel", other: LoadedModel):
        self.lm, self._state = lm, None
    def start(self, out):
        compiled = self.lm._compile_with(1)
        rows = self.lm._on_devices(2)
        out = out._replace(canvas=self._state)
        return cls._cache, out.__class__, self.lm.params
'''
    assert reaches_up(source, {"LoadedModel"}) == [
        "5: import LoadedModel",
        "7: LoadedModel",
        "10: self.lm._compile_with",
        "11: self.lm._on_devices",
    ]


def test_reaching_up_finds_the_session_that_drove_the_library_model():
    """The block session as it once was: ``BlockDecode`` called ``LoadedModel``'s private methods."""
    old = """
class BlockDecode:
    def __init__(self, lm: Any, program, prompt_ids, prompt_mask, values):
        self.lm, self.program = lm, program
    def _compiled(self, fn, name, args, shapes=()):
        compiled, seconds = self.lm._compile_with(fn, (name, *shapes), args, self.program)
        return compiled
    def start(self, keys, live):
        ids, mask = self.lm._on_devices(keys, live)
        index = self.lm._replicated(keys)
        return self.lm._results(ids, mask, index, self.lm.params)
"""
    assert reaches_up(old, upper_classes(module_sources())) == [
        "6: self.lm._compile_with",
        "9: self.lm._on_devices",
        "10: self.lm._replicated",
        "11: self.lm._results",
    ]
    assert "LoadedModel" in upper_classes(module_sources())


def test_core_names_no_upper_class_and_reads_no_private_attribute_of_others():
    sources = module_sources()
    upper = upper_classes(sources)
    found = [
        f"{module}:{where}"
        for module, source in sorted(sources.items())
        if module == CORE or module.startswith(CORE + ".")
        for where in reaches_up(source, upper)
    ]
    assert found == [], "core reaching the layers above: " + "; ".join(found)


def test_layouts_read_the_engine_through_views_it_satisfies():
    """``core.layouts`` cannot import the engine (which imports it): it reads the engine's ``Loop``
    and ``DecodeState`` through the protocols ``LoopView`` and ``StateView``. Every ``loop.x`` and
    ``state.x`` it reads is one of theirs, and the engine's classes have every one."""
    import dataclasses

    from psd_jax.core import engine

    tree = ast.parse((ROOT / "psd_jax" / "core" / "layouts.py").read_text())
    views = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    for variable, view, engine_class in (("loop", "LoopView", engine.Loop), ("state", "StateView", engine.DecodeState)):
        members = {n.name for n in views[view].body if isinstance(n, ast.FunctionDef)}
        read = {
            n.attr
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == variable
        }
        assert read <= members, f"layouts reads {sorted(read - members)} of {variable} outside {view}"
        has = {f.name for f in dataclasses.fields(engine_class)} | set(dir(engine_class))
        assert members <= has, f"engine.{engine_class.__name__} lacks {sorted(members - has)} of {view}"
