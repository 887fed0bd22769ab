"""What depends on the platform the programs run on: one policy per platform, chosen once from
the mesh (``policy``: ``PlatformPolicy``, ``policy_of``, ``current``, ``compiling_for``); XLA:CPU's
native few-row kernels and the host layout of checkpoint tensors (``cpu``); the compile cache
that hands the compiler's freed memory back (``compiled``). Code elsewhere reads the policy's
fields and never tests a platform name.

May import only the foundation (``rlx.types``, ``rlx.errors``, ``rlx.mesh``).
"""

from rlx.platform.policy import (CPU, GPU, TPU, PlatformPolicy, active, compiling_for, current,
                                 policy_for, policy_of)

__all__ = ["PlatformPolicy", "CPU", "GPU", "TPU", "policy_for", "policy_of", "current", "active",
           "compiling_for"]
