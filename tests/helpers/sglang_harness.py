"""Running a real SGLang server on a CPU-only test machine.

Two workarounds belong to this test harness only (never to rlx itself):
- SGLang's kernel package loads ``libcuda.so.1`` even when it runs on the CPU; a one-symbol stub
  library, built here with the system C compiler, satisfies the loader.
- On a CPU, SGLang's LoRA path pins host memory; a ``sitecustomize.py`` on the server's
  ``PYTHONPATH`` turns pinning (``Tensor.pin_memory`` and the ``pin_memory=`` argument of the
  tensor factories) into a no-op in the server process.

``cpu_server_args`` also passes ``--sleep-on-idle``: without it an idle server's scheduler polls
its sockets in a busy loop and holds most of one core, which on a 2-core machine slowed every
test (and every benchmark side) that ran while a server was up.

The SGLang interpreter is ``$RLX_SGLANG_PYTHON`` or the venv that ``.ci/sglang_env.sh`` creates.
"""

from __future__ import annotations

import os
import subprocess

SGLANG_PYTHON = os.environ.get(
    "RLX_SGLANG_PYTHON", os.path.expanduser("~/.cache/rlx/sglang-0.5.23/bin/python"))

_STUB_C = "int cuPointerGetAttribute(void* a, int b, unsigned long long c) { return 100; }\n"
_SITECUSTOMIZE = """\
import functools
import torch

torch.Tensor.pin_memory = lambda self, *args, **kwargs: self


def _unpinned(make):
    @functools.wraps(make)
    def wrapper(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return make(*args, **kwargs)
    return wrapper


for _name in ("tensor", "empty", "zeros", "ones", "full", "arange", "as_tensor", "empty_like",
              "zeros_like", "ones_like"):
    setattr(torch, _name, _unpinned(getattr(torch, _name)))
"""


def sglang_available() -> bool:
    return os.path.exists(SGLANG_PYTHON)


def harness_dir(root: str) -> str:
    """Build the libcuda stub and the sitecustomize shim under ``root``; return the folder."""
    os.makedirs(root, exist_ok=True)
    lib = os.path.join(root, "libcuda.so.1")
    if not os.path.exists(lib):
        src = os.path.join(root, "cuda_stub.c")
        with open(src, "w") as f:
            f.write(_STUB_C)
        subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", lib, src],
                       check=True)
    with open(os.path.join(root, "sitecustomize.py"), "w") as f:
        f.write(_SITECUSTOMIZE)
    return root


def cpu_server_env(root: str) -> tuple[tuple[str, str], ...]:
    d = harness_dir(root)
    ld = ":".join(p for p in (d, os.environ.get("LD_LIBRARY_PATH", "")) if p)
    return (("SGLANG_USE_CPU_ENGINE", "1"), ("LD_LIBRARY_PATH", ld), ("PYTHONPATH", d),
            ("OMP_WAIT_POLICY", "PASSIVE"))


def cpu_server_args(lora_rank: int = 0) -> tuple[str, ...]:
    args = ("--device", "cpu", "--attention-backend", "torch_native", "--skip-server-warmup",
            "--max-total-tokens", "8192", "--dtype", "float32", "--disable-cuda-graph",
            "--sleep-on-idle")
    if lora_rank:
        args += ("--enable-lora", "--max-lora-rank", str(lora_rank), "--lora-target-modules",
                 "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                 "--lora-backend", "torch_native")
    return args
