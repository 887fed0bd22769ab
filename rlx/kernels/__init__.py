"""Numerical kernels shared by the learner and the built-in engine, below both: chunked per-token
log-probabilities and entropies over the lm-head (``logprobs``).

May import ``rlx.platform`` and the foundation (``rlx.types``, ``rlx.errors``, ``rlx.mesh``).
"""
