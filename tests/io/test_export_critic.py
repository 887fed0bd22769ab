"""PPO's critic exported apart from the policy (``rlx.io.export.export_critic``), checked against
transformers' ``AutoModelForTokenClassification`` with one label (its ``score`` layer is the value
head): LoRA mode the critic's adapter and head as a PEFT folder on the policy's base (peft loads
it), full mode a HF folder with the head beside the weights (which ``config.critic.path`` reads
back). The values per token agree with rlx's critic (<= 1e-5, f32)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.io.export import export_critic, read_version
from rlx.learner.critic import read_value_head
from rlx.models import ModelConfig, Transformer
from rlx.models.hf import to_hf
from rlx.quant import LoraConfig, apply_lora
from tests.helpers.quant import randomize_lora_b

LORA = LoraConfig(rank=4, alpha=8.0)
CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=258, hidden_size=32,
                  intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  tie_word_embeddings=False)
IDS = np.array([5, 17, 99, 3, 250, 41, 7, 7, 130], np.int32)


def _head(seed: int = 4):
    k = jax.random.normal(jax.random.key(seed), (CFG.hidden_size,), jnp.float32)
    return {"kernel": k, "bias": jnp.float32(0.3)}


def _rlx_values(critic: Transformer, head) -> np.ndarray:
    """The head on every position's final hidden state (rlx's V(s_{t+1}) sits at t + 1)."""
    n = len(IDS)
    hidden = critic.hidden_states(jnp.asarray(IDS)[None], jnp.arange(n)[None],
                                  jnp.ones((1, n), jnp.int32))
    return np.asarray(hidden[0] @ head["kernel"] + head["bias"])


def _hf_values(model) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model.eval()(torch.tensor(IDS[None], dtype=torch.long)).logits[0, :, 0].numpy()


def test_a_lora_critic_is_a_peft_token_classification_adapter_on_the_base(tmp_path):
    import peft
    import torch
    import transformers

    critic = Transformer(CFG, rngs=nnx.Rngs(0))  # the policy's base weights
    apply_lora(critic, LORA, nnx.Rngs(5))
    randomize_lora_b(critic, seed=7, scale=0.2)  # the critic's own adapter, not zero
    to_hf(critic, str(tmp_path / "base"))  # the base alone (adapters are not written)
    head = _head()
    path = export_critic(critic, head, str(tmp_path / "critic"), "12", lora=LORA,
                         base_model_name_or_path=str(tmp_path / "base"))
    assert read_version(path) == "12"
    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    assert config["task_type"] == "TOKEN_CLS" and config["modules_to_save"] == ["score"]
    hf = transformers.AutoModelForTokenClassification.from_pretrained(
        str(tmp_path / "base"), num_labels=1, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf, path)
    want = _rlx_values(critic, head)
    np.testing.assert_allclose(_hf_values(model), want, atol=1e-5)
    with torch.no_grad():  # the adapter matters: the base with it off gives other values
        with model.disable_adapter():
            assert np.abs(_hf_values(model) - want).max() > 1e-3


def test_a_full_critic_is_a_hf_folder_with_its_value_head(tmp_path):
    import torch
    import transformers

    critic = Transformer(CFG, rngs=nnx.Rngs(2))
    head = _head(6)
    path = export_critic(critic, head, str(tmp_path / "critic"), "3")
    model = transformers.AutoModelForTokenClassification.from_pretrained(
        path, num_labels=1, dtype=torch.float32)
    np.testing.assert_allclose(_hf_values(model), _rlx_values(critic, head), atol=1e-5)
    kernel, bias = read_value_head(path)  # what config.critic.path starts from
    np.testing.assert_array_equal(kernel, np.asarray(head["kernel"]))
    assert bias == pytest.approx(0.3)
