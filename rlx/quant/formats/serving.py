"""The serving layouts (``config.quant.serving``): what each writes, which servers load it, which
activations those servers quantize, and what it can keep quantized. The tensors each writes are
``rlx.quant.serving``'s; which base formats each carries is the formats' own ``serving``.
"""

from rlx.quant.formats.base import ServingLayout

HF = ServingLayout(
    name="hf", summary="dequantized float weights, no quantization_config",
    servers=("sglang", "transformers"), dequantized=True, quantized_embeddings=True,
    experts_only=True, moe_lora=True)
W8A8_INT8 = ServingLayout(
    name="w8a8_int8", summary="SGLang's int8 weights with int8 activations per token",
    servers=("sglang",), symmetric_only=True, activations=("int8",))
FP8 = ServingLayout(
    name="fp8", summary="e4m3 weights (per channel, or DeepSeek/Qwen 128x128 blocks), fp8 "
    "activations", servers=("sglang",), activations=("fp8",), moe_lora=True)
COMPRESSED_TENSORS = ServingLayout(
    name="compressed-tensors", summary="pack-quantized int4 / int8 or float-quantized fp8",
    servers=("sglang",), experts_only=True, activations=("fp8",))
GGUF = ServingLayout(
    name="gguf", summary="the GGUF file the base was loaded from", servers=("sglang", "llama.cpp"),
    source_file=True, quantized_embeddings=True)

BUILTIN = (HF, W8A8_INT8, FP8, COMPRESSED_TENSORS, GGUF)
