"""Test setup: 8 fake CPU devices (set before JAX initialises its backends) and shared fixtures.

Compiled programs, every one however quick to compile, go to a persistent JAX compilation cache
shared by the pytest-xdist workers of one run and by the processes the tests launch (the
environment is inherited): many tests build the same tiny runs, and a resumed or second process
then loads what the first one compiled. The directory is removed when the run ends. Set
``JAX_COMPILATION_CACHE_DIR`` to use another one.
"""

import os
import shutil
import tempfile

import pytest

# Chosen by the first process that loads this file (the controller); its workers inherit it.
_CACHE = os.environ.setdefault("RLX_TESTS_JAX_CACHE",
                               os.path.join(tempfile.gettempdir(), f"rlx-tests-jax-{os.getpid()}"))

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def pytest_sessionfinish(session):
    """The controller (not an xdist worker) removes this run's cache."""
    if not hasattr(session.config, "workerinput"):
        shutil.rmtree(_CACHE, ignore_errors=True)


# Cases the CI leaves to the slow marker (the CI's 30 minutes on 2 cores), each covered in CI by
# the case named beside it; `python -m pytest -m slow` runs them.
CI_SLOW = {
    "tests/rollout/jax/test_engine.py::test_sampler_logprobs_equal_learner_on_gguf_blocks[Q8_0]":
        "[Q4_1]: GGUF blocks",
    "tests/rollout/jax/test_engine.py::test_bf16_logprob_figures[full]": "[lora]",
    "tests/rollout/jax/test_engine.py::test_sharded_mesh_gives_the_same_tokens[llama-full]":
        "[llama], [qwen3_moe]",
    "tests/rollout/jax/test_engine.py::"
    "test_sampler_logprobs_equal_learner_with_blockwise_attention[deepseek_v3]":
        "[llama], [gpt_oss] and tests/rollout/jax/test_engine_mla.py",
    "tests/rollout/jax/test_engine.py::test_sampler_logprobs_equal_learner_mode_a[qwen3_moe]":
        "mode_b[qwen3_moe-int8], mode_a[llama]",
    "tests/rollout/jax/test_engine_mla.py::"
    "test_latent_cache_sampler_matches_learner_and_greedy_matches_transformers[kimi_k2]":
        "[deepseek_v3], [kimi_k25]",
    "tests/learner/test_router_replay.py::test_engine_records_every_fed_token[lockstep]":
        "[continuous], [preempting]",
    "tests/rollout/jax/test_prefix_cache.py::"
    "test_continued_requests_prefill_only_their_new_tokens[llama stacked-lockstep]":
        "[llama stacked-continuous]",
    "tests/quant/test_mla_lora.py::test_peft_parity[deepseek_v2_lite-int4]":
        "[glm4_moe-int4], [kimi_k2-int4]",
    "tests/kernels/test_context_parallel.py::"
    "test_context_parallel_logprobs_and_grads_equal_one_device[deepseek_v3-lora-context2-fsdp2-tensor2]":
        "[llama-full-context2-fsdp2-tensor2] and the deepseek_v3 logits case",
    "tests/kernels/test_context_parallel.py::"
    "test_context_parallel_engine_samples_and_scores_as_one_device[deepseek_v3-lockstep]":
        "[deepseek_v3-continuous]",
    "tests/kernels/test_context_parallel.py::"
    "test_context_parallel_engine_samples_and_scores_as_one_device[llama-lockstep]":
        "[llama-continuous]",
    "tests/plan/test_plan.py::test_context_parallel_step_matches_compiled[lora-context4]":
        "[full-context2-tensor2]",
    "tests/plan/test_aot.py::test_the_sample_step_plan_agrees_with_xla_tpu":
        "test_train_and_generate_compile_and_match_the_plan",
    "tests/learner/test_logprob_head.py::test_blocked_head_gives_the_losses_and_gradients_of_the_"
    "logits_callable[untied-bf16-lora-0.0]": "[tied-bf16-full-0.01] and the f32 cases",
    "tests/learner/test_logprob_head.py::test_blocked_head_gives_the_losses_and_gradients_of_the_"
    "logits_callable[untied-bf16-lora-0.01]": "[tied-bf16-full-0.01] and the f32 cases",
    "tests/learner/test_logprob_head.py::test_blocked_head_gives_the_losses_and_gradients_of_the_"
    "logits_callable[tied-bf16-full-0.0]": "[tied-bf16-full-0.01] and the f32 cases",
    "tests/learner/test_step.py::"
    "test_scoring_only_the_loss_columns_gives_the_same_loss_and_gradients[full-padded]":
        "[lora-padded]",
    "tests/rewards/test_judge_sglang.py::test_smollm2_on_sglang_judges_a_batch_end_to_end":
        "tests/rewards/test_judge.py's OpenAI-compatible server (this one starts SGLang: 2 min)",
    "tests/envs/test_runner.py::test_a_resumed_synchronous_tool_run_ends_bit_identical":
        "tests/run/test_resume.py (the same checkpoint and data position, single-turn)",
    "tests/run/test_reward_model.py::test_one_tiny_rl_step_trains_on_the_reward_model":
        "test_the_reward_is_transformers_logit_of_the_chat and tests/run/test_judge_run.py's step",
    "tests/models/test_hf_parity.py::test_round_trip_through_to_hf[deepseek_v3]":
        "[kimi_k2] (the same DeepseekV3 architecture), [deepseek_v2_lite]",
    "tests/models/test_hf_parity.py::test_moe_ragged_equals_dense[glm4_moe]":
        "[deepseek_v3] (the same sigmoid routing with a correction bias)",
    "tests/models/test_hf_parity.py::test_correction_bias_decides_the_experts[kimi_k2]":
        "[deepseek_v3] (the same DeepseekV3 router)",
    "tests/rollout/jax/test_engine.py::test_sharded_mesh_gives_the_same_tokens[llama]":
        "[qwen3_moe] (its attention is sharded as llama's)",
    "tests/rollout/jax/test_engine.py::test_greedy_equals_transformers[qwen2]":
        "[llama], [qwen3_moe] and the learner parity of every family",
    "tests/rollout/jax/test_engine.py::test_greedy_equals_transformers[qwen3]":
        "[llama], [qwen3_moe] and the learner parity of every family",
    "tests/rollout/jax/test_engine.py::"
    "test_out_in_weights_sample_what_the_learner_layout_samples[qwen3]": "[llama]",
    "tests/rollout/jax/test_engine.py::test_sampling_matches_model_distribution[top_p]":
        "[top_k_top_p]",
    "tests/rollout/jax/test_engine.py::test_sampling_matches_model_distribution[top_k]":
        "[top_k_top_p]",
    "tests/rollout/jax/test_engine.py::"
    "test_without_logprobs_the_same_tokens_and_nan_logprobs[1.0]": "[0.0]",
    "tests/rollout/jax/test_engine.py::test_samples_of_a_prompt_share_its_prefill[1.0]": "[0.0]",
    "tests/rollout/jax/test_engine.py::test_shared_variables_are_the_callers_arrays[none]":
        "[int4]",
    "tests/quant/test_shipped.py::test_float_checkpoint_quantized_while_read[int8-all-llama]":
        "[int8-all-deepseek_v3], [int4-all-llama]",
    "tests/learner/test_step.py::test_packed_equals_padded[seq-mean-token-mean]":
        "[seq-mean-token-sum-norm] (per-sequence means over packed segments), [token-mean]",
    "tests/learner/test_step.py::test_packed_equals_padded[seq-mean-token-sum]":
        "[seq-mean-token-sum-norm] (per-sequence means over packed segments), [token-mean]",
    "tests/learner/test_step.py::test_remat_gives_the_same_loss_and_gradients[full-layer]":
        "[lora-layer], [full-projections]",
    "tests/learner/test_step.py::test_remat_gives_the_same_loss_and_gradients[lora-projections]":
        "[lora-layer], [full-projections]",
    "tests/test_configs.py::test_config_runs_one_shrunken_step[qwen3_30b_a3b_int4]":
        "[kimi_k2] (int4 experts as shipped), [quickstart] (GQA)",
    "tests/learner/test_logprob_head.py::test_blocked_head_gives_the_losses_and_gradients_of_the_"
    "logits_callable[tied-f32-full-0.01]": "[untied-f32-lora-0.01], [tied-f32-full-0.0], [tied-bf16-full-0.01]",
    "tests/learner/test_logprob_head.py::test_blocked_head_gives_the_losses_and_gradients_of_the_"
    "logits_callable[untied-f32-full-0.0]": "[untied-f32-lora-0.01], [tied-f32-full-0.0], [tied-bf16-full-0.01]",
    "tests/learner/test_logprob_head.py::test_blocked_head_gives_the_losses_and_gradients_of_the_"
    "logits_callable[tied-f32-lora-0.01]": "[untied-f32-lora-0.01], [tied-f32-full-0.0], [tied-bf16-full-0.01]",
    "tests/learner/test_logprob_head.py::test_blocked_head_gives_the_losses_and_gradients_of_the_"
    "logits_callable[untied-f32-lora-0.0]": "[untied-f32-lora-0.01], [tied-f32-full-0.0], [tied-bf16-full-0.01]",
    "tests/rollout/jax/test_engine_mla.py::test_adapters_and_quantized_kv_b_match_the_learner[none]":
        "[int8_token] (the same adapters over a quantized kv_b)",
    "tests/quant/test_export.py::test_round_trip_bit_identical[int4-asym-ct-llama]":
        "[int4-asym-ct-qwen2_moe] (attention, a dense shared expert and the experts)",
    "tests/quant/test_export.py::test_round_trip_bit_identical[fp8-block128-llama]":
        "[fp8-block128-qwen2_moe] (attention, a dense shared expert and the experts)",
    "tests/quant/test_export.py::test_round_trip_bit_identical[fp8-channel-llama]":
        "[fp8-channel-qwen2_moe] (attention, a dense shared expert and the experts)",
    "tests/quant/test_export.py::test_round_trip_bit_identical[int4-ct-llama]":
        "[int4-ct-qwen2_moe] (attention, a dense shared expert and the experts)",
    "tests/quant/test_export.py::test_round_trip_bit_identical[int4-bf16-scales-llama]":
        "[int4-bf16-scales-qwen2_moe] (attention, a dense shared expert and the experts)",
    "tests/plan/test_plan.py::test_analytic_matches_compiled[dense-lora]":
        "[dense-full], [moe-lora] (the adapter's and the base's bytes each counted once)",
    "tests/plan/test_plan.py::test_analytic_matches_compiled[moe-full]":
        "[dense-full], [moe-lora] (the adapter's and the base's bytes each counted once)",
    "tests/quant/test_oft.py::test_peft_parity[llama-lora1]":
        "[llama-lora0] (the Neumann form) and test_cayley_forms (the exact form against it)",
    "tests/quant/test_oft.py::test_peft_parity[qwen3-lora2]": "[llama-lora0]",
    "tests/quant/test_oft.py::test_peft_parity[qwen2_moe-lora3]":
        "[llama-lora0] (a dense MLP, as a shared expert is)",
    "tests/quant/test_oft.py::test_reference_is_adapter_off_exactly[qwen3_moe]":
        "[kimi_k2] (experts and MLA), [llama]",
    "tests/rollout/jax/test_engine_oft.py::"
    "test_sampler_logprobs_equal_learner_with_oft[llama-int4-lora0]":
        "[kimi_k2-int4-lora2] (rotated linears and MLA's folded kv_b)",
    "tests/test_configs.py::test_config_runs_one_shrunken_step[kimi_k26_oft]":
        "tests/learner/test_oft_step.py (an RL step on an int4 base) and [kimi_k2]",
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks the cases of ``CI_SLOW`` slow; a name there that no test has is an error."""
    ids = {item.nodeid for item in items}
    for item in items:
        if item.nodeid in CI_SLOW:
            item.add_marker(pytest.mark.slow)
    if not config.option.collectonly and len(items) > 200:  # a whole run: every name is a test
        missing = [n for n in CI_SLOW if n not in ids]
        assert not missing, f"tests/conftest.py CI_SLOW names no test: {missing}"
