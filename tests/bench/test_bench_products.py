"""``python -m rlx.bench products`` at tiny sizes: every side runs, the table and JSON carry the
figures. No timing assertions."""

import json

from rlx.bench.products import HEADER, SIDES, Shapes, main, model_shapes


def test_products_bench_tiny(tmp_path, capsys):
    path = tmp_path / "products.json"
    assert main(["--model", "tiny", "--batch", "4", "--steps", "2", "--repeats", "1",
                 "--warmup", "0", "--json", str(path)]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert table[0] == "| " + " | ".join(HEADER) + " |" and len(table) == 2 + len(SIDES)
    record = json.loads(path.read_text())
    assert [row[0] for row in record["rows"]] == list(SIDES) and SIDES[-1] == "torch"
    assert record["rows"][-1][4] == "1.00x"
    for side in SIDES:
        (run,) = record["runs"][side]
        assert run["steps"] == 2 and run["seconds"] > 0


def test_products_flops_count_every_projection_and_the_head():
    s = model_shapes("smollm2")
    assert (s.layers, s.hidden, s.q_width, s.kv_width, s.intermediate, s.vocab) == (
        30, 576, 576, 192, 1536, 49152)
    # SmolLM2-135M: 30 x (2 x 576^2 + 2 x 576 x 192 + 3 x 576 x 1536) + 576 x 49152 products
    assert s.flops(1) == 2 * (30 * (2 * 576 ** 2 + 2 * 576 * 192 + 3 * 576 * 1536) + 576 * 49152)
    assert Shapes(1, 2, 2, 2, 2, 2).flops(3) == 2 * 3 * (7 * 4 + 4)
