"""The DPO step of a run (``train.algorithm="dpo"``, ``rlx.learner.preference``).

pairs (``data.source``: ``pairs:PATH`` or ``arith_pairs:NAME``, ``data.prompts_per_step`` per
step) -> tokens (the prompt rendered as the RL prompts are, ``rlx.data.pairs.tokenize_pair``) ->
batch (chosen rows, then rejected rows) -> reference log-probs (the adapter switched off) -> one
update -> the step's ``dpo/*`` record. The loop (``rlx.run.loop``) then syncs the engine's weights,
so evaluation and ``Run.generate`` see the trained policy.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from rlx.config import RunConfig
from rlx.data.chat import PromptFormat, prompt_messages
from rlx.data.pairs import tokenize_pair
from rlx.data.sources import Example
from rlx.io.metrics import to_scalars
from rlx.learner.preference import pair_batch
from rlx.learner.step import Compiled
from rlx.mesh import batch_shards
from rlx.models.tokenizer import Tokenizer
from rlx.run.hosts import Hosts
from rlx.run.learn import buckets


def learn_preferences(cfg: RunConfig, mesh: Mesh, compiled: Compiled, hosts: Hosts,
                      tokenizer: Tokenizer, prompt_format: PromptFormat,
                      examples: Sequence[Example]) -> dict[str, float]:
    """One DPO update on this step's pairs (every process's); the ``dpo/*`` record."""
    pairs = [tokenize_pair(tokenizer, prompt_messages(e, prompt_format), e)
             for e in hosts.all_examples(examples)]
    host = pair_batch(pairs, buckets=buckets(cfg),
                      rows_multiple=batch_shards(mesh) * cfg.train.micro_batches)
    batch = hosts.device_batch(host, mesh)
    c = compiled
    batch = batch.replace(ref_logp=c.reference_logprobs(batch).logp)
    c.state, metrics = jax.block_until_ready(c.train_step(c.state, batch))
    lengths = [len(ch) + len(rj) for _, ch, rj in pairs]
    return {**{f"dpo/{k}": v for k, v in to_scalars(metrics).items()},
            "dpo/pairs": float(len(pairs)), "dpo/reply_tokens_mean": sum(lengths) / (2 * len(pairs))}


__all__ = ["learn_preferences"]
