"""The configs' shared vocabulary: their exceptions, the field -> flag names every message
uses, and what counts as a boolean, an integer and a finite number (a ``bool`` is not a count,
a string not a number). Part of :mod:`megatron_edit.config`, which re-exports it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Dict

# Field -> Megatron-style command-line flag, so errors name what the user typed; filled by
# megatron_edit.config from its classes' field metadata (megatron_edit.flags.flag).
FLAG_NAMES: Dict[str, str] = {}


class ConfigError(ValueError):
    """A bad EDiT option. The message names the option (and its flag) and the fix."""


class NotSupportedYet(ConfigError):
    """An EDiT option that is valid but whose behaviour is not implemented in this version."""


# Their public home (tracebacks, documentation): megatron_edit.config, which re-exports them.
ConfigError.__module__ = NotSupportedYet.__module__ = "megatron_edit.config"


def _name(field_name: str) -> str:
    flag = FLAG_NAMES.get(field_name)
    return f"{field_name} ({flag})" if flag else field_name


def _is_bool(value) -> bool:
    return isinstance(value, bool)


def _is_int(value) -> bool:
    """An integer, not a bool (``True`` is an int to Python, not a step count to us)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    """A finite real number, not a bool and not a string."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _got(value) -> str:
    return f"got {value!r}, a {type(value).__name__}" if not isinstance(value, (int, float)) else f"got {value!r}"


def _is_tensor(value) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "dim")


def _require(cond: bool, field_name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{_name(field_name)}: {msg}")


# What _check_types checks a field's value for, by its annotation (a str field is checked
# against its choices by its class).
_KINDS = {"bool": "bool", "int": "int", "float": "number", "Optional[float]": "optional number",
          "Optional[bool]": "optional bool"}


def _check_types(cfg) -> None:
    """Types first, so a range check never meets a string (which would raise a bare TypeError):
    booleans, integers, numbers, then optional numbers, each in field order."""
    kinds = {f.name: _KINDS.get(f.type) for f in dataclasses.fields(cfg)}  # f.type: a string
    for kind in _KINDS.values():
        for name in (n for n, k in kinds.items() if k == kind):
            value = getattr(cfg, name)
            if kind == "bool":
                _require(_is_bool(value), name,
                         f"must be True or False ({_got(value)}); a string such as 'no' is not a boolean.")
            elif kind == "int":
                _require(_is_int(value), name, f"must be an integer ({_got(value)}).")
            elif kind == "number":
                _require(_is_number(value), name, f"must be a finite number ({_got(value)}).")
            elif kind == "optional bool":
                _require(value is None or _is_bool(value), name,
                         f"must be True, False or None ({_got(value)}); a string such as 'no' is not a boolean.")
            else:
                _require(value is None or _is_number(value), name,
                         f"must be a finite number or None ({_got(value)}).")


def replace(cfg, **changes):
    """dataclasses.replace that re-runs validation."""
    return dataclasses.replace(cfg, **changes)
