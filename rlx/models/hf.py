"""HF transformers checkpoints in and out: ``from_hf`` / ``to_hf`` and the parameter name map.

Loading never builds the whole model on one device: the model is created abstractly
(``nnx.eval_shape``), each parameter's sharding is derived from its logical axes, and each process
reads just the distinct slices its devices hold from the safetensors files
(``jax.make_array_from_callback``; on CPU devices laid out by the host, ``rlx.platform.cpu.host_layout``).
HF linears are ``[out, in]``; rlx kernels are ``[in, out]``, and MoE experts are stacked ``[E, ...]``
(checkpoints hold one tensor per expert, ``...experts.{e}.gate_proj.weight``, which is also what
transformers 5.x ``save_pretrained`` writes). A vision-language checkpoint stores its language
model's tensors under a prefix (``Multimodal.weight_prefix``: Kimi-K2.5's ``language_model.``):
readers ask ``stored_param_map``, writers ``param_map`` (rlx writes the language model alone).
Besides the ``nnx.Param`` leaves, a router's ``CorrectionBias``
(``mlp.gate.e_score_correction_bias``) is read and written like a parameter.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rlx.mesh import TRAIN_RULES, LogicalRules, named_sharding, shard_variables
from rlx.models.config import ModelConfig, from_hf_config, quantization_config, to_hf_config
from rlx.models.decoder import Precision, Transformer
from rlx.models.deltanet import param_map_entries
from rlx.models.families import family_of, own_decoder, own_writer
from rlx.platform.cpu.host_layout import on_host, once_per_index, read_direct, read_transposed
from rlx.models.moe import CorrectionBias
from rlx.models.safetensors_io import DTYPES, CheckpointError, SafetensorsFolder, save_sharded
from rlx.models.stack import unrolled


@dataclasses.dataclass(frozen=True)
class ParamSource:
    """Where one rlx parameter comes from: HF names and how to lay them out."""

    hf_names: tuple[str, ...]
    # "copy" | "T" (transpose a linear) | "stack_T" (stack experts, transpose each) | "even" /
    # "odd" (the even / odd last-axis entries of a fused, interleaved tensor: gpt-oss gate_up)
    layout: str


INTERLEAVED = {"even": 0, "odd": 1}  # interleaved layouts -> the parity of their entries


def param_map(cfg: ModelConfig) -> dict[str, ParamSource]:
    """rlx parameter path ('layers/0/self_attn/q_proj/kernel') -> HF source."""
    out = {"embed": ParamSource(("model.embed_tokens.weight",), "copy"),
           "norm/weight": ParamSource(("model.norm.weight",), "copy")}
    if not cfg.tie_word_embeddings:
        out["lm_head/kernel"] = ParamSource(("lm_head.weight",), "T")
    for i in range(cfg.num_layers):
        out.update(_layer_map(cfg, i))
    return out


def stored_param_map(cfg: ModelConfig) -> dict[str, ParamSource]:
    """``param_map`` with the names a checkpoint of ``cfg``'s class stores (a vision-language
    checkpoint's language model under its ``Multimodal.weight_prefix``)."""
    mm = family_of(cfg).multimodal
    if mm is None:
        return param_map(cfg)
    return {p: dataclasses.replace(s, hf_names=tuple(mm.weight_prefix + n for n in s.hf_names))
            for p, s in param_map(cfg).items()}


def _layer_map(cfg: ModelConfig, i: int) -> dict[str, ParamSource]:
    us, hf = f"layers/{i}", f"model.layers.{i}"
    out = {f"{us}/{n}/weight": ParamSource((f"{hf}.{n}.weight",), "copy")
           for n in ("input_layernorm", "post_attention_layernorm")}
    attention = {"gqa": _attention_map, "mla": _mla_map, "dsa": _mla_map}[cfg.attention_kind]
    if cfg.is_linear_layer(i):  # a gated DeltaNet, rlx's self_attn, transformers' linear_attn
        out.update({p: ParamSource((n,), layout) for p, (n, layout) in param_map_entries(
            f"{us}/self_attn", f"{hf}.linear_attn").items()})
    else:
        out.update(attention(cfg, f"{us}/self_attn", f"{hf}.self_attn"))
    if cfg.dsa is not None and i not in cfg.dsa.shared_layers:  # a "shared" layer has none
        out.update(_indexer_map(f"{us}/self_attn/indexer", f"{hf}.self_attn.indexer"))
    if cfg.mlp_kind(i) == "dense":
        for p in ("gate_proj", "up_proj", "down_proj"):
            out[f"{us}/mlp/{p}/kernel"] = ParamSource((f"{hf}.mlp.{p}.weight",), "T")
        return out
    out.update(_moe_map(cfg, us, hf))
    return out


