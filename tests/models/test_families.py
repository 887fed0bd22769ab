"""Model families as specs (``rlx.models.families``): every registered family reads and writes its
``config.json`` both ways, and no code outside the family modules branches on a family's name.

The round trip draws a tiny random config for each family from transformers' own config class
(``AutoConfig.for_model``), so a new family is covered by its registration alone. The scan reads
rlx/ with ``ast``: a comparison against a family's ``model_type``, HF class or GGUF architecture
name (or against a tuple of them, or any comparison of a ``.model_type``) outside
rlx/models/families/ is a family branch that belongs in the family's spec (rlx/bench/ is exempt).
"""

import ast
import dataclasses
import os
import random

import pytest
import transformers

from rlx.models.config import from_hf_config, to_hf_config
from rlx.models.families import (BY_ARCHITECTURE, FAMILIES, PRESETS, family_of,
                                 written_architecture)
from rlx.quant.config import LoraConfig
from rlx.quant.lora import target_counts
from tests.helpers import ROOT


def _tiny_hf(model_type: str, seed: int, **overrides) -> dict:
    """A random tiny ``config.json`` of ``model_type``: transformers' class defaults for every
    family field, random sizes, and MoE sizes under each family's field names (a family ignores
    the names it does not read)."""
    rng = random.Random(seed)
    heads, head_dim = rng.choice((2, 4)), rng.choice((8, 16))
    experts = rng.choice((4, 8))
    sizes = dict(
        vocab_size=rng.randrange(64, 256), hidden_size=heads * head_dim * rng.choice((1, 2)),
        intermediate_size=rng.randrange(16, 96, 8), num_hidden_layers=rng.randrange(3, 6),
        num_attention_heads=heads, num_key_value_heads=rng.choice((1, heads)), head_dim=head_dim,
        max_position_embeddings=rng.choice((128, 512)), rms_norm_eps=rng.choice((1e-5, 1e-6)),
        tie_word_embeddings=rng.random() < 0.5, num_experts=experts, num_local_experts=experts,
        n_routed_experts=experts, num_experts_per_tok=2, moe_intermediate_size=rng.randrange(8, 32, 8),
        n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=rng.choice((None, 24)),
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=head_dim // 2, v_head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": rng.choice((100.0, 10000.0))},
    )
    if model_type in ("deepseek_v32", "glm_moe_dsa"):  # their indexer reads the query latent
        sizes["q_lora_rank"] = 24
    return transformers.AutoConfig.for_model(model_type, **sizes | overrides).to_dict()


def _tiny_family_hf(spec, seed: int, **overrides) -> dict:
    """``_tiny_hf`` of a family, its class in ``architectures``; a vision-language family's is
    its wrapper class's config (default vision tower) around a tiny text config of the first
    language-model type it reads."""
    arch = {"architectures": [spec.architectures[0]]}
    if spec.multimodal is None:
        return _tiny_hf(spec.model_type, seed, **overrides) | arch
    text = _tiny_hf(spec.multimodal.text_model_types[0], seed, **overrides)
    return transformers.AutoConfig.for_model(spec.model_type, text_config=text).to_dict() | arch


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_family_reads_and_writes_its_config_json(model_type):
    """A vision-language family's language model is written as its causal-LM class
    (``written_architecture``), which reads back as the same model."""
    spec = FAMILIES[model_type]
    for seed in range(3):
        cfg = from_hf_config(_tiny_family_hf(spec, seed), text_only=True)
        assert family_of(cfg) is spec
        assert cfg.attention_kind == spec.attention
        kinds = {cfg.mlp_kind(i) for i in range(cfg.num_layers)}
        assert ("moe" in kinds) == (spec.mlp == "moe"), kinds
        written = to_hf_config(cfg)
        arch = written_architecture(cfg)
        writer = BY_ARCHITECTURE[arch]
        assert written["model_type"] == writer.model_type
        assert written["architectures"] == [arch] == [writer.architectures[0]]
        same = dataclasses.replace(cfg, architecture=arch)
        assert from_hf_config(written) == same
        # what rlx writes means the same to transformers' class
        fields = {k: v for k, v in written.items() if k != "model_type"}
        again = transformers.AutoConfig.for_model(writer.model_type, **fields).to_dict()
        assert from_hf_config(again | {"architectures": written["architectures"]}) == same


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_presets_and_lora_targets_belong_to_their_family(model_type):
    spec = FAMILIES[model_type]
    for name, hf in spec.presets.items():
        assert PRESETS[name] is hf
        assert hf["model_type"] in (spec.model_type, *spec.aliases)
        assert family_of(from_hf_config(dict(hf), text_only=True)) is spec
    # each default target adapts a module of the family's models (MLA: with a low-rank q)
    cfg = from_hf_config(_tiny_family_hf(spec, 0, q_lora_rank=24), text_only=True)
    counts = target_counts(cfg, LoraConfig(targets=spec.lora_targets, experts=True))
    assert all(counts[t] for t in spec.lora_targets), counts


