"""The peers' separate environments (``rlx.bench.peer_envs``): where each is looked for and what
a missing one says. Nothing here creates an environment (that needs the package registry)."""

import pytest

from rlx.bench.peer_envs import ENVS, LLAMA_CPP, TUNIX, main


def test_each_environment_is_cached_by_its_pinned_version():
    assert LLAMA_CPP.default_python.endswith("/.cache/rlx/llama-cpp-0.3.36-noamx/bin/python")
    assert TUNIX.default_python.endswith("/.cache/rlx/tunix-0.1.7/bin/python")
    assert "llama-cpp-python==0.3.36" in LLAMA_CPP.requirements
    assert "google-tunix==0.1.7" in TUNIX.requirements
    assert sorted(ENVS) == ["llama.cpp", "tunix"]
    # llama.cpp's AMX product crashes on the Q4_1 file: built without it, never from a cached wheel
    assert dict(LLAMA_CPP.build_env)["CMAKE_ARGS"].count("-mno-amx-tile -mno-amx-int8") == 2
    assert TUNIX.build_env == ()


def test_the_interpreter_comes_from_the_flag_then_the_variable_then_the_cache(monkeypatch):
    monkeypatch.delenv("RLX_TUNIX_PYTHON", raising=False)
    assert TUNIX.interpreter() == TUNIX.default_python
    monkeypatch.setenv("RLX_TUNIX_PYTHON", "/from/variable/python")
    assert TUNIX.variable == "RLX_TUNIX_PYTHON" and LLAMA_CPP.variable == "RLX_LLAMA_CPP_PYTHON"
    assert TUNIX.interpreter() == "/from/variable/python"
    assert TUNIX.interpreter("/from/flag/python") == "/from/flag/python"


def test_a_missing_environment_names_the_command_that_creates_it(tmp_path):
    missing = str(tmp_path / "python")
    assert LLAMA_CPP.unavailable(missing) == (
        f"no llama.cpp environment at {missing}: create it with "
        "`python -m rlx.bench.peer_envs llama.cpp` or set $RLX_LLAMA_CPP_PYTHON")
    (tmp_path / "python").write_text("")
    assert LLAMA_CPP.unavailable(missing) is None


def test_the_command_line_refuses_an_unknown_peer(capsys):
    with pytest.raises(SystemExit) as e:
        main(["vllm"])
    assert e.value.code == 2 and "invalid choice: 'vllm'" in capsys.readouterr().err
