"""Hugging Face Hub ids as model paths: ``org/name``, ``org/name@revision`` and a GGUF file inside
a hub repo (``org/name[@revision]/file.gguf``, also written ``hf://org/name/file.gguf`` or with
``config.model.gguf_file``).

``resolve_hub`` turns such an id into a local folder (or file) through ``huggingface_hub``'s
``snapshot_download``, fetching only what rlx reads: the configs and tokenizer files
(``*.json``, ``*.jinja``), the ``*.safetensors`` weights, or the one GGUF file named. The Hub's
own environment applies: ``HF_HOME`` / ``HF_HUB_CACHE`` (where the cache lives),
``HF_HUB_OFFLINE=1`` (the cache only), ``HF_TOKEN`` or a ``hf auth login`` token (private and
gated repos), ``HF_ENDPOINT`` (a mirror). Every failure is one ``ConfigError`` line naming the
id and what to do. Resolutions are remembered for the life of the process (a run resolves its
path in the config checks, the build and the export).
"""

from __future__ import annotations

import functools
import os
import re

from rlx.errors import ConfigError

# What rlx reads from a HF model repo: config.json, generation_config.json, tokenizer.json,
# tokenizer_config.json, special_tokens_map.json, model.safetensors.index.json, chat_template.jinja
# and the weights (value_head.safetensors of a critic included).
HF_PATTERNS = ("*.json", "*.jinja", "*.safetensors")
INSTALL = 'pip install "huggingface_hub>=1.0"'

_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_HUB_ID = re.compile(rf"^(?P<repo>{_PART}/{_PART})(?:@(?P<rev>[A-Za-z0-9._-]+))?(?:/(?P<file>.+))?$")


def parse_hub_id(path: str) -> tuple[str, str | None, str | None] | None:
    """``(repo_id, revision or None, file in the repo or None)`` when ``path`` reads as a hub id
    (``org/name``, ``org/name@rev``, ``org/name[@rev]/dir/file.gguf``, each optionally after
    ``hf://``), else None. An existing local path is never a hub id; a file inside a repo must be
    a ``.gguf`` file."""
    explicit = path.startswith("hf://")
    rest = path[len("hf://"):] if explicit else path
    if not explicit and (os.path.exists(os.path.expanduser(path)) or path.startswith(("/", ".", "~"))):
        return None
    m = _HUB_ID.match(rest)
    if m is None or (m["file"] is not None and not m["file"].endswith(".gguf")):
        return None
    return m["repo"], m["rev"], m["file"]


def is_hub_id(path: str) -> bool:
    return parse_hub_id(path) is not None


def resolve_hub(path: str) -> str:
    """The local folder (a GGUF file inside a repo: the local file) a hub id stands for,
    downloading what is missing from the cache (see the module docstring)."""
    parsed = parse_hub_id(path)
    if parsed is None:
        raise ConfigError(f"{path!r} is not a Hugging Face Hub id (org/name, org/name@revision or "
                          "org/name/file.gguf)")
    return _resolve(*parsed)


@functools.lru_cache(maxsize=64)
def _resolve(repo: str, revision: str | None, file: str | None) -> str:
    try:
        import huggingface_hub
        from huggingface_hub import errors
    except ImportError:
        raise ConfigError(f"model path {repo!r} is a Hugging Face Hub id, which needs the "
                          f"huggingface_hub package: {INSTALL}") from None
    shown = repo + (f"@{revision}" if revision else "") + (f"/{file}" if file else "")
    patterns = [file] if file else list(HF_PATTERNS)
    try:
        folder = huggingface_hub.snapshot_download(repo, revision=revision, allow_patterns=patterns)
    except errors.GatedRepoError:
        raise ConfigError(f"hub model {shown!r} is gated: accept its terms on its Hub page, then "
                          "set HF_TOKEN (or run `hf auth login`) with an account that has access"
                          ) from None
    except errors.RepositoryNotFoundError:
        raise ConfigError(f"hub model {shown!r} does not exist or is private: check the id, or set "
                          "HF_TOKEN (or run `hf auth login`) for a private repo") from None
    except errors.RevisionNotFoundError:
        raise ConfigError(f"hub model {shown!r}: no revision {revision!r} in {repo!r}; name a "
                          "branch, tag or commit of the repo") from None
    except errors.LocalEntryNotFoundError:
        raise ConfigError(_not_cached(shown, repo)) from None
    except (errors.HfHubHTTPError, OSError) as e:
        raise ConfigError(f"hub model {shown!r} could not be downloaded "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                          ) from None
    return _check(folder, shown, repo, file)


def _not_cached(shown: str, repo: str) -> str:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return (f"hub model {shown!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                f"and HF_HUB_OFFLINE=1 forbids downloading it: run `hf download {repo}` where the "
                "Hub is reachable (same HF_HOME), or unset HF_HUB_OFFLINE")
    return (f"hub model {shown!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
            "the Hub cannot be reached: check the network (or HF_ENDPOINT), or download it once "
            "where the Hub is reachable")


def _check(folder: str, shown: str, repo: str, file: str | None) -> str:
    """The snapshot path, after checking it holds what rlx reads."""
    from huggingface_hub import constants

    if file is not None:
        local = os.path.join(folder, file)
        if not os.path.isfile(local):
            if constants.HF_HUB_OFFLINE:  # the snapshot is cached, but without this file
                raise ConfigError(_not_cached(shown, f"{repo} {file}"))
            raise ConfigError(f"hub model {shown!r}: the repo has no file {file!r}")
        return local
    if not os.path.isfile(os.path.join(folder, "config.json")):
        if constants.HF_HUB_OFFLINE:
            raise ConfigError(_not_cached(shown, repo))
        ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf")) if os.path.isdir(folder) else []
        hint = (f"; for a GGUF repo name its file: {shown}/<file>.gguf (config.model.gguf_file)"
                + (f", e.g. {ggufs[0]}" if ggufs else ""))
        raise ConfigError(f"hub model {shown!r} has no config.json (not a HF transformers model "
                          f"repo, or only partly in the cache){hint}")
    return folder


__all__ = ["HF_PATTERNS", "is_hub_id", "parse_hub_id", "resolve_hub"]
