"""A few RL steps of the tiny config (``rlx.build`` -> ``Run``) on one mesh over every process.

Run as ``python -m tests.helpers.multihost_run_driver --out result.npz --output-dir DIR --num-processes P
--process-id I --coordinator HOST:PORT --local-devices D --rollouts primary|per_host`` once per
process (P = 1 runs alone on D devices, without ``jax.distributed``). ``--resume-after K`` closes
the run after K steps (a checkpoint is saved after each step) and continues in a run built with
``config.resume=latest``. Process 0 writes the per-step losses and records, the prompt uids each
step consumed (all processes'), the final trainable params and the files of the run's export
(``Run.export``) to ``--out``.
``tests/run/test_multihost_run.py`` compares 2 x 4 against 1 x 8.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from tests.helpers.multiprocess import add_process_args, start_devices

STEPS = 3
REWARD = "test:text_hash"  # a random tiny model never solves arithmetic; this varies per sample
# Process-count independent fields of a step record (the rest are timings and throughputs).
COMPARED = ("learner/loss", "learner/pg_loss", "learner/kl", "learner/grad_norm",
            "learner/mismatch_abs_max", "reward/mean", "response_length/mean", "batch/kept_frac")


def _parse(argv=None) -> argparse.Namespace:
    p = add_process_args(argparse.ArgumentParser(description=__doc__))
    p.add_argument("--output-dir", required=True)
    p.add_argument("--rollouts", choices=("primary", "per_host", "global"), default="primary")
    p.add_argument("--resume-after", type=int, default=0)
    p.add_argument("--max-staleness", type=int, default=0, help="config.train.max_staleness")
    p.add_argument("--train", action="store_true", help="Run.train (preflight, evaluations, "
                   "checkpoints) instead of bare steps")
    p.add_argument("--sglang", choices=("", "lora", "full"), default="",
                   help="rollouts from an SGLang server launched by process 0, in this mode")
    return p.parse_args(argv)


def _sglang(c: dict, mode: str, output_dir: str) -> None:
    """``c`` with rollouts from one CPU SGLang server (tests.helpers.sglang_harness); mode
    "full": full-parameter training on fsdp=8 with a step size that moves the log-probs."""
    from tests.helpers.sglang_harness import SGLANG_PYTHON, cpu_server_args, cpu_server_env

    env = [f"{k}={v}" for k, v in cpu_server_env(os.path.join(output_dir, "harness"))]
    lora = ["--lora-backend", "torch_native"] if mode == "lora" else []
    c["rollout"].update(engine="sglang", sglang=dict(python=SGLANG_PYTHON, env=env,
                                                     extra_args=list(cpu_server_args()) + lora))
    c["quant"]["serving"] = "hf"  # a CPU server serves no quantized base
    c["data"]["eval_size"] = 0
    c["optim"]["learning_rate"] = 1e-2 if mode == "lora" else 1e-3  # one step moves log-probs
    if mode == "full":
        c["train"]["mode"] = "full"
        c["quant"]["format"] = "none"
        c["loss"]["kl_coef"] = 0.0
        c["mesh"].update(data=1, fsdp=8)


def _config(args: argparse.Namespace, resume: bool = False) -> dict:
    from configs.tiny import get_config

    c = get_config().to_dict()
    c["output_dir"] = args.output_dir
    c["resume"] = "latest" if resume else ""
    c["mesh"].update(data=8, fsdp=1, tensor=1, expert=1)
    c["data"].update(prompts_per_step=4)  # 2 per process; x group_size 4 = 16 rows
    # one-step-off runs save only at the end (a mid-run save's data position is not saved yet)
    c["train"].update(steps=STEPS, checkpoint_every=0 if args.max_staleness else 1,
                      reward=REWARD, max_staleness=args.max_staleness)
    c["distributed"] = dict(enabled=args.num_processes > 1, coordinator_address=args.coordinator,
                            num_processes=args.num_processes, process_id=args.process_id,
                            rollouts=args.rollouts, data_shards=2)
    if args.sglang:
        _sglang(c, args.sglang, args.output_dir)
    return c


def _text_hash(completion: str, sample):
    """A deterministic reward in [0, 1] that differs between completions (non-zero advantages)."""
    import zlib

    from rlx.rewards import RewardResult

    return RewardResult(zlib.crc32(completion.encode()) % 7 / 6, "hash")


def _register_reward() -> None:
    from rlx.rewards.base import available_rewards, register

    if REWARD not in available_rewards():
        register(REWARD, lambda **_: _text_hash)


def _recording(run, uids: list):
    """``run.data`` that also notes each batch's prompt uids (a grain iterator like the original)."""
    import grain

    class Recording(grain.DatasetIterator):
        def __init__(self, inner):
            super().__init__(inner)
            self._inner = inner

        def __next__(self):
            batch = next(self._inner)
            uids.append([p.uid for p in batch.prompts])
            return batch

        def get_state(self):
            return self._inner.get_state()

        def set_state(self, state):
            self._inner.set_state(state)

    run.data = Recording(run.data)
    return run


def run(args: argparse.Namespace) -> dict[str, np.ndarray] | None:
    """STEPS steps; on process 0 the results (see the module docstring), else None."""
    import jax

    from rlx.run import multihost
    from rlx.run.build import build

    _register_reward()
    uids: list[list[str]] = []
    first = _recording(build(_config(args), progress=False), uids)
    records = []
    if args.train:
        records = [r for r in first.train(STEPS) if "learner/loss" in r]
    else:
        for _ in range(args.resume_after or STEPS):
            records.append(first.step())
            first.save()
    current = first
    if args.resume_after:
        first.close()
        current = _recording(build(_config(args, resume=True), progress=False), uids)
        assert current.step_count == args.resume_after, current.step_count
        while current.step_count < STEPS:
            records.append(current.step())
    params = multihost.to_host(current.compiled.state.params)
    everyone = multihost.allgather_objects(uids)  # each process's uids per step
    evals = [r["eval/accuracy"] for r in current.metrics if "eval/accuracy" in r]
    preflight = [r["preflight/max_abs"] for r in current.metrics if "preflight/max_abs" in r]
    texts = current.generate(["What is 2 + 3?"], max_new_tokens=4)
    exported = current.export(os.path.join(args.output_dir, "export"))
    version = current.engine.weight_version if current.engine is not None else -1
    current.close()
    if not multihost.is_primary():
        return None
    leaves = jax.tree_util.tree_leaves_with_path(params)
    out = {"param:" + jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}
    for name in COMPARED:
        out["record:" + name] = np.array([r[name] for r in records])
    out["uids"] = np.array([[u for part in everyone for u in part[s]] for s in range(STEPS)])
    out["evals"], out["preflight"] = np.array(evals), np.array(preflight)
    out["generated"] = np.array(texts)
    out["exported"] = np.array(sorted(os.listdir(exported["policy"])))
    out["steps"] = np.array(current.step_count)
    out["engine_version"] = np.array(version)
    out["process_count"] = np.array(jax.process_count())
    out["device_count"] = np.array(jax.device_count())
    return out


def main(argv=None) -> None:
    args = _parse(argv)
    start_devices(args, distributed=False)  # the run joins the processes from its config
    result = run(args)
    if result is not None:
        np.savez(args.out, **result)


if __name__ == "__main__":
    main()
