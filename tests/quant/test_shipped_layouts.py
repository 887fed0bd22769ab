"""The shipped layout readers (``rlx.quant.formats.layouts``): each declares the tensors its
producer writes, names a registered format, and the refusal lists what every reader reads."""

import numpy as np
import pytest

from rlx.quant import formats
from rlx.quant.config import QuantConfigError
from rlx.quant.formats.layouts.registry import FILES, READERS, SUPPORTED, layout
from tests.helpers.shipped import Scheme, _quantize

# one of each producer's layouts (tests/helpers/shipped.py writes their tensors by formulas of its
# own, not rlx's), with the rlx format its values are
PRODUCED = {"fp8-block": (Scheme("fp8_block"), "fp8"),
            "fp8-channel": (Scheme("fp8_channel"), "fp8"), "w8a8": (Scheme("w8a8"), "int8"),
            "int4-g16": (Scheme("pack", bits=4, group=16), "int4"),
            "int4-g16-asym": (Scheme("pack", bits=4, group=16, symmetric=False), "int4"),
            "int8-channel": (Scheme("pack", bits=8), "int8")}


@pytest.mark.parametrize("name", list(PRODUCED))
def test_a_layout_declares_the_tensors_its_producer_writes(name):
    scheme, fmt = PRODUCED[name]
    lay = layout(scheme.quantization_config())
    t = lay.tensors
    declared = {t.values, t.scale} | {s for s in (t.shape, t.zero) if s}
    w = np.random.default_rng(0).normal(size=(8, 32)).astype(np.float32)
    assert declared == set(_quantize(w, scheme, np.float32))
    assert lay.fmt == fmt and lay.format is formats.get(fmt)


def test_the_refusal_lists_every_readers_lines_in_registry_order():
    lines = [line for r in READERS for line in r.supported] + [f.supported for f in FILES]
    assert list(SUPPORTED) == lines and len(lines) == 9
    with pytest.raises(QuantConfigError) as e:
        layout({"quant_method": "awq"})
    assert str(e.value).endswith("; ".join(lines))


def test_each_quant_method_has_one_reader():
    methods = [m for r in READERS for m in r.quant_methods]
    assert len(methods) == len(set(methods))
