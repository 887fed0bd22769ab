"""A GGUF file as a shipped checkpoint layout: its linear weights' blocks (``format="gguf"``,
served as the file itself) where they are block-quantized (``blocks.BLOCK_BYTES``), else its
floats; only the file's header is read.
"""

from __future__ import annotations

from rlx.quant.formats.gguf import GGUF
from rlx.quant.formats.layouts.base import FileReader


def quantized(path: str) -> bool:
    """Whether the GGUF file's linear weights are block-quantized (header only)."""
    from rlx.models.gguf import read_gguf
    from rlx.quant.formats.gguf.blocks import BLOCK_BYTES

    types = read_gguf(path).tensor_types
    return any(t in BLOCK_BYTES for n, t in types.items() if n.endswith("_proj.weight"))


READER = FileReader(name="gguf", suffix=".gguf", supported="GGUF files (Q4_0 / Q4_1 / Q8_0 blocks)",
                    format=GGUF, serving="gguf", quantized=quantized)
