"""Tool-use episodes as the loop's rollouts (`rlx.envs.runner`, `config.env.kind = "tools"`).

Scripted policies (tests/helpers/envs.py) drive `EnvRunner` for the bookkeeping: rollout order,
loss masks, rewards with the format term, reasons, transcripts, metrics, and every kind of bad
model output as a scored episode. The tiny config's real run (random 2-layer SmolLM2, int8 base +
LoRA, built-in engine, one-step-off, dynamic sampling) trains one step on forced three-turn
episodes: the sampler's log-probs of the policy's tokens equal the learner's within 1e-5 (f32) with
the tool tokens in the sequence and out of the mask.
"""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

from rlx.config import parse_config
from rlx.data.chat import PromptFormat
from rlx.data.sources import Message, user_example
from rlx.envs.base import Observation, StepInfo, StepResult
from rlx.envs.runner import EnvRunner, evaluate_episodes, make_runner
from rlx.errors import ConfigError
from rlx.rewards import RewardResult
from rlx.types import SamplingParams
from tests.helpers.envs import ScriptedEngine, ShortTurns, call, solver
from tests.helpers.runs import config_dict
from tests.helpers.tokenizers import smollm2_tokenizer

TASK = user_example("calc:1", "toy", "Compute (17*23)+5 using the calculator, then answer in "
                    "\\boxed{}.", answer="396")
SAMPLING = SamplingParams(max_new_tokens=96, n=2)


def exact(completion: str, sample) -> RewardResult:
    found = re.findall(r"\\boxed\{(.*?)\}", completion)
    return RewardResult(float(bool(found) and found[-1] == sample["answer"]), "exact")


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def runner(tok, **kw) -> EnvRunner:
    args = dict(max_turns=4, max_episode_tokens=400)
    return make_runner(("calculator",), exact, tok, PromptFormat(), **{**args, **kw})


def test_episodes_become_ordered_masked_scored_rollouts(tok):
    env = runner(tok, format_coef=0.25)
    other = user_example("calc:2", "toy", TASK.prompt, answer="0")  # graded wrong
    rollouts = env.generate(ScriptedEngine(tok, solver), [TASK, other], SAMPLING)
    assert [(r.prompt_uid, r.sample_index) for r in rollouts] == [
        ("calc:1", 0), ("calc:1", 1), ("calc:2", 0), ("calc:2", 1)]
    # right answer after two good calls: 1 + 0.25; wrong answer, good calls: 0 + 0.25
    assert [r.reward for r in rollouts] == [1.25, 1.25, 0.25, 0.25]
    for r in rollouts:
        assert r.finish_reason == "stop" and r.weight_version == ScriptedEngine.weight_version
        mask = r.completion_mask.astype(bool)
        assert 0 < mask.sum() < len(mask)  # tool turns in the sequence, out of the loss
        assert np.all(r.sampler_logp[mask] < 0) and not r.sampler_logp[~mask].any()
        tool_text = tok.decode(r.completion_ids[~mask].tolist())
        assert "<tool_response>\n391\n</tool_response>" in tool_text
    rewards, texts, reasons, metrics = env.scores(rollouts)
    assert rewards.tolist() == [1.25, 1.25, 0.25, 0.25]
    assert texts[0].startswith("[user] Compute") and "[tool] 391" in texts[0]
    assert reasons[0] == "final_answer: exact"
    assert metrics["env/tool_call_rate"] == 1.0 and metrics["env/tool_calls"] == 2.0
    assert metrics["env/turns"] == 3.0 and metrics["env/outcome"] == 0.5
    assert metrics["env/finish_final_answer"] == 1.0
    assert env.scores(rollouts)[3] == {}  # each episode is handed over once


def test_evaluation_in_chunks_plays_every_example_once(tok):
    """``chunk``: at most that many episodes at once; the same figures as one call."""
    env = runner(tok)
    examples = [user_example(f"calc:{i}", "toy", TASK.prompt, answer=("396", "0")[i % 2])
                for i in range(5)]
    engine, sizes = ScriptedEngine(tok, solver), []
    generate = engine.generate
    engine.generate = lambda prompts, sampling: sizes.append(len(prompts)) or generate(
        prompts, sampling)
    whole = evaluate_episodes(env, engine, examples, SAMPLING)
    assert max(sizes) == 5
    sizes.clear()
    chunked = evaluate_episodes(env, engine, examples, SAMPLING, chunk=2)
    assert max(sizes) == 2
    assert chunked == whole and whole["eval/accuracy"] == 0.6


