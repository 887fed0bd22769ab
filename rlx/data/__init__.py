"""Prompt data: typed examples, bundled and file sources, the grain pipeline, pass@k eval.

Importing this package loads only the records and the source registry; the pipeline (grain),
chat rendering (tokenizer) and evaluation are imported on first attribute access.

May import ``rlx.models`` (the tokenizer), ``rlx.rewards`` (evaluation grades with them) and the
foundation (``rlx.types``, ``rlx.errors``, ``rlx.mesh``); no stage above it.
"""

from __future__ import annotations

import importlib
from typing import Any

from rlx.data.sources import (DataError, Example, FieldMap, ListSource, Message, Source,
                              available_sources, get_source, load_file, register_source, split_of)

_LAZY = {
    "PromptFormat": "rlx.data.chat",
    "render_chat": "rlx.data.chat",
    "encode_prompt": "rlx.data.chat",
    "PromptBatch": "rlx.data.pipeline",
    "PromptIterator": "rlx.data.pipeline",
    "PipelineStats": "rlx.data.pipeline",
    "make_prompt_pipeline": "rlx.data.pipeline",
    "EvalRecord": "rlx.data.eval",
    "EvalReport": "rlx.data.eval",
    "evaluate": "rlx.data.eval",
    "pass_at_k": "rlx.data.eval",
    "distinct_examples": "rlx.data.eval",
    "ProceduralSource": "rlx.data.arith",
}

__all__ = [
    "DataError",
    "Example",
    "FieldMap",
    "ListSource",
    "Message",
    "Source",
    "available_sources",
    "get_source",
    "load_file",
    "register_source",
    "split_of",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlx.data' has no attribute {name!r}")