def test_registry_names_each_class_once():
    classes = [a for s in FAMILIES.values() for a in s.architectures]
    assert len(classes) == len(set(classes)) == len(BY_ARCHITECTURE)


def _family_names() -> set[str]:
    names = set()
    for spec in FAMILIES.values():
        names |= {spec.model_type, *spec.aliases, *spec.architectures}
        names |= {spec.gguf.name} if spec.gguf is not None else set()
    return names


def _names_in(node: ast.AST, names: set[str]) -> set[str]:
    """Family names ``node`` spells: a string constant, or a tuple / list / set of them."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {i.value for i in items if isinstance(i, ast.Constant) and i.value in names}


def _tables(trees: dict[str, ast.Module], names: set[str]) -> set[str]:
    """Module-level names bound to a tuple / list / set of family names (e.g. a ``MOE_TYPES``)."""
    out = set()
    for tree in trees.values():
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if isinstance(node.value, (ast.Tuple, ast.List, ast.Set)) and _names_in(node.value, names):
                    out |= {t.id for t in targets if isinstance(t, ast.Name)}
    return out


def _branches(path: str, tree: ast.Module, names: set[str], tables: set[str]) -> list[str]:
    out = []
    for node in sorted(ast.walk(tree), key=lambda n: getattr(n, "lineno", 0)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        spelled = set().union(*(_names_in(o, names) for o in operands))
        by_type = any(isinstance(o, ast.Attribute) and o.attr == "model_type" for o in operands)
        by_table = any(isinstance(o, ast.Name) and o.id in tables for o in operands)
        if spelled or by_type or by_table:
            what = sorted(spelled) or ["model_type" if by_type else "a table of family names"]
            out.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: compares with {', '.join(what)}")
    return out


def family_branches(top: str) -> list[str]:
    """Every comparison against a family's name in ``top`` outside its families/ and bench/."""
    skip = (os.path.join(top, "models", "families"), os.path.join(top, "bench"))
    trees = {}
    for folder, _, files in os.walk(top):
        if any(folder == s or folder.startswith(s + os.sep) for s in skip):
            continue
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                trees[path] = ast.parse(open(path).read(), path)
    names = _family_names()
    tables = _tables(trees, names)
    return [line for path, tree in sorted(trees.items()) for line in _branches(path, tree, names, tables)]


def test_no_code_outside_the_families_branches_on_a_family():
    bad = family_branches(os.path.join(ROOT, "rlx"))
    assert not bad, "family branches belong in the family's spec (rlx/models/families/):\n" + "\n".join(bad)


def test_the_scan_sees_a_family_branch(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "x.py").write_text(
        'KINDS = ("qwen3", "other")\n'
        'def f(cfg, kind):\n'
        '    return cfg.model_type == cfg.other or kind in ("glm4_moe",) or kind in KINDS\n')
    found = family_branches(str(tmp_path))
    assert [line.split(": ", 1)[1] for line in found] == [
        "compares with model_type", "compares with glm4_moe", "compares with a table of family names"]
