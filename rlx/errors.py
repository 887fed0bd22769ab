"""The error every layer raises for a setting it cannot honour, and the one check of a choice.

``ConfigError`` is a ``ValueError`` whose message is one line naming the field, what is wrong and
what would work. Sections of the run config are defined by the package that uses them (the loss
in ``rlx.learner.losses``, the base format in ``rlx.quant.config``, ...) and validate themselves
with ``one_of``; ``rlx.config`` prefixes their field names with the section's dotted path. This
module imports nothing of rlx, so any package may use it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """An invalid setting; ``str(e)`` is one line naming the field and how to fix it."""


def one_of(field: str, value: Any, allowed: Iterable[Any]) -> None:
    """Raise ``ConfigError("<field>=<value> is not one of [...]")`` unless ``value`` is allowed."""
    allowed = list(allowed)
    if value not in allowed:
        raise ConfigError(f"{field}={value!r} is not one of {allowed}")


__all__ = ["ConfigError", "one_of"]
