"""Small valid checkpoint files for the mutation tests, and a map of where their fields lie.

`write_tiny_gguf` writes a 1-layer llama-architecture GGUF (F32, F16 and Q8_0 tensors) with a
byte-level BPE vocabulary and a chat template, so reading it runs every part of `read_gguf`:
the `gguf` package's parser, the metadata checks, the tensor checks and `Tokenizer.from_gguf`.
`write_tiny_safetensors` writes a file with F32, I8 and F16 tensors through `safetensors`.
"""

from __future__ import annotations

import dataclasses
import os

import gguf
import numpy as np

from rlx.models.tokenizer import _byte_alphabet

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 32, 64, 4, 2, 8


def _vocabulary() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types): the 256 byte characters, two merges, two control tokens."""
    tokens = [_byte_alphabet()[b] for b in range(256)]
    merges = ["Ġ t", "Ġt h"]
    tokens += ["Ġt", "Ġth", "<|im_start|>", "<|im_end|>"]
    types = [1] * 258 + [3, 3]
    return tokens, merges, types


VOCAB = len(_vocabulary()[0])


def _blocks_of(value: np.ndarray, qt: gguf.GGMLQuantizationType, rng) -> np.ndarray:
    """``value`` quantized to ``qt``, or random blocks of ``qt`` where gguf cannot quantize to it."""
    try:
        return gguf.quants.quantize(value, qt)
    except NotImplementedError:
        block, nbytes = gguf.GGML_QUANT_SIZES[qt]
        return rng.integers(0, 256, size=(value.shape[0], value.shape[1] // block * nbytes),
                            dtype=np.uint8)


def write_tiny_gguf(path: str | os.PathLike, linear_type: str | None = None) -> None:
    """A tiny complete llama GGUF at `path` (about 60 KB); `linear_type` (e.g. "Q5_0") stores
    every attention and MLP weight in that GGUF type instead of the default mix."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(os.fspath(path), "llama")
    for key, value in {"block_count": 1, "context_length": 64, "embedding_length": HIDDEN,
                       "feed_forward_length": INTER, "attention.head_count": HEADS,
                       "attention.head_count_kv": KV_HEADS, "rope.dimension_count": HEAD_DIM,
                       "vocab_size": VOCAB}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    tokens, merges, types = _vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types)
    writer.add_bos_token_id(VOCAB - 2)
    writer.add_eos_token_id(VOCAB - 1)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>"
                             "{% endfor %}")
    shapes = {
        "token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,),
        "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.ffn_norm.weight": (HIDDEN,),
        "blk.0.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
        "blk.0.ffn_gate.weight": (INTER, HIDDEN), "blk.0.ffn_up.weight": (INTER, HIDDEN),
        "blk.0.ffn_down.weight": (HIDDEN, INTER),
    }
    for name, shape in shapes.items():
        value = rng.standard_normal(shape).astype(np.float32)
        if linear_type and len(shape) == 2 and name.startswith("blk."):
            qt = gguf.GGMLQuantizationType[linear_type]
            writer.add_tensor(name, _blocks_of(value, qt, rng), raw_dtype=qt)
        elif "ffn_up" in name:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(value, q8), raw_dtype=q8)
        elif "ffn_gate" in name:
            writer.add_tensor(name, value.astype(np.float16))
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@dataclasses.dataclass(frozen=True)
class Slot:
    """A fixed-width integer field of a file: byte offset, width in bytes, what it is."""

    offset: int
    width: int
    what: str


def gguf_slots(path: str | os.PathLike) -> list[Slot]:
    """Every count, length, type and offset field of a valid GGUF file's header."""
    reader = gguf.GGUFReader(os.fspath(path), "r")
    slots = [Slot(8, 8, "tensor count"), Slot(16, 8, "kv count")]
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        slots.append(Slot(field.offset, 8, f"key length of {name}"))
        type_at = field.offset + 8 + len(name.encode())
        slots.append(Slot(type_at, 4, f"value type of {name}"))
        value_at = type_at + 4
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            slots.append(Slot(value_at, 4, f"element type of {name}"))
            slots.append(Slot(value_at + 4, 8, f"array length of {name}"))
            if field.types[-1] == gguf.GGUFValueType.STRING:
                first = field.parts[field.data[0] - 1]  # the first element's length
                slots.append(Slot(_offset_of(reader, first), 8, f"first string length of {name}"))
        elif field.types[0] == gguf.GGUFValueType.STRING:
            slots.append(Slot(value_at, 8, f"string length of {name}"))
        else:
            slots.append(Slot(value_at, field.parts[-1].nbytes, f"value of {name}"))
    for tensor in reader.tensors:
        at = tensor.field.offset
        name_len = len(tensor.name.encode())
        slots.append(Slot(at, 8, f"name length of tensor {tensor.name}"))
        dims_at = at + 8 + name_len
        slots.append(Slot(dims_at, 4, f"dimension count of tensor {tensor.name}"))
        n_dims = len(tensor.shape)
        for d in range(n_dims):
            slots.append(Slot(dims_at + 4 + 8 * d, 8, f"dimension {d} of tensor {tensor.name}"))
        type_at = dims_at + 4 + 8 * n_dims
        slots.append(Slot(type_at, 4, f"type of tensor {tensor.name}"))
        slots.append(Slot(type_at + 4, 8, f"data offset of tensor {tensor.name}"))
    return slots


def _offset_of(reader: gguf.GGUFReader, part: np.ndarray) -> int:
    """Byte offset in the file of an array the reader returned as a view of its memory map."""
    base = reader.data.__array_interface__["data"][0]
    return part.__array_interface__["data"][0] - base


def gguf_header_end(path: str | os.PathLike) -> int:
    """Where a GGUF file's tensor data starts (the end of its header)."""
    return int(gguf.GGUFReader(os.fspath(path), "r").data_offset)


def write_tiny_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Three small tensors (F32, I8, F16) in one file; returns them."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {
        "a.weight": rng.standard_normal((4, 8)).astype(np.float32),
        "b.bias": rng.integers(-5, 5, size=(16,)).astype(np.int8),
        "c.scale": rng.standard_normal((2, 3, 2)).astype(np.float16),
    }
    save_file(tensors, os.fspath(path), {"format": "pt"})
    return tensors
