"""A separate critic model (``config.critic.path``, mode ``full``): refused before any weight is
read when it cannot serve (another vocabulary, a value head wider or narrower than its hidden
states); otherwise loaded beside the policy with the value head it carries."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from rlx.config import parse_config
from rlx.errors import ConfigError
from rlx.mesh import make_mesh
from rlx.models import ModelConfig, Transformer
from rlx.models.config import to_hf_config
from rlx.models.hf import hf_state_dict
from rlx.models.safetensors_io import save_sharded
from rlx.run.build import compile_steps, load_policy
from rlx.run.checks import check_before_build
from tests.helpers.runs import config_dict

SMOLLM2_VOCAB = 49152
PPO = {"train.advantage": "gae", "critic.enabled": True, "train.mode": "full",
       "quant.format": "none", "loss.kl_coef": 0.0, "mesh.data": 8}


def _critic_folder(tmp_path, vocab: int = SMOLLM2_VOCAB, head_width: int | None = 32) -> str:
    """A random 1-layer Llama of width 32 (the tiny policy's is 64), tied embeddings, with a
    value head ``score.weight`` [1, head_width] like HF's token-classification models."""
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=32,
                      intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=16, tie_word_embeddings=True)
    tensors = hf_state_dict(Transformer(cfg, rngs=nnx.Rngs(3)))
    if head_width is not None:
        tensors["score.weight"] = np.arange(head_width, dtype=np.float32)[None] / 100
        tensors["score.bias"] = np.array([0.25], np.float32)
    folder = tmp_path / f"critic-{vocab}-{head_width}"
    os.makedirs(folder)
    save_sharded(tensors, str(folder))
    (folder / "config.json").write_text(json.dumps(to_hf_config(cfg)))
    return str(folder)


def _cfg(tmp_path, **over):
    return parse_config(config_dict("tiny", tmp_path / "run", **{**PPO, **over}))


def test_gae_without_a_critic_and_a_critic_path_in_lora_mode_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"^config.train.advantage='gae' needs a learned critic: "
                                          r"set config.critic.enabled=True"):
        _cfg(tmp_path, **{"critic.enabled": False})
    with pytest.raises(ConfigError, match=r"^config.critic.path='.*': in train.mode='lora' the "
                                          r"critic is a second adapter on the policy's frozen base"):
        _cfg(tmp_path, **{"train.mode": "lora", "quant.format": "int8",
                          "critic.path": _critic_folder(tmp_path)})


@pytest.mark.parametrize("vocab,width,needle", [
    (SMOLLM2_VOCAB, 48, r"carries a value head \(score.weight\) of width 48, but its hidden size "
                        r"is 32"),
    (1000, 32, r"has a vocabulary of 1000 tokens, the policy's 49152"),
])
def test_a_critic_that_cannot_serve_is_refused_before_loading(tmp_path, vocab, width, needle):
    cfg = _cfg(tmp_path, **{"critic.path": _critic_folder(tmp_path, vocab, width)})
    with pytest.raises(ConfigError, match=r"^config.critic.path='.*' " + needle):
        check_before_build(cfg, 8)


def test_a_smaller_critic_starts_from_the_value_head_it_carries(tmp_path):
    cfg = _cfg(tmp_path, **{"critic.path": _critic_folder(tmp_path)})
    check_before_build(cfg, 8)
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, data=1))
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    model, _ = load_policy(cfg, mesh)
    compiled = compile_steps(cfg, model, mesh)
    critic = compiled.state.critic
    assert critic.params["head"]["kernel"].shape == (32,)
    np.testing.assert_allclose(critic.params["head"]["kernel"], np.arange(32) / 100, atol=1e-7)
    assert float(critic.params["head"]["bias"]) == 0.25
    assert critic.params["body"]["embed"].shape == (SMOLLM2_VOCAB, 32)  # its own, narrower model
    assert len(critic.params["body"]["layers"]) == 1 and critic.frozen is not None
    assert compiled.critic_graphdef != compiled.graphdef
