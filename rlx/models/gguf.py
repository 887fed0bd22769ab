"""Reading GGUF checkpoints (llama.cpp's file format) into Hugging Face names and layout.

`read_gguf(path)` returns a `GGUFCheckpoint`: a transformers-style `config.json` dict built from the
`{arch}.*` metadata, the tensors under HF names (`model.layers.{i}.self_attn.q_proj.weight`, ...) as
float32 arrays in HF layout ([out, in] for linears), the GGUF quantization type of each tensor, the
tokenizer and the chat template.

Tensors stay in the memory-mapped file until asked for: `checkpoint.tensors[name]` dequantizes one
tensor (with the `gguf` package's own block decoders) each time it is read, and
`checkpoint.raw(name)` returns the quantized blocks as they are stored (uint8, one row of blocks per
output row), for code that keeps a quantized base as its blocks instead of dequantizing it.

llama.cpp's converter permutes the rows of q_proj and k_proj of llama-architecture models (it
interleaves the two rotary halves of each head). We undo that permutation on the rows of the stored
blocks, so both `raw` and the dequantized tensors are in HF order and equal what transformers loads
from the same file. Qwen2/Qwen3 files are stored unpermuted.

Supported: the GGUF architectures of the families that declare one (``FamilySpec.gguf``): llama,
qwen2, qwen3, qwen2moe, qwen3moe (each expert of a 3-D `ffn_*_exps`
tensor is `model.layers.{i}.mlp.experts.{e}.*_proj.weight`, a view of its slice); tensor types `SUPPORTED_TYPES` (floats, Q4_0 .. Q8_0
and the K-quants Q2_K .. Q6_K).
Everything else raises `GGUFError`, as do llama3-style rope scaling and missing tensors.

Malformed files. Before the `gguf` package parses a file we walk its header ourselves and check
every declared length and count against the bytes that are left (the package trusts them: an
array length past the end of the file makes it loop without end), the value and tensor type ids,
the dimension counts and that each tensor's data lies inside the file. Every problem with a file,
down to a tokenizer vocabulary that cannot be built, raises `GGUFError` with the path first.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import gguf
import numpy as np

from rlx.models.families import GGUF_ARCHS, FamilySpec
from rlx.models.gguf_file import GGUFError, open_gguf
from rlx.models.tokenizer import Tokenizer, TokenizerError

__all__ = ["GGUFCheckpoint", "GGUFError", "GGUFTensors", "RawTensor", "SUPPORTED_TYPES", "read_gguf"]

# the float types, and the block types rlx also keeps as blocks
# (rlx.quant.formats.gguf.blocks.KEPT):
# Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 and the K-quants that llama.cpp's _S / _M / _L mixes use
SUPPORTED_TYPES: tuple[str, ...] = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


# GGUF per-layer tensor name (after `blk.{i}.`) -> HF name (after `model.layers.{i}.`).
_LAYER_NAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BIAS_NAMES = {f"attn_{p}.bias": f"self_attn.{p}_proj.bias" for p in "qkv"}
_QK_NORM_NAMES = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_DENSE_MLP = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
_EXPERTS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj", "ffn_down_exps.weight": "down_proj"}
_SHARED_NAMES = {"ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
                 "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
                 "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
                 "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight"}


@dataclasses.dataclass(frozen=True)
class RawTensor:
    """A tensor as stored: `blocks` is uint8 [*shape[:-1], bytes per row] of `qtype` blocks (for F32,
    F16 and BF16 the little-endian element bytes), rows already in HF order."""

    qtype: str
    blocks: np.ndarray
    shape: tuple[int, ...]

    def dequantize(self) -> np.ndarray:
        """The float32 values, shape `self.shape`."""
        qtype = gguf.GGMLQuantizationType[self.qtype]
        values = gguf.quants.dequantize(self.blocks, qtype)
        if qtype == gguf.GGMLQuantizationType.F32:
            values = values.copy()  # a view into the file otherwise
        return values.astype(np.float32, copy=False).reshape(self.shape)


class GGUFTensors(Mapping[str, np.ndarray]):
    """HF name -> float32 array, dequantized from the memory-mapped file on every access."""

    def __init__(self, stored: Mapping[str, Any], names: Mapping[str, str], heads: Mapping[str, int],
                 experts: Mapping[str, int] | None = None) -> None:
        self._stored = stored  # GGUF name -> gguf.ReaderTensor
        self._names = dict(names)  # HF name -> GGUF name
        self._heads = dict(heads)  # HF name -> head count whose rope permutation to undo
        self._experts = dict(experts or {})  # HF name -> its expert's index in a 3-D GGUF tensor

    def __getitem__(self, name: str) -> np.ndarray:
        return self.raw(name).dequantize()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        """The HF shape of `name`, without reading its data."""
        shape = _shape(self._stored[self._names[name]])
        if name in self._experts:
            return shape[1:]
        return (1, *shape) if name.endswith("shared_expert_gate.weight") else shape  # GGUF: [d]

    def gguf_name(self, name: str) -> str:
        """The GGUF name the HF tensor `name` is stored under."""
        return self._names[name]

    def stored_rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        """``rows`` in HF order of `name`'s output rows, put in the file's order (llama.cpp's rope
        permutation of q/k; other tensors as they are): what a tensor patching `name` stores."""
        if name not in self._heads:
            return rows
        heads = self._heads[name]
        grouped = rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
        return np.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(rows.shape)

    def raw(self, name: str) -> RawTensor:
        """The stored blocks of `name`, rows un-permuted to HF order (a read-only view of the file
        unless un-permuting made a copy)."""
        tensor = self._stored[self._names[name]]
        shape = self.shape(name)
        data = np.asarray(tensor.data)
        if name in self._experts:  # one expert of a 3-D [experts, rows, cols] tensor
            whole = data.view(np.uint8).reshape(_shape(tensor)[0], *shape[:-1], -1)
            blocks = whole[self._experts[name]]
        else:
            blocks = data.view(np.uint8).reshape(*shape[:-1], -1)
        if name in self._heads:
            blocks = _unpermute_rows(blocks, self._heads[name])
        return RawTensor(tensor.tensor_type.name, blocks, shape)


@dataclasses.dataclass(frozen=True)
class GGUFCheckpoint:
    """A GGUF file read under Hugging Face conventions."""

    path: str
    architecture: str  # the GGUF `general.architecture`
    hf_config: dict[str, Any]
    tensors: GGUFTensors
    tensor_types: dict[str, str]  # HF name -> GGUF type name, e.g. "Q4_1"
    tokenizer: Tokenizer | None  # None when the file carries no vocabulary
    chat_template: str | None

    def raw(self, name: str) -> RawTensor:
        """The quantized blocks of HF tensor `name`, as stored (rows in HF order)."""
        return self.tensors.raw(name)


def read_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Reads the metadata of a GGUF file and maps its tensors to HF names (tensor data stays mapped)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file at {path!r}")
    reader = open_gguf(path)  # container errors already name the file
    try:
        return _read(path, reader)
    except GGUFError as err:
        raise GGUFError(f"{path}: {err}") from err.__cause__  # the package's error, if any


def _read(path: str, reader: gguf.GGUFReader) -> GGUFCheckpoint:
    """`read_gguf` with errors that do not name the file yet."""
    meta = _metadata(reader)
    arch_name = meta.get("general.architecture")
    family = GGUF_ARCHS.get(arch_name) if isinstance(arch_name, str) else None
    if family is None:
        raise GGUFError(f"GGUF architecture {arch_name!r} is not supported; supported: {sorted(GGUF_ARCHS)}")
    arch = family.gguf
    stored = {tensor.name: tensor for tensor in reader.tensors}
    _reject_rope_scaling(arch_name, meta, stored)
    config = _hf_config(family, meta, stored)
    names, experts = _tensor_names(family, config)
    _check_tensors(names, stored, _expected_shapes(config))
    heads: dict[str, int] = {}
    if arch.permute_qk:
        for layer in range(config["num_hidden_layers"]):
            heads[f"model.layers.{layer}.self_attn.q_proj.weight"] = config["num_attention_heads"]
            heads[f"model.layers.{layer}.self_attn.k_proj.weight"] = config["num_key_value_heads"]
    tokenizer = None
    if "tokenizer.ggml.tokens" in reader.fields:
        try:
            tokenizer = Tokenizer.from_gguf(reader)
        except TokenizerError as err:
            raise GGUFError(f"the tokenizer cannot be read: {err}") from err
    chat_template = meta.get("tokenizer.chat_template")
    if chat_template is not None and not isinstance(chat_template, str):
        raise GGUFError("metadata 'tokenizer.chat_template' is not a string")
    return GGUFCheckpoint(
        path=path,
        architecture=arch_name,
        hf_config=config,
        tensors=GGUFTensors(stored, names, heads, experts),
        tensor_types={hf: stored[gg].tensor_type.name for hf, gg in names.items()},
        tokenizer=tokenizer,
        chat_template=chat_template,
    )


def _metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Decoded metadata values, without the large tokenizer arrays (the tokenizer reads those)."""
    meta = {}
    for key, field in reader.fields.items():
        is_array = bool(field.types) and field.types[0] == gguf.GGUFValueType.ARRAY
        if not (is_array and key.startswith("tokenizer.ggml.")):
            meta[key] = field.contents()
    return meta


