"""Rollout engines behind one protocol (``rlx.types.RolloutEngine``): the built-in JAX engine
(``jax_engine``: the learner's own kernels, KV cache, jitted decode loop) and SGLang servers
(``sglang_policy`` on ``sglang_engine`` / ``sglang_server``); the ``config.rollout`` section
(``config``) and the engines' error (``errors``).

May import ``rlx.models``, ``rlx.quant``, ``rlx.learner`` (log-prob kernels), ``rlx.io`` (exports
for SGLang) and the foundation (``rlx.types``, ``rlx.errors``, ``rlx.mesh``); never the run config
(``rlx.config``) or the run: the run hands an engine what it needs.
"""
