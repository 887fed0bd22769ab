"""The planner's KV cache equals the built-in engine's, per device: GQA layers cache every KV
head's keys and values (split over the tensor axis), multi-head latent attention layers the
latent and the shared rotary key (no head axis: whole on every device); under context
parallelism both split over the context devices along the slots."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from rlx.mesh import (SAMPLE_RULES, MeshShape, batch_sharding, batch_shards, context_as_rows,
                      make_mesh)
from rlx.models import from_hf_config
from rlx.models.families import SUPPORTED_ARCHITECTURES
from rlx.models.kv_cache import KVCache
from rlx.plan import plan
from rlx.models.paged_kv import PagedKVCache
from rlx.plan.memory import (engine_cache_bytes, kv_cache_bytes, kv_cache_per_token,
                             page_pool_bytes, step_bytes, step_features)
from rlx.plan.aot_sample import generate_lowered
from rlx.plan.spec import PlanSpec
from rlx.rollout.jax.cache_layout import cache_sharding
from rlx.rollout.jax.config import JaxSection
from rlx.rollout.jax.paged import PagedServing
from tests.helpers.hf_zoo import hf_config

ARCHITECTURE = {kind: arch for arch, kind in SUPPORTED_ARCHITECTURES.items()}  # by model_type


def _config(family: str):
    hf = hf_config(family)
    return from_hf_config(hf.to_dict() | {"architectures": [ARCHITECTURE[hf.model_type]]})


def _engine_cache_bytes_per_device(cfg, mesh_shape: MeshShape, rows: int, length: int) -> int:
    """Bytes on the first device of an f32 ``KVCache`` of ``rows`` x ``length`` slots placed on
    the engine's shardings (``cache_sharding`` for the layers' buffers, rows for the rest)."""
    mesh = make_mesh(mesh_shape, jax.devices()[:mesh_shape.num_devices])
    cache = KVCache.zeros(cfg, rows, length, np.float32)
    layers = cache_sharding(mesh, cfg, SAMPLE_RULES, batch_shards(mesh, SAMPLE_RULES))
    put = lambda xs, s: tuple(jax.device_put(x, s) for x in xs)  # noqa: E731
    cache = cache.replace(keys=put(cache.keys, layers[0]), values=put(cache.values, layers[1]),
                          positions=jax.device_put(cache.positions, batch_sharding(mesh, 2)),
                          segment_ids=jax.device_put(cache.segment_ids, batch_sharding(mesh, 2)))
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(cache))


@pytest.mark.parametrize("mesh", [MeshShape(), MeshShape(data=2, tensor=2),
                                  MeshShape(context=2, tensor=2)], ids=str)
@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2_lite", "kimi_k2", "qwen3_moe"])
def test_kv_cache_bytes_equal_the_engines_cache(family, mesh):
    cfg = _config(family)
    spec = PlanSpec(model=cfg, mode="full", dtype="float32", param_dtype="float32",
                    kv_dtype="float32", rollout_rows=8, rollout_len=48, mesh=mesh)
    assert kv_cache_bytes(spec) == _engine_cache_bytes_per_device(cfg, mesh, 8, 48)
    if cfg.mla is not None:  # 16 + 8 (deepseek_v3, kimi_k2), 16 + 4 (deepseek_v2_lite)
        assert kv_cache_per_token(cfg) == cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
        rows, slots = 8 // spec.batch_shards, 48 // mesh.context  # the slots split over context
        assert kv_cache_bytes(spec) == (cfg.num_layers * rows * slots * kv_cache_per_token(cfg)
                                        * 4 + 2 * rows * 48 * 4 + 4)


def test_deepseek_v3_caches_576_numbers_per_token_and_layer():
    """DeepSeek-V3's shape: 512 + 64 = 576 cached numbers per token and layer, where per-head
    keys (192 wide) and values (128) of its 128 heads would be 40,960 (2 x 128 x 192 = 49,152 with
    the values padded to the key width, as attention kernels that need equal widths hold them)."""
    hf = {"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
          "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
          "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
          "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
          "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
          "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
          "architectures": ["DeepseekV3ForCausalLM"]}
    cfg = from_hf_config(hf)
    expanded = cfg.num_heads * (cfg.head_dim + cfg.value_head_dim)
    spec = PlanSpec(model=cfg, mode="full", rollout_rows=64, rollout_len=4096,
                    mesh=MeshShape(data=8, tensor=8))
    per_token = kv_cache_per_token(cfg)
    print(f"DeepSeek-V3 KV cache per token and layer: {per_token} numbers (per-head form "
          f"{expanded}, {expanded / per_token:.1f}x); {per_token * 2 * cfg.num_layers:,} bf16 "
          f"bytes per token over {cfg.num_layers} layers; {kv_cache_bytes(spec) / 2**30:.2f} GiB "
          f"per device for 64 x 4096 slots over 8 batch shards")
    assert per_token == 576 and expanded == 40960
    assert 2 * cfg.num_heads * cfg.head_dim == 49152
    assert step_bytes(spec, 0)["kv_cache"] == engine_cache_bytes(spec)


def test_mla_attention_activations_count_its_own_projections():
    """The "qkv" feature of a tiny DeepSeek-V3 layer (f32, 2 rows x 8 tokens, no remat): per
    token q_a 24 + latent 16 + rotary key 8 + q_b 4 x 16 + kv_b 4 x (8 + 12) = 192 numbers,
    4 bytes x 16 tokens x 192 = 12,288 bytes per layer, two layers."""
    cfg = _config("deepseek_v3")
    spec = PlanSpec(model=cfg, mode="full", dtype="float32", param_dtype="float32", rows=2,
                    seq_len=8, logprob_chunk=16, remat="none")
    assert step_features(spec, 0)["qkv"] == 2 * 12288
    assert plan(spec, hbm_gb=1.0).bytes["kv_cache"] == engine_cache_bytes(spec)


def test_context_parallel_generate_keeps_its_cache_split():
    """XLA's memory analysis of the engine's generate step (8 rows, 2,048 slots, f32 cache): with
    ``context=2`` beside ``tensor=2`` each device holds half the cache's slots, and the decode
    loop's one-row attention reduces over them where they lie; the step's temporaries fall by at
    least the half of the cache a device no longer holds (no per-step gather of the cache)."""
    cfg = _config("llama")
    temps, caches = [], []
    for shape in (MeshShape(tensor=2), MeshShape(context=2, tensor=2)):
        spec = PlanSpec(model=cfg, mode="full", dtype="float32", param_dtype="float32",
                        kv_dtype="float32", rollout_rows=8, rollout_len=2048, mesh=shape)
        mesh = make_mesh(shape, jax.devices()[:shape.num_devices])
        temps.append(generate_lowered(spec, mesh).compile().memory_analysis().temp_size_in_bytes)
        caches.append(kv_cache_bytes(spec))
    assert caches[1] < 0.55 * caches[0]
    assert temps[0] - temps[1] >= caches[0] - caches[1], (temps, caches)


@pytest.mark.parametrize("mesh", [MeshShape(), MeshShape(data=2, tensor=2),
                                  MeshShape(data=2, fsdp=2, expert=2),
                                  MeshShape(context=2, tensor=2)], ids=str)
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_page_pool_bytes_equal_the_continuous_engines_pools(family, mesh):
    """The planner's page pools per device are the continuous engine's, placed as it places
    them: a data shard's pool (sized for its share of the call's sequences, a prompt's 2
    samples together; the context devices are data shards too), GQA's KV heads over tensor,
    MLA's latent pages whole."""
    cfg = _config(family)
    spec = PlanSpec(model=cfg, mode="full", dtype="float32", param_dtype="float32",
                    kv_dtype="float32", rollout_rows=8, rollout_len=48, rollout_group=2,
                    mesh=mesh)
    several = mesh.num_devices > 1
    m = make_mesh(mesh, jax.devices()[:mesh.num_devices]) if several else None
    serving = PagedServing(cfg, None, None, np.float32, JaxSection(), 8,
                           None if several else jax.devices()[0], mesh=m,
                           rules=context_as_rows(SAMPLE_RULES))  # as the engine passes them
    pages = serving._pages(48, 8, 2)
    pools = serving._place_pools(PagedKVCache.zeros(cfg, pages * serving.shards, 16,
                                                    np.float32), pages)
    held = sum(x.addressable_shards[0].data.nbytes for x in pools.keys + pools.values)
    assert page_pool_bytes(spec) == held
    assert spec.continuous and step_bytes(spec, 0)["kv_cache"] == held
