"""The Tunix sides of the learner and end-to-end benchmarks: Tunix 0.1.7's GRPO learner, CPU.

Tunix pins ``safetensors<0.8`` (rlx needs >= 0.8), so these sides run in their own environment
(``rlx.bench.peer_envs.TUNIX``: Tunix with the JAX stack pinned to rlx's versions, one XLA for
both); the worker there imports rlx from this checkout, and this module imports only the standard
library at import time.

The model is rlx's f32 HF folder of the benchmark (``rlx.bench.rl_models``), loaded by Tunix's own
Llama 3 family (``tunix.models.llama3``: ``ModelConfig`` from the folder's ``config.json``,
``create_model_from_safe_tensors``), LoRA of the benchmark's rank and alpha on every projection
by qwix (``qwix.LoraProvider`` + ``apply_lora_to_model``, as Tunix's own launcher applies it),
on a one-device ``("fsdp", "tp")`` mesh. Tunix's Llama 3 attention rotates with its default
base (1e6) whatever ``rope_theta`` the config holds (SmolLM2: 1e5), so its numbers differ from
HF's and rlx's; the work is the same.

* ``e2e_side``: ``RLCluster`` (vanilla rollout, i.e. Tunix's own ``Sampler``; actor and rollout
  colocated on the mesh, so they share weights) and ``GRPOLearner.train()`` itself, in a thread
  that a data source holds at every step boundary, so one repetition is one whole Tunix step
  (generate, score, update, sync). GRPO with the benchmark's loss: token-mean aggregation, clip
  0.2 / 0.28 (``epsilon_high``, read by Tunix's GRPO loss when its config has it), ``beta=0``
  (no reference model, no KL), one iteration; AdamW behind global-norm clipping; rlx's math
  reward called as a plain reward function. Fixed-length completions: the sampler's stop token
  is an id outside the vocabulary (``RolloutConfig.eos_tokens``), so every completion runs its
  ``max_tokens_to_generate`` tokens, as rlx's ``ignore_eos`` does. Prompts are left-padded to
  the longest prompt of the run (``max_prompt_length``).
* ``learner_side``: the same cluster and learner, and one update by hand as the learner's loop
  does it: ``RLCluster.update_actor`` on the benchmark's micro-batches as Tunix ``TrainExample``
  records (old log-probs given), gradients accumulated by the trainer's ``optax.MultiSteps``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import threading
import time
import traceback

TARGETS = ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*up_proj|.*down_proj"
NO_STOP = -1  # a stop-token id no sampler can produce


@dataclasses.dataclass(frozen=True)
class Shape:
    """What a Tunix cluster is built for (prompts per step and micro-batching in prompts)."""

    prompts: int
    micro_batches: int
    new: int
    prompt_tokens: int
    temperature: float
    steps: int
    seed: int


def _model_config(path: str):
    from tunix.models.llama3 import model as llama

    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    return llama.ModelConfig(
        num_layers=c["num_hidden_layers"], vocab_size=c["vocab_size"],
        embed_dim=c["hidden_size"], hidden_dim=c["intermediate_size"],
        num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"],
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        rope_theta=int(c.get("rope_theta", 10000)), norm_eps=c["rms_norm_eps"],
        weight_tying=c.get("tie_word_embeddings", False))


def load_actor(path: str, rank: int, alpha: float, dtype: str):
    """(LoRA actor, HF tokenizer, mesh) from rlx's HF folder ``path``."""
    import jax
    import jax.numpy as jnp
    import qwix
    import transformers
    from tunix.models.llama3 import params

    auto = jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(auto, auto))
    base = params.create_model_from_safe_tensors(path, _model_config(path), mesh,
                                                 dtype=jnp.dtype(dtype))
    provider = qwix.LoraProvider(module_path=TARGETS, rank=rank, alpha=alpha)
    actor = qwix.apply_lora_to_model(base, provider, **base.get_model_input())
    return actor, transformers.AutoTokenizer.from_pretrained(path), mesh


def _grpo_config(group: int, clip_low: float, clip_high: float):
    from tunix.rl.grpo import grpo_learner

    @dataclasses.dataclass(kw_only=True)
    class ClipHigher(grpo_learner.GRPOConfig):
        epsilon_high: float = clip_high

    return ClipHigher(num_generations=group, num_iterations=1, beta=0.0, epsilon=clip_low,
                      loss_agg_mode="token-mean")


