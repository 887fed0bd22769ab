"""Mode "lora": a frozen base kept in the representation that serves it, plus LoRA adapters.

- ``QuantConfig`` / ``LoraConfig`` (``rlx.quant.config``): base format, serving format (which fixes the
  learner's activation quantization), adapter rank / alpha / dropout / targets.
- ``rlx.quant.formats``: one module per base format (storage, quantize / decode / product hooks,
  serving layouts and their tensors, bytes per parameter, constraints) and the registry their
  names are looked up in.
- ``quantize_model`` turns a float model's linears (incl. MoE experts) into frozen ``QTensor``s;
  ``load_quantized`` / ``load_gguf_quantized`` keep already-quantized checkpoints as they are;
  ``load_base`` is a run's base: ``format="shipped"`` the checkpoint's own representation
  (``rlx.quant.shipped``), int8 / int4 / fp8 / nf4 a float checkpoint quantized while it is read.
- ``apply_lora`` attaches ``nnx.LoRAParam`` adapters (LoRA, or OFT rotations with ``LoraConfig.kind="oft"``,
  ``rlx.quant.oft``); ``model(ids, adapter=False)`` is the reference.
- ``state_bytes`` reports frozen and trainable bytes. Export lives in ``rlx.io.export``.

May import ``rlx.models``, ``rlx.platform``, ``rlx.kernels`` and the foundation (``rlx.types``, ``rlx.errors``, ``rlx.mesh``).
"""

from rlx.quant.config import LoraConfig, QuantConfig, QuantConfigError
from rlx.quant.formats.gguf.blocks import GGUFTensor
from rlx.quant.loading import load_base, load_gguf_quantized, load_quantized, resolve_quant
from rlx.quant.lora import LoRA, apply_lora
from rlx.quant.quantize import quantize_model, state_bytes
from rlx.quant.tensors import QTensor, QuantWeight, quantize_array

__all__ = ["LoraConfig", "QuantConfig", "QuantConfigError", "GGUFTensor", "load_base",
           "load_gguf_quantized", "resolve_quant",
           "load_quantized", "LoRA", "apply_lora", "quantize_model", "state_bytes", "QTensor",
           "QuantWeight", "quantize_array"]
