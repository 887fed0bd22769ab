"""Base formats and serving layouts as plugins: one module per format family, one registry.

- ``base``: the ``Format`` and ``ServingLayout`` records, ``QuantConfigError`` and the nibble
  packing the 4-bit formats share.
- ``plain`` ("none"), ``int8``, ``int4``, ``nf4``, ``fp8`` (channel / 128x128 tiles), ``mxfp4``
  (E2M1 in blocks of 32 with E8M0 scales), ``nvfp4`` (E2M1 in blocks of 16, e4m3 block scales
  and one f32 scale per matrix; ``e2m1`` is their FP4 value codec), ``gguf``
  (a GGUF file's blocks), ``shipped`` (the checkpoint's own): one ``Format`` each. ``gguf`` is a
  package that also holds the blocks' storage and product (``gguf.blocks``: ``GGUFTensor``) and
  the K-quant decoders (``gguf.kquants``).
- ``serving``: the serving layouts (hf, w8a8_int8, fp8, compressed-tensors, gguf).
- ``layouts``: the shipped checkpoint layouts rlx reads as they are (one reader module per
  layout family: ``hf_fp8``, ``w8a8_int8``, ``compressed_tensors``) and their registry; a GGUF
  file's reader is ``gguf.file``.
- ``registry``: ``get`` / ``names`` / ``serving`` / ``serving_names`` / ``register``.

The records import ``rlx.errors`` only (they need jax and numpy, nothing else of rlx); the GGUF
blocks and file reader (``gguf.blocks``, ``gguf.file``) also import ``rlx.quant.tensors``,
``rlx.models`` and ``rlx.platform`` (the weight protocol, the GGUF header reader, the few-row
threshold and the CPU kernels), and no record module imports them.
"""

from rlx.quant.formats.base import Format, QuantConfigError, ServingLayout
from rlx.quant.formats.registry import (carries, get, names, register, serving, serving_names,
                                        unregister)

__all__ = ["Format", "QuantConfigError", "ServingLayout", "carries", "get", "names", "register",
           "serving", "serving_names", "unregister"]
