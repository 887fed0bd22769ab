"""The registry of base formats and serving layouts: the one place their names are looked up.

``names()`` / ``serving_names()`` are ``config.quant.format`` / ``config.quant.serving``'s
choices; ``get(name)`` / ``serving(name)`` their records. A new format is one module declaring a
``Format``, added to ``BUILTIN`` here (or ``register``-ed by the code that defines it, and
``unregister``-ed when that code is done with it).
"""

from __future__ import annotations

from rlx.quant.formats import serving as _serving
from rlx.quant.formats.base import Format, QuantConfigError, ServingLayout
from rlx.quant.formats.fp8 import FP8
from rlx.quant.formats.gguf import GGUF
from rlx.quant.formats.int4 import INT4
from rlx.quant.formats.int8 import INT8
from rlx.quant.formats.mxfp4 import MXFP4
from rlx.quant.formats.nvfp4 import NVFP4, NVFP4_CT
from rlx.quant.formats.nf4 import NF4
from rlx.quant.formats.plain import NONE
from rlx.quant.formats.shipped import SHIPPED

BUILTIN = (NONE, INT8, INT4, FP8, NF4, MXFP4, NVFP4, NVFP4_CT, GGUF, SHIPPED)
_FORMATS: dict[str, Format] = {f.name: f for f in BUILTIN}
_SERVING: dict[str, ServingLayout] = {s.name: s for s in _serving.BUILTIN}


def register(fmt: Format | ServingLayout) -> None:
    """Add a format or serving layout; refuses a name already taken."""
    table = _FORMATS if isinstance(fmt, Format) else _SERVING
    if fmt.name in table:
        raise ValueError(f"{fmt.name!r} is already registered")
    if isinstance(fmt, Format):
        unknown = [s for s in fmt.serving if s not in _SERVING]
        if unknown:
            raise ValueError(f"format {fmt.name!r} names unknown serving layouts {unknown}")
    table[fmt.name] = fmt


def unregister(name: str) -> None:
    """Remove a format or serving layout ``register`` added (built-ins stay)."""
    if name in {f.name for f in BUILTIN} | {s.name for s in _serving.BUILTIN}:
        raise ValueError(f"{name!r} is built in")
    _FORMATS.pop(name, None)
    _SERVING.pop(name, None)


def names() -> tuple[str, ...]:
    return tuple(_FORMATS)


def serving_names() -> tuple[str, ...]:
    return tuple(_SERVING)


def get(name: str) -> Format:
    if name not in _FORMATS:
        raise QuantConfigError(f"quant format {name!r} is not one of {list(_FORMATS)}")
    return _FORMATS[name]


def serving(name: str) -> ServingLayout:
    if name not in _SERVING:
        raise QuantConfigError(f"serving layout {name!r} is not one of {list(_SERVING)}")
    return _SERVING[name]


def carries(fmt: str, layout: str) -> bool:
    """Whether serving layout ``layout`` carries base format ``fmt``'s exact values."""
    return layout in get(fmt).serving
