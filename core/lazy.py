"""A package's names imported from their modules when first used (PEP 562), so that importing one light module of
the package does not import what its heavy ones import."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_names(package: str, modules: dict[str, str]) -> Callable[[str], object]:
    """The module `__getattr__` of `package`: each name of `modules` (name -> its submodule) imported on first use."""

    def __getattr__(name: str) -> object:
        if name in modules:
            return getattr(importlib.import_module(f"{package}.{modules[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
