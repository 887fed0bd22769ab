"""Tool-use episodes whose policy is a real rlx decoder sampled by the built-in `JaxEngine`.

A tiny decoder (SmolLM2's tokenizer and chat template; 2 layers of width 64, random init, fixed
seed) is fitted by supervised learning, loss on the assistant's tokens only, to two scripted
transcripts until every assistant token is the argmax of its context by a margin:
- SOLVE: call the calculator for 17*23, read 391 in the tool response, call it for 391+5, answer
  \\boxed{396};
- RECOVER: a call with bad JSON, a call of an unknown tool, a call with a wrong argument name (each
  answered by an error observation), then a correct call for 12*12 and the answer \\boxed{144}.
The transcripts come from `run_episodes` with a scripted engine and the real env, so the tool
responses the model learns to read are the env's own. Then `run_episodes` drives the fitted model
through `JaxEngine` (greedy; both tasks share each `generate` call while both run): the env parses
and executes the calls, answers the malformed ones with error observations and grades the final
answer with math-verify. The episodes are checked token by token:
- each turn's tokens are exactly what the engine sampled, conditioned on exactly the sequence so
  far (loss mask 1, the engine's log-probs);
- the tokens between turns are the chat template's rendering of the env's messages: the rendering
  of the chat up to the next assistant header minus the text so far (loss mask 0, log-prob 0);
- the sampler log-probs equal `JaxEngine.score` and the learner's `token_logprobs` on the whole
  sequence within 1e-4 (f32).
Those episodes prefill every turn's whole sequence (the engine is behind a wrapper without
`prefix_cache`). Run again inside `JaxEngine.prefix_cache()`, each turn continues from the KV-cache
row of the episode's previous turn: the same transcripts token for token, sampler log-probs within
1e-5 of the re-prefilled ones and of the learner's, and the engine prefills each prompt once plus,
per later turn, the previous turn's last sampled token and the tool turn's tokens, nothing else.
"""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rlx.data.chat import render_chat
from rlx.data.sources import user_example
from rlx.envs import Calculator, ToolEnv, ToolEnvConfig, run_episodes
from rlx.models import ModelConfig, Transformer
from rlx.rewards import get_reward
from rlx.rollout.jax.config import JaxSection
from rlx.rollout.jax.engine import Buckets, JaxEngine
from rlx.rollout.preflight import learner_logprobs
from rlx.types import SamplingParams
from tests.helpers.envs import ScriptedEngine, call, solver
from tests.helpers.tokenizers import smollm2_tokenizer
from tests.helpers import smollm2_dir

smollm2_dir()

SEED = 0
LOCKSTEP = JaxSection(batching="lockstep")
LOGP_TOL = 1e-4  # f32: sampled (KV cache) vs teacher-forced log-probs of the same tokens
CONTINUED_TOL = 1e-5  # f32: continued from the KV cache vs re-prefilled, and vs the learner
FIT_MARGIN = 1.0  # nats between each target token's log-prob and the best other token's
FIT_STEPS = 300  # cap on optimizer steps
GREEDY = SamplingParams(max_new_tokens=64, temperature=0.0)

SOLVE = user_example("calc:solve", "toy", "Compute (17*23)+5 using the calculator, then answer "
                     "in \\boxed{}.", answer="396")
RECOVER = user_example("calc:recover", "toy", "Compute 12*12 using the calculator, then answer "
                       "in \\boxed{}.", answer="144")
# RECOVER's calls, one per turn: bad JSON (a "}" short), an unknown tool, a wrong argument name,
# then a correct call.
MALFORMED = [
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*12"}\n</tool_call>',
    '<tool_call>\n{"name": "calc", "arguments": {"expression": "12*12"}}\n</tool_call>',
    '<tool_call>\n{"name": "calculator", "arguments": {"expr": "12*12"}}\n</tool_call>',
    call("12*12"),
]


def teacher(context: str) -> str:
    """The scripted policy of both tasks: SOLVE by `solver`; RECOVER by the malformed calls, the
    correct call, then the last tool result as the answer."""
    if SOLVE.prompt in context:
        return solver(context)
    results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", context, re.DOTALL)
    if len(results) < len(MALFORMED):
        return MALFORMED[len(results)]
    return f"So 12*12 = \\boxed{{{results[-1]}}}."


class Recorder:
    """A `RolloutEngine` that passes every call to `engine` and keeps its rollouts by uid."""

    def __init__(self, engine):
        self.engine = engine
        self.rollouts = collections.defaultdict(list)

    def generate(self, prompts, sampling):
        rollouts = self.engine.generate(prompts, sampling)
        for rollout in rollouts:
            self.rollouts[rollout.prompt_uid.rsplit("@", 1)[0]].append(rollout)
        return rollouts

    def score(self, sequences):
        return self.engine.score(sequences)

    def close(self) -> None:
        self.engine.close()


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def reward():
    math = get_reward("math", timeout_s=20.0, hard_timeout_s=60.0)  # generous on a busy CPU
    yield math
    math.close()


