"""Typed, validated reads of config.yaml mappings, for proxy/config/load.py.

Every read that fails raises a `ConfigError` whose message names the field and says how
to fix it; `_Section.finish` and `_knobs` reject unknown keys with a did-you-mean hint.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from types import MappingProxyType
from typing import Any


class ConfigError(ValueError):
    """The configuration is invalid; the message names the field and the fix."""


def _fix_unknown(where: str, key: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"allowed keys: {', '.join(allowed)}"
    return f"{where}{key}: unknown key (fix: {hint})"


class _Section:
    """Typed reads from one mapping; remembers which keys were consumed."""

    def __init__(self, raw: object, where: str) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            name = where.rstrip(".") or "config"
            raise ConfigError(f"{name}: expected a mapping, got {_show(raw)} (fix: use key: value)")
        self.raw, self.where, self.used = raw, where, set[str]()

    def _get(self, key: str) -> object:
        self.used.add(key)
        return self.raw.get(key)

    def has(self, key: str) -> bool:
        return key in self.raw

    def get_int(self, key: str, default: int, lo: int = 1, hi: int | None = None) -> int:
        v = self._get(key)
        if v is None:
            return default
        bound = f"an integer >= {lo}" if hi is None else f"an integer in {lo}..{hi}"
        if lo == 1 and hi is None:
            bound = "a positive integer"
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
            raise ConfigError(
                f"{self.where}{key}: expected {bound}, got {_show(v)} (fix: e.g. {key}: {default})"
            )
        return v

    def get_num(self, key: str, default: float, zero: bool = False) -> float:
        """A positive number (or 0 too, with ``zero``)."""
        v = self._get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int | float) or not (
                v >= 0 if zero else v > 0):
            what = "a number >= 0" if zero else "a positive number"
            raise ConfigError(
                f"{self.where}{key}: expected {what}, got {_show(v)} "
                f"(fix: e.g. {key}: {default})"
            )
        return float(v)

    def get_str(self, key: str, default: str | None, example: str = "...") -> str | None:
        v = self._get(key)
        if v is None:
            return default
        if not isinstance(v, str) or not v:
            raise ConfigError(
                f"{self.where}{key}: expected a non-empty string, got {_show(v)} "
                f"(fix: e.g. {key}: {example})"
            )
        return v

    def get_raw(self, key: str) -> object:
        """The value as written (None: absent), for a caller that checks it itself."""
        return self._get(key)

    def get_str_list(self, key: str) -> tuple[str, ...]:
        v = self._get(key)
        if v is None:
            return ()
        if not isinstance(v, list) or not all(isinstance(x, str | int | float) for x in v):
            raise ConfigError(
                f"{self.where}{key}: expected a list of strings, got {_show(v)} "
                f'(fix: e.g. {key}: ["--temp", "0"])'
            )
        return tuple(str(x) for x in v)

    def get_str_map(self, key: str) -> Mapping[str, str]:
        v = self._get(key)
        if v is None:
            return MappingProxyType({})
        if not isinstance(v, Mapping) or not all(isinstance(k, str) for k in v):
            raise ConfigError(
                f"{self.where}{key}: expected a mapping of strings, got {_show(v)} "
                f'(fix: e.g. {key}: {{CUDA_VISIBLE_DEVICES: "0"}})'
            )
        return MappingProxyType({k: str(x) for k, x in v.items()})

    def finish(self, allowed: list[str] | None = None) -> None:
        allowed = allowed or sorted(self.used)
        for key in self.raw:
            if key not in self.used:
                raise ConfigError(_fix_unknown(self.where, str(key), allowed))


def unique_names(names: list[str], where: str) -> None:
    """A ConfigError naming the first of ``names`` (the entries of list ``where``) that
    another before it has too."""
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            raise ConfigError(f"{where}[{i}].name: duplicate name {name!r} (fix: give each "
                              f"entry of {where} a name of its own)")
        seen.add(name)


def _show(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _path(base: Path, value: str) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else (base / p).resolve()


def _check_knob(where: str, key: str, value: object, default: object) -> None:
    """A knob must have its default's type: a float knob takes an int (1 == 1.0), an int
    knob does not take a float, and a bool is neither."""
    want = (int | float) if isinstance(default, float) else type(default)
    if isinstance(value, bool) != isinstance(default, bool) or not isinstance(value, want):
        raise ConfigError(f"{where}{key}: expected {type(default).__name__}, got "
                          f"{_show(value)} (fix: e.g. {key}: {default})")


def _knobs(raw: Mapping[Any, Any], where: str, defaults: object,
           special: tuple[str, ...] = ()) -> dict[str, Any]:
    """Validate flat scalar knobs of a dataclass; keys in `special` are left to the caller."""
    known = {f.name for f in fields(defaults)}  # type: ignore[arg-type]
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key in special:
            continue
        if key not in known:
            raise ConfigError(_fix_unknown(where, str(key), sorted(known | set(special))))
        default = getattr(defaults, key)
        _check_knob(where, key, value, default)
        out[key] = float(value) if isinstance(default, float) else value
    return out
