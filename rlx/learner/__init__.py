"""The learner: advantages (host numpy), losses and chunked log-probs (jnp), host batching
(`batching`), state and optimizer (`state`), and the compiled train / log-prob steps (`step`).

Import the submodules directly (`from rlx.learner import losses`); nothing is imported here.

May import ``rlx.models``, ``rlx.quant`` and the foundation (``rlx.types``, ``rlx.errors``,
``rlx.mesh``); it knows nothing of rollouts, data or the run.
"""
