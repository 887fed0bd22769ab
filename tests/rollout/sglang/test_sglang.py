"""Real SGLang servers on the CPU, serving checkpoints that rlx exported.

Skipped only when the SGLang environment is absent (``.ci/run`` creates it).
"""

import os
import signal
import threading
import time

import jax
import numpy as np
import pytest

from rlx.models import from_hf, to_hf
from rlx.rollout.errors import RolloutError
from rlx.rollout.preflight import PreflightError, learner_logprobs, run_preflight
from rlx.rollout.sglang.engine import SGLangEngine
from rlx.rollout.sglang.server import ServerSpec, SGLangServer
from rlx.types import Prompt, SamplingParams
from tests.helpers.hf_zoo import make_hf_model
from tests.helpers.sglang_harness import (SGLANG_PYTHON, cpu_server_args, cpu_server_env,
                                          sglang_available)

pytestmark = [pytest.mark.sglang,
              pytest.mark.skipif(not sglang_available(), reason=f"no SGLang at {SGLANG_PYTHON}")]

PROMPTS = [Prompt("p0", (1, 2, 3, 4, 5)), Prompt("p1", (9, 8, 7)), Prompt("p2", (11,))]


def _spec(model_path, tmp, name, lora_rank=0):
    return ServerSpec(python=SGLANG_PYTHON, model_path=model_path,
                      extra_args=cpu_server_args(lora_rank) + ("--skip-tokenizer-init",),
                      env=cpu_server_env(os.path.join(tmp, "harness")),
                      log_path=os.path.join(tmp, f"{name}.log"))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """An rlx model and its rlx export (the folder SGLang serves, with and without adapters)."""
    tmp = str(tmp_path_factory.mktemp("sglang"))
    model = from_hf(make_hf_model("llama_wide", os.path.join(tmp, "zoo")))
    to_hf(model, os.path.join(tmp, "v0"))
    return tmp, model


@pytest.fixture(scope="module")
def server(exported):
    """One server for the module: LoRA enabled, so the same process serves the base and adapters."""
    tmp, _ = exported
    with SGLangServer(_spec(os.path.join(tmp, "v0"), tmp, "main", lora_rank=4)) as s:
        yield s


def _probe(rollouts):
    return [(list(r.prompt_ids) + list(r.completion_ids), len(r.prompt_ids)) for r in rollouts]


def test_generate_returns_sampler_logprobs_matching_the_learner(exported, server):
    _, model = exported
    engine = SGLangEngine([server.url])
    rollouts = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0, n=3, seed=1))
    assert [(r.prompt_uid, r.sample_index) for r in rollouts] == [
        (p.uid, j) for p in PROMPTS for j in range(3)]
    eos = model.config.eos_token_id
    for r in rollouts:  # stopped by length, or by sampling the end-of-sequence token
        assert (len(r.completion_ids) == 8 and r.finish_reason == "length") or (
            r.finish_reason == "stop" and r.completion_ids[-1] == eos), r
    ours = learner_logprobs(model, _probe(rollouts))
    diff = max(np.abs(a - r.sampler_logp).max() for a, r in zip(ours, rollouts))
    assert diff <= 1e-3, diff  # SGLang's CPU torch kernels vs XLA, both f32


def test_greedy_equals_learner_argmax(exported, server):
    _, model = exported
    engine = SGLangEngine([server.url])
    (r,) = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=6, temperature=0.0))
    seq = list(r.prompt_ids)
    for tok in r.completion_ids:
        logits = np.asarray(model(jax.numpy.asarray([seq])))[0, -1]
        assert int(np.argmax(logits)) == int(tok)
        seq.append(int(tok))


