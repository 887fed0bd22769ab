"""The command line of every rlx command that takes a run's config (``rlx.launch``, ``rlx.plan``,
``rlx.eval``): ``--config configs/X.py[:VARIANT]`` and its ``--config.FIELD=VALUE`` overrides, read
as ml_collections' ``config_flags`` reads them over the run config's defaults (any field of
``rlx.config.RunConfig`` may be overridden, whatever the file lists), with one-line errors naming
what is wrong and, for an unknown field, the closest one; ``--help`` and a reader that closes the
output early (``--help | head``) end with exit status 0 and no traceback."""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections
from absl import app, flags
from ml_collections import config_dict, config_flags

from rlx.errors import ConfigError

# an override (--config.a.b=v, --config.a.b v, --noconfig.a.b); the flag absl's errors name
_OVERRIDE = re.compile(r"^-{1,2}(?:no)?config\.([^=]+)")
_FLAG_IN_ERROR = re.compile(r"flag --(?:no)?config\.([^=:\s]+)")
HELP = ("-h", "-help", "--help", "-?", "--helpshort", "--helpfull")


def find_config_file(path: str) -> str | None:
    """``path`` where it is; else, for a relative path, inside the source tree rlx is imported from
    (an editable install: ``configs/X.py`` from any folder); else None."""
    if os.path.isfile(path):
        return path
    tree = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    inside = os.path.join(tree, path)
    return inside if not os.path.isabs(path) and os.path.isfile(inside) else None


def load_config_file(spec: str) -> ml_collections.ConfigDict:
    """``configs/X.py``: its ``get_config()``; ``configs/X.py:VARIANT``: ``get_config("VARIANT")``
    (ml_collections' convention for a file's variants); the file found by ``find_config_file``.
    Raises ``ConfigError`` for a missing file, a file without ``get_config`` or variants, or a
    variant the file refuses."""
    given, colon, variant = spec.partition(":")
    path = find_config_file(given)
    if path is None:
        raise ConfigError(f"--config {spec}: no file {given!r}; name a configs/*.py file")
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


