"""XLA:CPU's own engineering, which ``rlx.platform.policy.CPU`` turns on: the native few-row
products over packed weights (``kernels``, built from ``kernels.cc`` at first use) and the host
layout of checkpoint tensors for CPU devices (``host_layout``).

Part of ``rlx.platform``: may import only the foundation (``rlx.types``, ``rlx.errors``,
``rlx.mesh``).
"""