@pytest.mark.parametrize("turn,reason,tool_text", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}</tool_call>',
     "turn_limit", "not valid JSON"),
    (call("1+1").replace("calculator", "abacus"), "turn_limit", "unknown tool 'abacus'"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": 7}}</tool_call>',
     "turn_limit", "argument 'expression' must be of type string"),
    (call("9**9**9**9"), "turn_limit", "calculator error: result too large"),
    ("I keep thinking " * 40, "length", None),  # never ends: cut at the token budget
])
def test_bad_model_output_is_a_scored_episode_with_its_reason(tok, turn, reason, tool_text):
    env = runner(tok, max_turns=2, max_episode_tokens=120)
    (rollout,) = env.generate(ScriptedEngine(tok, lambda _: turn), [TASK],
                              SamplingParams(max_new_tokens=64))
    rewards, texts, reasons, metrics = env.scores([rollout])
    assert rewards.tolist() == [0.0] and reasons[0].startswith(reason)
    assert metrics[f"env/finish_{reason}"] == 1.0
    if tool_text:
        assert tool_text in texts[0] and metrics["env/tool_errors"] == 1.0


def test_overlong_tool_output_ends_the_episode_at_the_budget(tok):
    (rollout,) = make_runner(("tests.envs.test_runner:shout",), exact, tok, PromptFormat(),
                             max_turns=3, max_episode_tokens=200).generate(
        ScriptedEngine(tok, lambda _: '<tool_call>{"name": "shout", "arguments": '
                                      '{"word": "hey"}}</tool_call>'),
        [TASK], SamplingParams(max_new_tokens=64))
    assert rollout.reward == 0.0 and rollout.finish_reason == "length"
    assert len(rollout.completion_ids) <= 200


def shout(word: str) -> str:
    """Repeat a word, loudly."""
    return (word.upper() + " ") * 1000


def test_env_section_is_validated(tmp_path):
    def parse(**dotted):
        return parse_config(config_dict("tiny", tmp_path, **dotted))

    assert parse().env.kind == "single"
    with pytest.raises(ConfigError, match="config.env.kind"):
        parse(**{"env.kind": "chat"})
    with pytest.raises(ConfigError, match="config.env.tools is empty"):
        parse(**{"env.kind": "tools", "env.tools": []})
    with pytest.raises(ConfigError, match="rollout.partial"):
        parse(**{"env.kind": "tools", "rollout.partial": True, "train.max_staleness": 1})


class Chatter:
    """An env that answers every turn with a tool message until its third turn ends the
    episode (reward 1 for a turn that mentions "a"), whatever the model writes."""

    def reset(self, example):
        self.turn = 0
        return Observation((Message("user", example.prompt),))

    def step(self, text):
        self.turn += 1
        if self.turn == 3:
            result = RewardResult(float("a" in text), "has a")
            return StepResult(Observation(()), result.score, True,
                              StepInfo(self.turn, "final_answer", reward_result=result))
        return StepResult(Observation((Message("tool", f"turn {self.turn} seen"),)), 0.0, False,
                          StepInfo(self.turn, "tool_calls", tool_calls=1))


def _continued(rollout) -> int:
    """Tokens an engine continuing each turn from its KV cache prefills for ``rollout``'s
    episode: the prompt, then per tool turn its tokens and the sampled token before them."""
    mask = rollout.completion_mask
    env_runs = np.sum((mask[1:] == 0) & (mask[:-1] == 1))  # a tool turn after a model turn
    return len(rollout.prompt_ids) + int((mask == 0).sum()) + int(env_runs)


