"""``SamplingParams.ignore_eos`` (benchmarks): completions run to ``max_new_tokens`` past any stop
token, on the built-in engine and in SGLang's request. (A run's training rollouts take it from
``rlx.build``'s ``sampling_overrides``, not from the run config: tests/run/test_deep_async.py.)"""

import pytest

from rlx.rollout.jax.engine import JaxEngine
from rlx.rollout.sglang.engine import sampling_payload
from rlx.types import Prompt, SamplingParams
from tests.helpers.steps import tiny_model


def test_ignore_eos_refuses_stop_tokens():
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, stop_token_ids=(2,))
    assert sampling_payload(SamplingParams(ignore_eos=True), 0)["ignore_eos"] is True
    assert "ignore_eos" not in sampling_payload(SamplingParams(stop_token_ids=(2,)), 0)


def test_engine_runs_past_the_stop_token():
    engine = JaxEngine(tiny_model(0, head_scale=8.0))
    prompt = [Prompt("p", (1, 2, 3))]
    greedy = engine.generate(prompt, SamplingParams(max_new_tokens=6, temperature=0.0))[0]
    first = int(greedy.completion_ids[0])
    stopped = engine.generate(prompt, SamplingParams(max_new_tokens=6, temperature=0.0,
                                                     stop_token_ids=(first,)))[0]
    assert stopped.completion_ids.tolist() == [first] and stopped.finish_reason == "stop"
    full = engine.generate(prompt, SamplingParams(max_new_tokens=6, temperature=0.0,
                                                  ignore_eos=True))[0]
    assert full.completion_ids.tolist() == greedy.completion_ids.tolist()
    assert len(full.completion_ids) == 6 and full.finish_reason == "length"
