"""skyrl 0.3.0's request / response types, importable on Python 3.11.

skyrl 0.3.0's ``tinker/types.py`` uses ``typing.TypedDict`` inside pydantic models, which pydantic
refuses before Python 3.12: ``typing.TypedDict = typing_extensions.TypedDict`` first. The installed
skyrl must be 0.3.0 (``serve.py`` and ``engine_main.py`` copy its internals). Every module of this
package reaches skyrl through here (or ``_compat``, which imports this first).
"""

from __future__ import annotations

import importlib.metadata
import typing

import typing_extensions

typing.TypedDict = typing_extensions.TypedDict  # before the first skyrl import

SKYRL_VERSION = "0.3.0"

try:
    _installed = importlib.metadata.version("skyrl")
except importlib.metadata.PackageNotFoundError:
    raise ImportError(
        f"mcore_engine.integrations.tinker needs skyrl=={SKYRL_VERSION}: "
        f"pip install -c constraints.txt -e '.[tinker]' && pip install --no-deps skyrl=={SKYRL_VERSION}"
    ) from None
if _installed != SKYRL_VERSION:
    raise ImportError(
        f"mcore_engine.integrations.tinker needs skyrl=={SKYRL_VERSION} (its API routes and engine loop are "
        f"patched by copy), found skyrl=={_installed}: pip install --no-deps skyrl=={SKYRL_VERSION}"
    )

from skyrl.tinker import types  # noqa: E402

__all__ = ["SKYRL_VERSION", "types"]
