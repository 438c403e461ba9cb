"""The one strict base of every configuration dataclass (docs/architecture.md, "Configuration").

:class:`ConfigBase` gives a ``@dataclass`` four things, written once here for every config of the
project (``HCConfig``, the pre-training sections, ``OptimizerConfig``, ``ScheduleConfig``,
``DataConfig``, the finetuning sections):

- :meth:`ConfigBase.from_dict`: a mapping (YAML) to the dataclass.  An unknown key is a one-line
  error naming the dotted key and listing the known ones; a nested config field (a section) loads
  recursively from a nested mapping, keeping its defaults for the keys not given; with
  ``coerce_values`` every value is converted to its field's annotation (``"3e-4"`` to a float,
  ``"null"`` to None, ...) and a value that does not fit is a one-line error naming the key.
- :meth:`ConfigBase.to_dict`: a plain nested dict (tuples as lists), safe for YAML and JSON.
- :meth:`ConfigBase.replace`: a copy with some fields changed (validated again where the class
  validates at construction).
- dotted overrides: :func:`split_override` reads ``section.key=value`` and :func:`set_dotted` writes
  the value into a nested mapping before loading, so ``optimizer.lr=1e-3`` and a YAML file meet in
  one place.

A class chooses its exception class and the wording of its messages through class attributes (the
messages that users and tests rely on keep their words).  Plain Python: the standard library only.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, ClassVar, Dict, List, Mapping, MutableMapping, Optional, Sequence, Tuple

__all__ = ["ConfigBase", "ConfigKeyError", "coerce", "load", "set_dotted", "split_override", "to_plain"]

NONE_STRINGS = ("null", "none", "~")


class ConfigKeyError(ValueError):
    """A value that does not fit its key; re-raised by :func:`load` as the config class's own error."""

    def __init__(self, key: str, msg: str):
        super().__init__(f"{key}: {msg}")
        self.key, self.msg = key, msg


class ConfigBase:
    """Mixin of every configuration ``@dataclass`` (see the module docstring)."""

    config_error: ClassVar[type] = ValueError
    """The exception class of this config's errors."""
    key_format: ClassVar[str] = "{key}: {msg}"
    """A one-line error about one key: ``{key}`` is the dotted key, ``{msg}`` what is wrong and the fix."""
    unknown_key_format: ClassVar[Optional[str]] = None
    """The error for an unknown key: ``{key}`` dotted, ``{name}`` the key alone, ``{section}`` the
    mapping it was found in, ``{known}`` the known keys (comma separated).  None: ``key_format`` with
    ``unknown key; known keys of {section}: {known}``."""
    coerce_values: ClassVar[bool] = False
    """Convert every value to its field's annotation while loading (else values pass as given and the
    class validates them itself, e.g. in ``__post_init__``)."""

    @classmethod
    def key_error(cls, key: str, msg: str) -> Exception:
        return cls.config_error(cls.key_format.format(key=key, msg=msg))

    @classmethod
    def unknown_key_error(cls, key: str, name: str, section: str, known: Sequence[str]) -> Exception:
        known = ", ".join(sorted(known))
        if cls.unknown_key_format is None:
            return cls.key_error(key, f"unknown key; known keys of {section}: {known}")
        return cls.config_error(cls.unknown_key_format.format(key=key, name=name, section=section, known=known))

    @classmethod
    def from_dict(cls, data: Optional[Mapping[str, Any]], prefix: str = ""):
        """An instance from ``data``; an unknown key raises naming ``prefix.key``."""
        return load(cls, data, prefix=prefix, root=cls)

    def to_dict(self) -> dict:
        """Plain nested dict (tuples as lists), YAML/JSON-safe."""
        return to_plain(self)

    def replace(self, **changes):
        """A copy with some fields changed (validated again where the class validates at construction)."""
        return dataclasses.replace(self, **changes)


