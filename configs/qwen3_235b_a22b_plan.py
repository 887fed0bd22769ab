"""Memory plan: Qwen3-235B-A22B (MoE, 128 experts, 8 active) as a frozen int4 base + LoRA on one
node of 8 TPU7x (Ironwood) chips, 16 devices (two TensorCores per chip, 96 GiB HBM each).

The architecture is Qwen3-235B-A22B's published ``config.json``: 94 layers, hidden 4096, 64 query
and 4 key/value heads of width 128 (QK-norm), 128 routed experts of width 1536 per layer (top-8,
no shared expert), vocabulary 151,936, untied lm-head. The routed experts and attention are int4
with one bf16 scale per 128 inputs; embeddings and lm-head stay bf16. LoRA r16 (f32, AdamW) on
attention and every routed expert. Experts split 16 ways (``mesh.expert``); one update is 64
sequences of 2048 tokens in 4 micro-batches (one row per device per piece), remat per layer.

``python -m rlx.plan --config configs/qwen3_235b_a22b_plan.py`` plans it;
``... --aot tpu7x:2x2x2`` also compiles its train and generate steps for 8 Ironwood chips
(rlx/plan/README.md).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict()
    c.model.hf_config = {  # Qwen/Qwen3-235B-A22B config.json (the fields rlx reads)
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 94,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1536,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
        "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
    }
    c.model.dtype = "bfloat16"  # compute dtype
    c.model.param_dtype = "bfloat16"  # float leaves: embeddings, lm_head, norms, routers
    c.model.moe_impl = "ragged"  # expert axis > 1: tokens dispatched to their experts' devices
    # dropless token dispatch: its train step fits one node (XLA:TPU: 35.7 GB per device on
    # tpu7x:2x2x2, rlx/plan/README.md), where Kimi-K2's and DeepSeek-V3's need capacity 1.25
    c.model.moe_capacity_factor = 0.0

    c.quant = ml_collections.ConfigDict()
    c.quant.format = "int4"  # frozen base: 4-bit integers
    c.quant.group_size = 128  # one scale per 128 inputs
    c.quant.symmetric = True  # no zero points
    c.quant.scale_dtype = "bfloat16"  # scales rounded to bf16
    c.quant.quantize_embed = False  # embeddings stay bf16
    c.quant.quantize_lm_head = False  # lm_head stays bf16

    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 16  # adapter rank
    c.lora.alpha = 32.0  # scale = alpha / rank = 2
    c.lora.targets = ("q", "k", "v", "o", "gate", "up", "down")  # attention and every expert
    c.lora.experts = True  # one adapter per routed expert, batched like the experts
    c.lora.param_dtype = "float32"  # adapters and their AdamW state in f32

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1  # no data-parallel replicas
    c.mesh.fsdp = 1  # no parameter sharding besides the experts'
    c.mesh.context = 1  # context parallelism: each sequence's tokens over this many devices
    c.mesh.tensor = 1  # no tensor parallelism
    c.mesh.expert = 16  # 128 experts -> 8 per device (16 TensorCores = 8 chips)

    c.plan = ml_collections.ConfigDict()
    c.plan.mode = "lora"  # frozen base + LoRA (mode B)
    c.plan.rows = 64  # sequences per optimizer step
    c.plan.seq_len = 2048  # tokens per sequence
    c.plan.micro_batches = 4  # 16 rows per piece: one per device
    c.plan.logprob_chunk = 1024  # tokens per chunk of the chunked log-softmax
    c.plan.remat = "layer"  # recompute each decoder layer in backward
    c.plan.rollout_rows = 64  # built-in engine: sequences decoded at once
    c.plan.rollout_len = 2048  # built-in engine: prompt + completion slots
    c.plan.hbm_gb = 103.08  # 96 GiB: one TensorCore's half of an Ironwood chip's 192 GiB
    c.plan.devices_per_node = 16  # 8 chips x 2 TensorCores
    return c
