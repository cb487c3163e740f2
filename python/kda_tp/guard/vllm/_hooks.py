"""Run code right after a module is imported, for engine plugins that must not import their
engine early (``kda_tp.guard.vllm``): a process that never imports the module pays nothing.

This module imports no engine.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["after_import", "subclasses"]


def after_import(installers: dict[str, Callable[[Any], None]]) -> None:
    """Run each ``installers[name](module)`` once module ``name`` is imported: at once for a
    module this process has fully imported already, else right after its import executes
    (an import hook first on ``sys.meta_path``, which finds nothing itself: it wraps the loader
    the other finders return). An installer's exception propagates into that import."""
    pending = {name: install for name, install in installers.items()
               if not _apply(name, install)}
    if pending:
        sys.meta_path.insert(0, _AfterImport(pending))


def subclasses(cls: type) -> list[type]:
    """Every subclass of ``cls``, at any depth, defined so far."""
    found: list[type] = []
    todo: list[type] = list(cls.__subclasses__())
    while todo:
        sub = todo.pop()
        found.append(sub)
        todo.extend(sub.__subclasses__())
    return found


def _apply(name: str, install: Callable[[Any], None]) -> bool:
    """Run ``install`` on module ``name`` if it is imported (fully); whether it was."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    if module is None or getattr(spec, "_initializing", False):
        return False
    install(module)
    return True


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs an installer right after one of the pending modules is imported."""

    def __init__(self, pending: dict[str, Callable[[Any], None]]):
        self.pending = pending

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        install = self.pending.pop(name, None)
        if install is None:
            return None
        spec = importlib.util.find_spec(name)  # the other finders (this one no longer has it)
        loader = getattr(spec, "loader", None)
        execute = getattr(loader, "exec_module", None)
        if spec is None or execute is None:
            return spec

        def exec_module(module: Any) -> None:
            execute(module)
            install(module)

        loader.exec_module = exec_module  # type: ignore[union-attr]
        return spec
