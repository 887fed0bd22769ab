"""The tool env and the episode driver, with a scripted policy behind the engine protocol."""

from __future__ import annotations

import re

import numpy as np
import pytest

from rlx.data.chat import PromptFormat, render_chat
from rlx.data.sources import Message, user_example
from rlx.envs import Calculator, EnvError, EpisodeConfig, ToolEnv, ToolEnvConfig, run_episodes
from rlx.rewards import RewardResult, get_reward
from rlx.types import SamplingParams
from tests.helpers.envs import ScriptedEngine, call, solver
from tests.helpers.tokenizers import byte_tokenizer, smollm2_tokenizer

SAMPLING = SamplingParams(max_new_tokens=256)
TASK = user_example("calc:1", "toy", "Compute (17*23)+5 using the calculator, then answer in "
                    "\\boxed{}.", answer="396")


def exact(completion: str, sample) -> RewardResult:
    found = re.findall(r"\\boxed\{(.*?)\}", completion)
    return RewardResult(float(bool(found) and found[-1] == sample["answer"]), "exact")


def make_env(reward=exact, **config):
    return lambda: ToolEnv([Calculator()], reward, ToolEnvConfig(**config))


def check_tokens(episode, engine, tokenizer, env_texts):
    """Walks the completion: each turn's sampled ids (mask 1, the engine's log-probs), then the
    env text written by hand in the test (mask 0, log-prob 0)."""
    emitted = engine.emitted[f"{episode.uid}#{episode.sample_index}"]
    position = 0
    for turn, (sampled, env_text) in enumerate(zip(emitted, env_texts)):
        end = position + len(sampled)
        assert episode.completion_ids[position:end].tolist() == sampled, f"turn {turn}"
        assert episode.loss_mask[position:end].tolist() == [1] * len(sampled)
        expected_logp = -(np.arange(len(sampled), dtype=np.float32) + 1) / 100
        np.testing.assert_array_equal(episode.sampler_logp[position:end], expected_logp)
        env_ids = tokenizer.encode(env_text)
        position, end = end, end + len(env_ids)
        assert episode.completion_ids[position:end].tolist() == env_ids, f"env after {turn}"
        assert episode.loss_mask[position:end].tolist() == [0] * len(env_ids)
        assert not episode.sampler_logp[position:end].any()
        position = end
    assert position == len(episode.completion_ids) == len(episode.loss_mask)


def env_reply(result: str) -> str:
    """ChatML: the env closes the assistant turn after <|im_end|>, adds the tool message and
    opens the next assistant turn."""
    return (f"\n<|im_start|>tool\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n")


@pytest.mark.parametrize("tokenizer_kind", ["bytes", "smollm2"])
def test_scripted_policy_solves_the_task_and_masks_are_exact(tokenizer_kind):
    tok = byte_tokenizer() if tokenizer_kind == "bytes" else smollm2_tokenizer()
    engine = ScriptedEngine(tok, solver)
    math = get_reward("math", timeout_s=20.0, hard_timeout_s=60.0)  # generous on a busy CPU
    try:
        (episode,) = run_episodes(engine, make_env(math), [TASK], tok,
                                  SamplingParams(max_new_tokens=128))
    finally:
        math.close()
    assert episode.finish_reason == "final_answer" and len(episode.turns) == 3
    assert episode.reward_result.reason == "correct", episode.reward_result
    assert episode.reward == 1.0
    check_tokens(episode, engine, tok, [env_reply("391"), env_reply("396"), ""])
    assert [t.info.tool_calls for t in episode.turns[:2]] == [1, 1]
    assert all(t.weight_version == 7 for t in episode.turns)
    # Append-only: prompt + completion is the chat template's rendering of the transcript
    # (which ends with the template's "\n" after the final <|im_end|>).
    full = tok.decode(np.concatenate([episode.prompt_ids, episode.completion_ids]))
    rendered = render_chat(tok, episode.messages, [Calculator().spec()],
                           add_generation_prompt=False)
    assert full + "\n" == rendered
    assert [m.role for m in episode.messages][-6:] == [
        "user", "assistant", "tool", "assistant", "tool", "assistant"]


def test_tools_are_described_in_the_system_prompt_for_a_plain_template():
    tok = byte_tokenizer()
    engine = ScriptedEngine(tok, solver)
    (episode,) = run_episodes(engine, make_env(), [TASK], tok, SAMPLING)
    prompt = tok.decode(episode.prompt_ids)
    assert prompt.startswith("<|im_start|>system\nYou can call functions")
    assert '"name": "calculator"' in prompt and "<tool_call>" in prompt


