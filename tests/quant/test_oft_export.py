"""OFT on MoE experts (one rotation per expert, grouped and dense paths), merged export (the
rotation folded into float weights) against PEFT's own merge and transformers, checkpoint
resume of an OFT train state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rlx.io.checkpoint import CheckpointConfig, Checkpointer
from rlx.io.export import export_base, export_merged, export_peft, merged_state_dict
from rlx.learner.state import OptimizerConfig, create_train_state, make_optimizer
from rlx.mesh import MeshShape, make_mesh
from rlx.models import from_hf
from rlx.models.families import MLA_TARGETS
from rlx.quant import LoraConfig, apply_lora, quantize_model
from rlx.quant.config import OftConfig, QuantConfigError
from tests.helpers.hf_zoo import make_hf_model
from tests.helpers.quant import INT4, OFT8, ids, oft_model

MLA_OFT = LoraConfig(kind="oft", oft=OftConfig(block_size=8), targets=MLA_TARGETS)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zoo"))


def _hf_logits(folder: str, x) -> np.ndarray:
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor(x)).logits.numpy()


@pytest.mark.parametrize("family,lora", [pytest.param("qwen3_moe", OFT8, marks=pytest.mark.slow),
                                         ("kimi_k2", MLA_OFT)])
def test_expert_rotations_match_transformers_on_the_merged_export(zoo, tmp_path, family, lora):
    """rlx's logits (each expert's rows rotated by that expert's R before the int4 grouped
    product) == transformers' on the merged export (every R folded into its expert's float
    weight), <= 1e-5 (f32); the experts' rotations alone move the logits."""
    model = oft_model(zoo, family, lora)
    x = ids()
    ours = np.asarray(model(jnp.asarray(x)))
    diff = np.abs(ours - _hf_logits(export_merged(model, str(tmp_path / "m"), "v1"), x)).max()
    print(f"OFT experts {family}: transformers on the merged export {diff:.2e}")
    assert diff <= 1e-5
    for layer in model.layers:  # the experts' rotations back to the identity
        ex = getattr(layer.mlp, "experts", None)
        for o in () if ex is None else (ex.gate_lora, ex.up_lora, ex.down_lora):
            o.oft_r.set_value(jnp.zeros_like(o.oft_r[...]))
    assert np.abs(np.asarray(model(jnp.asarray(x))) - ours).max() > 1e-2


def test_grouped_and_dense_expert_paths_agree(zoo):
    """The same expert rotations through ``moe_impl="dense"`` (every expert on every token) give
    the grouped path's logits (<= 1e-5, f32)."""
    ragged = oft_model(zoo, "qwen3_moe")
    dense = quantize_model(from_hf(make_hf_model("qwen3_moe", zoo), moe_impl="dense"), INT4)
    apply_lora(dense, OFT8, nnx.Rngs(0))
    nnx.update(dense, nnx.state(ragged, nnx.LoRAParam))
    x = jnp.asarray(ids())
    assert np.abs(np.asarray(dense(x)) - np.asarray(ragged(x))).max() <= 1e-5


def test_merged_weights_equal_peft_merge(zoo, tmp_path):
    """``export_merged``'s weights (R folded into the dequantized int4 base) equal PEFT's
    ``merge_and_unload`` of the exported OFT folder on the exported base (<= 1e-6, f32)."""
    import peft
    import torch
    import transformers

    model = oft_model(zoo, "llama")
    base = export_base(model, INT4, str(tmp_path / "base"), "v1")
    adapter = export_peft(model, OFT8, str(tmp_path / "adapter"), "v1")
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(hf, adapter).merge_and_unload().state_dict()
    ours = merged_state_dict(model)
    assert set(ours) <= set(theirs)
    moved = 0
    for name, value in ours.items():
        assert np.abs(value - theirs[name].numpy()).max() <= 1e-6, name
        moved += "proj" in name
    assert moved == 2 * 7  # every adapted projection of both layers


def test_peft_export_refuses_expert_rotations(zoo, tmp_path):
    model = oft_model(zoo, "qwen3_moe", randomize=False)
    with pytest.raises(QuantConfigError, match="PEFT's OFT cannot adapt MoE experts"):
        export_peft(model, OFT8, str(tmp_path / "adapter"), "v1")


def test_checkpoint_resume_of_an_oft_state(zoo, tmp_path):
    """An OFT train state (int4 base, the rotations and AdamW moments after a made-up update)
    saves without its base and restores bit for bit onto a fresh state, whose logits are then
    the trained model's."""
    opt = make_optimizer(OptimizerConfig(learning_rate=1e-2))
    mesh = make_mesh(MeshShape(), jax.devices()[:1])

    def fresh():
        model = oft_model(zoo, "llama", randomize=False)
        return create_train_state(model, opt, mesh, trainable=nnx.LoRAParam)

    graphdef, state = fresh()
    grads = jax.tree.map(lambda p: jnp.cos(7.0 * p + 0.3), state.params)
    updates, opt_state = opt.update(grads, state.opt_state, state.params)
    state = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                          opt_state=opt_state)
    folder = CheckpointConfig(str(tmp_path / "ckpt"), every=1, keep=2)
    arch = from_hf(make_hf_model("llama", zoo)).config
    with Checkpointer(folder, model_config=arch) as ck:
        ck.save(1, state)
        saved = set(ck.read_meta(1)["fingerprint"]["leaves"])
    assert saved and all("oft_r" in p for p in saved if p.startswith("params/"))
    assert not any(p.startswith("frozen") for p in saved)
    _, other = fresh()
    restored = Checkpointer(folder, model_config=arch).restore_latest(other).state
    for a, b in zip(jax.tree.leaves((restored.params, restored.opt_state)),
                    jax.tree.leaves((state.params, state.opt_state))):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    x = jnp.asarray(ids())
    logits = lambda s: np.asarray(nnx.merge(graphdef, s.params, s.frozen)(x))  # noqa: E731
    assert np.array_equal(logits(restored), logits(state))
    assert np.abs(logits(restored) - logits(other)).max() > 1e-3
