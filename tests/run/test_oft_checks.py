"""An OFT run's config (``lora.kind="oft"``) is refused in one line where it cannot run: SGLang
(no OFT adapters), a block size that divides no adapted width, a W8A8 serving format, a LoRA
warm start; PEFT's options rlx does not implement (``coft``, ``block_share``,
``module_dropout``, ``r``) are refused by name as unknown fields."""

from __future__ import annotations

import pytest

from rlx.config import parse_config
from rlx.errors import ConfigError
from rlx.models import from_hf_config
from rlx.models.presets import PRESETS
from rlx.rollout.sglang.policy import check_servable
from rlx.run.checks import check_oft
from rlx.run.engines import serving
from tests.helpers.runs import config_dict

QWEN = from_hf_config(PRESETS["Qwen/Qwen2.5-1.5B-Instruct"])  # hidden 1536, MLP 8960


def _tiny(tmp_path, **overrides):
    oft = {"lora.kind": "oft", "lora.oft": {"block_size": 32}}  # fresh: overrides write into it
    return parse_config(config_dict("tiny", tmp_path / "run", **{"mesh": {"data": 8}, **oft,
                                                                 **overrides}))


def _one_line(e: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(e.value)
    return str(e.value)


def test_sglang_is_refused_naming_why(tmp_path):
    cfg = _tiny(tmp_path, **{"rollout.engine": "sglang", "rollout.sglang.urls": ["http://h:1"]})
    with pytest.raises(ConfigError) as e:
        check_servable(serving(cfg), QWEN)
    assert "cannot serve config.lora.kind='oft'" in _one_line(e)
    assert "rollout.engine='jax'" in str(e.value) and "merged export" in str(e.value)


def test_a_block_size_that_divides_no_width_is_refused(tmp_path):
    check_oft(_tiny(tmp_path), QWEN)  # 32 divides 1536 and 8960
    with pytest.raises(ConfigError) as e:
        check_oft(_tiny(tmp_path, **{"lora.oft.block_size": 48}), QWEN)  # 8960 = 186 x 48 + 32
    assert "block_size=48 does not divide" in _one_line(e) and "8960" in str(e.value)


def test_w8a8_serving_and_a_lora_warm_start_are_refused(tmp_path):
    w8a8 = _tiny(tmp_path, **{"quant.serving": "w8a8_int8"})
    with pytest.raises(ConfigError) as e:
        check_oft(w8a8, QWEN)
    assert "quantizes activations" in _one_line(e)
    with pytest.raises(ConfigError) as e:
        _tiny(tmp_path, **{"lora.init_from": str(tmp_path)})
    assert "kind='oft' starts from the identity" in _one_line(e)


@pytest.mark.parametrize("field", ["coft", "block_share", "module_dropout", "r"])
def test_peft_options_rlx_does_not_implement_are_unknown_fields(tmp_path, field):
    with pytest.raises(ConfigError) as e:
        _tiny(tmp_path, **{f"lora.oft.{field}": 1})
    assert field in _one_line(e)


def test_a_gguf_lora_export_of_an_oft_run_is_refused(tmp_path):
    from rlx.run.exporting import check_applies

    check_applies(_tiny(tmp_path), "peft")  # a PEFT OFT folder
    with pytest.raises(ConfigError) as e:
        check_applies(_tiny(tmp_path), "gguf-lora")
    assert "OFT adapter" in _one_line(e) and "--to merged" in str(e.value)
