"""The library's docstrings and comments say what the code does and why, not what a benchmark
measured: outside ``rlx/bench/`` no docstring or comment holds a benchmark command
(``python -m rlx.bench``) or a throughput figure (tokens/s, GB/s, samples/s). The figures live in
``rlx/bench/README.md`` beside the commands that produce them.

Read from the source (``ast`` for docstrings, ``tokenize`` for comments), so strings the code
prints or raises are not docstrings here.
"""

import ast
import io
import os
import re
import tokenize

from tests.helpers import ROOT

BENCH_TEXT = re.compile(r"python -m rlx\.bench|\b(tokens?|tok|samples?|[KMGT]i?B)/s\b", re.I)
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _texts(source: str):
    """(line, text) of every docstring and comment of ``source``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, DOCUMENTED) and (doc := ast.get_docstring(node, clean=False)):
            yield node.body[0].lineno, doc
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string


def offences(source: str) -> list[tuple[int, str]]:
    """(line, the matched text) of each benchmark command or throughput figure in ``source``'s
    docstrings and comments."""
    return [(line, m.group(0)) for line, text in _texts(source)
            for m in BENCH_TEXT.finditer(text)]


def _library_files():
    for folder, dirs, files in os.walk(os.path.join(ROOT, "rlx")):
        dirs[:] = [d for d in dirs if d not in ("bench", "__pycache__")]
        yield from (os.path.join(folder, f) for f in sorted(files) if f.endswith(".py"))


def test_the_check_sees_commands_and_figures_in_docstrings_and_comments_only():
    source = ('"""Decode at 41.5 tokens/s (python -m rlx.bench decode)."""\n'
              'def f():\n'
              '    """Loads at 2.1 GB/s."""\n'
              '    return "12 samples/s"  # 3 samples/s before\n')
    assert offences(source) == [(1, "tokens/s"), (1, "python -m rlx.bench"), (3, "GB/s"),
                                (4, "samples/s")]


def test_no_benchmark_figures_or_commands_outside_the_benchmarks():
    found = []
    for path in _library_files():
        with open(path, encoding="utf-8") as f:
            found += [f"{os.path.relpath(path, ROOT)}:{line}: {text}"
                      for line, text in offences(f.read())]
    assert not found, "\n".join(found)
