"""The grain prompt pipeline: chat template, shuffling, epochs, sharding, filtering, resume."""

from __future__ import annotations

import json

import pytest

from rlx.data import DataError, ListSource, PromptFormat, make_prompt_pipeline
from rlx.data.sources import user_example
from tests.helpers.tokenizers import byte_tokenizer, smollm2_tokenizer


def toy_source(n: int, long_every: int = 0) -> ListSource:
    """n examples "q<i>"; every `long_every`-th one is 100 characters longer."""
    examples = []
    for i in range(n):
        text = f"q{i}" + ("x" * 100 if long_every and i % long_every == 0 else "")
        examples.append(user_example(f"toy:{i}", "toy", text, answer=str(i)))
    return ListSource("toy", "all", examples)


def uids(batch) -> list[str]:
    return [p.uid for p in batch.prompts]


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_prompts_are_chat_encoded_with_the_format():
    tok = byte_tokenizer()
    fmt = PromptFormat(system_prompt="Be brief.", template="Solve: {prompt} Put it in \\boxed{}.")
    it = make_prompt_pipeline(toy_source(4), tok, batch_size=2, prompt_format=fmt, shuffle=False)
    batch = next(it)
    assert uids(batch) == ["toy:0", "toy:1"] and batch.examples[0].answer == "0"
    assert tok.decode(batch.prompts[0].token_ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nSolve: q0 Put it in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")


def test_example_tools_are_offered_in_the_prompt():
    tok = byte_tokenizer()
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {}}}
    example = user_example("t:0", "toy", "find x", tools=(tool,))
    source = ListSource("toy", "all", [example])
    prompt = tok.decode(next(make_prompt_pipeline(source, tok, batch_size=1)).prompts[0].token_ids)
    assert prompt.startswith("<|im_start|>system\nYou can call functions")
    assert '<tools>\n{"type": "function", "function": {"name": "lookup"' in prompt
    hidden = make_prompt_pipeline(source, tok, batch_size=1,
                                  prompt_format=PromptFormat(offer_tools=False))
    assert "<tools>" not in tok.decode(next(hidden).prompts[0].token_ids)


def test_smollm2_chat_template():
    tok = smollm2_tokenizer()
    it = make_prompt_pipeline(toy_source(2), tok, batch_size=1, shuffle=False)
    ids = next(it).prompts[0].token_ids
    assert tok.decode(ids).endswith("<|im_start|>user\nq0<|im_end|>\n<|im_start|>assistant\n")
    assert list(ids) == tok.encode_chat([{"role": "user", "content": "q0"}])


def test_shuffle_is_seeded_and_each_epoch_is_a_new_permutation():
    tok = byte_tokenizer()
    run = lambda seed: [u for b in take(make_prompt_pipeline(  # noqa: E731
        toy_source(12), tok, batch_size=4, seed=seed), 6) for u in uids(b)]
    a = run(1)
    assert a == run(1) and a != run(2)
    epoch0, epoch1 = a[:12], a[12:]
    assert sorted(epoch0) == sorted(epoch1) == sorted(f"toy:{i}" for i in range(12))
    assert epoch0 != epoch1


def test_resume_mid_epoch_yields_exactly_the_remaining_batches():
    tok = byte_tokenizer()
    make = lambda: make_prompt_pipeline(  # noqa: E731
        toy_source(30, long_every=7), tok, batch_size=4, seed=5, max_prompt_tokens=60,
        num_epochs=2, read_threads=2)
    reference = list(make())
    it = make()
    seen = take(it, 3)  # mid-epoch: 12 of the 25 short prompts of epoch 0
    state = json.loads(json.dumps(it.get_state()))  # survives a JSON checkpoint
    stats_at_save = it.stats
    rest = list(it)
    resumed = make()
    resumed.set_state(state)
    assert resumed.stats == stats_at_save
    again = list(resumed)
    assert seen + rest == reference
    assert [uids(b) for b in again] == [uids(b) for b in rest] and again == rest
    assert resumed.stats == it.stats


def test_over_long_prompts_are_dropped_and_counted():
    tok = byte_tokenizer()
    # 30 examples, i % 7 == 0 is long: 0, 7, 14, 21, 28 -> 5 filtered per epoch, 25 kept;
    # 2 epochs -> 50 kept = 12 full batches of 4 (2 dropped as a partial batch), 10 filtered.
    it = make_prompt_pipeline(toy_source(30, long_every=7), tok, batch_size=4,
                              max_prompt_tokens=60, num_epochs=2)
    batches = list(it)
    assert len(batches) == 12
    assert all(len(p.token_ids) <= 60 for b in batches for p in b.prompts)
    assert it.stats.filtered_too_long == 10 and it.stats.examples == 48
    assert it.stats.batches == 12 and it.stats.epoch == 1


def test_partial_last_batch_when_asked():
    it = make_prompt_pipeline(toy_source(10), byte_tokenizer(), batch_size=4, num_epochs=1,
                              drop_remainder=False)
    assert [len(b.prompts) for b in it] == [4, 4, 2]


@pytest.mark.parametrize("count", [1, 3, 4])
def test_shards_are_disjoint_and_cover_the_data(count):
    tok = byte_tokenizer()
    shards = []
    for index in range(count):
        it = make_prompt_pipeline(toy_source(22), tok, batch_size=1, seed=9, shard_index=index,
                                  shard_count=count, num_epochs=1)
        shards.append([u for b in it for u in uids(b)])
    everything = [u for shard in shards for u in shard]
    assert len(everything) == len(set(everything)) == 22
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_procedural_source_streams():
    from rlx.data import get_source

    it = make_prompt_pipeline(get_source("arith:basic", "train"), byte_tokenizer(), batch_size=8)
    batches = take(it, 3)
    assert all(len(b.prompts) == 8 for b in batches) and batches[0].epoch == 0


def test_bad_arguments_and_all_too_long():
    tok = byte_tokenizer()
    with pytest.raises(ValueError, match="shard_index"):
        make_prompt_pipeline(toy_source(4), tok, batch_size=1, shard_index=2, shard_count=2)
    with pytest.raises(DataError, match="longer than max_prompt_tokens"):
        next(make_prompt_pipeline(toy_source(4), tok, batch_size=1, max_prompt_tokens=5))


def test_orbax_checkpoint_round_trip(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    import grain

    make = lambda: make_prompt_pipeline(  # noqa: E731
        toy_source(30, long_every=7), byte_tokenizer(), batch_size=4, seed=5, max_prompt_tokens=60)
    it = make()
    take(it, 3)
    manager = ocp.CheckpointManager(tmp_path / "ckpt", item_names=("data",))
    manager.save(1, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    manager.wait_until_finished()
    expected = take(it, 2)
    restored = make()
    manager.restore(1, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(restored)))
    assert take(restored, 2) == expected
