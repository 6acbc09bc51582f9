"""The config machinery: field metadata, strict validation, override checks and Hydra's compose API.

Each config group's dataclass lives with the code it configures (`circuitkit.models.config`,
`circuitkit.discovery.config`, `gradian.settings`, `circuitkit.preflight.config`,
`circuitkit_app.report.config`); the root that holds them all, `AppConfig`, is the entry layer's
(`circuitkit_app.config`), which binds this machinery to it (`RootSchema`). A field is declared
with `_f` (its doc, choices and range in the metadata), which validation, docs/configuration.md and
the command-line flags that mirror a key (`add_schema_flag`) all read.

Validation is strict: an unknown key, a wrong type or an out-of-range value raises
:class:`ConfigError` naming the key, the value and what is allowed, before any work starts.
Overrides are checked before Hydra composes (so `discovery.memory_efficient=true` gets our
message, not Hydra's), and the composed config is checked again (choices, ranges, cross-field rules).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from circuitkit.core.errors import EXIT_USAGE, UserError
from circuitkit.core.flags import bounded

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


class ConfigError(UserError, ValueError):
    """A configuration value or key that cannot be used; the message says what to change."""

    exit_code = EXIT_USAGE


def _f(default: Any, doc: str, *, choices: Iterable[Any] | None = None, ge: float | None = None,
       gt: float | None = None, lt: float | None = None, le: float | None = None, finite: bool = True) -> Any:
    """A dataclass field with its documentation and allowed values in the metadata.

    finite: a float key refuses NaN and ±infinity unless this is False (its doc then says what they mean).
    """
    meta = {"doc": doc, "choices": tuple(choices) if choices else None, "ge": ge, "gt": gt, "lt": lt, "le": le,
            "finite": finite}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def choices(schema: type, key: str) -> tuple[Any, ...]:
    """The allowed values of `key` in the dataclass `schema` (its field's `choices`): the one
    list that validation, argument parsers and the code that branches on the value all read."""
    for f in dataclasses.fields(schema):
        if f.name == key and f.metadata.get("choices"):
            return f.metadata["choices"]
    raise KeyError(f"{schema.__name__}.{key} has no choices")



# --------------------------------------------------------------------------- validation

def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _describe_allowed(tp: Any, optional: bool, meta: Mapping[str, Any]) -> str:
    if tp is Any:  # the free-form placement keys
        return "null, a name or a mapping (see below)"
    parts = []
    if meta.get("choices"):
        parts.append("one of " + ", ".join(repr(c) for c in meta["choices"]))
    else:
        name = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp)
        if typing.get_origin(tp) is list:
            name = {(int,): "a list of integers", (float,): "a list of numbers"}.get(typing.get_args(tp),
                                                                                 "a list of strings")
        parts.append(name or str(tp))
    bounds = []
    if meta.get("ge") is not None:
        bounds.append(f">= {meta['ge']}")
    if meta.get("gt") is not None:
        bounds.append(f"> {meta['gt']}")
    if meta.get("le") is not None:
        bounds.append(f"<= {meta['le']}")
    if meta.get("lt") is not None:
        bounds.append(f"< {meta['lt']}")
    if bounds:
        parts.append(" and ".join(bounds))
    if optional:
        parts.append("or null")
    return " ".join(parts)


def _find_leaf_elsewhere(name: str, cls: type, prefix: str = "") -> list[str]:
    """Full paths of schema keys called `name` anywhere in the schema."""
    found = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        if f.name == name:
            found.append(path)
        tp, _ = _unwrap_optional(_type_hints(cls)[f.name])
        if dataclasses.is_dataclass(tp):
            found.extend(_find_leaf_elsewhere(name, tp, path + "."))
    return found


def unknown_key_error(path: str, cls: type, root: type | None = None) -> ConfigError:
    """The error for `path` whose last part is not a field of `cls`; with `root` (the schema `path`
    starts from), a key of that name elsewhere in it is named."""
    block, _, key = path.rpartition(".")
    valid = [f.name for f in dataclasses.fields(cls)]
    where = f"'{block}'" if block else "the top level"
    msg = f"Unknown config key '{path}': '{key}' is not a key of {where}."
    elsewhere = [p for p in _find_leaf_elsewhere(key, root) if p != path] if root is not None else []
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if elsewhere:
        msg += f" '{key}' belongs at {' or '.join(elsewhere)}: set it there instead."
    elif close:
        prefix = f"{block}." if block else ""
        msg += f" Did you mean '{prefix}{close[0]}'?"
    msg += f" Valid keys of {where}: {', '.join(valid)}."
    if key in ("memory_efficient", "use_half_precision_activations"):
        msg += (" This key does nothing in CircuitKit (older docs of similar tools accept it silently);"
                " what lowers the attribution peak is discovery.batch_size first, then"
                " discovery.data_params.seq_len, discovery.level=node and model.precision"
                " (ig_steps and num_examples change the time, not the peak; see docs/memory.md).")
    return ConfigError(msg)


def _is_finite(value: float) -> bool:
    """NaN, ±inf and an integer beyond float's range are not finite."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _check_value(path: str, value: Any, tp: Any, meta: Mapping[str, Any]) -> Any:
    """Validate one leaf value; returns it (ints accepted for floats)."""
    if tp is Any:  # free-form keys (model.device_map, model.max_memory): checked by their owner (circuitkit.models.config.check_placement)
        return value
    base, optional = _unwrap_optional(tp)
    allowed = _describe_allowed(base, optional, meta)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"Config key '{path}' is null, but it must be {allowed}.")
    if typing.get_origin(base) is list:
        if not isinstance(value, (list, tuple, ListConfig)):
            raise ConfigError(f"Config key '{path}' = {value!r} must be {allowed}.")
        items = list(value)
        item_type = (typing.get_args(base) or (str,))[0]
        for item in items:
            if item_type is int and (not isinstance(item, int) or isinstance(item, bool)):
                raise ConfigError(f"Config key '{path}' contains {item!r} ({type(item).__name__});"
                                  f" it must be {allowed}.")
            if item_type is str and not isinstance(item, str):
                raise ConfigError(f"Config key '{path}' contains {item!r} ({type(item).__name__});"
                                  f" it must be {allowed}.")
            if meta.get("choices") and item not in meta["choices"]:
                raise ConfigError(f"Config key '{path}' contains {item!r}; each entry must be {allowed}.")
        return items
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(base, True)
    if not ok:
        raise ConfigError(f"Config key '{path}' = {value!r} ({type(value).__name__}) has the wrong type;"
                          f" it must be {allowed}.")
    if base is float and meta.get("finite", True) and not _is_finite(value):
        raise ConfigError(f"Config key '{path}' = {value!r} is not a finite number; it must be {allowed} (NaN and"
                          " infinity are refused: give a number).")
    if meta.get("choices") and value not in meta["choices"]:
        close = difflib.get_close_matches(str(value), [str(c) for c in meta["choices"]], n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"Config key '{path}' = {value!r} is not allowed; it must be {allowed}.{hint}")
    for bound, test in (("ge", lambda v, b: v >= b), ("gt", lambda v, b: v > b),
                        ("le", lambda v, b: v <= b), ("lt", lambda v, b: v < b)):
        if meta.get(bound) is not None and not test(value, meta[bound]):
            raise ConfigError(f"Config key '{path}' = {value!r} is out of range; it must be {allowed}.")
    return float(value) if base is float else value


