"""A scripted policy behind the rollout-engine protocol, for tests of multi-turn episodes."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np

from rlx.types import Rollout, SamplingParams


def call(expression: str) -> str:
    return ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n'
            "</tool_call>" % expression)


def solver(context: str) -> str:
    """Reads the tool responses so far and takes the next step of (17*23)+5."""
    results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", context, re.DOTALL)
    if not results:
        return "First 17*23.\n" + call("17*23")
    if len(results) == 1:
        return call(f"{results[0]}+5")
    return f"The result is \\boxed{{{results[-1]}}}."


class ScriptedEngine:
    """A `RolloutEngine` whose policy is a function of the decoded context. It emits the
    policy's text token by token (then EOS), honours max_new_tokens and stop tokens, and gives
    token i of each turn the log-prob -(i + 1) / 100 so that their placement can be checked."""

    name = "scripted"
    weight_version = 7

    def __init__(self, tokenizer, policy: Callable[[str], str]):
        self.tokenizer, self.policy = tokenizer, policy
        self.emitted: dict[str, list[list[int]]] = {}  # prompt uid -> sampled ids per turn

    def generate(self, prompts, sampling: SamplingParams) -> list[Rollout]:
        out = []
        for prompt in prompts:
            text = self.policy(self.tokenizer.decode(prompt.token_ids))
            ids = self.tokenizer.encode(text) + [self.tokenizer.eos_id]
            stop = next((i for i, t in enumerate(ids) if t in sampling.stop_token_ids), None)
            ids = ids if stop is None else ids[:stop + 1]
            reason = "stop" if len(ids) <= sampling.max_new_tokens else "length"
            ids = ids[:sampling.max_new_tokens]
            episode = prompt.uid.rsplit("@", 1)[0]  # run_episodes' "<uid>#<sample>@<turn>"
            self.emitted.setdefault(episode, []).append(ids)
            logp = -(np.arange(len(ids), dtype=np.float32) + 1) / 100
            out.append(Rollout(prompt.uid, np.asarray(prompt.token_ids, np.int32),
                               np.asarray(ids, np.int32), logp, reason, self.weight_version))
        return out

    def score(self, sequences):
        raise NotImplementedError

    def update_weights(self, weights, version: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class ShortTurns:
    """The run's engine with every odd token id also a stop token, so that the random policy's
    turns end (finish "stop") after a few tokens and its episodes run all three turns."""

    def __init__(self, engine):
        self.engine, self.name = engine, engine.name

    @property
    def weight_version(self):
        return self.engine.weight_version

    def generate(self, prompts, sampling):
        stops = (*sampling.stop_token_ids, *range(1, 49152, 2))
        return self.engine.generate(prompts, dataclasses.replace(sampling, stop_token_ids=stops))

    def score(self, sequences):
        return self.engine.score(sequences)

    def prefix_cache(self):
        return self.engine.prefix_cache()

    def prefilled_tokens(self):
        return self.engine.prefilled_tokens()

    def update_weights(self, weights, version):
        self.engine.update_weights(weights, version)

    def close(self):
        self.engine.close()