def with_defaults(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The run config's defaults (``rlx.config.schema_fields``) under the file's values, so that an
    override may set any field whatever the file lists. Each value is held as its field's type
    (a float field's int as a float, an optional field's None as a typed placeholder), which is
    the type ``config_flags`` reads its override as. Keys outside the schema (a planner's ``plan``
    section) stay as the file sets them."""
    from rlx.config import schema_fields

    data = cfg.to_dict()
    for dotted, (tp, default) in schema_fields().items():
        *sections, leaf = dotted.split(".")
        node = data
        for key in sections:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):  # a section set to a value: parse_config names it
                break
        else:
            node[leaf] = _as_field_type(tp, node.get(leaf, default))
    return ml_collections.ConfigDict(data)


def _as_field_type(tp: Any, value: Any) -> Any:
    if value is None and typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = next(a for a in typing.get_args(tp) if a is not type(None))
        return config_dict.placeholder(inner)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _leaf_fields(node: Any, prefix: str = "") -> list[str]:
    if not isinstance(node, ml_collections.ConfigDict):
        return [prefix]
    return [f for key in node for f in _leaf_fields(node[key], f"{prefix}{'.' * bool(prefix)}{key}")]


def closest_field(cfg: ml_collections.ConfigDict, dotted: str, listed: Sequence[str] = ()) -> str:
    """The field of ``cfg`` an unknown ``dotted`` name most likely meant: the same name in another
    section (``train.temperature``: ``rollout.temperature``), a name it abbreviates by initials
    (``train.lr``: ``optim.learning_rate``), a near spelling in its section (``train.stepz``:
    ``train.steps``), else the nearest dotted name. Among equals, those in the same section,
    then those the file ``listed``; more than one: "config.a or config.b"."""
    fields = _leaf_fields(cfg)
    section, _, key = dotted.rpartition(".")
    leaf = {f: f.rpartition(".")[2] for f in fields}
    same = [f for f in fields if leaf[f] == key]
    initials = [f for f in fields if len(key) > 1 and "_" in leaf[f]
                and "".join(w[:1] for w in leaf[f].split("_")) == key]
    for found in (same, initials):
        if found:
            rank = {f: (f.rpartition(".")[0] != section, f not in listed) for f in found}
            return " or config.".join(f for f in found if rank[f] == min(rank.values()))
    near = difflib.get_close_matches(key, [leaf[f] for f in fields if f.rpartition(".")[0] == section],
                                     n=1, cutoff=0.6)
    if near:
        return f"{section}.{near[0]}" if section else near[0]
    return difflib.get_close_matches(dotted, fields, n=1, cutoff=0.0)[0]


def _check_override(cfg: ml_collections.ConfigDict, dotted: str, listed: Sequence[str]) -> None:
    """An override sets a field (not a section) of the run config or of the file (whose fields
    are ``listed``)."""
    node, path = cfg, "config"
    for key in dotted.split("."):
        if not isinstance(node, ml_collections.ConfigDict):
            raise ConfigError(f"--config.{dotted}: {path} is no section (it is the value {node!r})")
        if key not in node:
            raise ConfigError(f"unknown key {path}.{key} (--config.{dotted}): no such field; the "
                              f"closest is config.{closest_field(cfg, dotted, listed)}")
        node, path = node[key], f"{path}.{key}"
    if isinstance(node, ml_collections.ConfigDict):
        raise ConfigError(f"--config.{dotted}: {path} is a section; override its fields "
                          f"(--{path}.FIELD=VALUE)")


def _override_error(cfg: ml_collections.ConfigDict, error: Exception) -> str:
    """absl's refusal of an override's value, one line, with the field's value and its type."""
    text = " ".join(str(error).split())
    found = _FLAG_IN_ERROR.search(text)
    if found is None:
        return text
    value = cfg
    for key in found.group(1).split("."):
        value = value[key]
    kind = "" if value is None else f" ({type(value).__name__})"
    return f"{text}; config.{found.group(1)} is {value!r}{kind}"


def config_from_argv(argv: Sequence[str]) -> tuple[ml_collections.ConfigDict | None, list[str]]:
    """(The config of ``--config configs/X.py[:VARIANT]`` (``load_config_file``; None without one)
    over the run config's defaults (``with_defaults``), with its ``--config.a.b=v`` overrides
    applied by ml_collections' ``config_flags``, each read as its field's type; the arguments left
    for the command's own parser). A file that does not load, an override of an unknown field, of
    a section, or of the wrong type: a one-line ``ConfigError``."""
    spec, rest = _split_config_path(argv)
    if spec is None:
        if any(_OVERRIDE.match(a) for a in rest):
            raise ConfigError("--config.FIELD=VALUE overrides need the file: --config configs/X.py")
        return None, rest
    from_file = load_config_file(spec)
    cfg, listed = with_defaults(from_file), _leaf_fields(from_file)
    for arg in rest:
        if found := _OVERRIDE.match(arg):
            _check_override(cfg, found.group(1), listed)
    command = ["rlx", *rest]
    values = flags.FlagValues()  # this command line's own: nothing global is defined
    try:
        holder = config_flags.DEFINE_config_dict("config", cfg, flag_values=values,
                                                 sys_argv=command, lock_config=True)
        left = values(command, known_only=True)
    except (flags.Error, TypeError, ValueError) as e:
        raise ConfigError(_override_error(cfg, e)) from None
    return holder.value, left[1:]


def print_help(write: Callable[[], Any]) -> None:
    """``write`` the help to standard output and exit with status 0, also when the reader stopped
    reading early (``--help | head``)."""
    end_output(write)
    sys.exit(0)


def end_output(write: Callable[[], Any]) -> Any:
    """``write()``'s result (or the status it exited with), standard output flushed; a reader that
    closed it early (``| head``) took what it wanted: the rest goes nowhere, with no
    ``BrokenPipeError`` traceback, and the result is None."""
    try:
        try:
            result = write()
        except SystemExit as e:
            result = e.code
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return None
    return result


def absl_flags_parser(prog: str) -> Callable[[list[str]], tuple[Any, list[str]]]:
    """``absl.app.run``'s ``flags_parser`` for a command taking a config: ``main`` receives (the
    config of ``config_from_argv``, the positional arguments), absl's flags (the command's own)
    read from the rest. ``--help``: the command's docstring and flags, exit status 0. A bad config
    file or override, or none: one line on stderr, exit status 2."""
    def parse(argv: list[str]) -> tuple[Any, list[str]]:
        if any(a in HELP for a in argv[1:]):
            print_help(lambda: app.usage(shorthelp="--helpfull" not in argv, writeto_stdout=True))
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