def validate_block(data: Mapping[str, Any], cls: type, prefix: str = "", root: type | None = None) -> Any:
    """`data` (a plain dict) checked against the dataclass `cls` and returned as one: keys, types,
    choices and ranges, nested blocks included; missing keys take the defaults. prefix: the block's
    path in the config (`model.`), for the messages; root: the whole schema, to name a misplaced key."""
    hints = _type_hints(cls)
    names = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise unknown_key_error(f"{prefix}{key}", cls, root)
    kwargs = {}
    for name, f in names.items():
        path = f"{prefix}{name}"
        tp, optional = _unwrap_optional(hints[name])
        if name not in data:
            continue
        value = data[name]
        if dataclasses.is_dataclass(tp):
            if value is None and optional:
                kwargs[name] = None
                continue
            if not isinstance(value, Mapping):
                raise ConfigError(f"Config key '{path}' = {value!r} must be a block of keys"
                                  f" ({', '.join(x.name for x in dataclasses.fields(tp))}).")
            kwargs[name] = validate_block(value, tp, path + ".", root)
        else:
            kwargs[name] = _check_value(path, value, hints[name], f.metadata)
    return cls(**kwargs)



def config_error_from_omegaconf(err: OmegaConfBaseException) -> ConfigError:
    """One line for an OmegaConf error (an interpolation that does not resolve, a bad type)."""
    key = getattr(err, "full_key", None)
    text = str(getattr(err, "msg", None) or err).splitlines()[0].strip()
    where = f"Config key '{key}'" if key else "The config"
    if "nterpolation" in type(err).__name__ or "${" in text:
        return ConfigError(f"{where} has an interpolation that cannot be resolved ({text}); write the value"
                           " itself, or ${other.key} naming an existing key.")
    return ConfigError(f"{where}: {text}.")


