"""How an EcoSpec setting's raw value is read: the settings file's JSON object, an
``SGLANG_ECOSPEC_*`` string parsed by its field's annotation, a value checked against it
(:mod:`sglang_ecospec.settings` validates what the values mean)."""

import json
import typing
from typing import Any


class EcoSpecSettingsError(ValueError):
    """An EcoSpec setting is missing, unknown or out of range (the message says which)."""


def read_file(path: str, variable: str) -> dict:
    """The JSON object in ``path``, which the environment variable ``variable`` named."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise EcoSpecSettingsError(f"{variable}={path!r}: no such file") from None
    except json.JSONDecodeError as exc:
        raise EcoSpecSettingsError(f"{variable}={path!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise EcoSpecSettingsError(f"{variable}={path!r} must hold a JSON object")
    return data


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _kind(type_: Any) -> tuple[tuple[type, ...], bool]:
    """(base types, accepts None) of a field annotation: ``float``, ``str | None`` or
    ``float | str`` (tried in that order when parsing)."""
    if isinstance(type_, type):
        return (type_,), False
    args = typing.get_args(type_)
    return tuple(a for a in args if a is not type(None)), type(None) in args


def _type_names(bases: tuple[type, ...]) -> str:
    return " or ".join(base.__name__ for base in bases)


def parse(key: str, raw: str, type_: Any) -> Any:
    """The value of the environment variable ``key`` (text ``raw``) as a field annotated
    ``type_`` holds it."""
    bases, optional = _kind(type_)
    text = raw.strip()
    if optional and text.lower() in ("", "none"):
        return None
    for base in bases:
        if base is bool:
            if text.lower() in _TRUE | _FALSE:
                return text.lower() in _TRUE
            continue
        try:
            return base(text)
        except ValueError:
            continue
    raise EcoSpecSettingsError(f"{key}={raw!r} is not a valid {_type_names(bases)}")


def check_type(name: str, value: Any, type_: Any, source: str) -> None:
    """EcoSpecSettingsError unless ``value`` (of the setting ``name``, read from ``source``)
    fits the annotation ``type_``."""
    bases, optional = _kind(type_)
    if value is None and optional:
        return
    for base in bases:
        accepted = (int, float) if base is float else (base,)
        if isinstance(value, accepted) and (base is bool or not isinstance(value, bool)):
            return
    raise EcoSpecSettingsError(
        f"EcoSpec setting {name!r} from {source} must be {_type_names(bases)}, got {value!r}"
    )
