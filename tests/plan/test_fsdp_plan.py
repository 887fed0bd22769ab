"""The planner's full-mode train step on FSDP meshes against XLA's memory analysis of the compiled
step (compiled only, on the 8 CPU devices): what FSDP gathers (``fsdp_gather``) and the
vocabulary tiles of the lm-head (``vocab_grads``, ``head_tile``)."""

from __future__ import annotations

import jax
import pytest

from rlx.mesh import MeshShape
from rlx.models import ModelConfig
from rlx.plan import plan
from rlx.plan.memory import compiled_bytes
from rlx.plan.spec import PlanSpec


def _dense(vocab: int) -> ModelConfig:
    """A tied-embedding Llama of shapes outside the sweep ``COEFFS`` was fitted on."""
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=192,
                       intermediate_size=512, num_layers=3, num_heads=6, num_kv_heads=2,
                       head_dim=32, tie_word_embeddings=True)


FULL = dict(mode="full", dtype="float32", param_dtype="float32", remat="none", rows=16,
            seq_len=96, logprob_chunk=384)
# Per-device step bytes (MB), planned / XLA: small-fsdp4 49.2 / 51.1, large-fsdp8 41.7 / 41.6,
# large-data2-fsdp4 54.8 / 62.3. The model before the FSDP and vocabulary-tile terms planned
# 44.6, 66.3 and 78.7 (-13%, +60%, +26%: two of three fail). Before the decoder split the rows
# of its unrolled layers over the batch axes (``Transformer._split_rows``), XLA's figures were
# 84.6, 89.0 and 80.1: its partitioner gathered every row to each device.
CASES = {
    "small-fsdp4": PlanSpec(model=_dense(3072), mesh=MeshShape(fsdp=4), **FULL),
    "large-fsdp8": PlanSpec(model=_dense(24576), mesh=MeshShape(fsdp=8), **FULL),
    "large-data2-fsdp4": PlanSpec(model=_dense(24576), mesh=MeshShape(data=2, fsdp=4), **FULL),
}


@pytest.mark.parametrize("name", list(CASES))
def test_full_mode_fsdp_step_matches_compiled(name):
    """Whole full-mode train step per device, analytic within 15% of XLA's memory analysis
    (arguments + outputs - aliased + temporaries); the state exact."""
    spec = CASES[name]
    p = plan(spec, hbm_gb=1.0)
    xla = compiled_bytes(spec, jax.devices())
    step = p.train_peak - p.bytes["engine"]  # the engine's own weights are no part of the step
    assert p.bytes["fsdp_gather"] > 0
    assert abs(step - xla["total"]) <= 0.15 * xla["total"], (name, step, xla)
    state = sum(p.bytes[k] for k in ("trainable", "optimizer", "batch"))
    assert abs(state - xla["argument"]) <= 64, (state, xla)
