"""Separate Python environments of the benchmark peers that cannot share rlx's own.

llama.cpp (llama-cpp-python, built from its source distribution with the machine's cmake and C
compiler) and Tunix (``google-tunix`` pins ``safetensors<0.8``; rlx needs >= 0.8) each get a
virtual environment of their own, created once and cached by path, as SGLang's is
(``rlx.bench.sglang_setup``). A benchmark side names its environment's interpreter
(``rlx.bench.harness.Side.python``); the worker there imports rlx from this checkout
(``PYTHONPATH``), so an environment holds the peer and what the peer's side itself calls:

- ``llama.cpp``: ``llama-cpp-python`` only, compiled without AMX tile instructions (its AMX
  product crashes on the Q4_1 file on an AMX CPU with llama-cpp-python 0.3.36; its AVX-512 / VNNI
  products are kept). The build never reuses pip's cached wheel, which may hold other flags.
- ``tunix``: ``google-tunix`` with the JAX stack pinned to the versions rlx is measured with (one
  XLA for both sides), and ``math-verify``, which grades rlx's math reward inside the Tunix side's
  process as TRL's side calls it.

``python -m rlx.bench.peer_envs NAME`` creates the environment (nothing if it works already) and
prints its interpreter; ``$RLX_<NAME>_PYTHON`` (``RLX_LLAMA_CPP_PYTHON``, ``RLX_TUNIX_PYTHON``)
points a benchmark at another interpreter. Creating one needs the package registry; the
benchmarks and tests never create one themselves: they skip the side and name the command.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys


@dataclasses.dataclass(frozen=True)
class PeerEnv:
    """One peer's environment: where it lives, what it installs, which import proves it works."""

    name: str
    folder: str  # under ~/.cache/rlx
    requirements: tuple[str, ...]
    check: str  # modules (``import`` syntax) that import only when the environment works
    build_env: tuple[tuple[str, str], ...] = ()  # variables for building its source distributions

    @property
    def variable(self) -> str:
        return "RLX_" + "".join(c if c.isalnum() else "_" for c in self.name.upper()) + "_PYTHON"

    @property
    def default_python(self) -> str:
        return os.path.expanduser(f"~/.cache/rlx/{self.folder}/bin/python")

    def interpreter(self, override: str = "") -> str:
        """``override``, else ``$RLX_<NAME>_PYTHON``, else the cached environment's python."""
        return os.path.expanduser(override or os.environ.get(self.variable, self.default_python))

    def unavailable(self, override: str = "") -> str | None:
        """Why no side of this peer can run here (the command that fixes it), or None."""
        python = self.interpreter(override)
        if os.path.exists(python):
            return None
        return (f"no {self.name} environment at {python}: create it with "
                f"`python -m rlx.bench.peer_envs {self.name}` or set ${self.variable}")


_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMA_CPP = PeerEnv("llama.cpp", "llama-cpp-0.3.36-noamx", ("llama-cpp-python==0.3.36",),
                    "llama_cpp", build_env=(("CMAKE_ARGS", f"-DCMAKE_C_FLAGS='{_NO_AMX}' "
                                                            f"-DCMAKE_CXX_FLAGS='{_NO_AMX}'"),))
TUNIX = PeerEnv("tunix", "tunix-0.1.7",
                ("google-tunix==0.1.7", "jax[cpu]==0.10.2", "jaxlib==0.10.2", "flax==0.12.8",
                 "qwix==0.1.8", "optax==0.2.8", "math-verify==0.9.0"),
                "tunix.rl.grpo.grpo_learner, math_verify")
ENVS = {e.name: e for e in (LLAMA_CPP, TUNIX)}


def works(env: PeerEnv, python: str) -> bool:
    if not os.path.exists(python):
        return False
    probe = subprocess.run([python, "-c", f"import {env.check}"], capture_output=True)
    return probe.returncode == 0


def create(env: PeerEnv) -> str:
    """Create ``env``'s virtual environment at its default place unless it works already (one that
    exists but fails its check gets the requirements installed into it); returns its interpreter."""
    python = env.default_python
    if works(env, python):
        return python
    root = os.path.dirname(os.path.dirname(python))
    if not os.path.exists(python):
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", root], check=True)
    fresh = ("--no-cache-dir",) if env.build_env else ()
    subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *fresh,
                    *env.requirements], check=True, env={**os.environ, **dict(env.build_env)})
    if not works(env, python):
        raise RuntimeError(f"{env.name}: `import {env.check}` fails in {root} after installing")
    return python


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m rlx.bench.peer_envs",
                                description=__doc__.splitlines()[0])
    p.add_argument("name", choices=sorted(ENVS), help="the peer whose environment to create")
    python = create(ENVS[p.parse_args(argv).name])
    print(python)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
