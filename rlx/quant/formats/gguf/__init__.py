"""Format "gguf": a GGUF file's block-quantized tensors kept block for block (Q4_0 / Q4_1 / Q5_0 /
Q5_1 / Q8_0 and the K-quants Q2_K .. Q6_K).

- this module: the ``Format`` record (imports nothing but ``base``, so the registry can);
- ``blocks``: ``GGUFTensor`` (the blocks on device, their dequantization and product);
- ``kquants``: the decoders of the 5-bit legacy blocks and the K-quant super-blocks;
- ``file``: a GGUF file as a shipped checkpoint layout (``format="shipped"`` on a .gguf file).

rlx never requantizes float weights into llama.cpp blocks: the base is read from a GGUF file, and
served as that file (``gguf``) or as its dequantized floats (``hf``). Its bytes per weight are
the file's block type's (``BLOCK_BYTES``), not a property of the format.
"""

from rlx.quant.formats.base import Format

GGUF = Format(name="gguf", summary="a GGUF file's blocks, kept as stored", serving=("hf", "gguf"),
              keeps_file_blocks=True)