def test_malformed_calls_get_error_observations_and_the_episode_goes_on():
    tok = byte_tokenizer()
    script = [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>',
        '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>' + call("(17*23)+5"),
        "\\boxed{396}",
    ]
    engine = ScriptedEngine(tok, lambda ctx: script[ctx.count("<|im_start|>assistant") - 1])
    (episode,) = run_episodes(engine, make_env(max_turns=5), [TASK], tok, SAMPLING)
    assert episode.reward == 1.0 and len(episode.turns) == 4
    errors = [t.info.tool_errors for t in episode.turns[:3]]
    assert "not valid JSON" in errors[0][0]
    assert "unknown tool 'search'" in errors[1][0] and "unexpected argument 'expr'" in errors[1][1]
    assert "missing required argument 'expression'" in errors[2][0]
    assert episode.turns[2].info.tool_calls == 2 and len(errors[2]) == 1
    tool_messages = [m.content for m in episode.messages if m.role == "tool"]
    assert tool_messages[-1] == "396" and tool_messages[0].startswith("error: ")
    check_tokens(episode, engine, tok, [
        env_reply(tool_messages[0]),
        env_reply(tool_messages[1]).removesuffix("<|im_start|>assistant\n")
        + env_reply(tool_messages[2])[1:],
        env_reply(tool_messages[3]).removesuffix("<|im_start|>assistant\n")
        + env_reply(tool_messages[4])[1:],
        "",
    ])


def test_assistant_prefix_opens_the_first_turn_in_the_prompt():
    tok = byte_tokenizer()
    opening = "<tool_call>\n"
    # The policy writes only what follows the prefix on its first turn.
    engine = ScriptedEngine(tok, lambda ctx: solver(ctx).removeprefix("First 17*23.\n")
                            .removeprefix(opening) if ctx.endswith(opening) else solver(ctx))
    (episode,) = run_episodes(engine, make_env(assistant_prefix=opening), [TASK], tok, SAMPLING)
    assert tok.decode(episode.prompt_ids).endswith("<|im_start|>assistant\n" + opening)
    assert episode.reward == 1.0 and [t.info.tool_calls for t in episode.turns] == [1, 1, 0]
    assert episode.turns[0].text == call("17*23") and episode.messages[-5].content == call("17*23")
    check_tokens(episode, engine, tok, [env_reply("391"), env_reply("396"), ""])
    full = tok.decode(np.concatenate([episode.prompt_ids, episode.completion_ids]))
    rendered = render_chat(tok, episode.messages, [Calculator().spec()],
                           add_generation_prompt=False)
    assert full + "\n" == rendered  # the prefix is the first turn's text, rendered once


def test_turn_limit_ends_with_zero_reward():
    tok = byte_tokenizer()
    engine = ScriptedEngine(tok, lambda context: call("1+1"))
    (episode,) = run_episodes(engine, make_env(max_turns=3), [TASK], tok, SAMPLING)
    assert episode.finish_reason == "turn_limit" and episode.reward == 0.0
    assert len(episode.turns) == 3 and episode.turns[-1].env_ids == ()


def test_token_budget_cuts_the_episode():
    tok = byte_tokenizer()
    engine = ScriptedEngine(tok, solver)
    # The first turn alone is 84 bytes + EOS; a 60-token budget cuts it.
    (cut,) = run_episodes(engine, make_env(), [TASK], tok, SamplingParams(),
                          EpisodeConfig(max_completion_tokens=60))
    assert cut.finish_reason == "length" and cut.reward == 0.0
    assert len(cut.completion_ids) == 60 and cut.loss_mask.all() and cut.turns[0].info is None
    # Room for turn 1 but not for turn 1 + the env's reply: the reply is not appended.
    first_turn = len(tok.encode(solver(""))) + 1
    (short,) = run_episodes(engine, make_env(), [TASK], tok, SamplingParams(),
                            EpisodeConfig(max_completion_tokens=first_turn + 10))
    assert short.finish_reason == "length" and len(short.completion_ids) == first_turn


def test_groups_run_side_by_side_in_one_generate_call_per_round():
    tok = byte_tokenizer()
    other = user_example("calc:2", "toy", "Compute (17*23)+5 again.", answer="396")
    calls = []
    engine = ScriptedEngine(tok, solver)
    generate = engine.generate
    engine.generate = lambda prompts, sampling: calls.append(len(prompts)) or generate(
        prompts, sampling)
    episodes = run_episodes(engine, make_env(), [TASK, other], tok, SAMPLING,
                            EpisodeConfig(group_size=2, env_workers=2))
    assert [(e.uid, e.sample_index) for e in episodes] == [
        ("calc:1", 0), ("calc:1", 1), ("calc:2", 0), ("calc:2", 1)]
    assert all(e.reward == 1.0 for e in episodes) and calls == [4, 4, 4]
    rollout = episodes[1].to_rollout(uid=0, weight_version=3)
    assert rollout.completion_mask is episodes[1].loss_mask and rollout.reward == 1.0


