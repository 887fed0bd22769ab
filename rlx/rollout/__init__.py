"""Rollout engines behind one protocol (``rlx.types.RolloutEngine``), one sub-package per backend:
the built-in JAX engine (``jax/``: the learner's own kernels, KV cache, compiled decode loop) and
SGLang servers (``sglang/``: launch, export, sync, client). Shared by backends: the registry of
engine builders (``registry``: the names ``config.rollout.engine`` takes), the record of what
servers serve (``serving``), fault-tolerant HTTP dispatch over a set of servers (``dispatch``),
the learner-vs-engine parity preflight (``preflight``), the ``config.rollout`` section
(``config``) and the engines' error (``errors``).

May import ``rlx.models``, ``rlx.quant``, ``rlx.io`` (exports for servers), ``rlx.kernels``,
``rlx.platform`` and the foundation (``rlx.types``, ``rlx.errors``, ``rlx.mesh``); never the
learner, the run config (``rlx.config``) or the run: the run hands an engine what it needs.
"""
