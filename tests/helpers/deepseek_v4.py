"""The tiny random DeepSeek-V4 of the V4 tests (``tests/models/test_deepseek_v4*.py``): a
transformers 5.25 ``DeepseekV4ForCausalLM`` whose sizes make every feature bind (see
``tests/models/test_deepseek_v4.py``), every weight, bias, sink and table random, saved as an HF
folder; transformers' logits of it, and rlx's."""

import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

TOL = 1e-4
VOCAB, T = 48, 13
TINY = dict(
    vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=1, head_dim=16, q_lora_rank=12,
    partial_rotary_factor=0.5, num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
    layer_types=["sliding_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention", "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
    hc_mult=3, hc_sinkhorn_iters=5, mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    swiglu_limit=0.3, sliding_window=4, o_groups=2, o_lora_rank=8, index_n_heads=8,
    index_head_dim=12, index_topk=2, num_nextn_predict_layers=0, max_position_embeddings=64,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                     "beta_fast": 8.0, "beta_slow": 1.0})


def _randomise(model, seed: int) -> None:
    """Every parameter and buffer random; ``tid2eid`` distinct experts."""
    g = torch.Generator().manual_seed(seed)
    normal = lambda t, std: torch.randn(t.shape, generator=g) * std  # noqa: E731
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("tid2eid"):
                keys = torch.rand((t.shape[0], 4), generator=g)
                t.copy_(keys.argsort(-1)[:, :t.shape[1]])
            elif "inv_freq" in name:
                continue
            elif "norm" in name or name.endswith("scale"):
                t.copy_(1 + normal(t, 0.2))
            elif t.ndim == 1 or "position_bias" in name:
                t.copy_(normal(t, 0.5))
            else:
                t.copy_(normal(t, 0.2))


def make_v4(path: str, seed: int = 0, **overrides) -> str:
    cfg = transformers.DeepseekV4Config(**(TINY | overrides))
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(cfg).eval()
    _randomise(model, seed)
    model.save_pretrained(path)
    return path


def hf_logits(path: str, ids: np.ndarray) -> np.ndarray:
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.numpy()


@nnx.jit
def _forward(model, ids, mask):
    return model(ids, attention_mask=mask)


def logits(model, ids, mask=None) -> np.ndarray:
    ids = jnp.asarray(ids)
    return np.asarray(_forward(model, ids, jnp.ones_like(ids) if mask is None else jnp.asarray(mask)))


def ids_of(b=2, t=T, seed=0):
    return np.random.RandomState(seed).randint(0, VOCAB, (b, t))
