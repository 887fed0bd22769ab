"""The learner: advantages (host numpy), losses (jnp), host batching (`batching`), state and
optimizer (`state`), and the compiled train / log-prob steps (`step`); the chunked log-prob kernel
it shares with the engine is ``rlx.kernels.logprobs``.

Import the submodules directly (`from rlx.learner import losses`); nothing is imported here.

May import ``rlx.models``, ``rlx.quant``, ``rlx.kernels``, ``rlx.platform`` and the foundation (``rlx.types``, ``rlx.errors``,
``rlx.mesh``); it knows nothing of rollouts, data or the run.
"""