def _linears(us: str, hf: str, names, bias=()) -> dict[str, ParamSource]:
    """Kernels (and the biases named in ``bias``) of the linears ``names``."""
    out = {f"{us}/{p}/kernel": ParamSource((f"{hf}.{p}.weight",), "T") for p in names}
    out.update({f"{us}/{p}/bias": ParamSource((f"{hf}.{p}.bias",), "copy") for p in bias})
    return out


def _norms(us: str, hf: str, names) -> dict[str, ParamSource]:
    return {f"{us}/{n}/weight": ParamSource((f"{hf}.{n}.weight",), "copy") for n in names}


def _attention_map(cfg: ModelConfig, us: str, hf: str) -> dict[str, ParamSource]:
    """GQA: q/k/v/o projections, q/k/v biases, q/k norms."""
    bias = (("q_proj", "k_proj", "v_proj") if cfg.qkv_bias else ()) + (
        ("o_proj",) if cfg.o_bias else ())
    out = _linears(us, hf, ("q_proj", "k_proj", "v_proj", "o_proj"), bias)
    if cfg.attention_sinks:
        out[f"{us}/sinks"] = ParamSource((f"{hf}.sinks",), "copy")
    return out | (_norms(us, hf, ("q_norm", "k_norm")) if cfg.qk_norm else {})


def _mla_map(cfg: ModelConfig, us: str, hf: str) -> dict[str, ParamSource]:
    """MLA (DeepSeek names); ``attention_bias`` puts biases on q_a, kv_a and o."""
    low_rank_q = cfg.mla.q_lora_rank is not None
    names = ("q_a_proj", "q_b_proj") if low_rank_q else ("q_proj",)
    names += ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    bias = tuple(n for n in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj")
                 if n in names) if cfg.qkv_bias else ()
    norms = ("q_a_layernorm", "kv_a_layernorm") if low_rank_q else ("kv_a_layernorm",)
    return _linears(us, hf, names, bias) | _norms(us, hf, norms)


def _indexer_map(us: str, hf: str) -> dict[str, ParamSource]:
    """The DSA indexer's projections and its key's LayerNorm (``rlx.models.dsa``)."""
    out = {f"{us}/{p}": ParamSource((f"{hf}.{p}.weight",), "T")
           for p in ("wq_b", "wk", "weights_proj")}
    return out | {f"{us}/k_norm_{p}": ParamSource((f"{hf}.k_norm.{p}",), "copy")
                  for p in ("weight", "bias")}


def _moe_map(cfg: ModelConfig, us: str, hf: str) -> dict[str, ParamSource]:
    m = cfg.moe
    assert m is not None
    moe_names = family_of(cfg).moe_names  # the family's names of its sparse block
    block, names = f"{hf}.{moe_names.block}", dict(moe_names.experts)
    router = f"{block}.{moe_names.router}"
    out = {f"{us}/mlp/router": ParamSource((f"{router}.weight",), "T")}
    if m.router_bias:
        out[f"{us}/mlp/router_bias"] = ParamSource((f"{router}.bias",), "copy")
    if m.correction_bias:
        out[f"{us}/mlp/correction_bias"] = ParamSource((f"{router}.e_score_correction_bias",), "copy")
    if moe_names.fused:
        out.update(_fused_experts_map(cfg, f"{us}/mlp/experts", f"{block}.experts"))
    else:
        for ours, theirs in names.items():
            srcs = tuple(f"{block}.experts.{e}.{theirs}.weight" for e in range(m.num_experts))
            out[f"{us}/mlp/experts/{ours}"] = ParamSource(srcs, "stack_T")
    if m.shared_intermediate_size:  # Qwen2-MoE: one gated shared_expert; DeepSeek / GLM: several
        out.update(_linears(f"{us}/mlp/shared_expert", f"{block}.{moe_names.shared}",
                            ("gate_proj", "up_proj", "down_proj")))
    if m.shared_expert_gate:
        out[f"{us}/mlp/shared_gate"] = ParamSource((f"{block}.shared_expert_gate.weight",), "T")
    return out


