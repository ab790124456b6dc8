"""Names a package re-exports without importing their modules (and Dagster) until first used."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` resolving each of ``names`` from its module on first access (a name of a submodule
    of ``package``, mapped to that submodule, is the submodule itself)."""

    def __getattr__(name: str) -> Any:
        if name in names:
            module = importlib.import_module(names[name])
            return module if names[name] == f"{package}.{name}" else getattr(module, name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