def _parse_overrides(overrides: list[str]) -> list:
    """Hydra's parse of the overrides; ConfigError naming the one that does not parse."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    out = []
    for text in overrides:
        try:
            out.extend(parser.parse_overrides([text]))
        except HydraException as err:
            detail = str(err).splitlines()[0].strip()
            raise ConfigError(f"Override {text!r} is not valid override syntax ({detail}). Write key=value;"
                              " quote values with brackets, commas or spaces in the shell, e.g."
                              " 'stages=[data,attribution]'.") from None
    return out


def _schema_at(path: list[str], root: type) -> tuple[type | None, Any, Mapping[str, Any] | None]:
    """Walk the schema `root` along `path`; returns (block class, leaf type, leaf metadata)."""
    cls: type = root
    for i, part in enumerate(path):
        names = {f.name: f for f in dataclasses.fields(cls)}
        if part not in names:
            raise unknown_key_error(".".join(path[: i + 1]), cls, root)
        tp, _ = _unwrap_optional(_type_hints(cls)[part])
        if i == len(path) - 1:
            return cls, _type_hints(cls)[part], names[part].metadata
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(f"Config key '{'.'.join(path[: i + 1])}' is a value, not a block;"
                              f" '{'.'.join(path)}' does not exist.")
        cls = tp
    return cls, None, None


def _check_group_choice(group: str, values: list[Any]) -> None:
    """A group choice (`model=gpt2`) must name a file of conf/<group>/ (each value of a sweep too,
    so a sweep with one bad option stops before any job instead of in the middle)."""
    options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
    for value in values:
        if value is not None and str(value) not in options:
            close = difflib.get_close_matches(str(value), options, n=1)
            hint = f" Did you mean {group}={close[0]}?" if close else ""
            raise ConfigError(f"'{group}={value}' names no config file conf/{group}/{value}.yaml; options:"
                              f" {', '.join(options)}.{hint}")


def _unquoted(value: Any) -> Any:
    """A parsed override element as the job will get it: quoted strings (Hydra's QuotedString, also
    inside lists and dicts) as their text."""
    from hydra.core.override_parser.types import QuotedString

    if isinstance(value, QuotedString):
        return value.text
    if isinstance(value, list):
        return [_unquoted(v) for v in value]
    if isinstance(value, dict):
        return {k: _unquoted(v) for k, v in value.items()}
    return value


def _yaml_error(err: Exception) -> ConfigError:
    """One line for a YAML syntax error: the file, line and column, and what the parser expected."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or " ".join(str(err).split())
    where = f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "a config file"
    context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and start is not None and mark is not None and start.line != mark.line:
        problem += f" ({context} from line {start.line + 1}, column {start.column + 1})"
    return ConfigError(f"YAML syntax error in {where}: {problem}; fix the file (quote values with ':', '[' or '{{').")