def build_learner(actor, tokenizer, mesh, shape: Shape, optim: dict, algo, reward, learner_cls):
    """A Tunix ``RLCluster`` (one mesh for every role) and ``learner_cls`` over it."""
    import optax
    from tunix.rl import rl_cluster as rlc
    from tunix.rl.rollout import base_rollout

    if shape.prompts % shape.micro_batches:
        raise ValueError(f"Tunix micro-batches split prompts: {shape.prompts} prompts do not "
                         f"split into {shape.micro_batches}")
    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=shape.new, temperature=shape.temperature, top_p=1.0, top_k=None,
        seed=shape.seed, max_prompt_length=shape.prompt_tokens,
        kv_cache_size=shape.prompt_tokens + shape.new, eos_tokens=[NO_STOP])
    adamw = optax.adamw(optim["learning_rate"], b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)
    training = rlc.RLTrainingConfig(
        actor_optimizer=optax.chain(optax.clip_by_global_norm(optim["max_grad_norm"]), adamw),
        eval_every_n_steps=1 << 30, max_steps=shape.steps, mini_batch_size=shape.prompts,
        train_micro_batch_size=shape.prompts // shape.micro_batches,
        rollout_micro_batch_size=shape.prompts, compute_logps_micro_batch_size=shape.prompts)
    roles = {rlc.Role.ACTOR: mesh, rlc.Role.REFERENCE: mesh, rlc.Role.ROLLOUT: mesh}
    config = rlc.ClusterConfig(role_to_mesh=roles, rollout_engine="vanilla",
                               training_config=training, rollout_config=rollout)
    cluster = rlc.RLCluster(actor=actor, reference=None, tokenizer=tokenizer, cluster_config=config)
    return learner_cls(rl_cluster=cluster, algo_config=algo, reward_fns=reward)


# ------------------------------------------------------------------------------ end to end
def _observing_learner():
    """Tunix's ``GRPOLearner``, recording per step the time of its generate-and-score stage and
    the completion tokens it produced (read from the ``TrainExample`` the stage returns)."""
    import numpy as np
    from tunix.rl.grpo import grpo_learner

    class ObservedGRPOLearner(grpo_learner.GRPOLearner):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.observed: list[dict] = []

        def _generate_and_compute_advantage(self, training_input, mode=None):
            t = time.perf_counter()
            kw = {} if mode is None else {"mode": mode}
            example = super()._generate_and_compute_advantage(training_input, **kw)
            tokens = int(np.asarray(example.completion_mask).sum())
            self.observed.append({"generate_s": time.perf_counter() - t, "tokens": tokens})
            return example

    return ObservedGRPOLearner


class StepGate:
    """The learner's data source: step ``k``'s batch is handed out when ``step()`` asks for it,
    and the learner asking for batch ``k + 1`` (or returning) marks the end of step ``k``."""

    def __init__(self, batches: list[dict]):
        self._batches, self._go, self._done = batches, threading.Semaphore(0), queue.Queue()

    def __iter__(self):
        for i, batch in enumerate(self._batches):
            if i:
                self._done.put(("step", None))
            self._go.acquire()
            yield batch

    def start(self, train) -> None:
        def target():
            try:
                train(self)
                self._done.put(("step", None))
            except BaseException as e:  # reported by the next step()
                traceback.print_exc()
                self._done.put(("error", f"{type(e).__name__}: {e}"))

        threading.Thread(target=target, name="tunix-train", daemon=True).start()

    def step(self) -> float:
        t = time.perf_counter()
        self._go.release()
        kind, payload = self._done.get()
        if kind != "step":
            raise RuntimeError(f"Tunix training stopped before the step was done: {payload}")
        return time.perf_counter() - t


def _reward(extractors: tuple[str, ...], record: list):
    """rlx's math reward as a Tunix reward function; ``record`` keeps each call's mean."""
    from rlx.rewards import get_reward, score_batch

    fn = get_reward("math", extractors=extractors)

    def math_reward(prompts, completions, answer, **kwargs) -> list[float]:
        scores = [r.score for r in score_batch(fn, completions, [{"answer": a} for a in answer])]
        record.append(sum(scores) / max(len(scores), 1))
        return scores

    return math_reward


