"""The registry of shipped checkpoint layout readers: ``layout(quantization_config)`` asks each
reader in turn (the first that recognises the config parses it) and ``SUPPORTED`` lists what they
all read, in the refusals. A new layout is one reader module declaring a ``LayoutReader`` (or a
``FileReader``), added to ``READERS`` (``FILES``) here.
"""

from __future__ import annotations

from rlx.quant.formats.base import QuantConfigError
from rlx.quant.formats.gguf import file as gguf_file
from rlx.quant.formats.layouts import compressed_tensors, hf_fp8, modelopt, mxfp4, w8a8_int8
from rlx.quant.formats.layouts.base import FileReader, Layout, LayoutReader, Refused

READERS: tuple[LayoutReader, ...] = (hf_fp8.READER, w8a8_int8.READER, compressed_tensors.READER,
                                     mxfp4.READER, modelopt.READER)
FILES: tuple[FileReader, ...] = (gguf_file.READER,)
SUPPORTED: tuple[str, ...] = (tuple(line for r in READERS for line in r.supported)
                              + tuple(f.supported for f in FILES))


def refusal(method, why: str) -> QuantConfigError:
    """The error refusing ``quant_method=method`` for ``why``, listing what rlx reads."""
    return QuantConfigError(
        f"quantization_config quant_method={method!r}: {why}; rlx keeps these checkpoints as they "
        f"are: {'; '.join(SUPPORTED)}")


def layout(qc: dict) -> Layout:
    """The ``Layout`` of a ``quantization_config``, or ``QuantConfigError`` naming the method, what
    is not supported and what rlx reads."""
    reader = next((r for r in READERS if r.recognises(qc)), None)
    if reader is None:
        raise refusal(qc.get("quant_method"), "not a layout rlx reads")
    try:
        return reader.parse(qc)
    except Refused as e:
        raise refusal(e.method, e.why) from None


def file_reader(path: str) -> FileReader | None:
    """The reader of a checkpoint file that is its own layout, by its suffix (None: a folder)."""
    return next((f for f in FILES if path.endswith(f.suffix)), None)
