"""Tool-use episodes in each model family's tool-call format, rendered with the family's own chat
template (the originals TRL ships in ``trl/chat_templates``, an oracle rlx did not write): the
format is picked from the template, calls parse, and the tool results go back in the family's
tokens (checked against the text each template documents for a tool turn)."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import trl

from rlx.data.chat import PromptFormat, render_chat
from rlx.data.sources import user_example
from rlx.envs import EnvError, run_episodes
from rlx.envs.registry import demonstration, make_tools
from rlx.envs.runner import make_runner
from rlx.rewards import RewardResult
from rlx.rewards.tool_calls import FORMATS, parse_tool_calls
from rlx.types import SamplingParams
from tests.helpers.envs import ScriptedEngine
from tests.helpers.tokenizers import byte_tokenizer

TEMPLATES = os.path.join(os.path.dirname(trl.__file__), "chat_templates")
TASK = user_example("calc:1", "toy", "Compute 17*23 with the calculator.", answer="391")
SAMPLING = SamplingParams(max_new_tokens=256)
# TRL's DeepSeek-V3 template opens the generation prompt with "<think>\n", which the assistant
# turns it renders drop; the original V3 release's prompt is "<｜Assistant｜>" alone (spelled
# as in the template's source, where "\\n" is a Jinja escape)
DEEPSEEK_PROMPT = ("<｜Assistant｜><think>\\n", "<｜Assistant｜>")
# (template, the format picked from it, the env's tokens after the call turn: the closing of the
# assistant turn, the tool turn holding "391", and the next generation prompt, as each template
# writes them)
FAMILIES = [
    ("qwen2_5", "hermes", "\n<|im_start|>user\n<tool_response>\n391\n</tool_response>"
                          "<|im_end|>\n<|im_start|>assistant\n"),
    ("llama3_1", "llama3_json", '<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n'
                                '"391"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'),
    ("deepseekv3", "deepseek_v3", "<｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>"
                                  "391<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"),
]


def _tokenizer(template: str):
    with open(os.path.join(TEMPLATES, f"{template}.jinja"), encoding="utf-8") as f:
        text = f.read()
    return byte_tokenizer(text.replace(*DEEPSEEK_PROMPT) if template == "deepseekv3" else text)


def _graded(completion: str, sample) -> RewardResult:
    found = re.findall(r"\\boxed\{(.*?)\}", completion)
    return RewardResult(float(bool(found) and found[-1] == sample["answer"]), "exact")


def _policy(fmt: str):
    """Calls the calculator in ``fmt`` on its first turn, then answers."""
    turns = iter([FORMATS[fmt].render_call("calculator", {"expression": "17*23"}),
                  "The answer is \\boxed{391}."])
    return lambda context: next(turns)


def _runner(tokenizer, prompt_format=PromptFormat(), **kw):
    return make_runner(("calculator",), _graded, tokenizer, prompt_format, max_turns=3,
                       max_episode_tokens=2048, **kw)


@pytest.mark.parametrize("template, fmt, env_text", FAMILIES)
def test_an_episode_in_the_family_format(template, fmt, env_text):
    tok = _tokenizer(template)
    engine = ScriptedEngine(tok, _policy(fmt))
    (episode,) = _runner(tok).episodes(engine, [TASK], SAMPLING)
    assert episode.finish_reason == "final_answer" and episode.reward == 1.0
    assert [t.info.tool_calls for t in episode.turns] == [1, 0]
    assert [m.content for m in episode.messages if m.role == "tool"] == ["391"]
    assert tok.decode(list(episode.turns[0].env_ids)) == env_text
    # append-only: prompt + completion is the template's rendering of the transcript, but for
    # the EOS ending each scripted turn (the test tokenizer's, ChatML's <|im_end|>, where the
    # template writes its family's end of turn)
    full = tok.decode(np.concatenate([episode.prompt_ids, episode.completion_ids]).tolist())
    if fmt != "hermes":
        full = full.replace("<|im_end|>", "")
    rendered = render_chat(tok, episode.messages, [make_tools(["calculator"])[0].spec()],
                           add_generation_prompt=False, tool_format=fmt)
    assert rendered.startswith(full)


def test_a_template_without_tools_gets_the_format_preamble_and_no_hermes_wrapping():
    # DeepSeek-V3's template renders no tools list: rlx's system text teaches its own syntax
    tok = _tokenizer("deepseekv3")
    engine = ScriptedEngine(tok, _policy("deepseek_v3"))
    (episode,) = _runner(tok).episodes(engine, [TASK], SAMPLING)
    prompt = tok.decode(episode.prompt_ids.tolist())
    assert "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜><function-name>" in prompt
    assert '"name": "calculator"' in prompt and "<tool_call>" not in prompt
    full = tok.decode(episode.completion_ids.tolist())
    assert "<tool_response>" not in full
    # the format can be named over the template's: ChatML (hermes by its template) in Llama's
    tok = byte_tokenizer()
    engine = ScriptedEngine(tok, _policy("llama3_json"))
    (episode,) = _runner(tok, PromptFormat(tool_format="llama3_json")).episodes(
        engine, [TASK], SAMPLING)
    assert episode.reward == 1.0 and episode.turns[0].info.tool_calls == 1
    assert '"parameters": dictionary' in tok.decode(episode.prompt_ids.tolist())
    assert tok.decode(list(episode.turns[0].env_ids)) == (  # a plain tool turn: no wrapping
        "\n<|im_start|>tool\n391<|im_end|>\n<|im_start|>assistant\n")


def test_templates_episodes_cannot_render_are_refused():
    # TRL's DeepSeek-V3 template as shipped: its generation prompt is not what its turns render
    with open(os.path.join(TEMPLATES, "deepseekv3.jinja"), encoding="utf-8") as f:
        tok = byte_tokenizer(f.read())
    with pytest.raises(EnvError, match="rewrites earlier turns"):
        run_episodes(ScriptedEngine(tok, _policy("deepseek_v3")),
                     _runner(tok).make_env, [TASK], tok, SAMPLING)
    # gpt-oss's renders a tool result from structured tool calls: episodes are refused up front
    with pytest.raises(ValueError, match="'harmony' format are not supported.*tool_call"):
        _runner(_tokenizer("gptoss"))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_worked_calls_are_written_in_the_format(fmt):
    (calculator,) = make_tools(["calculator"])
    messages = demonstration([calculator], fmt)
    (call,) = parse_tool_calls(messages[1].content, tool_format=fmt).items
    assert call.name == "calculator" and call.arguments == calculator.demo[1]
