"""Tiny randomly initialised transformers ``*ForSequenceClassification`` models (reward models),
the zoo's causal-LM shapes with a ``score`` head, and their logits by transformers."""

from __future__ import annotations

import os

import numpy as np
import torch
import transformers

from tests.helpers.hf_zoo import hf_config


def make_classifier(family: str, root: str, *, num_labels: int = 3, pad_token_id: int | None = 0,
                    vocab_size: int | None = None, tokenizer=None) -> str:
    """Create, save and return the folder of a tiny ``<family>ForSequenceClassification`` (the
    zoo's config of ``family``; its norms perturbed so a missed final norm shows), with
    ``tokenizer`` (an rlx ``Tokenizer``) saved beside it when given."""
    path = os.path.join(root, f"{family}_cls{num_labels}")
    torch.manual_seed(0)
    config = hf_config(family)
    config.num_labels, config.pad_token_id = num_labels, pad_token_id
    if vocab_size is not None:
        config.vocab_size = vocab_size
    model = transformers.AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("bias"):
                p.add_(0.5 * torch.randn_like(p))
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save(path)
    return path


def hf_classifier_logits(path: str, ids, attention_mask=None) -> np.ndarray:
    """transformers' pooled logits ``[B, num_labels]`` of the saved classifier at ``path`` (f32;
    every weight from the file)."""
    model, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    kw = {} if attention_mask is None else {"attention_mask": torch.tensor(attention_mask)}
    with torch.no_grad():
        return model.eval()(torch.tensor(ids), **kw).logits.float().numpy()
