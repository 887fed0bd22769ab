"""An engine that answers with pre-written completions, for tests of evaluation arithmetic."""

from __future__ import annotations

import numpy as np

from rlx.types import Rollout


class ReplayEngine:
    """Answers every prompt with pre-written completions, cycling through them."""

    def __init__(self, tokenizer, answers: dict[str, list[str]]):
        self.tokenizer, self.answers = tokenizer, answers

    def generate(self, prompts, sampling):
        out = []
        for prompt in prompts:
            for i in range(sampling.n):
                text = self.answers[prompt.uid][i % len(self.answers[prompt.uid])]
                ids = np.asarray(self.tokenizer.encode(text) + [self.tokenizer.eos_id], np.int32)
                out.append(Rollout(prompt.uid, np.asarray(prompt.token_ids, np.int32), ids,
                                   np.zeros(len(ids), np.float32), "stop", 0, i))
        return out