@pytest.fixture(scope="module")
def make_env(reward):
    return lambda: ToolEnv([Calculator()], reward, ToolEnvConfig(max_turns=6))


@pytest.fixture(scope="module")
def transcripts(tok, make_env):
    """The scripted episodes (real env) that the model memorises."""
    episodes = run_episodes(ScriptedEngine(tok, teacher), make_env, [SOLVE, RECOVER], tok, GREEDY)
    assert [e.reward for e in episodes] == [1.0, 1.0]
    return episodes


def tiny_model(vocab_size: int) -> Transformer:
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab_size, hidden_size=64,
                      intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16)
    return Transformer(cfg, rngs=nnx.Rngs(SEED))


def fit(model: Transformer, episodes) -> dict[str, float]:
    """Adam on the cross-entropy of the sampled (loss-mask 1) tokens of `episodes`, teacher
    forced, until each is the argmax of its context by FIT_MARGIN nats; updates `model`.

    Only the lm-head columns of the S distinct target tokens are trained; the other V - S
    columns are 0, so their logits are exactly 0 and the full-vocabulary log-softmax is
    `logits_S - logaddexp(logsumexp(logits_S), log(V - S))` without a [K, V] projection.
    """
    seqs = [np.concatenate([e.prompt_ids, e.completion_ids]) for e in episodes]
    ids = np.zeros((len(seqs), max(map(len, seqs))), np.int32)  # right padded [N, T]
    attention = np.zeros_like(ids)
    rows, cols = [], []  # (row, position) whose next token is a sampled one
    for r, (episode, seq) in enumerate(zip(episodes, seqs)):
        ids[r, :len(seq)], attention[r, :len(seq)] = seq, 1
        cols += (len(episode.prompt_ids) + np.flatnonzero(episode.loss_mask) - 1).tolist()
        rows += [r] * int(episode.loss_mask.sum())
    rows, cols = np.asarray(rows), np.asarray(cols)
    vocab, targets = np.unique(ids[rows, cols + 1], return_inverse=True)  # [S], [K] in [0, S)
    zero_logits = np.log(model.config.vocab_size - len(vocab))
    head = 0.02 * jax.random.normal(jax.random.key(SEED), (model.config.hidden_size, len(vocab)))
    trainable = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("lm_head")))
    graphdef, params, rest = nnx.split(model, trainable, ...)
    optimizer = optax.adam(1e-2)

    def loss_fn(weights):
        params, head = weights
        h = nnx.merge(graphdef, params, rest).hidden_states(
            jnp.asarray(ids), attention_mask=jnp.asarray(attention))[rows, cols]  # [K, D]
        logits = h @ head  # [K, S]
        lse = jnp.logaddexp(jax.nn.logsumexp(logits, axis=1), zero_logits)  # [K]
        logp = logits - lse[:, None]  # [K, S]
        target = jnp.take_along_axis(logp, targets[:, None], axis=1)[:, 0]  # [K]
        other = jnp.max(logp.at[np.arange(len(targets)), targets].set(-jnp.inf), axis=1)
        return -target.mean(), jnp.min(target - jnp.maximum(other, -lse))  # loss, margin

    @jax.jit
    def step(weights, opt_state):
        (loss, margin), grads = jax.value_and_grad(loss_fn, has_aux=True)(weights)
        updates, opt_state = optimizer.update(grads, opt_state, weights)
        return optax.apply_updates(weights, updates), opt_state, loss, margin

    weights = (params, head)
    opt_state = optimizer.init(weights)
    for steps in range(FIT_STEPS + 1):
        updated, opt_state, loss, margin = step(weights, opt_state)  # loss, margin of `weights`
        if float(margin) >= FIT_MARGIN or steps == FIT_STEPS:
            break
        weights = updated
    stats = {"steps": steps, "loss": float(loss), "margin": float(margin), "tokens": len(targets)}
    assert stats["margin"] >= FIT_MARGIN, (
        f"the tiny model did not memorise the transcripts in {FIT_STEPS} steps: {stats} (needs "
        f"every sampled token to be the argmax by {FIT_MARGIN} nats for greedy to replay them)")
    params, head = weights
    nnx.update(model, params)
    kernel = jnp.zeros_like(model.lm_head.kernel[...])  # [D, V]
    model.lm_head.kernel.value = kernel.at[:, vocab].set(head)
    return stats


