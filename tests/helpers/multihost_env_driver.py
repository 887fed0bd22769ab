"""One RL step of the tiny config on three-turn tool-use episodes, on one mesh over every process.

Run as ``python -m tests.helpers.multihost_env_driver --out result.npz --output-dir DIR
--num-processes P --process-id I --coordinator HOST:PORT --local-devices D --rollouts
global|primary|per_host`` once per process. The tiny config (random shrunken SmolLM2, int8 base + LoRA,
GRPO) runs ``env.kind="tools"`` with 2 prompts x 4 episodes per step (one data shard per process);
the episodes' env answers every turn with a tool message and ends the third (with a reward that
is a hash of that turn's text, so that rewards differ within a group), and every odd token id also
stops a turn, so the random policy's episodes run all three turns. Every process writes ``--out`` with its process index appended: the step's
record, the trainable parameters (all-gathered), and the (prompt uid, sample) of the episodes
this process's engine ran, and how many env steps this process took. ``tests/run/test_multihost_env.py``
compares them.
"""

from __future__ import annotations

import argparse
import zlib

import numpy as np

from tests.helpers.multiprocess import add_process_args, start_devices

# Process-count independent fields of the step record (the rest are timings and throughputs).
COMPARED = ("learner/loss", "learner/grad_norm", "learner/mismatch_abs_max", "reward/mean",
            "response_length/mean", "env/turns", "env/prefilled_tokens")


def _parse(argv=None) -> argparse.Namespace:
    p = add_process_args(argparse.ArgumentParser(description=__doc__))
    p.add_argument("--output-dir", required=True)
    p.add_argument("--rollouts", choices=("global", "primary", "per_host"), default="global")
    return p.parse_args(argv)


def _config(args: argparse.Namespace) -> dict:
    from configs.tiny import get_config

    c = get_config().to_dict()
    c["output_dir"] = args.output_dir
    c["mesh"].update(data=8, fsdp=1, tensor=1, expert=1)
    c["data"].update(prompts_per_step=2, eval_size=0)  # 1 per process; x 4 episodes
    c["rollout"].update(max_new_tokens=16)
    c["env"] = dict(kind="tools", max_episode_tokens=256)  # the tiny config has no env section
    c["train"].update(steps=1, checkpoint_every=0)
    c["distributed"] = dict(enabled=args.num_processes > 1, coordinator_address=args.coordinator,
                            num_processes=args.num_processes, process_id=args.process_id,
                            rollouts=args.rollouts, data_shards=2)
    return c


class Chatter:
    """An env that answers every turn with a tool message until its third turn ends the
    episode, whatever the model writes (reward: a hash of the last turn's text in [0, 1]).
    ``steps`` counts this process's env steps."""

    steps = 0

    def reset(self, example):
        from rlx.data.sources import Message
        from rlx.envs.base import Observation

        self.turn = 0
        return Observation((Message("user", example.prompt),))

    def step(self, text):
        from rlx.data.sources import Message
        from rlx.envs.base import Observation, StepInfo, StepResult
        from rlx.rewards import RewardResult

        self.turn += 1
        Chatter.steps += 1
        if self.turn == 3:
            result = RewardResult(zlib.crc32(text.encode()) % 7 / 6, "hash")
            return StepResult(Observation(()), result.score, True,
                              StepInfo(self.turn, "final_answer", reward_result=result))
        return StepResult(Observation((Message("tool", f"turn {self.turn} seen"),)), 0.0, False,
                          StepInfo(self.turn, "tool_calls", tool_calls=1))


def run(args: argparse.Namespace) -> dict[str, np.ndarray]:
    import jax

    from rlx.envs.runner import EnvRunner
    from rlx.run import multihost
    from rlx.run.build import build
    from tests.helpers.envs import ShortTurns

    step = build(_config(args), progress=False)
    ran = []
    try:
        step.env = EnvRunner(Chatter, step.tokenizer, max_episode_tokens=96,
                             share=step.env.share)
        if step.engine is not None:  # primary: only process 0 samples
            step.engine = ShortTurns(step.engine)
        generate = step.env.generate

        def recording(engine, examples, sampling):
            out = generate(engine, examples, sampling)
            ran.extend((r.prompt_uid, r.sample_index, r.reward, r.completion_ids) for r in out)
            return out

        step.env.generate = recording
        record = step.step()
        params = multihost.to_host(step.compiled.state.params)
    finally:
        step.close()
    leaves = jax.tree_util.tree_leaves_with_path(params)
    out = {"param:" + jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}
    out.update({"record:" + name: np.array(record.get(name, np.nan)) for name in COMPARED})
    out["ran"] = np.array([f"{uid}#{j}" for uid, j, *_ in ran], dtype=str)
    out["rewards"] = np.array([reward for _, _, reward, _ in ran], np.float64)
    out["tokens"] = np.array([" ".join(map(str, ids)) for *_, ids in ran], dtype=str)
    out["env_steps"] = np.array(Chatter.steps)
    out["process_index"] = np.array(jax.process_index())
    out["process_count"] = np.array(jax.process_count())
    return out


def main(argv=None) -> None:
    args = _parse(argv)
    start_devices(args, distributed=False)  # the run joins the processes from its config
    result = run(args)
    np.savez(f"{args.out}.{int(result['process_index'])}.npz", **result)


if __name__ == "__main__":
    main()