def _missing_config(config_name: str, config_dir: str | None) -> ConfigError:
    dirs = [Path(config_dir).expanduser()] if config_dir else []
    dirs.append(CONF_DIR)
    options = sorted({p.stem for d in dirs if d.is_dir() for p in d.glob("*.yaml")})
    close = difflib.get_close_matches(config_name, options, n=1)
    hint = f" Did you mean --config-name {close[0]}?" if close else ""
    return ConfigError(f"--config-name {config_name}: there is no {config_name}.yaml in"
                       f" {' or '.join(str(d) for d in dirs)} (add --config-dir DIR for your own); configs there:"
                       f" {', '.join(options) or 'none'}.{hint}")


def _hydra_compose(overrides: list[str], config_name: str, root: type, with_hydra: bool, keep: bool = False,
                   config_dir: str | None = None) -> DictConfig:
    """Hydra's compose API on conf/, its errors turned into ConfigError naming the problem (`root`:
    the schema registered as `schema`, for a config file's unknown key).

    with_hydra: include the `hydra` block (run and sweep dirs). keep: leave Hydra's global
    state initialized afterwards (as `compose` always has), else clear it. config_dir: a user's
    directory of configs (`--config-dir`), searched for `config_name` first, with conf/ behind it
    for the groups and defaults it names.
    """
    import yaml
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException, MissingConfigException

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    primary = str(CONF_DIR)
    if config_dir is not None:
        user_dir = Path(config_dir).expanduser().resolve()
        if not user_dir.is_dir():
            raise ConfigError(f"--config-dir {config_dir}: {user_dir} is not a directory; give the directory that"
                              " holds your .yaml config.")
        if (user_dir / f"{config_name}.yaml").is_file():  # else conf/ holds it: Hydra's CLI finds it there too
            primary = str(user_dir)
            overrides = [*overrides, f"hydra.searchpath=[file://{CONF_DIR}]"]
    try:
        with initialize_config_dir(config_dir=primary, version_base="1.3"):
            return hydra_compose(config_name=config_name, overrides=overrides, return_hydra_config=with_hydra)
    except yaml.YAMLError as err:
        raise _yaml_error(err) from None
    except OmegaConfBaseException as err:
        raise config_error_from_omegaconf(err) from None
    except MissingConfigException as err:
        if "primary config" in str(err):
            raise _missing_config(config_name, config_dir) from None
        raise ConfigError(" ".join(str(err).split())) from None
    except HydraException as err:  # e.g. a group option that does not exist (model=nope)
        raise _unknown_key_in_file(err, [primary, str(CONF_DIR)], root) or ConfigError(" ".join(str(err).split())) from None
    finally:
        if not keep:
            GlobalHydra.instance().clear()


def _unknown_key_in_file(err: Exception, dirs: list[str], root: type) -> ConfigError | None:
    """Hydra's "In 'X': ConfigKeyError raised while composing config" (a config file sets a key the
    schema lacks) as the sentence of `unknown_key_error`, after the file's path; None otherwise."""
    import re

    from omegaconf.errors import ConfigKeyError

    cause = err.__cause__ or err.__context__
    key = getattr(cause, "full_key", None)
    if not isinstance(cause, ConfigKeyError) or not key:
        return None
    try:
        _schema_at(str(key).split("."), root)
    except ConfigError as unknown:
        found = re.match(r"In '([^']+)'", str(err))
        name = found.group(1) if found else None
        files = [Path(d) / f"{name}.yaml" for d in dirs] if name else []
        where = next((str(f) for f in files if f.is_file()), f"{name}.yaml" if name else "a config file")
        return ConfigError(f"{where}: {unknown}")
    return None