def _hints(cls) -> Dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # pragma: no cover - unresolvable annotations: no conversion
        return {f.name: Any for f in dataclasses.fields(cls)}


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def load(cls, data: Optional[Mapping[str, Any]], prefix: str = "", base: Any = None, root: Any = None):
    """An instance of dataclass ``cls`` from ``data`` (the engine of :meth:`ConfigBase.from_dict`).

    ``root``: the class whose errors and ``coerce_values`` rule the whole load (the outermost config;
    default ``cls``).  ``base``: an instance whose values the keys not in ``data`` keep; it is updated
    in place (no second validation).  Without it the instance is built with ``cls(**values)``, so a
    class that validates in ``__post_init__`` validates the result.  A field whose current value is a
    config dataclass (a section) loads from a nested mapping (or ``None``: its defaults).
    """
    root = root if root is not None else cls
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise root.key_error(prefix or "<root>", f"expected a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = _hints(cls) if root.coerce_values else {}
    values: Dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            raise root.unknown_key_error(key, str(name), prefix or "the config", list(fields))
        current = getattr(base, name) if base is not None else _default(fields[name])
        if dataclasses.is_dataclass(current) and not isinstance(current, type):
            values[name] = load(type(current), value, key, base=current, root=root)
        elif root.coerce_values:
            try:
                values[name] = coerce(value, hints.get(name, Any), key)
            except ConfigKeyError as e:
                raise root.key_error(e.key, e.msg) from None
        else:
            values[name] = value
    if base is None:
        return cls(**values)
    for name, value in values.items():
        setattr(base, name, value)
    return base


def to_plain(value: Any) -> Any:
    """A config dataclass (or any nesting of them, lists, tuples and dicts) as plain dicts and lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_plain(x) for x in value]
    if isinstance(value, dict):
        return {str(k): to_plain(x) for k, x in value.items()}
    return value


# ------------------------------------------------------------------------------------------------
# Typed conversion (``coerce_values``)
# ------------------------------------------------------------------------------------------------
def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin in (list, List):
        return f"list of {_type_name(typing.get_args(tp)[0])}" if typing.get_args(tp) else "list"
    if origin in (tuple, Tuple):
        return "list of " + ", ".join(_type_name(a) for a in typing.get_args(tp) if a is not Ellipsis)
    if origin in (dict, Dict):
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, key: str) -> Any:
    """``value`` converted to the annotation ``tp``; :class:`ConfigKeyError` naming ``key`` if it does
    not fit.  YAML already gives python types; a few string forms are accepted (``3e-4`` is a string
    to PyYAML, ``null`` from a command-line override)."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.strip().lower() in NONE_STRINGS):
            if type(None) in typing.get_args(tp):
                return None
        for a in args:
            try:
                return coerce(value, a, key)
            except ConfigKeyError:
                pass
        raise ConfigKeyError(key, f"{value!r} is not a {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        if dataclasses.is_dataclass(value) and isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigKeyError(key, f"expected a mapping of {tp.__name__} fields, got {value!r}")
        return load(tp, value, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "yes", "no", "on", "off"):
            return value.strip().lower() in ("true", "yes", "on")
        raise ConfigKeyError(key, f"{value!r} is not a boolean (true/false)")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigKeyError(key, f"{value!r} is not an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value)
            except ValueError:
                raise ConfigKeyError(key, f"{value!r} is not an integer") from None
            if f.is_integer():
                return int(f)
        raise ConfigKeyError(key, f"{value!r} is not an integer")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigKeyError(key, f"{value!r} is not a number")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigKeyError(key, f"{value!r} is not a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigKeyError(key, f"{value!r} is not a string")
    if origin in (list, List, Sequence, typing.Sequence) or tp in (list, List):
        args = typing.get_args(tp)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value]  # a single prefix / weight
        if not isinstance(value, (list, tuple)):
            raise ConfigKeyError(key, f"{value!r} is not a list")
        return [coerce(v, args[0], f"{key}[{i}]") if args else v for i, v in enumerate(value)]
    if origin in (tuple, Tuple):
        args = list(typing.get_args(tp))
        if not isinstance(value, (list, tuple)):
            raise ConfigKeyError(key, f"{value!r} is not a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigKeyError(key, f"{value!r} needs {len(args)} entries")
        return tuple(coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin in (dict, Dict) or tp in (dict, Dict):
        if not isinstance(value, dict):
            raise ConfigKeyError(key, f"{value!r} is not a mapping")
        return dict(value)
    return value  # unannotated / exotic: pass through


# ------------------------------------------------------------------------------------------------
# Dotted overrides
# ------------------------------------------------------------------------------------------------
def split_override(item: str, example: str) -> Tuple[str, str]:
    """``"optimizer.lr=1e-3"`` -> ``("optimizer.lr", "1e-3")``; :class:`ValueError` with the fix
    (``example``, e.g. ``optimizer.lr=1e-3``) when it is not ``section.key=value``."""
    if "=" not in item:
        raise ValueError(f"override {item!r}: write section.key=value, e.g. {example}")
    key, text = item.split("=", 1)
    key = key.strip().lstrip("-")
    if not key or "." not in key:
        raise ValueError(f"override {item!r}: the key must be dotted, section.key (e.g. {example})")
    return key, text


def set_dotted(raw: MutableMapping[str, Any], key: str, value: Any,
               sections: Optional[Sequence[str]] = None) -> None:
    """Write ``value`` at the dotted ``key`` of the nested mapping ``raw`` (missing levels are
    created; a null level becomes a mapping).  :class:`ConfigKeyError` when the first part is not one
    of ``sections`` or a level on the way holds a value."""
    parts = key.split(".")
    if sections is not None and parts[0] not in sections:
        raise ConfigKeyError(key, f"unknown section {parts[0]!r}; sections: {', '.join(sections)}")
    node = raw
    for i, p in enumerate(parts[:-1]):
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigKeyError(".".join(parts[: i + 1]), f"is a value ({nxt!r}), not a section; cannot set {key}")
        node = nxt
    node[parts[-1]] = value