def _reject_rope_scaling(arch_name: str, meta: Mapping[str, Any], stored: Mapping[str, Any]) -> None:
    scaling = meta.get(f"{arch_name}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFError(f"rope scaling {scaling!r} ({arch_name}.rope.scaling.type) is not supported yet")
    if "rope_freqs.weight" in stored:
        raise GGUFError("llama3-style rope frequency scaling (tensor 'rope_freqs.weight') is not supported yet")


def _hf_config(family: FamilySpec, meta: Mapping[str, Any], stored: Mapping[str, Any]) -> dict[str, Any]:
    """A transformers `config.json` dict from the `{arch}.*` and `tokenizer.ggml.*` metadata."""
    arch = family.gguf
    arch_name = arch.name

    def get(key: str, default: Any = None, kind: type = int) -> Any:
        """A positive int (or a positive finite float for kind=float) metadata value."""
        value = meta.get(f"{arch_name}.{key}", default)
        if value is None:
            raise GGUFError(f"metadata key {arch_name}.{key!r} is missing")
        number = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and value > 0):
            raise GGUFError(f"metadata {arch_name}.{key} = {value!r} is not a positive {kind.__name__}")
        return kind(value)

    hidden, heads = get("embedding_length"), get("attention.head_count")
    head_key = "attention.key_length"
    if head_key not in meta and arch.permute_qk:  # llama stores the rotary width, which is the head size
        head_key = "rope.dimension_count"
    head_dim = get(head_key, hidden // heads)
    if arch.permute_qk and head_dim % 2:
        raise GGUFError(f"metadata {arch_name}.{head_key} = {head_dim} is odd; rotary heads need an even size")
    if "token_embd.weight" not in stored:
        raise GGUFError("required tensor 'token_embd.weight' (HF 'model.embed_tokens.weight') is missing")
    vocab = get("vocab_size", int(stored["token_embd.weight"].shape[-1]))
    rope_theta = get("rope.freq_base", 10000.0, float)
    layers = get("block_count")
    if layers > len(stored):
        raise GGUFError(f"metadata {arch_name}.block_count = {layers}, but the file holds only {len(stored)} tensors")
    config: dict[str, Any] = {
        "architectures": [family.architectures[0]],
        "model_type": family.model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length", meta.get(f"{arch_name}.expert_feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", kind=float),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": get("context_length"),
        "tie_word_embeddings": "output.weight" not in stored,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        **dict(arch.extra_config),
    }
    if family.mlp == "moe":
        config |= {"num_experts": get("expert_count"), "num_experts_per_tok": get("expert_used_count"),
                   "moe_intermediate_size": get("expert_feed_forward_length")}
    if arch.shared_expert:
        config["shared_expert_intermediate_size"] = get("expert_shared_feed_forward_length")
    return config | _token_ids(meta)


def _token_ids(meta: Mapping[str, Any]) -> dict[str, int]:
    """config.json's special token ids from the ``tokenizer.ggml.*`` metadata the file holds."""
    out = {}
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("padding_token_id", "pad_token_id"), ("unknown_token_id", "unk_token_id")):
        if (value := meta.get(f"tokenizer.ggml.{key}")) is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise GGUFError(f"metadata tokenizer.ggml.{key} = {value!r} is not a token id")
            out[hf_key] = value
    return out