def test_preflight_passes_and_fails_with_a_clear_message(exported, server):
    _, model = exported
    engine = SGLangEngine([server.url])
    probe = _probe(engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=3)))
    report = run_preflight(model, engine.score, probe, engine_name="sglang", base_format="f32",
                           threshold=5e-3)
    assert report.passed and report.max_abs <= 5e-3
    assert report.tokens == sum(len(ids) - p for ids, p in probe)
    wrong = _perturbed(model)
    with pytest.raises(PreflightError, match=r"sglang \(base format f32\).*max \|diff\|"):
        run_preflight(wrong, engine.score, probe, engine_name="sglang", base_format="f32",
                      threshold=5e-3)


def test_an_idle_server_sleeps_instead_of_spinning(exported, server):
    from rlx.bench.sglang_setup import group_cpu_s

    SGLangEngine([server.url]).generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, seed=0))
    time.sleep(1.0)  # the request's own work is over
    before, start = group_cpu_s(server.proc.pid), time.monotonic()
    time.sleep(3.0)
    busy = (group_cpu_s(server.proc.pid) - before) / (time.monotonic() - start)
    # a busy-polling scheduler holds ~0.7-1 core; sleeping on its sockets it takes ~0.01
    assert busy < 0.2, f"the idle server used {busy:.2f} cores (is --sleep-on-idle passed?)"


def _perturbed(model):
    from flax import nnx
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda x: x * 1.1 if x.ndim == 2 else x, state)
    return nnx.merge(graphdef, state)


def test_full_weight_update_from_an_rlx_export(exported, server):
    tmp, model = exported
    new = _perturbed(model)
    to_hf(new, os.path.join(tmp, "v1"))
    engine = SGLangEngine([server.url])
    engine.update_weights_from_disk(os.path.join(tmp, "v1"), version=1)
    rollouts = engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, seed=4))
    assert {r.weight_version for r in rollouts} == {1}
    probe = _probe(rollouts)
    run_preflight(new, engine.score, probe, engine_name="sglang", base_format="f32", threshold=5e-3)
    with pytest.raises(PreflightError):
        run_preflight(model, engine.score, probe, engine_name="sglang", base_format="f32", threshold=5e-3)
    engine.update_weights_from_disk(os.path.join(tmp, "v0"), version=0)  # restore


def test_full_weight_update_in_memory_matches_the_learner(exported, server):
    """Buckets through shared memory (two or more here: the limit is half the model's bytes); a
    server given other weights meanwhile is sent rlx's again (a re-sync)."""
    from rlx.io.export import merged_tensors
    from rlx.rollout.sglang.tensors import SharedStaging, payloads

    _, model = exported
    new, staging = _perturbed(model), SharedStaging()
    limit = sum(v.nbytes for _, v in merged_tensors(new)) // 2
    sent = lambda m: payloads(staging, merged_tensors(m), limit)  # noqa: E731
    assert len(list(sent(new))) >= 2
    engine = SGLangEngine([server.url])
    engine.load_tensors(sent(new), version=7)
    engine.reload = lambda: (sent(new), 7, 1)
    rollouts = engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, seed=4))
    assert {r.weight_version for r in rollouts} == {7}
    probe = _probe(rollouts)
    run_preflight(new, engine.score, probe, engine_name="sglang", base_format="f32", threshold=5e-3)
    SGLangEngine([server.url]).load_tensors(sent(model), version=8)  # another client's weights
    # the next answer carries version 8: the engine re-sends its weights and asks again
    run_preflight(new, engine.score, probe, engine_name="sglang", base_format="f32", threshold=5e-3)
    assert engine.resyncs == 1 and engine.servers.versions() == {"7"}
    engine.update_weights_from_disk(os.path.join(exported[0], "v0"), version=0)  # restore


