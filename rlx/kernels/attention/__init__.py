"""Attention without a ``[t, s]`` score or mask tensor where sequences are long: one entry point,
``attend`` (``api``), over three implementations chosen by the platform policy: ``dense``
(short sequences, one-token decode steps), ``blockwise`` (an online-softmax XLA loop with a
recomputing backward; any platform) and ``splash`` (JAX's Pallas TPU kernels). Sliding windows
and attention sinks are defined once for all of them (``local``)."""

from rlx.kernels.attention.api import AttentionSharding, attend
from rlx.kernels.attention.blockwise import MASK_VALUE, blockwise_attention
from rlx.kernels.attention.dense import (attention_mask, causal_attention, causal_blocks,
                                         gqa_attention)

__all__ = ["AttentionSharding", "attend", "MASK_VALUE", "blockwise_attention", "attention_mask",
           "causal_attention", "causal_blocks", "gqa_attention"]
