"""The frozen-base formats the benchmarks compare, and GGUF-block copies of a float model.

``ROWS`` maps each row label of the quant benchmarks to a ``QuantConfig`` (rlx's quantizer) or a
GGUF block type (the ``gguf`` package's quantizer, as llama.cpp writes the blocks).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from rlx.models.decoder import Transformer
from rlx.models.moe import SparseMoE
from rlx.quant.config import QuantConfig
from rlx.quant.formats.gguf.blocks import GGUFTensor
from rlx.quant.quantize import linears

ROWS = [  # (label, QuantConfig or GGUF type)
    ("int8 channel", QuantConfig(format="int8")),
    ("int8 + int8 act (w8a8_int8)", QuantConfig(format="int8", serving="w8a8_int8")),
    ("int4 g64 sym", QuantConfig(format="int4", group_size=64)),
    ("int4 g64 asym", QuantConfig(format="int4", group_size=64, symmetric=False)),
    ("nf4 g64", QuantConfig(format="nf4", group_size=64)),
    ("fp8 channel", QuantConfig(format="fp8")),
    ("fp8 channel + fp8 act", QuantConfig(format="fp8", serving="compressed-tensors")),
    ("fp8 block128 + fp8 act", QuantConfig(format="fp8", fp8_granularity="block128", serving="fp8")),
    ("GGUF Q8_0", "Q8_0"), ("GGUF Q4_1", "Q4_1"), ("GGUF Q4_0", "Q4_0"),
]


def _gguf_tensor(w: np.ndarray, qtype: str) -> GGUFTensor:
    import gguf

    hf = np.ascontiguousarray(np.swapaxes(w, -1, -2))  # [..., out, in]
    t = gguf.GGMLQuantizationType[qtype]
    blocks = gguf.quants.quantize(hf.reshape(-1, hf.shape[-1]), t)
    return GGUFTensor(qtype, hf.shape, jnp.asarray(blocks.reshape(*hf.shape[:-1], -1)), None, kernel=True)


def gguf_model(model: Transformer, qtype: str) -> Transformer:
    for lin in linears(model):
        lin.kernel = _gguf_tensor(np.asarray(lin.kernel[...]), qtype)
    for layer in model.layers:
        if isinstance(layer.mlp, SparseMoE):
            ex = layer.mlp.experts
            for name in ("gate_proj", "up_proj", "down_proj"):
                setattr(ex, name, _gguf_tensor(np.asarray(getattr(ex, name)[...]), qtype))
    return model
