"""The built-in engine with an OFT adapter (``lora.kind="oft"``): its sampler and scorer
log-probs against the learner's compiled log-prob step, <= 1e-5 in f32 (``tests.helpers.parity``),
on a quantized base: GQA with a dense MLP, MoE experts (one rotation each), and multi-head latent
attention, whose absorbed decode folds ``kv_b_proj``'s rotation into its weight (``R W``)."""

import pytest

from rlx.models.families import MLA_TARGETS
from rlx.quant import LoraConfig, QuantConfig
from rlx.quant.config import OftConfig
from tests.helpers.parity import TOL, parity
from tests.helpers.quant import OFT8, oft_model


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zoo"))


@pytest.mark.parametrize("family,fmt,lora", [
    ("llama", "int4", OFT8),
    pytest.param("qwen3_moe", "int8", OFT8, marks=pytest.mark.slow),
    ("kimi_k2", "int4", LoraConfig(kind="oft", oft=OftConfig(block_size=8), targets=MLA_TARGETS))])
def test_sampler_logprobs_equal_learner_with_oft(zoo, family, fmt, lora):
    model = oft_model(zoo, family, lora, QuantConfig(format=fmt, group_size=8))
    sampled, scored, _ = parity(model)
    print(f"OFT {family} {fmt} f32: sampler {sampled:.2e}, score {scored:.2e}")
    assert sampled <= TOL and scored <= TOL
