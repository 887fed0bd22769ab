"""One SGLang server (CPU, LoRA enabled) shared by every ``sglang`` benchmark smoke test.

It serves rlx's export of the benchmarks' tiny model; each benchmark attached to it loads its own
export first (``--sglang-url``), so the tests do not depend on what another test left loaded.
"""

import os

import pytest

from tests.helpers.sglang_harness import SGLANG_PYTHON, cpu_server_args, cpu_server_env, sglang_available

LORA_RANK = 4


@pytest.fixture(scope="package")  # stopped once tests/bench is done
def sglang_url(tmp_path_factory):
    if not sglang_available():
        pytest.skip(f"no SGLang at {SGLANG_PYTHON}")
    from rlx.bench.workloads import export_hf, smollm2_config
    from rlx.rollout.sglang.server import SGLangServer, ServerSpec

    root = str(tmp_path_factory.mktemp("bench-sglang"))
    folder = os.path.join(root, "tiny-hf")
    export_hf("tiny", folder, smollm2_config())
    spec = ServerSpec(python=SGLANG_PYTHON, model_path=folder,
                      extra_args=cpu_server_args(LORA_RANK) + ("--skip-tokenizer-init",),
                      env=cpu_server_env(os.path.join(root, "harness")),
                      log_path=os.path.join(root, "server.log"))
    with SGLangServer(spec) as server:
        yield server.url
