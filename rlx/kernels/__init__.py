"""Numerical kernels shared by the learner and the built-in engine, below both: attention without
a ``[t, s]`` score tensor (``attention``) and chunked per-token log-probabilities and entropies
over the lm-head (``logprobs``).

May import ``rlx.platform`` and the foundation (``rlx.types``, ``rlx.errors``, ``rlx.mesh``).
"""