def e2e_side(spec: dict, model: dict, prompts: list[dict]):
    """Worker factory: ``GRPOLearner.train()`` in a thread, released one step per repetition.
    ``prompts``: the run's rendered prompts with their answers, in rlx's order."""
    from rlx.bench.e2e import e2e_spec
    from rlx.platform.compiled import release_free_heap

    s = e2e_spec(spec)
    actor, tokenizer, mesh = load_actor(model["path"], s.lora_rank, s.lora_alpha, s.dtype)
    longest = max(len(tokenizer.encode(p["prompt"])) for p in prompts)
    shape = Shape(s.prompts, s.micro_batches, s.new, longest, s.temperature, s.steps, s.seed)
    rewards: list = []
    learner = build_learner(actor, tokenizer, mesh, shape,
                            {"learning_rate": s.learning_rate, "max_grad_norm": 1.0},
                            _grpo_config(s.group, s.clip_eps_low, s.clip_eps_high),
                            _reward(s.extractors, rewards), _observing_learner())
    batches = [{"prompts": [p["prompt"] for p in prompts[i:i + s.prompts]],
                "answer": [p["answer"] for p in prompts[i:i + s.prompts]]}
               for i in range(0, s.steps * s.prompts, s.prompts)]
    gate = StepGate(batches)
    gate.start(learner.train)

    def step() -> dict:
        seconds = gate.step()
        release_free_heap()  # the training thread is held at the step boundary
        seen = learner.observed[-1]
        return {"samples": float(s.samples), "seconds": seconds,
                "completion_tokens": float(seen["tokens"]), "reward_mean": rewards[-1],
                "generate_s": seen["generate_s"], "update_s": seconds - seen["generate_s"]}

    return step


# ------------------------------------------------------------------------------ learner
def learner_side(spec: dict, model: dict):
    """Worker factory: one update = ``RLCluster.update_actor`` over the benchmark's micro-batches."""
    from rlx.bench.learner import LearnerSpec, make_rollouts
    from rlx.platform.compiled import release_free_heap
    from tunix.rl.grpo import grpo_learner

    s = LearnerSpec(**spec)
    actor, tokenizer, mesh = load_actor(model["path"], s.lora_rank, s.lora_alpha, s.dtype)
    shape = Shape(s.micro_batches, s.micro_batches, s.completion, s.prompt, 1.0, 1 << 30, s.seed)
    learner = build_learner(actor, tokenizer, mesh, shape,
                            {"learning_rate": s.learning_rate, "max_grad_norm": s.max_grad_norm},
                            _grpo_config(max(s.group, 2), s.clip_eps_low, s.clip_eps_high),
                            lambda prompts, completions, **kw: [0.0] * len(prompts),
                            grpo_learner.GRPOLearner)
    cluster = learner.rl_cluster
    micro = _examples(s, make_rollouts(s, actor.config.vocab_size))

    def run() -> dict:  # the trainer logs an update's loss one update later: none reported
        t = time.perf_counter()
        cluster.update_actor(micro, None)  # the trainer waits for its last computation
        seconds = time.perf_counter() - t
        release_free_heap()
        return {"tokens": float(s.tokens), "loss_tokens": float(s.batch * s.completion),
                "seconds": seconds}

    return run


def _examples(s, r) -> list:
    """Tunix ``TrainExample`` micro-batches, rows j, j + k, ... as the other sides deal them."""
    import jax.numpy as jnp
    import numpy as np
    from tunix.rl.common import TrainExample

    out = []
    for j in range(s.micro_batches):
        rows = np.arange(j, s.batch, s.micro_batches)
        prompt, completion = r.prompt_ids[rows], r.completion_ids[rows]
        out.append(TrainExample(
            prompt_ids=jnp.asarray(prompt, jnp.int32), prompt_mask=jnp.ones(prompt.shape, bool),
            completion_ids=jnp.asarray(completion, jnp.int32),
            completion_mask=jnp.ones(completion.shape, bool),
            advantages=jnp.asarray(r.advantages[rows]), ref_per_token_logps=None,
            old_per_token_logps=jnp.asarray(r.old_logp[rows])))
    return out