def test_tiny_run_trains_on_three_turn_episodes_with_learner_parity(tmp_path):
    """One-step-off (the next batch's episodes are generated while this one trains) with dynamic
    sampling, on the lockstep engine, whose prefix cache continues a row at its exact last token
    (the continuous engine's shares whole pages: ``tests/rollout/jax/test_prefix_cache.py``)."""
    from rlx.run.build import build

    cfg = config_dict("tiny", tmp_path / "run", **{
        "env.kind": "tools", "env.max_episode_tokens": 256, "rollout.max_new_tokens": 16,
        "train.steps": 1, "train.max_staleness": 1, "train.dynamic_sampling": True,
        "data.eval_size": 0, "train.checkpoint_every": 0, "mesh.data": 8,
        "rollout.jax.batching": "lockstep"})
    run = build(cfg, progress=False)
    try:
        run.env = EnvRunner(Chatter, run.tokenizer, max_episode_tokens=96)
        run.engine = ShortTurns(run.engine)
        batches, generate = [], run.env.generate

        def recording(*args):  # keeps the rollouts made (this step's and the next's)
            out = generate(*args)
            batches.append(out)
            return out

        run.env.generate = recording
        record = run.step()
        assert record["env/turns"] == 3.0 and record["env/finish_final_answer"] == 1.0
        for r in (r for batch in batches for r in batch):
            mask = r.completion_mask.astype(bool)
            assert mask.sum() >= 3 and (~mask).sum() >= 2 * len(run.tokenizer.encode(
                "turn 1 seen"))  # the policy's turns in the loss, the tool turns out of it
        # each turn continued from the engine's KV cache: it prefilled every prompt and then only
        # each tool turn and the sampled token before it
        assert record["env/prefilled_tokens"] == sum(_continued(r) for r in batches[0])
        # the learner's log-probs of the sampled tokens (mask 1) vs the engine's: f32 parity
        assert record["learner/mismatch_abs_max"] <= 1e-5, record["learner/mismatch_abs_max"]
        assert np.isfinite(record["learner/loss"]) and record["learner/kl"] >= 0
        # run.generate(texts, tools=...) shows whole episodes (here a scripted policy's)
        run.engine = ScriptedEngine(run.tokenizer, solver)
        (text,) = run.generate([TASK.prompt], tools=["calculator"], max_new_tokens=64)
        assert text.startswith(f"[user] {TASK.prompt}\n[assistant] First 17*23.")
        assert "[tool] 391" in text and "[tool] 396" in text
        assert text.endswith("[assistant] The result is \\boxed{396}.")
        # run.evaluate() runs held-out episodes: accuracy and the tool metrics
        run.env, run.eval_set = runner(run.tokenizer, format_coef=0.5), [TASK]
        run.cfg = dataclasses.replace(run.cfg, rollout=dataclasses.replace(
            run.cfg.rollout, max_new_tokens=64))  # room for the scripted calls
        record = run.evaluate()
        assert record["eval/accuracy"] == 1.0 and record["eval/mean_reward"] == 1.5
        assert record["eval/tool_call_rate"] == 1.0 and record["eval/tool_calls"] == 2.0
        # the end-of-run summary prints the tool-call rate and correct answers per step
        lines = run.summary().splitlines()
        assert f"tool-call rate per step: {run.metrics[0]['env/tool_call_rate']:.2f}" in lines
        assert f"correct per step: {run.metrics[0]['env/outcome']:.2f}" in lines
    finally:
        run.close()
    # the step's samples (tensorboard text and samples.jsonl) are whole transcripts
    with open(tmp_path / "run" / "samples.jsonl", encoding="utf-8") as f:
        samples = [json.loads(line) for line in f]
    assert samples and all("[tool] turn 1 seen" in s["completion"] for s in samples)


def test_a_resumed_synchronous_tool_run_ends_bit_identical(tmp_path):
    """Tool episodes, synchronous: 2 steps straight, and 1 step + resume + 1 step from its
    checkpoint, end on the same adapter bits."""
    import jax

    from rlx.run.build import build

    def trained(out, steps, **extra):
        cfg = config_dict("tiny", out, **{
            "env.kind": "tools", "env.max_episode_tokens": 64, "rollout.max_new_tokens": 8,
            "train.steps": steps, "data.eval_size": 0, "train.checkpoint_every": 1,
            "mesh.data": 8, **extra})
        run = build(cfg, progress=False)
        try:
            run.train()
            return [np.asarray(x) for x in jax.tree.leaves(run.compiled.state.params)]
        finally:
            run.close()

    straight = trained(tmp_path / "straight", 2)
    first = trained(tmp_path / "cut", 1)
    resumed = trained(tmp_path / "cut", 2, **{"resume": "latest"})
    assert len(straight) == len(resumed) == len(first) > 0
    assert any(not np.array_equal(a, b) for a, b in zip(straight, first))  # step 2 moved them
    for a, b in zip(straight, resumed):
        np.testing.assert_array_equal(a, b)
