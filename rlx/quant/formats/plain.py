"""Format "none": the base stays float (what a float checkpoint holds, in ``model.param_dtype``)."""

from rlx.quant.formats.base import Format

NONE = Format(name="none", summary="float weights", serving=("hf",), float_base=True)
