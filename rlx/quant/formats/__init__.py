"""Base formats and serving layouts as plugins: one module per format family, one registry.

- ``base``: the ``Format`` and ``ServingLayout`` records, ``QuantConfigError`` and the nibble
  packing the 4-bit formats share.
- ``plain`` ("none"), ``int8``, ``int4``, ``nf4``, ``fp8`` (channel / 128x128 tiles), ``gguf``
  (a GGUF file's blocks), ``shipped`` (the checkpoint's own): one ``Format`` each.
- ``serving``: the serving layouts (hf, w8a8_int8, fp8, compressed-tensors, gguf).
- ``registry``: ``get`` / ``names`` / ``serving`` / ``serving_names`` / ``register``.

May import ``rlx.errors`` only (the records need jax and numpy, nothing else of rlx).
"""

from rlx.quant.formats.base import Format, QuantConfigError, ServingLayout
from rlx.quant.formats.registry import (carries, get, names, register, serving, serving_names,
                                        unregister)

__all__ = ["Format", "QuantConfigError", "ServingLayout", "carries", "get", "names", "register",
           "serving", "serving_names", "unregister"]