def _wait_for_requests(log_path, n, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(log_path, errors="replace") as f:
            if f.read().count("POST /generate") >= n:
                return
        time.sleep(0.05)


@pytest.mark.slow  # CI: 90 s; a SIGKILLed server mid-run is in tests/reliability/test_engine_faults.py
def test_killed_server_mid_generation_is_retried_elsewhere_without_loss(exported, server):
    tmp, _ = exported
    with SGLangServer(_spec(os.path.join(tmp, "v0"), tmp, "victim")) as victim:
        engine = SGLangEngine([victim.url, server.url], backoff_s=0.2, weight_version=0)
        prompts = [Prompt(f"q{i}", (1 + i, 2, 3)) for i in range(16)]
        result = {}
        worker = threading.Thread(target=lambda: result.update(out=engine.generate(
            prompts, SamplingParams(max_new_tokens=128, n=2, seed=5))))
        worker.start()
        _wait_for_requests(victim.log_path, 2)  # the victim has answered some requests...
        os.killpg(victim.proc.pid, signal.SIGKILL)  # ...and dies with others in flight
        worker.join(timeout=300)
        victim.proc.wait(timeout=30)
        rollouts = result["out"]
        keys = [(r.prompt_uid, r.sample_index) for r in rollouts]
        assert keys == [(p.uid, j) for p in prompts for j in range(2)]  # none dropped or doubled
        assert all(len(r.completion_ids) == 128 or r.finish_reason == "stop" for r in rollouts)
        assert engine.retries >= 1, "no request was in flight on the killed server"
        assert not engine.healthy[victim.url] and engine.healthy[server.url]


def test_all_servers_dead_is_a_clear_error():
    engine_urls = ["http://127.0.0.1:9"]  # discard port: nothing listens
    with pytest.raises(RolloutError, match="no healthy SGLang server left|failed on every attempt|does not answer"):
        SGLangEngine(engine_urls, backoff_s=0.01, max_retries=1).generate(
            PROMPTS[:1], SamplingParams(max_new_tokens=2))


# --- LoRA mode: LoRA adapters exported by rlx, hot-loaded into SGLang --------------------------------

def _with_random_adapter(base_path, seed):
    from flax import nnx

    from rlx.quant import LoraConfig, apply_lora

    lcfg = LoraConfig(rank=4, alpha=8.0)
    model = apply_lora(from_hf(base_path), lcfg, nnx.Rngs(seed))
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    lora = jax.tree.map(lambda x: 0.3 * jax.random.normal(next(keys), x.shape), lora)
    return nnx.merge(graphdef, lora, rest), lcfg


def test_lora_adapter_exported_hot_loaded_used_and_unloaded(exported, server):
    from rlx.io.export import export_peft

    tmp, _ = exported
    base = os.path.join(tmp, "v0")
    policy1, lcfg = _with_random_adapter(base, seed=1)
    policy2, _ = _with_random_adapter(base, seed=2)
    engine = SGLangEngine([server.url], weight_version=0)
    engine.load_adapter(export_peft(policy1, lcfg, os.path.join(tmp, "adapter-1"), "1"), version=1)
    rollouts = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=7))
    assert {r.weight_version for r in rollouts} == {1}
    probe = _probe(rollouts)
    report = run_preflight(policy1, engine.score, probe, engine_name="sglang", base_format="f32+lora",
                           threshold=5e-3)
    assert report.max_abs <= 5e-3
    # the reference policy (adapter off) is the base the server holds without an adapter
    with pytest.raises(PreflightError):
        run_preflight(policy1, engine.score, probe, engine_name="sglang", base_format="f32+lora",
                      threshold=5e-3, adapter=False)
    # a wrong adapter loaded on the server fails the preflight with a clear message
    engine.load_adapter(export_peft(policy2, lcfg, os.path.join(tmp, "adapter-2"), "2"), version=2)
    with pytest.raises(PreflightError, match=r"sglang \(base format f32\+lora\) and the learner disagree"):
        run_preflight(policy1, engine.score, probe, engine_name="sglang", base_format="f32+lora",
                      threshold=5e-3)
    run_preflight(policy2, engine.score, probe, engine_name="sglang", base_format="f32+lora",
                  threshold=5e-3)
    # the first adapter was unloaded when the second arrived
    assert engine.loaded_adapters() == {server.url: {"policy-2"}}
