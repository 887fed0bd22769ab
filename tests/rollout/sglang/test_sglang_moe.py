"""Real SGLang servers on the CPU serving rlx's exports of GLM-4.5 and DeepSeek-V3 / Kimi-K2 MoEs.

- GLM-4.5 MoE (GQA, partial rotary, sigmoid router with correction bias, shared expert): the
  server's log-probs of sampled completions equal the learner's (<= 5e-3, f32).
- DeepSeek-V3 family (multi-head latent attention): SGLang 0.5.23's CPU path cannot run it. Its
  CPU rotary embedding takes YaRN only (a default-rope checkpoint stops at model build), and with
  ``--attention-backend torch_native`` (the one CPU backend without SGLang's CPU kernels) the
  prefill reads the latent cache as per-head keys and fails on the first request. The test
  launches the server on a YaRN checkpoint (Kimi-K2's rope) and skips with the error SGLang
  gives; where a later SGLang serves it, it checks the log-probs like GLM's.

Each server starts once (about a minute on a CPU); skipped without the SGLang environment.
"""

import os
import re

import pytest

from rlx.models import from_hf, to_hf
from rlx.rollout.preflight import run_preflight
from rlx.rollout.sglang.engine import SGLangEngine
from rlx.rollout.sglang.server import ServerSpec, SGLangServer
from rlx.types import Prompt, SamplingParams
from tests.helpers.hf_zoo import make_hf_model
from tests.helpers.sglang_harness import (SGLANG_PYTHON, cpu_server_args, cpu_server_env,
                                          sglang_available)

pytestmark = [pytest.mark.sglang,
              pytest.mark.skipif(not sglang_available(), reason=f"no SGLang at {SGLANG_PYTHON}")]

PROMPTS = [Prompt("p0", (1, 2, 3, 4, 5)), Prompt("p1", (9, 8, 7))]


def _served_logprob_error(family: str, tmp) -> float:
    """Export the zoo's ``family`` with ``to_hf``, serve it, sample 6 tokens per prompt and return
    the largest |learner - server| log-prob over the sampled tokens."""
    model = from_hf(make_hf_model(family, str(tmp / "zoo")))
    folder = str(tmp / "export")
    to_hf(model, folder)
    spec = ServerSpec(python=SGLANG_PYTHON, model_path=folder,
                      extra_args=cpu_server_args() + ("--skip-tokenizer-init",),
                      env=cpu_server_env(str(tmp / "harness")), startup_timeout_s=300,
                      log_path=str(tmp / "server.log"))
    with SGLangServer(spec) as server:
        engine = SGLangEngine([server.url], request_timeout_s=120, max_retries=1)
        rollouts = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=7))
        probe = [(list(r.prompt_ids) + list(r.completion_ids), len(r.prompt_ids)) for r in rollouts]
        report = run_preflight(model, engine.score, probe, engine_name="sglang", base_format="f32",
                               threshold=1.0)
    return report.max_abs


def _sglang_error(log_path: str) -> str:
    """The exception line (``SomeError: ...``) of the scheduler's traceback in the server log,
    or the log's tail."""
    text = open(log_path).read() if os.path.exists(log_path) else ""
    crash = text.rfind("Scheduler hit an exception")
    errors = re.findall(r"^(\w+(?:Error|Exception): .+)$", text[max(crash, 0):], flags=re.M)
    return errors[0] if errors else text[-500:]


def test_glm4_moe_logprobs_match_the_learner(tmp_path):
    assert _served_logprob_error("glm4_moe", tmp_path) <= 5e-3


@pytest.mark.slow  # CI time: SGLang 0.5.23 cannot serve the latent cache on CPU
def test_deepseek_v3_mla_logprobs_match_the_learner_or_say_why_not(tmp_path):
    try:
        error = _served_logprob_error("kimi_k2", tmp_path)
    except Exception as e:  # the server died or refused the request: report SGLang's own error
        pytest.skip(f"SGLang 0.5.23 cannot serve DeepseekV3ForCausalLM (multi-head latent "
                    f"attention) on a CPU with --attention-backend torch_native: "
                    f"{_sglang_error(str(tmp_path / 'server.log'))} ({type(e).__name__})")
    assert error <= 5e-3
