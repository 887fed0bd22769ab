"""Shipped checkpoint layouts as plugins: one module per layout family, one registry.

- ``base``: the ``Layout``, ``Tensors``, ``LayoutReader`` and ``FileReader`` records and
  ``Refused``.
- ``hf_fp8`` (transformers' ``quant_method: fp8``, 128x128 blocks), ``w8a8_int8`` (SGLang),
  ``compressed_tensors`` (pack-quantized int4 / int8, float-quantized fp8, int-quantized int8),
  ``mxfp4`` (gpt-oss's E2M1 experts with E8M0 scales), ``modelopt`` (NVFP4):
  one ``LayoutReader`` each, declaring the ``quantization_config`` it recognises, the tensors it
  reads, the rlx ``Format`` its values become and its supported-description lines. A GGUF file's
  reader is the gguf format's (``rlx.quant.formats.gguf.file``).
- ``registry``: ``layout`` (the first reader that recognises a config), ``file_reader``,
  ``SUPPORTED``.

Checking and reading the tensors a layout declares is ``rlx.quant.shipped_read``; resolving a
checkpoint to its run-level ``QuantConfig`` is ``rlx.quant.shipped``.
"""

from rlx.quant.formats.layouts.base import FileReader, Layout, LayoutReader, Refused, Tensors

__all__ = ["FileReader", "Layout", "LayoutReader", "Refused", "Tensors"]
