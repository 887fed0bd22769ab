"""The RL loop end to end on the tiny config (random shrunken SmolLM2, int8 base + LoRA)."""

import os

import numpy as np
import pytest

from rlx.io.metrics import read_metrics
from rlx.run.build import build
from tests.helpers.runs import run_config


def test_tiny_run_trains_logs_and_generates(tmp_path):
    run = build(run_config("tiny", tmp_path, **{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}),
                progress=False)
    try:
        records = run.train()
        steps = [r for r in records if "reward/mean" in r]
        assert [r["step"] for r in steps] == [1, 2]
        for key in ("learner/loss", "learner/kl", "learner/grad_norm", "learner/mismatch_abs_max",
                    "reward/mean", "response_length/mean", "time/generate", "time/update",
                    "throughput/gen_tokens_per_s"):
            assert all(np.isfinite(r[key]) for r in steps), key
        assert all(r["learner/mismatch_abs_max"] < 1e-3 for r in steps)  # engine == learner
        assert sum("eval/accuracy" in r for r in records) == 2  # at the start and the end
        run.evaluate()  # step 2 again: the summary has one line per evaluated step
        summary = run.summary().splitlines()
        assert [line.split(":")[0] for line in summary if "held-out" in line] == [
            "held-out greedy accuracy at step 0", "held-out greedy accuracy at step 2"], summary
        (pre,) = [r for r in records if "preflight/max_abs" in r]  # before training
        assert pre["step"] == 0 and pre["preflight/max_abs"] <= 1e-5
        assert run.compiled.state.step == 2 and run.engine.weight_version == 2
        texts = run.generate(["What is 2 + 3?"], max_new_tokens=4)
        from rlx.types import Prompt, SamplingParams

        # greedy (eval temperature 0): the engine gives the same tokens again for the same
        # chat-templated prompt; the text is exactly their decoding, special tokens dropped
        assert run.cfg.rollout.eval_temperature == 0.0
        ids = run.tokenizer.encode_chat([{"role": "user", "content": "What is 2 + 3?"}],
                                        add_generation_prompt=True)
        (out,) = run.engine.generate([Prompt("check", tuple(ids))], SamplingParams(
            max_new_tokens=4, temperature=0.0, stop_token_ids=(run.tokenizer.eos_id,),
            logprobs=False))
        decoded = run.tokenizer.decode(out.completion_ids.tolist(), skip_special_tokens=True)
        assert texts == [decoded]
    finally:
        run.close()
    logged = read_metrics(os.path.join(str(tmp_path / "tiny"), "metrics.jsonl"))
    assert any("reward/mean" in r for r in logged)
    import json

    with open(os.path.join(str(tmp_path / "tiny"), "samples.jsonl"), encoding="utf-8") as f:
        samples = [json.loads(line) for line in f]
    assert samples and all(s["reason"] == "no answer found" for s in samples)  # why it scored 0


@pytest.mark.slow  # CI: tests/test_configs.py runs the same shrunken quickstart step
def test_quickstart_config_runs_one_shrunken_step(tmp_path):
    """The README's main job, shrunken: same data, reward, loss and engine; random tiny weights."""
    cfg = run_config("quickstart", tmp_path, **{
        "model.shrink.enabled": True, "quant.format": "int8", "quant.serving": "hf",
        "mesh.data": 8, "data.prompts_per_step": 2, "data.eval_size": 2, "rollout.group_size": 4,
        "rollout.max_new_tokens": 4, "train.steps": 1, "train.micro_batches": 1})
    run = build(cfg, progress=False)
    try:
        record = run.step()
        assert np.isfinite(record["learner/loss"]) and record["batch/kept_frac"] == 1.0
        record = run.evaluate()
        # one greedy answer to each of the data.eval_size = 2 problems, graded 0 or 1 by the
        # math reward: accuracy is correct/2, and the mean reward of the same answers
        assert len(run.eval_set) == 2
        assert record["eval/accuracy"] in (0.0, 0.5, 1.0)
        assert record["eval/accuracy"] == record["eval/mean_reward"]
    finally:
        run.close()


def test_preflight_stops_a_run_whose_engine_serves_another_policy(tmp_path):
    import jax
    from flax import nnx

    from rlx.rollout.preflight import PreflightError

    run = build(run_config("tiny", tmp_path, **{"mesh.data": 8}), progress=False)
    try:
        graphdef, lora, rest = nnx.split(run.compiled.model(), nnx.LoRAParam, ...)
        keys = iter(jax.random.split(jax.random.key(3), 64))
        lora = jax.tree.map(lambda x: x + 0.5 * jax.random.normal(next(keys), x.shape), lora)
        run.engine.update_weights(nnx.merge(graphdef, lora, rest), version=7)  # not the learner's
        with pytest.raises(PreflightError, match=r"jax \(base format int8\) and the learner disagree"):
            run.train(1)
    finally:
        run.close()
