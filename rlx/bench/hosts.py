"""``python -m rlx.bench hosts``: what each process of a multi-process run holds.

``configs/tiny.py`` in full mode (every parameter trained with AdamW, no KL term), its model
shrunk to ``--width`` and ``--layers`` (1024 and 6: 126M parameters with SmolLM2's 49,152-token
vocabulary, about 2 GB of f32 weights, gradients and moments), on a mesh of 8 CPU devices
(``fsdp=8``), runs ``--steps`` RL steps with the built-in engine, as one process of 8 devices
and as 2 processes of 4 (gloo collectives over localhost) for each ``distributed.rollouts`` mode
asked (``--rollouts``: "global" runs the engine over the whole mesh on the learner's arrays,
"primary" on process 0 from a host copy of the model). Each process reports its peak resident
memory (``ru_maxrss``: weights, engine, compilation, everything). Runs one after another, never
side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time


def _config(args: argparse.Namespace, out: str, processes: int, index: int, coordinator: str):
    from configs.tiny import get_config

    c = get_config().to_dict()
    c["model"]["shrink"].update(hidden_size=args.width, intermediate_size=3 * args.width,
                                num_layers=args.layers, num_heads=args.width // 64,
                                num_kv_heads=max(1, args.width // 256), head_dim=64)
    c["quant"].update(format="none")
    c["mesh"].update(data=1, fsdp=8, tensor=1, expert=1)
    c["data"].update(prompts_per_step=4)
    c["train"].update(mode="full", steps=args.steps, checkpoint_every=0, sample_every=0,
                      eval_every=0)
    c["loss"].update(kl_coef=0.0)
    c["optim"].update(learning_rate=1e-5)
    c["output_dir"] = out
    c["distributed"] = dict(enabled=processes > 1, coordinator_address=coordinator,
                            num_processes=processes, process_id=index,
                            rollouts=args.rollout_mode, data_shards=2)
    return c


def worker(args: argparse.Namespace) -> dict:
    """This process's part: ``--steps`` steps, then its peak RSS (MB) and what it ran."""
    import jax

    jax.config.update("jax_num_cpu_devices", 8 // args.processes)
    from rlx.run.build import build

    run = build(_config(args, args.out, args.processes, args.index, args.coordinator),
                progress=False)
    start = time.perf_counter()
    for _ in range(args.steps):
        run.step()
    seconds = time.perf_counter() - start
    params = sum(x.size for x in jax.tree.leaves(run.compiled.state.params))
    run.close()
    return {"process": jax.process_index(), "peak_rss_mb":
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "seconds": seconds,
            "params": int(params)}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(argv: list[str], processes: int, mode: str, root: str) -> list[dict]:
    """Every process of one run at once; their reports (process order)."""
    coordinator = f"127.0.0.1:{_port()}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
    procs = []
    for i in range(processes):
        out = os.path.join(root, f"{mode}-{processes}-{i}")
        cmd = [sys.executable, "-m", "rlx.bench", "hosts", *argv, "--worker", "--processes",
               str(processes), "--index", str(i), "--coordinator", coordinator,
               "--rollout-mode", mode, "--out", out]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    reports = []
    for p in procs:
        stdout, stderr = p.communicate()
        if p.returncode:
            raise RuntimeError(f"a process of the {processes}-process {mode!r} run exited with "
                               f"{p.returncode}: {stderr.strip()[-int(os.environ.get('RLX_BENCH_TAIL', 2000)):]}")
        reports.append(json.loads(stdout.strip().splitlines()[-1]))
    return reports


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m rlx.bench hosts",
                                description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rollouts", default="global,primary", help="distributed.rollouts modes")
    for name, kind in (("--worker", None), ("--processes", int), ("--index", int),
                       ("--coordinator", str), ("--rollout-mode", str), ("--out", str)):
        p.add_argument(name, **({"action": "store_true"} if kind is None else
                                {"type": kind, "default": kind()}), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return 0
    own = ["--width", str(args.width), "--layers", str(args.layers), "--steps", str(args.steps)]
    print(f"{'run':<26}{'process':>8}{'peak RSS GB':>12}{'steps s':>9}", flush=True)
    with tempfile.TemporaryDirectory() as root:
        runs = [("1 x 8", 1, "global")] + [(f"2 x 4, {m}", 2, m) for m in args.rollouts.split(",")]
        for name, processes, mode in runs:
            for r in _launch(own, processes, mode, root):
                print(f"{name:<26}{r['process']:>8}{r['peak_rss_mb'] / 1024:>12.2f}"
                      f"{r['seconds']:>9.1f}", flush=True)
        print(f"parameters: {r['params'] / 1e6:.0f}M", flush=True)
    return 0
