"""Outside ``rlx.quant`` no code compares a base-format or serving-layout name: it asks the
format's record (``rlx.quant.formats``), so a new format is one module there.

The names are the registry's own. ``"none"`` is also the name of other choices (``train.remat``,
a linear's ``act_quant``), so it counts only where the other side is a format or serving field.
``rlx/bench/`` names its table rows after formats and is outside the library.
"""

from __future__ import annotations

import ast
import os

from rlx.quant import formats
from tests.helpers import ROOT

# the one test of the checkpoint's container (an HF folder or a GGUF file), not a base format
ALLOWED = {("rlx/models/loading.py", "self.resolved_format == 'gguf'")}
FIELDS = ("format", "fmt", "serving")


def _literals(node) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [v for e in node.elts for v in _literals(e)]
    return []


def _field(node) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call) and node.args:  # quant.get("format")
        return _literals(node.args[0])[0] if _literals(node.args[0]) else ""
    return ""


def name_comparisons(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, comparison) of every comparison of a format or serving name in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        fields = any(_field(s).endswith(FIELDS) for s in sides)
        hits = {v for s in sides for v in _literals(s) if v in names}
        if hits - {"none"} or (hits and fields):
            out.append((node.lineno, ast.unparse(node)))
    return out


def _library_files():
    for folder, _, files in os.walk(os.path.join(ROOT, "rlx")):
        rel = os.path.relpath(folder, ROOT).replace(os.sep, "/")
        if rel.startswith(("rlx/quant", "rlx/bench")):
            continue
        yield from (f"{rel}/{f}" for f in sorted(files) if f.endswith(".py"))


def test_no_format_name_is_compared_outside_rlx_quant():
    names = set(formats.names()) | set(formats.serving_names())
    bad = []
    for rel in _library_files():
        with open(os.path.join(ROOT, rel)) as f:
            found = name_comparisons(f.read(), names)
        bad += [f"{rel}:{line}: {text}" for line, text in found if (rel, text) not in ALLOWED]
    assert not bad, "compare the format's record (rlx.quant.formats), not its name:\n" + "\n".join(bad)


def test_the_scan_finds_such_comparisons():
    names = set(formats.names()) | set(formats.serving_names())
    source = ("a = q.format != 'none'\nb = x.fmt in ('int4', 'nf4')\nc = q.serving == 'hf'\n"
              "d = cfg.train.remat == 'none'\ne = q.get('format') == 'gguf'\n")
    assert [line for line, _ in name_comparisons(source, names)] == [1, 2, 3, 5]
