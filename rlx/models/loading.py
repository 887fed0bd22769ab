"""Entry points that turn a checkpoint on disk (HF folder or GGUF file) into a sharded model."""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
from jax.sharding import Mesh

from rlx.mesh import TRAIN_RULES, LogicalRules
from rlx.models.config import from_hf_config
from rlx.models.decoder import Precision, Transformer
from rlx.models.hf import load_model, read_hf_config
from rlx.models.safetensors_io import SafetensorsFolder
from rlx.models.tokenizer import Tokenizer

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass
class LoadedModel:
    """A model with its tokenizer (None when the checkpoint carries none) and where it came from."""

    model: Transformer
    tokenizer: Tokenizer | None
    source: str
    format: str


def from_gguf(
    path: str, dtype=jnp.float32, mesh: Mesh | None = None, *, param_dtype=None,
    rules: LogicalRules = TRAIN_RULES, moe_impl: str = "ragged",
) -> Transformer:
    """Load a llama.cpp GGUF file (dequantized to ``param_dtype``) into a sharded model."""
    return load_gguf(path, dtype, mesh, param_dtype=param_dtype, rules=rules, moe_impl=moe_impl).model


def load_gguf(path, dtype=jnp.float32, mesh=None, *, param_dtype=None, rules=TRAIN_RULES,
              moe_impl="ragged") -> LoadedModel:
    from rlx.models.gguf import read_gguf

    ckpt = read_gguf(path)
    cfg = from_hf_config(ckpt.hf_config)
    precision = Precision(dtype=dtype, param_dtype=param_dtype or dtype, moe_impl=moe_impl)
    model = load_model(cfg, ckpt.tensors, precision=precision, mesh=mesh, rules=rules)
    return LoadedModel(model, ckpt.tokenizer, path, "gguf")


def load_hf(path, dtype=jnp.float32, mesh=None, *, param_dtype=None, rules=TRAIN_RULES,
            moe_impl="ragged") -> LoadedModel:
    cfg = read_hf_config(path)
    precision = Precision(dtype=dtype, param_dtype=param_dtype or dtype, moe_impl=moe_impl)
    model = load_model(cfg, SafetensorsFolder(path), precision=precision, mesh=mesh, rules=rules)
    has_tok = os.path.exists(os.path.join(path, "tokenizer.json"))
    return LoadedModel(model, Tokenizer.from_dir(path) if has_tok else None, path, "hf")


def shrunk(cfg, s):
    """``cfg`` (a ``ModelConfig``) with the sizes of a ``config.model.shrink`` section."""
    moe = None if cfg.moe is None else dataclasses.replace(
        cfg.moe, num_experts=s.num_experts, top_k=min(cfg.moe.top_k, s.num_experts),
        intermediate_size=s.moe_intermediate_size,
        sparse_layers=tuple(i for i in cfg.moe.sparse_layers if i < s.num_layers))
    return dataclasses.replace(cfg, num_layers=s.num_layers, hidden_size=s.hidden_size,
                               intermediate_size=s.intermediate_size, num_heads=s.num_heads,
                               num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, moe=moe)


def shrunk_random(section, mesh: Mesh | None, seed: int, rules: LogicalRules = TRAIN_RULES) -> LoadedModel:
    """A randomly initialised, shrunken copy of the checkpoint's architecture, with its tokenizer."""
    from flax import nnx

    from rlx.config import resolve_path

    path = resolve_path(section.path)
    if section.resolved_format == "gguf":
        from rlx.models.gguf import read_gguf

        ckpt = read_gguf(path)
        cfg, tokenizer = from_hf_config(ckpt.hf_config), ckpt.tokenizer
    else:
        cfg = read_hf_config(path)
        has_tok = os.path.exists(os.path.join(path, "tokenizer.json"))
        tokenizer = Tokenizer.from_dir(path) if has_tok else None
    cfg = shrunk(cfg, section.shrink)
    precision = Precision(dtype=_DTYPES[section.dtype], param_dtype=_DTYPES[section.param_dtype],
                          moe_impl=section.moe_impl)
    model = Transformer(cfg, precision, rngs=nnx.Rngs(seed))
    if mesh is not None:
        from rlx.quant.lora import shard_variables

        shard_variables(model, nnx.Param, mesh, rules)
    return LoadedModel(model, tokenizer, f"random shrunken copy of {path}", "random")


def load_from_section(section, mesh: Mesh | None, rules: LogicalRules = TRAIN_RULES,
                      seed: int = 0) -> LoadedModel:
    """Load what a validated ``config.model`` section names."""
    from rlx.config import resolve_path

    if section.shrink.enabled:
        return shrunk_random(section, mesh, seed, rules)
    loader = load_gguf if section.resolved_format == "gguf" else load_hf
    return loader(resolve_path(section.path), _DTYPES[section.dtype], mesh,
                  param_dtype=_DTYPES[section.param_dtype], rules=rules, moe_impl=section.moe_impl)