def _fused_experts_map(cfg: ModelConfig, us: str, hf: str) -> dict[str, ParamSource]:
    """Experts stacked in one tensor per projection, ``[E, in, out]`` as rlx stores them, gate
    and up fused with their columns interleaved (gpt-oss: ``gate_up_proj[..., ::2]`` is the
    gate), and their biases (``*_bias``) where the MoE has them."""
    out = {f"{us}/gate_proj": ParamSource((f"{hf}.gate_up_proj",), "even"),
           f"{us}/up_proj": ParamSource((f"{hf}.gate_up_proj",), "odd"),
           f"{us}/down_proj": ParamSource((f"{hf}.down_proj",), "copy")}
    if cfg.moe.expert_bias:
        out.update({f"{us}/gate_bias": ParamSource((f"{hf}.gate_up_proj_bias",), "even"),
                    f"{us}/up_bias": ParamSource((f"{hf}.gate_up_proj_bias",), "odd"),
                    f"{us}/down_bias": ParamSource((f"{hf}.down_proj_bias",), "copy")})
    return out


def _expected_hf_shape(src: ParamSource, shape: tuple[int, ...]) -> tuple[int, ...]:
    if src.layout == "copy":
        return shape
    if src.layout in INTERLEAVED:
        return shape[:-1] + (2 * shape[-1],)
    return tuple(reversed(shape if src.layout == "T" else shape[1:]))


FLOAT_STORAGE = ("F64", "F32", "F16", "BF16")  # safetensors dtypes a float parameter is read from


def _where(tensors, name: str) -> str:
    """``file: `` of tensor ``name`` where the mapping knows it (safetensors folders), else ''."""
    return f"{tensors.file_of(name)}: " if hasattr(tensors, "file_of") else ""


def check_tensors(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], shapes: dict[str, tuple]) -> None:
    """Every needed HF tensor exists with the right shape and a float dtype; errors name the
    file, the tensor and the fix. A float parameter is never read from integer or fp8 storage:
    those are quantized values, which without their scales would be a wrong model."""
    for path, src in stored_param_map(cfg).items():
        if path not in shapes:
            continue
        want = _expected_hf_shape(src, shapes[path])
        for name in src.hf_names:
            if name not in tensors:
                raise CheckpointError(
                    f"checkpoint is missing tensor {name!r} (needed for rlx parameter {path!r}); "
                    "is the config.json from the same model as the weights?")
            got = tuple(tensors.shape(name) if hasattr(tensors, "shape") else tensors[name].shape)
            if got != want:
                raise CheckpointError(
                    f"{_where(tensors, name)}tensor {name!r} has shape {got}, but config.json "
                    f"implies {want}; the weights and config.json disagree")
            kind = tensors.dtype_name(name) if hasattr(tensors, "dtype_name") else "F32"
            if kind not in FLOAT_STORAGE:
                raise CheckpointError(
                    f"{_where(tensors, name)}tensor {name!r} is stored as {kind}: quantized values, "
                    f"which float loading would misread as weights (rlx parameter {path!r}); load "
                    "the checkpoint with config.quant.format='shipped' (rlx.quant.load_quantized)")


def read_order(paths, sources: dict[str, ParamSource], tensors) -> list[str]:
    """``paths`` in the order their first tensor lies in the files (each file read once, front
    to back), where the mapping knows positions; else as given."""
    if not hasattr(tensors, "position"):
        return list(paths)
    return sorted(paths, key=lambda p: tensors.position(sources[p].hf_names[0]))


def abstract_model(cfg: ModelConfig, precision: Precision = Precision()) -> Transformer:
    """The model's shapes, dtypes and logical axes without values (``nnx.eval_shape``), built
    with ``rngs=None`` (zero initializers): a random-key draw per parameter inside the trace asks
    the tracer for a sharding, whose error text walks the whole trace so far, so tracing with keys
    takes time quadratic in the number of parameters."""
    return nnx.eval_shape(lambda: Transformer(cfg, precision, rngs=None))