@dataclass(frozen=True)
class RootSchema:
    """The root of a config tree (conf/config.yaml's `schema`): its dataclass, whose dataclass fields
    are the config groups, and the rules that read several of its sections (`cross_check`, run after
    every key has passed on its own). The entry layer binds it to AppConfig (circuitkit_app.config).
    """

    cls: type
    cross_check: Callable[[Any], None] = lambda cfg: None

    @property
    def groups(self) -> tuple[str, ...]:
        """The config groups: the fields that are blocks (model, discovery, ...), each a folder of conf/."""
        hints = _type_hints(self.cls)
        return tuple(f.name for f in dataclasses.fields(self.cls) if dataclasses.is_dataclass(_unwrap_optional(hints[f.name])[0]))

    def validate(self, cfg: DictConfig | Mapping[str, Any] | Any) -> Any:
        """Check a composed config (or a plain dict shaped like it, or an instance) and return it typed.

        Missing keys take the schema defaults; anything unknown, mistyped or out of range raises
        ConfigError naming the key, the value and what is allowed.
        """
        try:
            if isinstance(cfg, self.cls):
                cfg = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
            elif isinstance(cfg, DictConfig):
                cfg = OmegaConf.to_container(cfg, resolve=True)
        except OmegaConfBaseException as err:
            raise config_error_from_omegaconf(err) from None
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"A config must be a mapping of groups to keys, got {type(cfg).__name__}.")
        data = {k: v for k, v in cfg.items() if k != "hydra"}
        typed = validate_block(data, self.cls, "", self.cls)
        self.cross_check(typed)
        return typed

    def check_overrides(self, overrides: Iterable[str], ranges: bool = True) -> None:
        """Validate command-line overrides against the schema before Hydra composes them.

        Group choices (`model=gpt2`) are left to Hydra, which lists the available options;
        `hydra.*` overrides are Hydra's own. Every other key must exist in the schema and its
        value (each value of a sweep) must have the right type and, with `ranges`, be an allowed
        choice in range. A sweep passes ranges=False: one job's out-of-range value fails that
        job alone, not the sweep.
        """
        parsed = _parse_overrides(list(overrides))
        for ov in parsed:
            key = ov.key_or_group
            if key.startswith(("hydra.", "hydra/")) or key == "hydra" or ov.is_delete():
                continue
            parts = key.split(".")
            if len(parts) == 1 and parts[0] in self.groups and ov.package is None:
                _check_group_choice(key, list(ov.sweep_iterator()) if ov.is_sweep_override() else [ov.value()])
                continue
            _, leaf_tp, meta = _schema_at(parts, self.cls)
            if leaf_tp is None or meta is None:
                continue
            base, _ = _unwrap_optional(leaf_tp)
            if dataclasses.is_dataclass(base):
                continue
            # A sweep's elements come raw (a quoted value is a QuotedString): unquote them as Hydra does for a job.
            values = ([_unquoted(v) for v in ov.sweep_iterator()] if ov.is_sweep_override() else [ov.value()])
            if not ranges:
                meta = {"doc": meta.get("doc"), "finite": False}  # NaN / inf: out of range, the job's own error
            for v in values:
                _check_value(key, v, leaf_tp, meta)

    def compose(self, overrides: Iterable[str] = (), config_name: str = "config") -> tuple[DictConfig, Any]:
        """Compose the config like `python -m circuitkit.run` would, with Hydra's compose API.

        Returns the composed DictConfig and its validated root.
        """
        overrides = list(overrides)
        self.check_overrides(overrides)
        cfg = _hydra_compose(overrides, config_name, self.cls, with_hydra=False, keep=True)
        return cfg, self.validate(cfg)

    def compose_with_run_dir(self, overrides: Iterable[str], config_name: str = "config",
                             config_dir: str | None = None) -> tuple[Any, str]:
        """One composition that gives what `compose` validates and `hydra.run.dir` resolved now,
        so a single run is checked before Hydra creates its directory (a composition takes
        seconds on a busy machine: one, not two)."""
        overrides = list(overrides)
        self.check_overrides(overrides)
        cfg = _hydra_compose(overrides, config_name, self.cls, with_hydra=True, config_dir=config_dir)
        try:
            run_dir = str(OmegaConf.select(cfg, "hydra.run.dir", throw_on_resolution_failure=True))
            typed = self.validate(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]))
        except OmegaConfBaseException as err:
            raise config_error_from_omegaconf(err) from None
        return typed, run_dir

    def hydra_dir(self, overrides: Iterable[str], kind: str = "run", config_name: str = "config",
                  config_dir: str | None = None) -> str:
        """`hydra.run.dir` (kind "run") or `hydra.sweep.dir` ("sweep") as these overrides set it,
        resolved now (so it can be checked before Hydra creates it)."""
        overrides = list(overrides)
        # A sweep's values do not decide its directory; compose cannot take them.
        single = [text for text, ov in zip(overrides, _parse_overrides(overrides), strict=True)
                  if not ov.is_sweep_override()]
        cfg = _hydra_compose(single, config_name, self.cls, with_hydra=True, config_dir=config_dir)
        try:
            return str(OmegaConf.select(cfg, f"hydra.{kind}.dir", throw_on_resolution_failure=True))
        except OmegaConfBaseException as err:
            raise config_error_from_omegaconf(err) from None


