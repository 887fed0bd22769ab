"""``train.reward = "reward_model"`` (``rlx.run.reward_model``): the reward is the chosen logit of
a sequence classifier on the prompt chat and the completion rendered by the reward model's own
chat template, equal to transformers' logit on the same tokens (one unpadded sequence at a time)
within 1e-4 though rlx scores them in padded batches; a tiny RL step trains on it; a missing path
and a label the head lacks are refused in one line."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from rlx.config import parse_config
from rlx.data.sources import user_example
from rlx.errors import ConfigError
from rlx.models.classifier import RewardModelSection
from rlx.rewards.base import reads_chat, score_batch
from rlx.run.build import build, make_reward
from rlx.run.reward_model import RewardModelReward
from tests.helpers.classifiers import hf_classifier_logits, make_classifier
from tests.helpers.runs import config_dict, run_config
from tests.helpers.tokenizers import byte_tokenizer

EOS = 257  # the byte tokenizer's <|im_end|>, also its pad token


def _reward_model(root) -> str:
    """A one-layer-pair Llama reward model (2 labels) over the byte tokenizer, with its ChatML template."""
    return make_classifier("llama", str(root), num_labels=2, pad_token_id=EOS, vocab_size=258,
                           tokenizer=byte_tokenizer())


def test_the_reward_is_transformers_logit_of_the_chat(tmp_path):
    path = _reward_model(tmp_path)
    section = RewardModelSection(path=path, label=1, batch_size=2, max_length=256, scale=2.0,
                                 offset=-1.0)
    reward = RewardModelReward(section)
    assert reads_chat(reward)
    example = user_example("q", "test", "What is 2 + 2?")
    sample = example.reward_sample(chat=True)
    completions = ["4", "The answer is \\boxed{4}.", "", "five"]
    results = score_batch(reward, completions, [sample] * len(completions))  # 2 padded batches
    text = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    assert reward.tokens("4", sample) == byte_tokenizer().encode(text)  # ChatML, no generation prompt
    for completion, result in zip(completions, results):
        ids = reward.tokens(completion, sample)
        logit = hf_classifier_logits(path, [ids])[0, 1]  # batch 1, unpadded
        assert abs(result.extra["logit"] - logit) <= 1e-4, (completion, result, logit)
        assert result.score == 2.0 * result.extra["logit"] - 1.0
    assert len({r.score for r in results}) == len(results)  # a random head tells them apart
    with pytest.raises(ValueError, match="needs the prompt"):
        reward("4", example.reward_sample())


def test_a_missing_path_and_a_label_out_of_range_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"^config.train.reward='reward_model' needs "
                                          r"config.reward_model.path"):
        run_config("tiny", tmp_path, **{"train.reward": "reward_model"})
    with pytest.raises(ConfigError, match=r"^config.reward_model.path='/nowhere' does not exist"):
        run_config("tiny", tmp_path, **{"train.reward": "reward_model",
                                        "reward_model.path": "/nowhere"})
    path = _reward_model(tmp_path)
    with pytest.raises(ConfigError, match=r"^config.train.reward='reward_model' scores single-"
                                          r"turn completions in one process; got env.kind='tools'"):
        run_config("tiny", tmp_path, **{"train.reward": "reward_model", "env.kind": "tools",
                                        "reward_model.path": path})
    cfg = run_config("tiny", tmp_path, **{"train.reward": "reward_model",
                                          "reward_model.path": path, "reward_model.label": 2})
    with pytest.raises(ConfigError, match=r"^config.reward_model.label=2 is out of range: .* has "
                                          r"2 label\(s\) \(0..1\)$"):
        make_reward(cfg)
    with pytest.raises(ConfigError, match=r"^config.reward_model.dtype='int8' is not one of"):
        parse_config(config_dict("tiny", tmp_path, **{"reward_model.dtype": "int8"}))


def test_one_tiny_rl_step_trains_on_the_reward_model(tmp_path):
    path = _reward_model(tmp_path)
    cfg = run_config("tiny", tmp_path, **{"train.reward": "reward_model", "reward_model.path": path,
                                          "train.steps": 1, "data.eval_size": 0, "mesh.data": 2,
                                          "mesh.fsdp": 2, "mesh.tensor": 2})
    run = build(cfg, progress=False)
    try:
        assert isinstance(run.reward, RewardModelReward)
        embed = run.reward.scorer.state["body"]["embed"][...]  # vocab over tensor, hidden over fsdp
        assert embed.sharding.mesh == run.mesh and embed.addressable_shards[0].data.shape == (129, 16)
        record = run.step()
    finally:
        run.close()
    assert np.isfinite(record["learner/loss"]) and record["reward/std"] > 0  # graded floats
    with open(os.path.join(cfg.output_dir, "samples.jsonl"), encoding="utf-8") as f:
        samples = [json.loads(line) for line in f]
    assert samples and all(s["reason"] == "reward model" for s in samples)