def load_model(
    cfg: ModelConfig, tensors: Mapping[str, np.ndarray], *, precision: Precision = Precision(),
    mesh: Mesh | None = None, rules: LogicalRules = TRAIN_RULES, skip: frozenset[str] = frozenset(),
    abstract: Transformer | None = None,
) -> Transformer:
    """Build a ``Transformer`` whose parameters are read slice-wise from ``tensors`` (HF names),
    one parameter at a time in file order, each device reading only its own slice.

    Parameters whose rlx path is in ``skip`` are left abstract (``jax.ShapeDtypeStruct``) for the
    caller to replace, e.g. by a frozen quantized tensor (``rlx.quant``); ``abstract``: the
    model's ``nnx.eval_shape`` when the caller has it already (tracing it is not free)."""
    if abstract is None:
        abstract = abstract_model(cfg, precision)
    graphdef, state = nnx.split(abstract)
    sources = stored_param_map(cfg)
    flat = {"/".join(map(str, k)): (k, v) for k, v in nnx.to_flat_state(state)}
    check_tensors(cfg, tensors, {p: tuple(v.shape) for p, (_, v) in flat.items()
                                 if p in sources and p not in skip})
    loaded = {p: var for p, (_, var) in flat.items() if p in skip}
    for path in read_order([p for p in flat if p not in skip], sources, tensors):
        var = flat[path][1]
        sharding = _sharding(mesh, var, rules)
        loaded[path] = var.replace(place(tuple(var.shape), var.dtype, sharding, tensors, sources[path]))
    return nnx.merge(graphdef, nnx.from_flat_state([(k, loaded[p]) for p, (k, _) in flat.items()]))


def place(shape: tuple, dtype, sharding, tensors, src: ParamSource) -> jax.Array:
    """One parameter of rlx ``shape`` / ``dtype`` placed with ``sharding``, each device reading
    only its slice of the HF tensor(s). CPU devices get it in rlx's layout from the host
    (``rlx.platform.cpu.host_layout``: no compile, no second copy); an accelerator copies its slice as
    stored and turns it into rlx's layout and dtype itself (``to_layout``)."""
    if src.layout in INTERLEAVED:
        return jax.make_array_from_callback(shape, sharding, once_per_index(
            lambda idx: read_stored(tensors, src.hf_names[0], interleaved_index(
                idx, shape, INTERLEAVED[src.layout])).astype(dtype)))
    if isinstance(tensors, SafetensorsFolder) and on_host(sharding):
        return jax.make_array_from_callback(
            shape, sharding, once_per_index(host_reader(tensors, src, shape, dtype)))
    if src.layout == "copy":
        return jax.make_array_from_callback(shape, sharding, once_per_index(
            lambda idx: read_stored(tensors, src.hf_names[0], idx).astype(dtype)))
    hf_shape = shape[:-2] + (shape[-1], shape[-2])
    raw = jax.make_array_from_callback(hf_shape, swapped(sharding, hf_shape),
                                       once_per_index(lambda idx: _read_stored(tensors, src, idx)))
    return to_layout(jnp.dtype(dtype), sharding)(raw)


def interleaved_index(index: tuple, shape: tuple, parity: int) -> tuple:
    """The index into a fused, interleaved HF tensor of an rlx ``index`` into its ``parity``
    half (``shape``: the half's): last-axis entries ``a:b`` are ``2a + parity : 2b : 2``."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    lo, hi, _ = index[-1].indices(shape[-1])
    return index[:-1] + (slice(2 * lo + parity, 2 * hi, 2),)


def swapped(sharding, shape: tuple):
    """``sharding`` with its last two dimensions swapped, for an array of ``shape`` (a dimension
    its mesh axes do not divide stays whole)."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    spec = spec[:-2] + (spec[-1], spec[-2])
    mesh = sharding.mesh
    keep = []
    for dim, part in zip(shape, spec):
        names = (part,) if isinstance(part, str) else tuple(part or ())
        keep.append(part if dim % int(np.prod([mesh.shape[n] for n in names])) == 0 else None)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*keep))


