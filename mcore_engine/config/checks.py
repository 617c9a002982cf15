"""The one recipe of every config block: refusals that carry their field, value checks, dict -> dataclass.

A block is a dataclass deriving from :class:`Block`: ``__post_init__`` checks its own fields with the
``_ints`` / ``_bools`` / ``_numbers`` / ``_choice`` / ``_require`` helpers, and ``check(model,
parallel)`` the rules that involve other blocks (``parallel=None``: the model alone, what
``ModelConfig`` runs on its blocks; ``EngineConfig`` runs them again with the layout). Every refusal
is a :class:`ConfigError` whose ``fields`` are dotted paths from ``EngineConfig``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, NoReturn

__all__ = ["Block", "ConfigError", "build", "fail", "is_int", "is_number", "require"]


class ConfigError(ValueError):
    """A refused config value. ``fields``: dotted paths from ``EngineConfig`` of the fields the rule
    combines (``"model.moe.num_experts"``, ``"parallel.context_parallel_size"``): a block's own field
    first, or for a rule across the model and the layout the layout's field first (what an adapter
    renames); ``field``: that first one (None for a rule without a field). The message names the
    field that is refused."""

    def __init__(self, message: str, *fields: str) -> None:
        super().__init__(message)
        self.fields: tuple[str, ...] = fields
        self.field: str | None = fields[0] if fields else None


def fail(message: str, *fields: str) -> NoReturn:
    raise ConfigError(message, *fields)


def require(ok: Any, message: str, *fields: str) -> None:
    if not ok:
        raise ConfigError(message, *fields)


def is_int(value: Any, low: int | None = None) -> bool:
    """An int, not a bool, ``>= low`` when given."""
    return isinstance(value, int) and not isinstance(value, bool) and (low is None or value >= low)


def is_number(value: Any) -> bool:
    """A finite int or float, not a bool (YAML ``true`` is no number)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def one_of(choices: tuple[Any, ...]) -> str:
    """``"None, 'a' or 'b'"``."""
    names = [repr(c) for c in choices]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def build(cls: type, value: Any, label: str, path: str, *, optional: bool = True) -> Any:
    """``value`` as a ``cls`` (a dataclass): an instance as is, a mapping of its field names through
    ``cls(**value)`` (unknown keys refused), ``None`` when ``optional``."""
    if (value is None and optional) or isinstance(value, cls):
        return value
    require(isinstance(value, dict), f"{label} must be {'None, ' if optional else ''}a {cls.__name__} or a "
            f"mapping, got {value!r}", path)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    require(not unknown, f"{label}: unknown field(s) {unknown}; expected some of {sorted(known)}",
            *(f"{path}.{k}" if path else k for k in unknown))
    return cls(**value)


class Block:
    """Base of the config dataclasses; ``PATH``: where the block sits in ``EngineConfig``."""

    PATH: ClassVar[str] = ""

    @classmethod
    def path(cls, name: str) -> str:
        return f"{cls.PATH}.{name}" if cls.PATH else name

    def check(self, model: Any, parallel: Any) -> None:
        """Rules against the model and (unless None) the layout; none by default."""

    # --- own-field checks: the label is ``Class.field``, the ConfigError field its path
    def _require(self, ok: Any, message: str, *names: str) -> None:
        require(ok, message, *map(self.path, names))

    def _label(self, name: str) -> str:
        return f"{type(self).__name__}.{name}"

    def _ints(self, *names: str, low: int = 1, optional: bool = False) -> None:
        for name in names:
            v = getattr(self, name)
            if optional and v is None:
                continue
            self._require(is_int(v, low),
                          f"{self._label(name)} must be an int >= {low}, got {v!r}", name)

    def _bools(self, *names: str) -> None:
        for name in names:
            v = getattr(self, name)
            self._require(isinstance(v, bool), f"{self._label(name)} must be a bool, got {v!r}", name)

    def _numbers(self, *names: str, low: float = 0, strict: bool = False, optional: bool = False) -> None:
        """Finite numbers ``>= low`` (``> low`` when ``strict``), or None when ``optional``."""
        for name in names:
            v = getattr(self, name)
            if optional and v is None:
                continue
            self._require(is_number(v) and (v > low if strict else v >= low),
                          f"{self._label(name)} must be {'None or ' if optional else ''}a finite number "
                          f"{'>' if strict else '>='} {low}, got {v!r}", name)

    def _choice(self, name: str, choices: tuple[Any, ...]) -> None:
        v = getattr(self, name)
        self._require(v in choices, f"{self._label(name)} must be {one_of(choices)}, got {v!r}", name)

    def _block(self, name: str, cls: type) -> None:
        """Field ``name`` (a ``cls`` block, a mapping or None) as a ``cls`` or None."""
        setattr(self, name, build(cls, getattr(self, name), self._label(name), self.path(name)))


# --- for the recipes' job configs (mcore_engine.recipes): message-only refusals
def _require(ok: Any, message: str) -> None:
    require(ok, message)


def _positive_int(obj: Any, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        require(is_int(v, 1),
                f"{type(obj).__name__}.{name} must be an int >= 1, got {v!r}", name)
