"""Memory plan of a Kimi-K2-shaped ~1T-parameter MoE: ``python -m rlx.plan --config configs/kimi_k2_plan.py``.

Shape (from the public Kimi K2 config): 61 layers, hidden 7168, 384 routed experts (top-8,
expert width 2048) plus 1 shared expert, the first layer dense (width 18432), vocab 163840.
Stand-ins, documented: rlx has no MLA attention yet, so attention is GQA with 64 query heads and
8 KV heads of 128 (about 8.1B attention parameters instead of MLA's ~4.6B, and a KV cache of
2 x 8 x 128 = 2048 values per token per layer instead of MLA's 512 + 64); the architecture is
expressed as Qwen2-MoE (shared expert with a sigmoid gate: 7168 extra parameters per layer).
Total about 1.04T parameters, 32B active per token.

Default: mode "lora" (int4 base, group 64, bf16 scales + LoRA r16 on attention, dense and shared
MLPs; routed experts frozen) on one node of 8 x 192 GB. Mode "full" (bf16 + AdamW on everything):
``python -m rlx.plan --config configs/kimi_k2_plan.py --mode full``.
"""

import ml_collections

KIMI_K2_SHAPE = {
    "architectures": ["Qwen2MoeForCausalLM"],  # shared expert + first-k dense layers
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 18432,  # the dense first layer
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,  # GQA stand-in for MLA
    "head_dim": 128,
    "qkv_bias": False,
    "num_experts": 384,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "shared_expert_intermediate_size": 2048,  # 1 shared expert
    "norm_topk_prob": True,
    "mlp_only_layers": [0],  # first layer dense
    "decoder_sparse_step": 1,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072,
    "rope_theta": 50000.0,
    "tie_word_embeddings": False,
}


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict()
    c.model.hf_config = KIMI_K2_SHAPE  # architecture only: the planner reads no weights
    c.model.dtype = "bfloat16"  # compute dtype
    c.model.param_dtype = "bfloat16"  # float parameters (embeddings, norms, full-mode weights)
    c.model.moe_impl = "dense"  # experts sharded over the expert axis use the einsum path
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1  # data-parallel replicas
    c.mesh.fsdp = 1  # parameter sharding (mode full scales this over nodes)
    c.mesh.tensor = 1  # tensor parallelism
    c.mesh.expert = 8  # 384 experts -> 48 per device
    c.quant = ml_collections.ConfigDict()
    c.quant.format = "int4"  # frozen base: 4-bit integers, two per byte
    c.quant.group_size = 64  # one scale per 64 inputs
    c.quant.scale_dtype = "bfloat16"  # scales rounded to bf16
    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 16  # adapter rank
    c.lora.alpha = 32.0  # scaling alpha / rank = 2
    c.lora.experts = False  # routed experts stay frozen (SGLang serves MoE LoRA only on bf16/fp8)
    c.plan = ml_collections.ConfigDict()
    c.plan.mode = "lora"  # "full": bf16 + AdamW on every parameter; "lora": frozen int4 base + LoRA
    c.plan.rows = 64  # sequences per optimizer step
    c.plan.seq_len = 4096  # tokens per sequence
    c.plan.micro_batches = 8  # gradient accumulation: 8 rows (1 per device) per micro-batch
    c.plan.logprob_chunk = 2048  # tokens per chunk of the chunked log-softmax
    c.plan.remat = "layer"  # keep each layer's input only
    c.plan.rollout_rows = 64  # built-in engine: sequences decoded together
    c.plan.rollout_len = 4096  # built-in engine: KV slots per sequence
    c.plan.kv_dtype = "bfloat16"  # KV cache dtype
    c.plan.hbm_gb = 192.0  # memory per device
    c.plan.devices_per_node = 8  # devices per node, for "needs N nodes"
    return c
