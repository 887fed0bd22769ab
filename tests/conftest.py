"""Test setup: 8 fake CPU devices (set before JAX initialises its backends) and shared fixtures.

Compiled programs, every one however quick to compile, go to a persistent JAX compilation cache
shared by the pytest-xdist workers of one run and by the processes the tests launch (the
environment is inherited): many tests build the same tiny runs, and a resumed or second process
then loads what the first one compiled. The directory is removed when the run ends. Set
``JAX_COMPILATION_CACHE_DIR`` to use another one.
"""

import os
import shutil
import tempfile

# Chosen by the first process that loads this file (the controller); its workers inherit it.
_CACHE = os.environ.setdefault("RLX_TESTS_JAX_CACHE",
                               os.path.join(tempfile.gettempdir(), f"rlx-tests-jax-{os.getpid()}"))

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def pytest_sessionfinish(session):
    """The controller (not an xdist worker) removes this run's cache."""
    if not hasattr(session.config, "workerinput"):
        shutil.rmtree(_CACHE, ignore_errors=True)