@pytest.fixture(scope="module")
def policy(tok, transcripts):
    model = tiny_model(tok.vocab_size)
    stats = fit(model, transcripts)
    print(f"fit: {stats}")
    return model


@pytest.fixture(scope="module")
def run(tok, make_env, policy):
    """The episodes with the fitted model behind `JaxEngine`, and what the engine returned."""
    # One compiled program: 2 rows, prompts up to 1024 tokens, 64 new tokens. Lockstep: its
    # prefix cache continues at any token (the counts below); continuous batching shares whole
    # pages (tests/rollout/jax/test_prefix_cache.py)
    engine = Recorder(JaxEngine(policy, tokenizer=tok, seed=SEED, settings=LOCKSTEP,
                                buckets=Buckets(min_prompt=1024, min_rows=2)))
    episodes = run_episodes(engine, make_env, [SOLVE, RECOVER], tok, GREEDY)
    print(f"JaxEngine programs compiled: {engine.engine.compilations()}")
    yield episodes, engine
    engine.close()


@pytest.fixture(scope="module")
def continued(tok, make_env, policy):
    """The episodes again, the engine continuing each turn from its KV cache; also how many
    sequences it held at the end of the last turn."""
    engine = JaxEngine(policy, tokenizer=tok, seed=SEED, settings=LOCKSTEP,
                       buckets=Buckets(min_prompt=1024, min_rows=2))
    with engine.prefix_cache():
        episodes = run_episodes(engine, make_env, [SOLVE, RECOVER], tok, GREEDY)
        held = engine.cached_sequences()
    print(f"JaxEngine programs compiled (prefix cache): {engine.compilations()}")
    yield episodes, engine, held
    engine.close()


def transcript(episode) -> str:
    return "\n".join(f"[{m.role}] {m.content}" for m in episode.messages)


def test_engine_policy_solves_the_task_with_the_env_executing_the_calls(run, transcripts):
    (solve, _), _ = run
    assert solve.finish_reason == "final_answer", transcript(solve)
    assert solve.reward == 1.0 and solve.reward_result.reason == "correct", solve.reward_result
    assert len(solve.turns) == 3 and [t.info.tool_calls for t in solve.turns] == [1, 1, 0]
    tools = [m.content for m in solve.messages if m.role == "tool"]
    calculator = Calculator()
    assert tools == [calculator({"expression": "17*23"}).text,
                     calculator({"expression": "391+5"}).text] == ["391", "396"]
    # The second call uses the number the env returned; the answer is the env's last result.
    assert f'"{tools[0]}+5"' in solve.turns[1].text
    assert solve.turns[2].text.endswith(f"\\boxed{{{tools[1]}}}.")
    # Greedy replays the memorised transcript token for token.
    assert solve.completion_ids.tolist() == transcripts[0].completion_ids.tolist()
    assert solve.messages == transcripts[0].messages


def test_malformed_calls_get_error_observations_and_the_engine_policy_recovers(run, transcripts):
    (_, recover), _ = run
    assert recover.finish_reason == "final_answer", transcript(recover)
    assert recover.reward == 1.0 and len(recover.turns) == 5
    errors = [t.info.tool_errors for t in recover.turns[:4]]
    assert len(errors[0]) == 1 and "not valid JSON" in errors[0][0]
    assert errors[1] == ("error: unknown tool 'calc' (available: calculator)",)
    assert len(errors[2]) == 1 and "unexpected argument 'expr'" in errors[2][0]
    assert errors[3] == () and [t.info.tool_calls for t in recover.turns] == [0, 1, 1, 1, 0]
    tools = [m.content for m in recover.messages if m.role == "tool"]
    assert tools[:3] == [e[0] for e in errors[:3]] and tools[3] == "144"
    assert recover.turns[4].text.endswith("\\boxed{144}.")
    assert recover.completion_ids.tolist() == transcripts[1].completion_ids.tolist()