@functools.lru_cache(maxsize=None)
def to_layout(dtype, sharding, fn=None):
    """A jitted ``[..., n, k] -> [..., k, n]`` in ``dtype`` placed with ``sharding`` (``fn``: a
    transform of its own instead, with the same output placement)."""
    return jax.jit(fn or (lambda x: jnp.swapaxes(x, -1, -2).astype(dtype)), out_shardings=sharding)


def host_reader(tensors: SafetensorsFolder, src: ParamSource, shape: tuple, dtype):
    """Callback: a device's ``index`` slice of the rlx parameter ``src`` names, laid out on the
    host (transposed per matrix for "T" / "stack_T")."""
    stored = DTYPES[tensors.dtype_name(src.hf_names[0])]

    def read(name, index, out):
        return tensors.read(name, index, out=out)

    if src.layout == "copy":
        return lambda index: read_direct(read, src.hf_names[0], index, shape, dtype, stored)
    stacked = src.layout == "stack_T"
    return lambda index: read_transposed(read, src.hf_names, stacked, index, shape, dtype, stored)


def _read_stored(tensors, src: ParamSource, index: tuple) -> np.ndarray:
    """The ``index`` slice (HF layout, stored dtype) of a "T" / "stack_T" parameter's tensor(s)."""
    if src.layout == "T":
        return read_stored(tensors, src.hf_names[0], index)
    names = src.hf_names[index[0]]
    first = read_stored(tensors, names[0], index[1:])
    out = np.empty((len(names),) + first.shape, first.dtype)
    out[0] = first
    for i, n in enumerate(names[1:], 1):
        out[i] = read_stored(tensors, n, index[1:])
    return out


def read_stored(tensors, name: str, index: tuple) -> np.ndarray:
    """A host copy of ``tensors[name][index]`` (``SafetensorsFolder.read``: one read call for a
    run of whole rows)."""
    if isinstance(tensors, SafetensorsFolder):
        return tensors.read(name, index)
    return np.array(tensors[name][index])


def _sharding(mesh: Mesh | None, var, rules: LogicalRules):
    if mesh is None:
        return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    axes = var.get_metadata().get("logical_axes")
    return named_sharding(mesh, axes, rules, tuple(var.shape))


def read_hf_config(path: str, *, text_only: bool = False) -> ModelConfig:
    """The ``ModelConfig`` of a HF folder's ``config.json`` (``text_only``: ``from_hf_config``)."""
    file = os.path.join(path, "config.json")
    if not os.path.exists(file):
        raise CheckpointError(f"{path}: no config.json; pass a HF model folder (config.json + *.safetensors)")
    with open(file) as f:
        return from_hf_config(json.load(f), text_only=text_only)


def check_float_checkpoint(path: str) -> None:
    """Refuse a folder whose ``config.json`` names a ``quantization_config`` (FP8 blocks as
    DeepSeek-V3 ships, compressed-tensors int4, ...): its weight tensors are not the float values,
    and reading them as such would give a wrong model without an error (a vision-language
    checkpoint's may sit in its text config: ``rlx.models.config.quantization_config``)."""
    with open(os.path.join(path, "config.json")) as f:
        qc = quantization_config(json.load(f))
    if qc:
        raise CheckpointError(
            f"{path} holds a quantized checkpoint (quantization_config quant_method="
            f"{qc.get('quant_method')!r}); float loading would misread its weights: load it with "
            "rlx.quant.load_quantized, or point model.path at a float (bf16) copy")


def from_hf(
    path: str, dtype=jnp.float32, mesh: Mesh | None = None, *, param_dtype=None,
    rules: LogicalRules = TRAIN_RULES, moe_impl: str = "ragged", text_only: bool = False,
) -> Transformer:
    """Load a local HF folder (config.json + safetensors, sharded or not) into a sharded model;
    a quantized checkpoint is refused (``check_float_checkpoint``); ``text_only``: the language
    model of a vision-language checkpoint, its vision tower skipped (``from_hf_config``). A class
    with a decoder of its own (``rlx.models.families.OWN_DECODERS``: DeepSeek-V4) loads as that
    model (``load_own``)."""
    own = load_own(path, dtype, param_dtype or dtype, mesh, rules)
    if own is not None:
        return own
    cfg = read_hf_config(path, text_only=text_only)
    check_float_checkpoint(path)
    precision = Precision(dtype=dtype, param_dtype=param_dtype or dtype, moe_impl=moe_impl)
    return load_model(cfg, SafetensorsFolder(path), precision=precision, mesh=mesh, rules=rules)


