"""The package tree is the architecture: layers import downwards only, no import circles, no
borrowed private names, a short top level, and tests that share helpers through tests/helpers.

Read from the source with ``ast`` (every ``import`` statement, also those inside functions), so
nothing here depends on what happens to be imported at run time.
"""

import ast
import collections
import os

from tests.helpers import ROOT

# What each part of rlx may import (besides itself), lowest layer first. The package docstrings
# say the same in words; this table is what holds them to it.
FOUNDATION = {"rlx.errors", "rlx.types", "rlx.mesh"}
# beneath the model code: the platform policy and compile cache, the numerical kernels
LOW = FOUNDATION | {"rlx.platform", "rlx.kernels"}
ALLOWED = {
    "rlx.errors": set(),
    "rlx.types": set(),
    "rlx.mesh": {"rlx.errors"},
    "rlx.platform": FOUNDATION,
    "rlx.kernels": FOUNDATION | {"rlx.platform"},
    "rlx.models": LOW,
    "rlx.quant": LOW | {"rlx.models"},
    "rlx.learner": LOW | {"rlx.models", "rlx.quant"},
    "rlx.rewards": FOUNDATION,
    "rlx.data": FOUNDATION | {"rlx.models", "rlx.rewards"},
    "rlx.envs": FOUNDATION | {"rlx.models", "rlx.rewards", "rlx.data"},
    "rlx.io": LOW | {"rlx.models", "rlx.quant", "rlx.learner"},
    "rlx.rollout": LOW | {"rlx.models", "rlx.quant", "rlx.io"},
    "rlx.config": LOW | {"rlx.models", "rlx.quant", "rlx.learner", "rlx.io", "rlx.rollout",
                         "rlx.rewards"},
    "rlx.run": LOW | {"rlx.models", "rlx.quant", "rlx.learner", "rlx.rewards", "rlx.data",
                      "rlx.envs", "rlx.io", "rlx.rollout", "rlx.config"},
    "rlx.commandline": FOUNDATION | {"rlx.config"},  # the run config's fields and defaults
    "rlx.plan": LOW | {"rlx.models", "rlx.quant", "rlx.learner", "rlx.rollout", "rlx.config",
                       "rlx.commandline"},
    "rlx.launch": FOUNDATION | {"rlx.config", "rlx.commandline", "rlx.run", "rlx.io",
                                "rlx.rollout"},
    "rlx.eval": FOUNDATION | {"rlx.config", "rlx.commandline", "rlx.run"},
    "rlx.export": FOUNDATION | {"rlx.commandline", "rlx.run"},
    "rlx": {"rlx.run", "rlx.commandline"},  # rlx/__init__.py: build, load_config
}
TOP_LEVEL = {"__init__.py", "launch.py", "config.py", "commandline.py", "types.py", "mesh.py",
             "errors.py"}


def _modules(top: str) -> dict[str, str]:
    """Dotted module name -> file, for every .py file under ``top``."""
    out = {}
    for folder, _, files in os.walk(os.path.join(ROOT, top)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


def _imports(path: str, known: dict[str, str]):
    """(imported module, imported name or None, line) for every import in ``path``: ``from a.b
    import c`` names module ``a.b.c`` when that is a module, else ``a.b`` with name ``c``."""
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            yield from ((a.name, None, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                yield (sub, None, node.lineno) if sub in known else (node.module, a.name, node.lineno)


def _graph(top: str) -> dict[str, set[str]]:
    known = _modules(top)
    return {m: {t for t, _, _ in _imports(p, known) if t in known and t != m}
            for m, p in known.items()}


def _part(module: str) -> str:
    """The layer a module belongs to: its package under rlx, or the top-level module itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_circles_between_modules():
    assert _cycle(_graph("rlx")) is None, " -> ".join(_cycle(_graph("rlx")))


def test_no_import_circles_between_packages():
    parts = collections.defaultdict(set)
    for mod, targets in _graph("rlx").items():
        parts[_part(mod)] |= {_part(t) for t in targets} - {_part(mod)}
    assert _cycle(parts) is None, " -> ".join(_cycle(parts))


def test_each_layer_imports_only_the_layers_below_it():
    bad = []
    for mod, targets in _graph("rlx").items():
        part = _part(mod)
        if part == "rlx.bench":  # the benchmarks sit on top and may use anything
            continue
        assert part in ALLOWED, f"{part} has no row in ALLOWED: say what it may import"
        bad += [f"{mod} -> {t}" for t in targets if _part(t) != part and _part(t) not in ALLOWED[part]]
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_the_layer_table_itself_has_no_circle():
    assert _cycle(ALLOWED) is None


def test_no_module_imports_another_modules_private_names():
    known = _modules("rlx")
    bad = [f"{os.path.relpath(path, ROOT)}:{line}: {mod}.{name}"
           for mod_name, path in known.items()
           for mod, name, line in _imports(path, known)
           if name and name.startswith("_") and mod.startswith("rlx") and mod != mod_name]
    assert not bad, "\n".join(bad)


def test_the_top_level_is_short():
    top = {f for f in os.listdir(os.path.join(ROOT, "rlx")) if f.endswith(".py")}
    assert top == TOP_LEVEL, f"top-level modules of rlx/: {sorted(top)}"


def test_every_package_says_what_it_owns_and_may_import():
    for name in sorted(p for p in ALLOWED if p.count(".") == 1):
        init = os.path.join(ROOT, *name.split("."), "__init__.py")
        if not os.path.exists(init):  # a top-level module
            continue
        doc = ast.get_docstring(ast.parse(open(init).read())) or ""
        assert "May import" in doc, f"{name}/__init__.py's docstring says nothing of its imports"
        for other in sorted(ALLOWED[name] - FOUNDATION):
            assert f"``{other}``" in doc, f"{name}/__init__.py does not name {other}"


def test_no_test_module_imports_another_test_module():
    known = _modules("tests")
    bad = [f"{os.path.relpath(path, ROOT)}:{line}: {target}"
           for path in known.values()
           for target, _, line in _imports(path, known)
           if target.startswith("tests.") and target.rsplit(".", 1)[-1].startswith("test_")]
    assert not bad, "shared test helpers belong in tests/helpers:\n" + "\n".join(bad)