def test_loss_mask_and_env_tokens_token_by_token(run, tok):
    episodes, engine = run
    tools = [Calculator().spec()]
    for episode in episodes:
        rollouts = engine.rollouts[f"{episode.uid}#0"]
        assert len(rollouts) == len(episode.turns)
        assistants = [i for i, m in enumerate(episode.messages) if m.role == "assistant"]
        prompt = render_chat(tok, episode.messages[:assistants[0]], tools,
                             add_generation_prompt=True)
        assert episode.prompt_ids.tolist() == tok.encode(prompt)
        ids, position = episode.prompt_ids.tolist(), 0
        for k, rollout in enumerate(rollouts):
            # The engine was conditioned on exactly the sequence so far; its tokens are kept.
            assert rollout.prompt_ids.tolist() == ids, f"{episode.uid} turn {k}"
            sampled = rollout.completion_ids.tolist()
            assert sampled[-1] == tok.eos_id and rollout.finish_reason == "stop"
            span = slice(position, position + len(sampled))
            assert episode.completion_ids[span].tolist() == sampled
            assert episode.loss_mask[span].tolist() == [1] * len(sampled)
            np.testing.assert_array_equal(episode.sampler_logp[span], rollout.sampler_logp)
            assert np.all(rollout.sampler_logp < 0)
            ids, position = ids + sampled, span.stop
            if k + 1 == len(rollouts):
                break
            # The env's tokens: the template's rendering of the chat through the tool messages,
            # with the next assistant header, minus the text so far.
            so_far = tok.decode(ids)
            after = render_chat(tok, episode.messages[:assistants[k + 1]], tools,
                                add_generation_prompt=True)
            assert after.startswith(so_far), f"{episode.uid} turn {k}"
            env_ids = tok.encode(after[len(so_far):])
            assert list(episode.turns[k].env_ids) == env_ids
            span = slice(position, position + len(env_ids))
            assert episode.completion_ids[span].tolist() == env_ids
            assert episode.loss_mask[span].tolist() == [0] * len(env_ids)
            assert episode.sampler_logp[span].tolist() == [0.0] * len(env_ids)
            ids, position = ids + env_ids, span.stop
        assert position == len(episode.completion_ids) == len(episode.loss_mask)
        full = tok.decode(ids) + "\n"  # the template's "\n" after the final <|im_end|>
        assert full == render_chat(tok, episode.messages, tools, add_generation_prompt=False)


def test_sampler_logprobs_equal_engine_score_and_learner(run, policy):
    episodes, engine = run
    seqs = [(np.concatenate([e.prompt_ids, e.completion_ids]), len(e.prompt_ids))
            for e in episodes]
    scored = engine.score(seqs)
    learner = learner_logprobs(policy, seqs)
    diffs = []
    for episode, by_engine, by_learner in zip(episodes, scored, learner):
        sampled = episode.loss_mask == 1
        assert by_engine.shape == by_learner.shape == episode.sampler_logp.shape
        logp = episode.sampler_logp[sampled]
        diffs.append((np.abs(logp - by_engine[sampled]).max(),
                      np.abs(logp - by_learner[sampled]).max()))
    score_diff, learner_diff = np.max(diffs, axis=0)
    print(f"sampler log-probs, max |diff|: vs engine.score {score_diff:.2e}, "
          f"vs learner {learner_diff:.2e} (f32)")
    assert score_diff <= LOGP_TOL and learner_diff <= LOGP_TOL


def test_turns_continue_from_the_kv_cache_and_prefill_only_new_tokens(run, continued, policy):
    (again, recorder), (episodes, engine, held) = run, continued
    assert [len(e.turns) for e in episodes] == [3, 5]
    for episode, reference in zip(episodes, again):
        assert episode.completion_ids.tolist() == reference.completion_ids.tolist()
        assert episode.messages == reference.messages and episode.reward == reference.reward
        np.testing.assert_array_equal(episode.loss_mask, reference.loss_mask)
    sampled = [e.loss_mask == 1 for e in episodes]
    logp_diff = max(np.abs(e.sampler_logp - r.sampler_logp)[m].max()
                    for e, r, m in zip(episodes, again, sampled))
    seqs = [(np.concatenate([e.prompt_ids, e.completion_ids]), len(e.prompt_ids))
            for e in episodes]
    learner_diff = max(np.abs(e.sampler_logp - by_learner)[m].max() for e, by_learner, m in
                       zip(episodes, learner_logprobs(policy, seqs), sampled))
    # Re-prefilled: every turn's whole sequence. Continued: each prompt, then per later turn the
    # previous turn's last sampled token (never fed by its decode loop) and the tool turn.
    whole = [sum(len(r.prompt_ids) for r in recorder.rollouts[f"{e.uid}#0"]) for e in episodes]
    new = [len(e.prompt_ids) + sum(1 + len(t.env_ids) for t in e.turns[:-1]) for e in episodes]
    print(f"prefilled tokens (solve, recover): re-prefill {whole}, continued {new}; max |diff| "
          f"of sampler log-probs vs re-prefill {logp_diff:.2e}, vs learner {learner_diff:.2e}")
    assert recorder.engine.prefilled_tokens() == sum(whole)
    assert engine.prefilled_tokens() == sum(new) < sum(whole)
    assert logp_diff <= CONTINUED_TOL and learner_diff <= CONTINUED_TOL
    assert held == 1 and engine.cached_sequences() == 0  # the last turn's row, freed on exit