def _tensor_names(family: FamilySpec, config: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, int]]:
    """HF name -> GGUF name of every tensor the model needs, in HF state-dict order; and HF name ->
    expert index for the experts' slices of the 3-D ``ffn_*_exps`` tensors."""
    arch, moe = family.gguf, family.mlp == "moe"
    per_layer = dict(_LAYER_NAMES)
    if family.qkv_bias_default:
        per_layer.update(_BIAS_NAMES)
    if family.qk_norm is True:
        per_layer.update(_QK_NORM_NAMES)
    if moe:
        per_layer = {g: h for g, h in per_layer.items() if g not in _DENSE_MLP}
        per_layer["ffn_gate_inp.weight"] = "mlp.gate.weight"
    if arch.shared_expert:
        per_layer.update(_SHARED_NAMES)
    names, experts = {"model.embed_tokens.weight": "token_embd.weight"}, {}
    for layer in range(config["num_hidden_layers"]):
        for gguf_name, hf_name in per_layer.items():
            names[f"model.layers.{layer}.{hf_name}"] = f"blk.{layer}.{gguf_name}"
        for gguf_name, proj in _EXPERTS.items() if moe else ():
            for e in range(config["num_experts"]):
                hf_name = f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                names[hf_name], experts[hf_name] = f"blk.{layer}.{gguf_name}", e
    names["model.norm.weight"] = "output_norm.weight"
    if not config["tie_word_embeddings"]:
        names["lm_head.weight"] = "output.weight"
    return names, experts


