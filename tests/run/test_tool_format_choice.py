"""``env.tool_format`` as the run reads it (``rlx.run.build``): "auto" takes the format the
model's chat template shows, a name overrides it, and what cannot run is refused in one line
naming the field."""

from __future__ import annotations

import os

import pytest
import trl

from rlx.errors import ConfigError
from rlx.run.build import make_env_runner, make_reward, tool_format
from tests.helpers.runs import run_config
from tests.helpers.tokenizers import byte_tokenizer

TEMPLATES = os.path.join(os.path.dirname(trl.__file__), "chat_templates")


def _tokenizer(template: str):
    with open(os.path.join(TEMPLATES, f"{template}.jinja"), encoding="utf-8") as f:
        return byte_tokenizer(f.read())


@pytest.mark.parametrize("template, fmt", [("llama3_1", "llama3_json"),
                                           ("deepseekv3", "deepseek_v3"), ("gptoss", "harmony")])
def test_auto_takes_the_chat_template_format_and_a_name_overrides_it(template, fmt, tmp_path):
    cfg = run_config("tiny", tmp_path)
    assert tool_format(cfg, _tokenizer(template)) == fmt
    assert tool_format(cfg, byte_tokenizer()) == tool_format(cfg, None) == "hermes"
    named = run_config("tiny", tmp_path, **{"env.tool_format": "deepseek_v3"})
    assert tool_format(named, _tokenizer(template)) == "deepseek_v3"
    calls = make_reward(run_config("tiny", tmp_path, **{"train.reward": "tool_call"}),
                        _tokenizer(template))
    assert calls.config.tool_format == fmt


def test_unknown_formats_and_harmony_episodes_are_refused_in_one_line(tmp_path):
    bad = run_config("tiny", tmp_path, **{"env.tool_format": "mistral"})
    with pytest.raises(ConfigError, match=r"^config.env.tool_format='mistral' is not 'auto'.*"
                                          r"'hermes', 'llama3_json', 'deepseek_v3', 'harmony'"):
        make_reward(bad)
    tools = run_config("tiny", tmp_path, **{"env.kind": "tools"})
    with pytest.raises(ConfigError, match=r"^config.env.tool_format='auto': tool-use episodes "
                                          r"in the 'harmony' format are not supported") as e:
        make_env_runner(tools, make_reward(tools), _tokenizer("gptoss"))
    assert "\n" not in str(e.value)
