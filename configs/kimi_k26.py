"""GRPO on MATH with Kimi-K2.6 (its 1.03T-parameter language model, latent attention): int4
experts + LoRA.

Kimi-K2.6 (like K2.5) is a vision-language checkpoint (``Kimi_K25ForConditionalGeneration``):
MoonViT (27 layers of width 1152) and a projector in front of Kimi-K2's language model, which rlx
trains on text (``model.text_only``; ``rlx.models.families.kimi_k25``). The architecture is the
release's ``config.json`` (``rlx.models.presets``): 61 layers, hidden 7168, 64 heads of
multi-head latent attention (q_lora 1536, kv_lora 512, nope 128, rope 64, v 128), 384 routed
experts of width 2048 (top-8, one group) plus one shared expert, the first layer dense, YaRN
factor 64 (262,144 positions), vocabulary 163,840. The frozen base is laid out as Moonshot ships
it: the routed experts in symmetric int4 with one bf16 scale per 32 inputs (compressed-tensors
pack-quantized), attention, the dense layer and the shared experts in bf16
(``quant.modules = "experts"``). LoRA adapts every attention projection, the dense and shared
MLPs and every routed expert. Rollouts come from the built-in engine, which keeps the per-token
latent (512 + 64 numbers per layer) in its KV cache. The KL reference is the base with the
adapters off. Exports (``to_hf``, merged adapters) hold the language model alone, as
``DeepseekV3ForCausalLM``.

``python -m rlx.plan --config configs/kimi_k26.py --hbm-gb 141`` (rlx/plan/README.md): the
language model is Kimi-K2's, so the plan is configs/kimi_k2.py's: 74.3 GB frozen base, train
peak 101.2 GB per device, sample peak 91.3: fits one 8-device node of 141 GB (H200), not one of
80 GB (the default ``--hbm-gb``; the planner then suggests 16 devices with ``mesh.fsdp=2``).

``model.path`` names the checkpoint (its architecture is also in ``rlx.models.presets``). rlx
quantizes a float checkpoint tensor by tensor while reading it.

Every other field is configs/kimi_k2.py's (read beside this file), only the checkpoint, its
vision tower and the output folder differ. Variants (``--config configs/kimi_k26.py:VARIANT``, ``get_config("VARIANT")``): none, sequences of
2,048 tokens (512-token prompts + 1,536-token completions); ``long``, 32,768 (2,048 + 30,720;
``long_context``), within the 262,144 positions that YaRN (factor 64 over 4,096) gives the model.
"""

import pathlib

import ml_collections

from rlx.commandline import load_config_file

VARIANTS = ("", "long")
KIMI_K2 = pathlib.Path(__file__).with_name("kimi_k2.py")  # the same language model's recipe


def get_config(variant: str = "") -> ml_collections.ConfigDict:
    if variant not in VARIANTS:
        raise ValueError(f"configs/kimi_k26.py has no variant {variant!r}; its variants: "
                         f"{list(VARIANTS)}")
    c = load_config_file(f"{KIMI_K2}:{variant}")  # Kimi-K2's model, data, rollout, loss, optim
    c.output_dir = "runs/kimi_k26_long" if variant == "long" else "runs/kimi_k26"
    c.model.path = "moonshotai/Kimi-K2.6"  # Hugging Face Hub id or a local HF folder
    # the checkpoint is vision-language (Kimi_K25ForConditionalGeneration): RL its language model
    # on text, the vision tower and projector skipped (False would refuse the checkpoint)
    c.model.text_only = True
    c.quant.group_size = 32  # one scale per 32 inputs (as the release ships its experts)
    return c