def _expected_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF name suffix -> HF shape, for checking the metadata against the tensors."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    return {
        "embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden), "norm.weight": (hidden,),
        "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
        "q_proj.weight": (q_rows, hidden), "k_proj.weight": (kv_rows, hidden), "v_proj.weight": (kv_rows, hidden),
        "o_proj.weight": (hidden, q_rows), "gate_proj.weight": (inter, hidden), "up_proj.weight": (inter, hidden),
        "down_proj.weight": (hidden, inter),
        "q_proj.bias": (q_rows,), "k_proj.bias": (kv_rows,), "v_proj.bias": (kv_rows,),
        "q_norm.weight": (config["head_dim"],), "k_norm.weight": (config["head_dim"],),
        **_moe_shapes(config),
    }


def _moe_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The router's, the whole 3-D experts' and the shared expert's stored shapes (GGUF keeps the
    shared expert's gate as a vector)."""
    if "num_experts" not in config:
        return {}
    e, f, d = config["num_experts"], config["moe_intermediate_size"], config["hidden_size"]
    out = {"gate.weight": (e, d), "experts.gate_proj.weight": (e, f, d),
           "experts.up_proj.weight": (e, f, d), "experts.down_proj.weight": (e, d, f)}
    if (s := config.get("shared_expert_intermediate_size")) is not None:
        out |= {"shared_expert.gate_proj.weight": (s, d), "shared_expert.up_proj.weight": (s, d),
                "shared_expert.down_proj.weight": (d, s), "shared_expert_gate.weight": (d,)}
    return out


def _shape_key(hf_name: str) -> str:
    """The key of ``_expected_shapes`` for ``hf_name``."""
    suffix = ".".join(hf_name.split(".")[-2:])
    for part in ("experts", "shared_expert"):
        if f".{part}." in hf_name:
            return f"{part}.{suffix}"
    return suffix


def _shape(tensor) -> tuple[int, ...]:
    """A GGUF tensor's shape in row-major (HF) order."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _check_tensors(
    names: Mapping[str, str], stored: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]
) -> None:
    """Every needed tensor is present, of a supported type and of the shape the metadata implies."""
    for hf_name, gguf_name in names.items():
        tensor = stored.get(gguf_name)
        if tensor is None:
            raise GGUFError(f"required tensor {hf_name!r} (GGUF {gguf_name!r}) is missing")
        qtype = tensor.tensor_type.name
        if qtype not in SUPPORTED_TYPES:
            raise GGUFError(
                f"tensor {gguf_name!r} ({hf_name}) has unsupported type {qtype}; "
                f"supported: {', '.join(SUPPORTED_TYPES)}"
            )
        shape, key = _shape(tensor), _shape_key(hf_name)
        if shapes[key] != shape:
            raise GGUFError(
                f"tensor {gguf_name!r} ({hf_name}) has shape {list(shape)}, "
                f"but the metadata implies {list(shapes[key])}"
            )


def _unpermute_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's rope permutation of q/k rows.

    Within each head llama.cpp stores row `2*i + j` (i < head_dim/2, j in {0, 1}) for HF row
    `j*head_dim/2 + i`: the two rotary halves are interleaved. Trailing axes are untouched, so this
    works on dequantized rows and on rows of quantized blocks alike.
    """
    n_rows = rows.shape[0]
    if n_rows % (2 * n_heads):
        raise GGUFError(f"cannot un-permute {n_rows} rows over {n_heads} heads")
    grouped = rows.reshape(n_heads, n_rows // n_heads // 2, 2, *rows.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(rows.shape)
