"""DPO (``rlx.learner.preference``): rlx's loss on a batch of pairs equals TRL's ``DPOTrainer``
loss on the same pairs, model and adapter (<= 1e-5, f32), with the same tokens; micro-batches
of whole pairs give the one-batch update."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from rlx.data.pairs import record_to_pair, tokenize_pair
from rlx.io.export import export_peft
from rlx.learner.preference import make_dpo_step, pair_batch
from rlx.learner.state import OptimizerConfig, create_train_state, make_optimizer
from rlx.learner.step import StepConfig, make_logprob_step, reference_forward
from rlx.mesh import MeshShape, make_mesh
from rlx.models import ModelConfig, Transformer
from rlx.models.hf import to_hf
from rlx.quant import LoraConfig, apply_lora
from tests.helpers.quant import randomize_lora_b
from tests.helpers.tokenizers import byte_tokenizer

BETA = 0.1
LORA = LoraConfig(rank=4, alpha=8.0)
CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=258, hidden_size=32,
                  intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  tie_word_embeddings=False)
PAIRS = [
    {"prompt": [{"role": "user", "content": "2 + 2?"}],
     "chosen": [{"role": "assistant", "content": "4"}],
     "rejected": [{"role": "assistant", "content": "five"}]},
    {"prompt": [{"role": "user", "content": "Color of the sky?"}],
     "chosen": [{"role": "assistant", "content": "blue"}],
     "rejected": [{"role": "assistant", "content": "green, mostly"}]},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
     "chosen": [{"role": "assistant", "content": "Hello."}],
     "rejected": [{"role": "assistant", "content": "Greetings to you"}]},
    {"prompt": [{"role": "user", "content": "Opposite of up?"}],
     "chosen": [{"role": "assistant", "content": "down"}],
     "rejected": [{"role": "assistant", "content": "sideways"}]},
]


@pytest.fixture(scope="module")
def policy():
    """A random float-base decoder with a non-zero LoRA adapter (so policy != reference)."""
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    apply_lora(model, LORA, nnx.Rngs(1))
    randomize_lora_b(model, scale=0.2)
    return model


def _rlx(model, pairs, micro_batches: int = 1):
    mesh = make_mesh(MeshShape(), jax.devices()[:1])
    opt = OptimizerConfig(learning_rate=1e-2, schedule="constant")
    graphdef, state = create_train_state(model, make_optimizer(opt), mesh, trainable=nnx.LoRAParam)
    cfg = StepConfig(micro_batches=micro_batches)
    batch = pair_batch(pairs)
    ref = make_logprob_step(graphdef, state.params, state.frozen, mesh, cfg,
                            apply_fn=reference_forward)(state.params, state.frozen, batch)
    step = make_dpo_step(graphdef, state, mesh, cfg, opt, beta=BETA)
    return step(state, batch.replace(ref_logp=ref.logp))


def test_dpo_loss_and_tokens_match_trl(policy, tmp_path):
    import datasets
    import peft
    import torch
    import transformers
    from trl import DPOConfig, DPOTrainer

    tokenizer = byte_tokenizer()
    to_hf(policy, str(tmp_path / "base"), tokenizer=tokenizer)
    adapter = export_peft(policy, LORA, str(tmp_path / "adapter"), "v1")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"),
                                                           dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf, adapter, is_trainable=True)
    # rlx's reference is the base with the adapter off: TRL's for a fresh adapter; this adapter is
    # trained already (TRL would copy it as the reference), so the base is passed as ref_model
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"),
                                                             dtype=torch.float32)
    # bf16=False: TRL's default would run the reference under the CPU's bf16 autocast
    trainer = DPOTrainer(
        model=model, ref_model=base, processing_class=transformers.AutoTokenizer.from_pretrained(
            str(tmp_path / "base")),
        train_dataset=datasets.Dataset.from_list(PAIRS),
        args=DPOConfig(output_dir=str(tmp_path / "trl"), beta=BETA, report_to="none",
                       per_device_train_batch_size=len(PAIRS), use_cpu=True, max_length=None, bf16=False,
                       dataset_num_proc=None))
    rows = [trainer.train_dataset[i] for i in range(len(PAIRS))]
    ours = []
    for i, record in enumerate(PAIRS):
        pair = record_to_pair(record, "pairs", f"pair {i}")
        ours.append(tokenize_pair(tokenizer, pair.messages, pair))
    theirs = [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in rows]
    assert [tuple(map(list, t)) for t in ours] == [tuple(map(list, t)) for t in theirs]
    with torch.no_grad():
        want = float(trainer.compute_loss(trainer.model, trainer.data_collator(rows)))
    _, metrics = _rlx(policy, ours)
    assert abs(float(metrics.loss) - want) <= 1e-5, (float(metrics.loss), want)
    assert abs(want - np.log(2)) > 1e-3  # the adapter moves the policy off the reference


def test_micro_batches_of_whole_pairs_give_the_one_batch_update(policy):
    tokenizer = byte_tokenizer()
    pairs = [tokenize_pair(tokenizer, p.messages, p) for p in
             (record_to_pair(r, "pairs", f"pair {i}") for i, r in enumerate(PAIRS))]
    one, m1 = _rlx(policy, pairs)
    two, m2 = _rlx(policy, pairs, micro_batches=2)
    for a, b in zip(m1, m2):
        assert float(a) == pytest.approx(float(b), abs=1e-6)
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(two.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    assert float(m1.reward_accuracy) in (0.0, 0.25, 0.5, 0.75, 1.0)


def test_a_pair_with_an_empty_side_is_refused_naming_the_line_and_field(tmp_path):
    from rlx.data.pairs import pairs_source
    from rlx.data.sources import DataError

    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in [
        PAIRS[0], {"prompt": "Q?", "chosen": "A", "rejected": ""}]) + "\n")
    with pytest.raises(DataError, match=r"pairs.jsonl: line 2: field 'rejected' is empty"):
        pairs_source(str(path), "all")
