"""Rollout engine errors that need no server (reliability, engine line; the faults of running
SGLang servers during a run are in ``test_engine_faults.py``): the coordinator's check of every
batch of rollouts, and an unreachable server refused at start with the URL, what happened and
what to do."""

import dataclasses
import socket

import numpy as np
import pytest

from rlx.rollout.errors import RolloutError
from rlx.rollout.sglang.engine import SGLangEngine
from rlx.run.rollouts import check_rollouts
from rlx.types import Prompt, Rollout

PROMPTS = [Prompt("a", (1, 2)), Prompt("b", (3,))]


def _rollouts(version: int = 3) -> list[Rollout]:
    return [Rollout(prompt_uid=p.uid, prompt_ids=np.asarray(p.token_ids, np.int32),
                    completion_ids=np.asarray([7, 8], np.int32),
                    sampler_logp=np.zeros(2, np.float32), finish_reason="stop",
                    weight_version=version, sample_index=j) for p in PROMPTS for j in range(2)]


@pytest.mark.parametrize("damage,needle", [
    (lambda rs: rs[1:], "1 missing (first [('a', 0)])"),
    (lambda rs: rs + rs[-1:], "1 unexpected or doubled (first [('b', 1)])"),
    (lambda rs: rs[:-1] + [dataclasses.replace(rs[-1], prompt_uid="z")], "('z', 1)"),
    (lambda rs: rs[:-1] + [dataclasses.replace(rs[-1], weight_version=2)],
     "made with weight_version [2], not the policy's 3"),
], ids=["dropped", "doubled", "foreign", "stale"])
def test_a_damaged_batch_of_rollouts_is_refused(damage, needle):
    check_rollouts(PROMPTS, 2, _rollouts()[::-1], version=3)  # complete (in any order): fine
    with pytest.raises(RolloutError, match="refusing to train on them") as e:
        check_rollouts(PROMPTS, 2, damage(_rollouts()), version=3)
    assert needle in str(e.value)


def test_an_unreachable_server_is_a_clear_error_at_start():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(RolloutError) as e:
        SGLangEngine([url], request_timeout_s=5.0, backoff_s=0.01)
    message = str(e.value)
    assert url in message and "/model_info does not answer" in message
    assert "What to do" in message and "request_timeout_s" in message