def load_own(path: str, dtype, param_dtype, mesh: Mesh | None,
             rules: LogicalRules = TRAIN_RULES) -> nnx.Module | None:
    """The model of a HF folder whose class has a decoder of its own (``OWN_DECODERS``), every
    variable placed by its logical axes on ``mesh`` (when given); None for any other class. Its
    ``config.json`` is checked and a quantized checkpoint refused before any weight is read."""
    file = os.path.join(path, "config.json")
    if not os.path.exists(file):
        return None  # read_hf_config names what is missing
    with open(file) as f:
        load = own_decoder(json.load(f))
    if load is None:
        return None
    check_float_checkpoint(path)
    model = load(path, dtype=dtype, param_dtype=param_dtype)
    if mesh is not None:
        shard_variables(model, nnx.Variable, mesh, rules)
    return model


# what a HF checkpoint holds: float base parameters and frozen buffers (not the LoRA adapters)
CHECKPOINTED = nnx.Any(nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)), CorrectionBias)


def hf_state_dict(model: Transformer, dtype=np.float32) -> dict[str, np.ndarray]:
    """HF-named host arrays for every float base parameter and buffer of ``model`` (experts split
    per expert; LoRA adapters and quantized weights are left to ``rlx.io.export``)."""
    out: dict[str, np.ndarray] = {}
    sources = param_map(model.config)
    model = unrolled(model, CHECKPOINTED)  # scanned layers: per-layer tensors
    for key, var in nnx.to_flat_state(nnx.state(model, CHECKPOINTED)):
        path = "/".join(map(str, key))
        src = sources[path]
        kept = np.float32 if isinstance(var, CorrectionBias) else dtype  # f32, as transformers keeps it
        put_hf_layout(src, np.asarray(jax.device_get(var[...])).astype(kept), out)
    return out


def put_hf_layout(src: ParamSource, value: np.ndarray, out: dict[str, np.ndarray]) -> None:
    """Store an rlx-layout ``value`` into ``out`` under its HF name(s), in HF layout."""
    if src.layout == "copy":
        out[src.hf_names[0]] = value
    elif src.layout in INTERLEAVED:  # one half of a fused tensor, the other half beside it
        fused = out.setdefault(src.hf_names[0], np.zeros(
            value.shape[:-1] + (2 * value.shape[-1],), value.dtype))
        fused[..., INTERLEAVED[src.layout]::2] = value
    elif src.layout == "T":
        out[src.hf_names[0]] = np.ascontiguousarray(value.T)
    else:
        for e, name in enumerate(src.hf_names):
            out[name] = np.ascontiguousarray(value[e].T)


def to_hf(model: Transformer, path: str, dtype=np.float32, tokenizer=None,
          max_shard_bytes: int = 2 << 30) -> None:
    """Write ``model`` as a HF folder that ``AutoModelForCausalLM.from_pretrained`` loads (a
    decoder of its own, ``families.OWN_WRITERS``, by its family's writer: f32)."""
    own = own_writer(model)
    if own is not None:
        own(model, path)
        if tokenizer is not None:
            tokenizer.save(path)
        return
    os.makedirs(path, exist_ok=True)
    hf_cfg = to_hf_config(model.config)
    hf_cfg["torch_dtype"] = np.dtype(dtype).name
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    save_sharded(hf_state_dict(model, dtype), path, max_shard_bytes)
    if tokenizer is not None:
        tokenizer.save(path)


def param_bytes_per_device(model: Transformer, kinds=nnx.Param) -> dict[str, int]:
    """Bytes of parameters (the variables ``kinds`` selects) held by each device (from the
    arrays' actual shards)."""
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(nnx.state(model, kinds)):
        for shard in leaf.addressable_shards:
            key = str(shard.device)
            out[key] = out.get(key, 0) + shard.data.nbytes
    return out


__all__ = ["from_hf", "load_own", "to_hf", "load_model", "param_map", "stored_param_map", "hf_state_dict", "read_hf_config",
           "check_float_checkpoint",
           "param_bytes_per_device", "CheckpointError"]
