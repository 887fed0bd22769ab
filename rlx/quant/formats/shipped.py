"""Format "shipped": the checkpoint's own representation, resolved when the checkpoint is read
(``rlx.quant.shipped.shipped``): a quantized HF folder's ``quantization_config`` layout (read by
the first reader of ``rlx.quant.formats.layouts`` that recognises it), a GGUF file's blocks, a
float checkpoint's floats. The resolved format fixes every other ``QuantConfig`` field, its
serving layout included.
"""

from rlx.quant.formats.base import Format

SHIPPED = Format(name="shipped", summary="the checkpoint's own representation", serving=("hf",),
                 from_checkpoint=True)
