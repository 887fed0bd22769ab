"""``python -m rlx.bench``: --help lists every benchmark (exit 0); no name or an unknown one exits 2."""

import importlib.util
import subprocess
import sys

import pytest

from rlx.bench.__main__ import BENCHMARKS, main
from tests.helpers import ROOT


def _benchmark_lines(text: str) -> dict[str, str]:
    """name -> summary, for the listing's lines that start with a benchmark's name."""
    rows = [line.split(maxsplit=1) for line in text.splitlines() if line.startswith("  ")]
    return {row[0]: row[1] for row in rows if len(row) == 2}


def test_help_lists_every_benchmark_and_exits_0():
    # the command line itself, as a user types it
    proc = subprocess.run(
        [sys.executable, "-m", "rlx.bench", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m rlx.bench NAME")
    assert _benchmark_lines(proc.stdout) == {name: b.summary for name, b in BENCHMARKS.items()}


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_flags(flag, capsys):
    assert main([flag]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert list(_benchmark_lines(out)) == list(BENCHMARKS)


@pytest.mark.parametrize("argv", [[], ["nope"], ["nope", "--help"]])
def test_no_or_unknown_name_is_a_usage_error_with_the_list(argv, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert list(_benchmark_lines(err)) == list(BENCHMARKS)
    assert ("unknown benchmark 'nope'" in err) == bool(argv)


def test_every_entry_names_a_module_with_a_summary():
    for name, bench in BENCHMARKS.items():
        assert importlib.util.find_spec(bench.module) is not None, name
        assert bench.summary and "\n" not in bench.summary, name
