"""Count what one ``kda-tp`` command re-derives: config reads and parses, name lists, plans.

Runs the command in this process (``kda_tp.cli.main``) with counting wrappers around the
functions below, wherever a kda_tp module holds them, and prints one line per counter::

    python tools/callcounts.py audit CKPT DUMP --tp-size 4 --quiet
    python tools/callcounts.py plan CKPT --tp-size 4

Counters: ``config.json reads`` (``kda_tp.config.read_json`` of a ``config.json``),
``parse_config``, ``quantization_config``, ``names() lists`` (``SafetensorsSource.names``),
``plans built`` (``KdaTpPlan.from_description`` calls, else ``from_config``), ``rank views`` (``KdaShardedSource`` built), ``param_plan``
(``EngineLayout.param_plan``) and, with ``kda_tp.description``, ``descriptions`` (checkpoints
inspected).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import kda_tp

COUNTS: Counter[str] = Counter()


def _counted(label: str, fn: Callable[..., Any], when: Callable[..., bool] | None = None) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if when is None or when(*args, **kwargs):
            COUNTS[label] += 1
        return fn(*args, **kwargs)

    return wrapper


def _patch_everywhere(module_name: str, attr: str, label: str,
                      when: Callable[..., bool] | None = None) -> None:
    """Replace ``module.attr`` in every loaded kda_tp module that holds the same object."""
    original = getattr(importlib.import_module(module_name), attr)
    wrapped = _counted(label, original, when)
    for name, module in list(sys.modules.items()):
        if name.startswith("kda_tp") and module is not None:
            for key, value in list(vars(module).items()):
                if value is original:
                    setattr(module, key, wrapped)


def _patch_method(cls: type, attr: str, label: str, *, classmethod_: bool = False) -> None:
    original = cls.__dict__[attr]
    fn = original.__func__ if classmethod_ else original
    wrapped = _counted(label, fn)
    setattr(cls, attr, classmethod(wrapped) if classmethod_ else wrapped)


def install() -> None:
    """Import every kda_tp module and wrap the counted functions."""
    for info in pkgutil.iter_modules(kda_tp.__path__):
        if info.name not in ("__main__", "vllm_plugin", "sglang_plugin", "torch"):
            importlib.import_module(f"kda_tp.{info.name}")
    _patch_everywhere("kda_tp.config", "read_json", "config.json reads",
                      lambda path, *a, **k: str(path).endswith("config.json")
                      and not str(path).endswith("hf_quant_config.json"))
    _patch_everywhere("kda_tp.config", "parse_config", "parse_config")
    _patch_everywhere("kda_tp.quant", "quantization_config", "quantization_config")
    from kda_tp.checkpoint import SafetensorsSource
    from kda_tp.engines import EngineLayout
    from kda_tp.plan import KdaTpPlan
    from kda_tp.source import KdaShardedSource

    _patch_method(SafetensorsSource, "names", "names() lists")
    # Every plan from a checkpoint goes through from_description where it exists.
    planned = "from_description" if "from_description" in vars(KdaTpPlan) else "from_config"
    _patch_method(KdaTpPlan, planned, "plans built", classmethod_=True)
    _patch_method(KdaShardedSource, "__init__", "rank views")
    _patch_method(EngineLayout, "param_plan", "param_plan")
    try:
        description = importlib.import_module("kda_tp.description")
    except ImportError:
        return
    _patch_method(description.CheckpointDescription, "__init__", "descriptions")


def main(argv: list[str]) -> int:
    install()
    from kda_tp.cli import main as cli_main

    try:
        status = cli_main(argv)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    for label in ("config.json reads", "parse_config", "quantization_config", "names() lists",
                  "descriptions", "plans built", "rank views", "param_plan"):
        print(f"{label}: {COUNTS[label]}", file=sys.stderr)
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
