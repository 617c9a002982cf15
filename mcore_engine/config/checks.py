"""Small validation helpers shared by the config dataclasses (``config``, ``moe_config``, recipes)."""

from __future__ import annotations

import dataclasses
from typing import Any


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _positive_int(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                 f"{type(obj).__name__}.{name} must be an int >= 1, got {value!r}")


def _bools(obj: Any, *names: str) -> None:
    """``ValueError`` unless every named field is a real bool (YAML ``"no"`` is a str, not False)."""
    for name in names:
        value = getattr(obj, name)
        _require(isinstance(value, bool), f"{type(obj).__name__}.{name} must be a bool, got {value!r}")


def _check_keys(cls: type, d: dict[str, Any], where: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    _require(not unknown, f"{where}: unknown field(s) {unknown}; expected some of {sorted(known)}")
