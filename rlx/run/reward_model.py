"""``train.reward = "reward_model"``: a frozen sequence classifier (``config.reward_model``, a
transformers ``*ForSequenceClassification`` checkpoint, ``rlx.models.classifier``) on the run's
mesh scores each prompt + completion.

The reward model reads text through its own tokenizer and chat template (those of its folder),
whatever the policy's are: the prompt's messages and the completion (decoded without special
tokens) as the assistant's turn are rendered without a generation prompt, encoded, and the last
``max_length`` tokens scored, ``batch_size`` sequences per forward pass. The reward is
``scale * logits[label] + offset``; the raw logit is kept in the result's extra.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import Mesh

from rlx.errors import ConfigError
from rlx.models.classifier import RewardModelSection, Scorer, classify, load_classifier
from rlx.models.loading import resolve_path
from rlx.models.tokenizer import Tokenizer
from rlx.rewards.base import CHAT_KEY, RewardResult

NAME = "reward_model"  # the train.reward value that selects it


class RewardModelReward:
    """A batch reward from a sequence classifier; its samples must carry the prompt chat."""

    reads_chat = True  # rlx.rewards.base.reads_chat: samples carry the prompt's messages

    def __init__(self, section: RewardModelSection, mesh: Mesh | None = None):
        path = resolve_path(section.path)
        self.section = section
        self.tokenizer = Tokenizer.from_dir(path)
        if self.tokenizer.chat_template is None:
            raise ConfigError(f"config.reward_model.path={section.path!r} has no chat template "
                              "(tokenizer_config.json or chat_template.jinja); the reward model "
                              "reads prompt and completion as its chat")
        model = load_classifier(path, mesh, section.dtype)
        labels = int(model.score.shape[-1])
        if section.label >= labels:
            raise ConfigError(f"config.reward_model.label={section.label} is out of range: "
                              f"{section.path!r} has {labels} label(s) (0..{labels - 1})")
        self.scorer = Scorer(model, mesh)

    def tokens(self, completion: str, sample: Mapping[str, Any]) -> list[int]:
        """The reward model's token ids of the prompt chat followed by ``completion``."""
        if CHAT_KEY not in sample:
            raise ValueError(f"the reward model needs the prompt: pass samples with the prompt's "
                             f"messages under {CHAT_KEY!r} (Example.reward_sample(chat=True))")
        chat = [*sample[CHAT_KEY], {"role": "assistant", "content": completion}]
        return self.tokenizer.encode_chat(chat, add_generation_prompt=False)

    def batch(self, completions: Sequence[str], samples: Sequence[Mapping[str, Any]]
              ) -> list[RewardResult]:
        """Results in input order (one forward pass per ``batch_size`` sequences)."""
        if not completions:
            return []
        s = self.section
        logits = classify(self.scorer, [self.tokens(c, x) for c, x in zip(completions, samples)],
                          s.batch_size, s.max_length)[:, s.label]
        return [RewardResult(score=s.scale * float(v) + s.offset, reason="reward model",
                             extra={"logit": float(v)}) for v in logits]

    def __call__(self, completion: str, sample: Mapping[str, Any]) -> RewardResult:
        return self.batch([completion], [sample])[0]


__all__ = ["NAME", "RewardModelReward"]