def test_env_protocol_errors_and_prompt_format():
    env = ToolEnv([Calculator()], exact,
                  ToolEnvConfig(prompt_format=PromptFormat(system_prompt="Use tools.")))
    with pytest.raises(EnvError, match="before reset"):
        env.step("hi")
    observation = env.reset(TASK)
    assert observation.messages[0] == Message("system", "Use tools.")
    assert observation.tools[0]["function"]["name"] == "calculator"
    result = env.step("\\boxed{396}")
    assert result.done and result.reward == 1.0 and result.info.reason == "final_answer"
    with pytest.raises(EnvError, match="after the episode ended"):
        env.step("again")
    with pytest.raises(TypeError, match="reward function"):
        ToolEnv([Calculator()], "math")
    hidden = ToolEnvConfig(prompt_format=PromptFormat(offer_tools=False))
    assert ToolEnv([Calculator()], exact, hidden).reset(TASK).tools == ()


# A Qwen-like template of our own: it renders `tools` itself, merges consecutive tool results
# into one user turn of <tool_response> blocks, and trims assistant text.
TOOL_TEMPLATE = (
    "{%- if tools -%}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for t in tools -%}{{ '\\n' + (t | tojson) }}{%- endfor -%}"
    "{{ '\\n</tools><|im_end|>\\n' }}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'tool' -%}"
    "{%- if messages[loop.index0 - 1]['role'] != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}"
    "{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}"
    "{{ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' + (m['content'] | trim) + '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def test_template_with_tools_merged_responses_and_trimmed_turns():
    tok = byte_tokenizer(TOOL_TEMPLATE)
    script = [call("17*23") + call("1+1") + "\n", "\\boxed{396}"]
    engine = ScriptedEngine(tok, lambda ctx: script[ctx.count("<|im_start|>assistant") - 1])
    (episode,) = run_episodes(engine, make_env(), [TASK], tok, SAMPLING)
    prompt = tok.decode(episode.prompt_ids)
    assert prompt.startswith('<|im_start|>system\n# Tools\n<tools>\n{"type": "function"')
    assert episode.reward == 1.0 and len(episode.turns) == 2
    # The sampled "\n" before <|im_end|> stays (append-only) although the template would trim
    # it; the env appends what follows <|im_end|>: one user turn holding both responses.
    check_tokens(episode, engine, tok, [
        "\n<|im_start|>user\n<tool_response>\n391\n</tool_response>\n<tool_response>\n2\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n",
        "",
    ])


class _Exchange:
    """``count`` threads' values gathered for each of them, as processes' collectives are."""

    def __init__(self, count: int):
        import threading

        self.barrier, self.slots = threading.Barrier(count), [None] * count

    def gather(self, index: int, value):
        self.barrier.wait()
        self.slots[index] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


def _shared_runs(make, count: int = 2):
    """``run_episodes`` on ``count`` threads, each an ``EpisodeShare`` of its index; each
    thread's episodes or exception, and the (thread, episode key) of every env step."""
    import concurrent.futures

    from rlx.envs.episode import EpisodeShare

    exchange, stepped, tok = _Exchange(count), [], byte_tokenizer()
    other = user_example("calc:2", "toy", "Compute (17*23)+5 again.", answer="396")

    def run(index: int):
        def env():
            inner = make()

            class Recorded:
                def reset(self, example):
                    self.key = example.uid
                    return inner.reset(example)

                def step(self, text):
                    stepped.append((index, self.key))
                    return inner.step(text)
            return Recorded()
        share = EpisodeShare(index, count, lambda value: exchange.gather(index, value))
        return run_episodes(ScriptedEngine(tok, solver), env, [TASK, other], tok, SAMPLING,
                            EpisodeConfig(group_size=2, env_workers=2), share)

    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(run, i) for i in range(count)]
        return [f.exception() or f.result() for f in futures], stepped


def test_shared_episodes_step_each_env_on_its_process_only_and_end_alike():
    alone = run_episodes(ScriptedEngine(byte_tokenizer(), solver), make_env(),
                         [TASK, user_example("calc:2", "toy", "Compute (17*23)+5 again.",
                                             answer="396")], byte_tokenizer(), SAMPLING,
                         EpisodeConfig(group_size=2))
    (first, second), stepped = _shared_runs(make_env())
    for a, b, c in zip(first, second, alone):
        assert a.completion_ids.tolist() == b.completion_ids.tolist() == c.completion_ids.tolist()
        assert a.messages == b.messages == c.messages and a.reward == b.reward == c.reward == 1.0
    # 4 episodes x 3 turns; episode i (calc:1 #0, #1, calc:2 #0, #1) stepped by thread i % 2 only
    assert len(stepped) == 12
    assert sorted(set(stepped)) == [(0, "calc:1"), (0, "calc:2"), (1, "calc:1"), (1, "calc:2")]
    assert sum(1 for t, _ in stepped if t == 0) == sum(1 for t, _ in stepped if t == 1) == 6


def test_an_env_raising_on_one_process_raises_on_every_process():
    class Broken:
        def reset(self, example):
            return make_env()().reset(example)

        def step(self, text):
            raise RuntimeError("the sandbox is gone")

    (first, second), stepped = _shared_runs(Broken)
    for error in (first, second):
        assert isinstance(error, EnvError)
        assert "episode 0 raised on process 0: RuntimeError: the sandbox is gone" in str(error)
