"""Import on first use: lazy package attributes and "module:function" entry points.

Keeps `polybasic --help` and argument errors free of torch, transformers and lightning.
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def load_entry(entry: str) -> Callable:
    """The object named by "package.module:attribute", imported now."""
    module, _, attr = entry.partition(":")
    return getattr(importlib.import_module(module), attr)


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable, Callable]:
    """(__getattr__, __dir__) for a package whose public names (name -> submodule) are imported on
    first access and then cached on the package."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
