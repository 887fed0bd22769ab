"""The learner's math: advantages (host numpy), losses and chunked log-probs (jnp).

Import the submodules directly (`from rlx.learner import losses`); nothing is imported here.
"""
