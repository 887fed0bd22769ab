"""The command line of every rlx command that takes a run's config (``rlx.launch``, ``rlx.plan``,
``rlx.eval``): ``--config configs/X.py[:VARIANT]`` and its ``--config.FIELD=VALUE`` overrides, read
as ml_collections' ``config_flags`` reads them, with one-line errors naming what is wrong."""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections
from absl import app, flags
from ml_collections import config_flags

from rlx.errors import ConfigError

# an override (--config.a.b=v, --config.a.b v, --noconfig.a.b); the flag absl's errors name
_OVERRIDE = re.compile(r"^-{1,2}(?:no)?config\.([^=]+)")
_FLAG_IN_ERROR = re.compile(r"flag --(?:no)?config\.([^=:\s]+)")


def load_config_file(spec: str) -> ml_collections.ConfigDict:
    """``configs/X.py``: its ``get_config()``; ``configs/X.py:VARIANT``: ``get_config("VARIANT")``
    (ml_collections' convention for a file's variants). Raises ``ConfigError`` for a missing file,
    a file without ``get_config`` or variants, or a variant the file refuses."""
    path, colon, variant = spec.partition(":")
    if not os.path.isfile(path):
        raise ConfigError(f"--config {spec}: no file {path!r}; name a configs/*.py file")
    module_spec = importlib.util.spec_from_file_location("rlx_config_file", path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"--config {spec}: cannot import {path!r} as Python")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    get_config = getattr(module, "get_config", None)
    if get_config is None:
        raise ConfigError(f"--config {spec}: {path} defines no get_config()")
    if colon and not inspect.signature(get_config).parameters:
        raise ConfigError(f"--config {spec}: {path} has no variants (its get_config() takes no "
                          f"argument); drop ':{variant}'")
    try:
        cfg = get_config(variant) if colon else get_config()
    except ValueError as e:  # a variant the file does not define, in the file's own words
        raise ConfigError(f"--config {spec}: {e}") from None
    return cfg if isinstance(cfg, ml_collections.ConfigDict) else ml_collections.ConfigDict(cfg)


def _split_config_path(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """(the value of ``--config PATH`` / ``--config=PATH``, the other arguments)."""
    spec, rest, args = None, [], iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        if name not in ("-config", "--config"):
            rest.append(arg)
            continue
        value = value if eq else next(args, "")
        if not value or spec is not None:
            raise ConfigError("--config takes one file, once: --config configs/X.py")
        spec = value
    return spec, rest


def _check_override(cfg: ml_collections.ConfigDict, dotted: str, spec: str) -> None:
    """An override sets a field (not a section) that the config file sets: the config is locked."""
    node, path = cfg, "config"
    for key in dotted.split("."):
        if not isinstance(node, ml_collections.ConfigDict):
            raise ConfigError(f"--config.{dotted}: {path} is no section ({spec} sets {node!r})")
        if key not in node:
            raise ConfigError(f"unknown key {path}.{key} (--config.{dotted}); {spec} sets "
                              f"{path}: {sorted(node)}; an override changes a field the file sets")
        node, path = node[key], f"{path}.{key}"
    if isinstance(node, ml_collections.ConfigDict):
        raise ConfigError(f"--config.{dotted}: {path} is a section; override its fields "
                          f"(--{path}.FIELD=VALUE)")


def _override_error(cfg: ml_collections.ConfigDict, error: Exception, spec: str) -> str:
    """absl's refusal of an override's value, one line, with the file's value and its type."""
    text = " ".join(str(error).split())
    found = _FLAG_IN_ERROR.search(text)
    if found is None:
        return text
    value = cfg
    for key in found.group(1).split("."):
        value = value[key]
    return f"{text}; {spec} sets config.{found.group(1)}={value!r} ({type(value).__name__})"


def config_from_argv(argv: Sequence[str]) -> tuple[ml_collections.ConfigDict | None, list[str]]:
    """(The config of ``--config configs/X.py[:VARIANT]`` (``load_config_file``; None without one)
    with its ``--config.a.b=v`` overrides applied by ml_collections' ``config_flags``, each read as
    the type of the file's value; the arguments left for the command's own parser). A file that
    does not load, an override of a field the file does not set or of the wrong type: a
    one-line ``ConfigError``."""
    spec, rest = _split_config_path(argv)
    if spec is None:
        if any(_OVERRIDE.match(a) for a in rest):
            raise ConfigError("--config.FIELD=VALUE overrides need the file: --config configs/X.py")
        return None, rest
    cfg = load_config_file(spec)
    for arg in rest:
        if found := _OVERRIDE.match(arg):
            _check_override(cfg, found.group(1), spec)
    command = ["rlx", *rest]
    values = flags.FlagValues()  # this command line's own: nothing global is defined
    try:
        holder = config_flags.DEFINE_config_dict("config", cfg, flag_values=values,
                                                 sys_argv=command, lock_config=True)
        left = values(command, known_only=True)
    except (flags.Error, TypeError, ValueError) as e:
        raise ConfigError(_override_error(cfg, e, spec)) from None
    return holder.value, left[1:]


def absl_flags_parser(prog: str) -> Callable[[list[str]], tuple[Any, list[str]]]:
    """``absl.app.run``'s ``flags_parser`` for a command taking a config: ``main`` receives (the
    config of ``config_from_argv``, the positional arguments), absl's flags (``--help``, the
    command's own) read from the rest. A bad config file or override, or none: one line on
    stderr, exit status 2."""
    def parse(argv: list[str]) -> tuple[Any, list[str]]:
        try:
            cfg, rest = config_from_argv(argv[1:])
        except ConfigError as e:
            print(f"{prog}: config error: {e}", file=sys.stderr)
            sys.exit(2)
        rest = app.parse_flags_with_usage(argv[:1] + rest)  # its errors: exit status 1
        if cfg is None:
            print(f"{prog}: config error: give the run's config file: --config configs/X.py",
                  file=sys.stderr)
            sys.exit(2)
        return cfg, rest[1:]
    return parse
