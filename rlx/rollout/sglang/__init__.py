"""SGLang servers as a rollout backend: the section that configures them (``config``), launching
and stopping server processes (``server``), the HTTP client of SGLang's API (``engine``, over the
fault-tolerant ``rlx.rollout.dispatch``), and the policy that exports rlx's weights, launches or
attaches servers and keeps them in sync (``policy``).
"""

from __future__ import annotations

from rlx.rollout.sglang.policy import SGLangPolicy


def build(request) -> SGLangPolicy:
    """Exports the policy, then launches or attaches the servers ``request.serving`` names."""
    return SGLangPolicy(request.serving, request.model)


__all__ = ["SGLangPolicy", "build"]