def to_dict(cfg: Any) -> dict[str, Any]:
    """The typed config as plain Python containers (for hashing, manifests and circuit.pt)."""
    return dataclasses.asdict(cfg)


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dict as {dotted key: value} (`{"a": {"b": 1}}` -> `{"a.b": 1}`)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def iter_keys(cls: type, prefix: str = "") -> Iterable[tuple[str, Any, Mapping[str, Any]]]:
    """Every leaf key of the schema `cls` as (path, type, metadata); used by the docs check."""
    hints = _type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, _ = _unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp):
            yield from iter_keys(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", hints[f.name], f.metadata


# --------------------------------------------------------------------------- command-line flags

def add_schema_flag(parser: argparse.ArgumentParser | Any, schema: type, key: str, *, flag: str | None = None,
                    le: float | None = None, why: str = "", metavar: str | None = None) -> argparse.Action:
    """An option of `parser` that mirrors the config key `key` of the dataclass `schema`: its default,
    help, choices, type and range are read from the field, the one place they are written, so the
    flag and the key cannot drift apart.

    flag: its spelling (default `--` + the key with dashes, `top_k` -> `--top-k`). A list-of-strings
    key takes one comma-separated value (`--engines dot,cosine`; its default joined the same way),
    which the command splits and checks. A number's range is the field's ge/gt/le (checked after
    parsing, `circuitkit.core.flags.check_numeric_flags`); le: an upper bound for a key whose field
    has none (a count a person types); why: what the range is for, in its message.
    """
    f = next((f for f in dataclasses.fields(schema) if f.name == key), None)
    if f is None:
        raise KeyError(f"{schema.__name__} has no key {key!r}")
    tp, _ = _unwrap_optional(_type_hints(schema)[key])
    meta = f.metadata
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    shown = ",".join(map(str, default)) if isinstance(default, list) else default
    # argparse formats help with %: a literal one (the "95 % interval") is doubled.
    kwargs: dict[str, Any] = {"default": shown, "help": f"{meta['doc']} (default {shown})".replace("%", "%%")}
    if typing.get_origin(tp) is list:
        kwargs["type"] = str
    elif tp in (int, float, str):
        kwargs["type"] = tp
        if meta.get("choices"):
            kwargs["choices"] = meta["choices"]
    else:
        raise TypeError(f"{schema.__name__}.{key} ({tp}) has no command-line form: give the flag by hand")
    if metavar is not None:
        kwargs["metavar"] = metavar
    action = parser.add_argument(flag or "--" + key.replace("_", "-"), **kwargs)
    if tp in (int, float):
        if meta.get("lt") is not None:
            raise TypeError(f"{schema.__name__}.{key}: a flag's range takes ge, gt and le, not lt")
        bounded(action, ge=meta.get("ge"), gt=meta.get("gt"), le=meta.get("le") if meta.get("le") is not None else le,
                why=why)
    return action
