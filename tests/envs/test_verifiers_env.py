"""verifiers 0.4 environments played with rlx's engine (`rlx.envs.verifiers_env`,
``config.env.kind = "verifiers"``).

Three environments built here from local data (tests/helpers/vf_tasksets): single-turn sums with
a two-reward rubric, a guessing game played over several turns through its `guess` tool, and
Python function tools (`add`, `multiply`). A scripted policy plays them: the rewards are the
environments' own scoring (verifiers' ``Task.score`` over the transcript), the tool turns are in
the sequence and out of the loss. Each environment then trains one step of the tiny config
(random 2-layer SmolLM2, built-in engine) whose logged rewards are the rubric's.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from rlx.config import parse_config
from rlx.data.chat import PromptFormat
from rlx.envs.verifiers_env import load_verifiers_env, make_verifiers_runner, verifiers_source
from rlx.errors import ConfigError
from rlx.types import SamplingParams
from tests.helpers.envs import ScriptedEngine, ShortTurns
from tests.helpers.runs import config_dict
from tests.helpers.tokenizers import smollm2_tokenizer

ARITH, GUESS, TOOLS = (f"rlx_vf_{name}:load_environment" for name in ("arith", "guess", "tools"))
SAMPLING = SamplingParams(max_new_tokens=96)


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def responses(context: str) -> list[str]:
    return re.findall(r"<tool_response>\n(.*?)\n</tool_response>", context, re.DOTALL)


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def play(tok, reference: str, policy, args: str = "{}", **kw):
    runner = make_verifiers_runner(reference, args, tok, PromptFormat(),
                                   **{"max_turns": 6, "max_episode_tokens": 400, **kw})
    examples = list(verifiers_source(reference, "all", args))
    rollouts = runner.generate(ScriptedEngine(tok, policy), examples, SAMPLING)
    return examples, rollouts, runner.scores(rollouts)


def test_single_turn_rubric_scores_the_reply(tok):
    def policy(context: str) -> str:  # right on 2 + 3 and 12 + 30, wrong elsewhere
        a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)", context)[-1])
        return f"\\boxed{{{a + b if a in (2, 12) else 0}}}"

    examples, rollouts, (rewards, texts, reasons, _) = play(
        tok, ARITH, policy, args='{"system_prompt": "Be brief."}')
    assert [e.uid for e in examples] == [f"verifiers:sum-{i}" for i in range(4)]
    assert [m.role for m in examples[0].messages] == ["system", "user"]  # verifiers_args reach it
    # correct (weight 1) + 0.1 * brevity, brevity = 1 / (1 + len(reply)):
    # "\boxed{5}" and "\boxed{0}" have 9 characters -> 0.1 / 10 = 0.01; "\boxed{42}" 10 -> 0.1 / 11
    assert rewards == pytest.approx([1.01, 0.01, 1 + 0.1 / 11, 0.01], abs=1e-12)
    assert reasons[0] == "final_answer: verifiers: brevity=0.1, correct=1"
    assert texts[1] == "[user] What is 7 + 5? Answer in \\boxed{}.\n[assistant] \\boxed{0}"
    for r in rollouts:  # one turn: every completion token was sampled
        assert r.completion_mask.all() and r.finish_reason == "stop"


def test_guessing_game_runs_turns_until_the_answer(tok):
    def policy(context: str) -> str:  # binary search over the tool's hints
        low, high = 1, int(re.findall(r"from 1 to (\d+)", context)[-1])
        guesses = [int(g) for g in re.findall(r'"number": (\d+)', context)]
        for number, hint in zip(guesses, responses(context)):
            if hint == "correct":
                return f"It is \\boxed{{{number}}}."
            low, high = (number + 1, high) if hint == "higher" else (low, number - 1)
        return call("guess", number=(low + high) // 2)

    examples, rollouts, (rewards, texts, reasons, metrics) = play(tok, GUESS, policy)
    # secret 6; from 1 to 8: 4 (higher), 6 (correct); to 10: 5, 8 (lower), 6; to 16: 8, 4, 6
    turns = {"verifiers:guess-8": 3, "verifiers:guess-10": 4, "verifiers:guess-16": 4}
    assert [r.prompt_uid for r in rollouts] == list(turns)
    # found (1) + 0.5 * few_guesses (1 / guesses): 1 + 0.5 / 2, 1 + 0.5 / 3, 1 + 0.5 / 3
    assert rewards == pytest.approx([1.25, 1 + 0.5 / 3, 1 + 0.5 / 3], abs=1e-12)
    assert metrics["env/turns"] == pytest.approx(np.mean(list(turns.values())))
    assert metrics["env/finish_final_answer"] == 1.0 and metrics["env/tool_errors"] == 0.0
    for r in rollouts:
        mask = r.completion_mask.astype(bool)
        env_text = tok.decode(r.completion_ids[~mask].tolist())
        assert "<tool_response>\ncorrect\n</tool_response>" in env_text  # the env's turns ...
        assert "correct" not in tok.decode(r.completion_ids[mask].tolist())  # ... not trained
        assert np.all(r.sampler_logp[mask] < 0) and not r.sampler_logp[~mask].any()
    assert "[tool] higher" in texts[0] and texts[0].endswith("It is \\boxed{6}.")


def test_python_function_tools_answer_calls(tok):
    def policy(context: str) -> str:
        a, b, c = map(int, re.findall(r"Compute \((\d+) \+ (\d+)\) \* (\d+)", context)[-1])
        done = responses(context)
        if not done:
            return call("add", a=a, b=b)
        if len(done) == 1:
            return call("multiply", a=int(done[0]), b=c)
        return f"\\boxed{{{done[-1]}}}"

    _, rollouts, (rewards, texts, _, metrics) = play(tok, TOOLS, policy)
    assert rewards.tolist() == [1.0, 1.0]  # (3 + 4) * 5 = 35, (2 + 8) * 3 = 30
    assert "[tool] 7\n" in texts[0] and "[tool] 35\n" in texts[0]  # async multiply awaited
    assert metrics["env/tool_calls"] == 2.0 and metrics["env/turns"] == 3.0
    for r in rollouts:
        assert 0 < r.completion_mask.sum() < len(r.completion_mask)


@pytest.mark.parametrize("reference, problem", [
    ("rlx_vf_arith", "not a function reference 'package.module:function'"),
    ("no_such_module_here:load_environment", "cannot import 'no_such_module_here'"),
    ("rlx_vf_arith:nothing", "rlx_vf_arith has no function 'nothing'"),
    ("builtins:dict", "returned a dict, not a verifiers.v1.Env"),
])
def test_bad_references_get_one_line(reference, problem):
    with pytest.raises(ValueError, match=re.escape(problem)) as error:
        load_verifiers_env(reference)
    assert "\n" not in str(error.value)


def test_config_refuses_a_bad_reference_or_arguments(tmp_path):
    from rlx.run.build import run_source

    def cfg(**dotted):
        return parse_config(config_dict("tiny", tmp_path, **{"env.kind": "verifiers", **dotted}))

    with pytest.raises(ConfigError, match="'package.module:function'"):
        cfg(**{"env.verifiers": "no_colon"})
    with pytest.raises(ConfigError, match="must be a JSON object"):
        cfg(**{"env.verifiers": ARITH, "env.verifiers_args": "[1]"})
    with pytest.raises(ConfigError, match=r"^config.env.verifiers='nope:f': cannot import"):
        run_source(cfg(**{"env.verifiers": "nope:f"}), "train")
    assert [e.uid for e in run_source(cfg(**{"env.verifiers": GUESS}), "eval")] == [
        "verifiers:guess-8"]  # rlx's prompt-hash split of the environment's tasks


@pytest.mark.parametrize("reference, prefix", [  # about a minute each on 2 shared cores
    pytest.param(ARITH, "", marks=pytest.mark.slow),
    pytest.param(GUESS, "<tool_call>\n", marks=pytest.mark.slow),
    (TOOLS, "<tool_call>\n")])
def test_tiny_step_trains_on_the_rubric_rewards(reference, prefix, tmp_path):
    """The random policy's episodes (its turns cut short; the tool envs' first turn opened with
    a call, which the random text breaks, so an error turn follows): the step's rewards are the
    environment's scoring of them, the env's tokens out of the loss."""
    from rlx.envs.verifiers_env import score_transcript
    from rlx.run.build import build

    cfg = config_dict("tiny", tmp_path / "run", **{
        "env.kind": "verifiers", "env.verifiers": reference, "env.max_turns": 2,
        "env.assistant_prefix": prefix, "env.max_episode_tokens": 96,
        "rollout.max_new_tokens": 12, "train.steps": 1, "data.eval_size": 0,
        "train.checkpoint_every": 0, "mesh.data": 8, "rollout.jax.batching": "lockstep"})
    run = build(cfg, progress=False)
    try:
        run.engine = ShortTurns(run.engine)
        made, episodes = [], run.env.episodes

        def recording(*args):
            out = episodes(*args)
            made.extend(out)
            return out

        run.env.episodes = recording
        record = run.step()
    finally:
        run.close()
    env = run.env.make_env()
    graded = [e for e in made if e.finish_reason != "length"]
    assert graded
    for e in graded:  # the environment's own scoring of each transcript
        env.reset(next(x for x in verifiers_source(reference, "all") if x.uid == e.uid))
        expected = score_transcript(env.tasks[e.uid], e.messages, env.opening)
        assert e.reward == pytest.approx(expected.score, abs=1e-12)
        assert e.reward_result.reason == expected.reason
        assert expected.reason.startswith("verifiers: ")  # the rubric ran
    if reference == ARITH:  # brevity: rewards that differ, so advantages that do
        assert np.std([e.reward for e in graded]) > 0
    assert record["reward/mean"] == pytest.approx(np.mean([e.reward for e in made]), abs=1e-6)
    if prefix:  # an error turn: env tokens in the sequence, out of the loss
        assert any(not e.loss_mask.all() for e in made)
    assert np.isfinite(record["learner/loss"])


def test_a_failing_rubric_scores_zero_with_its_error():
    """verifiers awaits every reward together: a plain (not async) one, or one that raises,
    fails the scoring, which is the episode's reason, not a crashed run."""
    import verifiers.v1 as vf

    from rlx.data.sources import Message
    from rlx.envs.verifiers_env import score_transcript

    class Plain(vf.Task):
        @vf.reward
        def length(self, trace) -> float:
            return float(len(trace.last_reply))

    class Raising(vf.Task):
        @vf.reward
        async def broken(self, trace) -> float:
            raise ZeroDivisionError("no")

    chat = [Message("user", "hi"), Message("assistant", "hello")]
    for task in (Plain(vf.TaskData(prompt="hi")), Raising(vf.TaskData(prompt="hi"))):
        result = score_transcript(task, chat, 1)
        assert result.score == 0.0 and result.reason.startswith("verifiers scoring failed (")
