"""GRPO on MATH with Kimi-K2.6's language model: int4 experts as shipped + OFT adapters.

configs/kimi_k26.py (read beside this file) with the adapter swapped: instead of LoRA, an OFT
adapter (``lora.kind = "oft"``, ``rlx.quant.oft``) rotates the input of every attention
projection (q_a, q_b, kv_a, kv_b, o), of the dense layer's and the shared experts' MLPs and of
every routed expert (one rotation per expert) in blocks of 32, each block orthogonal through
PEFT's Cayley-Neumann form (5 terms). The rotation is applied to the activations before the
frozen product, so the routed experts stay in their shipped symmetric int4 (one bf16 scale per
32 inputs) and attention, the dense layer and the shared experts in bf16; nothing is dequantized
for the adapter. The KL reference is the base with the adapters off, as with LoRA.

Rollouts come from the built-in engine (SGLang cannot serve OFT: ``rollout.engine="sglang"``
is refused). Exports: ``python -m rlx.export --to merged`` folds every rotation into the float
weights (as ``DeepseekV3ForCausalLM``); ``--to peft`` writes PEFT's OFT folder where PEFT can
name every adapted module, which excludes the routed experts (PEFT's OFT has no
``target_parameters``): use the merged export for this recipe.

Every other field is configs/kimi_k26.py's; its variants (``--config
configs/kimi_k26_oft.py:VARIANT``): none, sequences of 2,048 tokens; ``long``, 32,768.
"""

import pathlib

import ml_collections

from rlx.commandline import load_config_file

VARIANTS = ("", "long")
KIMI_K26 = pathlib.Path(__file__).with_name("kimi_k26.py")  # the same model, base and data


def get_config(variant: str = "") -> ml_collections.ConfigDict:
    if variant not in VARIANTS:
        raise ValueError(f"configs/kimi_k26_oft.py has no variant {variant!r}; its variants: "
                         f"{list(VARIANTS)}")
    c = load_config_file(f"{KIMI_K26}:{variant}")  # Kimi-K2.6's model, int4 experts, data, loss
    c.output_dir = "runs/kimi_k26_oft_long" if variant == "long" else "runs/kimi_k26_oft"
    c.lora.kind = "oft"  # a block-diagonal orthogonal rotation of each adapted input, not LoRA
    c.lora.oft = ml_collections.ConfigDict()
    c.lora.oft.block_size = 32  # blocks of 32 inputs (divides 7168, 1536, 512, 8192 and 2048)
    c.lora.oft.cayley_neumann = True  # PEFT's default: I + 2Q + 2Q^2 + 2Q^3 + Q^4, no solve
    c.lora.oft.neumann_terms = 5  # terms of that series
    # rank, alpha and dropout stay in the section (LoRA's alone; OFT reads none of them)
    return c
