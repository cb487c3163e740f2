"""Count what kda_tp re-derives: config reads and parses, name lists, descriptions, plans.

Two modes. A ``kda-tp`` command, run in this process (``kda_tp.cli.main``)::

    python tools/callcounts.py audit CKPT DUMP --tp-size 4 --quiet
    python tools/callcounts.py plan CKPT --tp-size 4

or the guard on one rank (``guard``: no ``kda-tp`` command runs it), without an engine::

    python tools/callcounts.py guard CKPT --tp-rank 1 --tp-size 4 [--layout NAME] [--dtype BF16]

which builds the rank's KDA parameters from the checkpoint as the layout holds them (torch CPU
tensors, the build API; not counted), then counts, each on its own: the first-load check
(``kda_tp.guard.check``), the rank's update target (``RankTarget.of``, built once per model from
the plan the first-load check built) and one refit session (``UpdateSession`` on it:
feed every KDA tensor of the checkpoint, close); before the guard's redesign, one
``UpdateCheck`` (construct, feed, check). It needs torch.

With counting wrappers around the functions below, wherever a kda_tp module holds them, it prints
one line per counter (a heading per part in ``guard`` mode) on stderr. Counters: ``config.json
reads`` (the JSON reader's ``read_json`` of a ``config.json``), ``parse_config``,
``quantization_config``, ``names() lists`` (``SafetensorsSource.names``), ``descriptions``
(checkpoints inspected: ``CheckpointDescription`` built), ``plans built``
(``KdaTpPlan.from_description`` calls, else ``from_config``), ``rank views``
(``KdaShardedSource`` built), ``param_plan`` (``EngineLayout.param_plan``), ``safetensors
opens`` (``SafetensorsSource`` built: the checkpoint's and each dump file's), ``engine_params``
(a rank's engine parameter list) and ``engine_model_dtype`` (the engine's model dtype decided).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import pkgutil
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import kda_tp

COUNTS: Counter[str] = Counter()
LABELS = ("config.json reads", "parse_config", "quantization_config", "names() lists",
          "descriptions", "plans built", "rank views", "param_plan", "safetensors opens",
          "engine_params", "engine_model_dtype")
# Not imported by install(): the command line's entry, the engine plugins, the optional torch
# modules (and the torchrun jobs) and the oracle (a separate restatement of the spec).
SKIPPED = ("__main__", "vllm_plugin", "sglang_plugin", "vllm", "sglang", "torch", "distributed",
           "oracle")


def _counted(label: str, fn: Callable[..., Any], when: Callable[..., bool] | None = None) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if when is None or when(*args, **kwargs):
            COUNTS[label] += 1
        return fn(*args, **kwargs)

    return wrapper


def _found(attr: str, *modules: str) -> Any:
    """``attr`` of the first of ``modules`` that has it (kda_tp's modules before and after the
    house move hold the same functions under other names)."""
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, attr):
            return getattr(module, attr)
    raise LookupError(f"none of {modules} has {attr}")


def _patch_everywhere(original: Any, label: str, when: Callable[..., bool] | None = None) -> None:
    """Replace ``original`` in every loaded kda_tp module that holds the same object."""
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
    """Import every kda_tp module (folders too) and wrap the counted functions."""
    for info in pkgutil.walk_packages(kda_tp.__path__, "kda_tp.",
                                      onerror=lambda name: None):
        if not set(info.name.split(".")[1:]) & set(SKIPPED):
            importlib.import_module(info.name)
    _patch_everywhere(_found("read_json", "kda_tp.model.json_reader", "kda_tp.config"),
                      "config.json reads",
                      lambda path, *a, **k: str(path).endswith("config.json")
                      and not str(path).endswith("hf_quant_config.json"))
    _patch_everywhere(_found("parse_config", "kda_tp.model.config", "kda_tp.config"),
                      "parse_config")
    _patch_everywhere(_found("quantization_config", "kda_tp.model.quant", "kda_tp.quant"),
                      "quantization_config")
    source = _found("SafetensorsSource", "kda_tp.checkpoint.reader", "kda_tp.checkpoint")
    layout = _found("EngineLayout", "kda_tp.engines")
    plan = _found("KdaTpPlan", "kda_tp.rank.plan", "kda_tp.plan")
    view = _found("KdaShardedSource", "kda_tp.rank.view", "kda_tp.source")
    description = _found("CheckpointDescription", "kda_tp.checkpoint.description",
                         "kda_tp.description")
    _patch_method(source, "names", "names() lists")
    # Every plan from a checkpoint goes through from_description where it exists.
    planned = "from_description" if "from_description" in vars(plan) else "from_config"
    _patch_method(plan, planned, "plans built", classmethod_=True)
    _patch_method(view, "__init__", "rank views")
    _patch_method(layout, "param_plan", "param_plan")
    _patch_method(description, "__init__", "descriptions")
    _patch_method(source, "__init__", "safetensors opens")
    _patch_everywhere(_found("engine_params", "kda_tp.engines.build"), "engine_params")
    _patch_everywhere(_found("engine_model_dtype", "kda_tp.engines.dtype"),
                      "engine_model_dtype")


def report(heading: str | None = None) -> None:
    if heading:
        print(f"{heading}:", file=sys.stderr)
    for label in LABELS:
        print(f"{'  ' if heading else ''}{label}: {COUNTS[label]}", file=sys.stderr)
    COUNTS.clear()


def guard(argv: list[str]) -> int:
    """The ``guard`` mode (the module's text)."""
    parser = argparse.ArgumentParser(prog="callcounts.py guard")
    parser.add_argument("checkpoint")
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--tp-size", type=int, default=4)
    parser.add_argument("--layout", help="the engine layout (default: vLLM 0.33's for the "
                        "checkpoint's family)")
    parser.add_argument("--dtype", default="BF16", help="the engine's model dtype (BF16)")
    args = parser.parse_args(argv)
    import numpy as np
    import torch

    from kda_tp.checkpoint.names import param_name
    from kda_tp.engines import get_layout, layouts_for

    build = (getattr(importlib.import_module("kda_tp.engines"), "build_param", None)
             or (lambda v, *a, **k: v.build_param(*a, **k)))  # a view's method before the move

    check = _found("check", "kda_tp.guard.check", "kda_tp.guard")
    update_check = _found("UpdateCheck", "kda_tp.guard._updates", "kda_tp.guard.updates", "kda_tp.update_check") \
        if not hasattr(importlib.import_module("kda_tp.guard"), "RankTarget") else None
    install()
    dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
              "F8_E4M3": torch.float8_e4m3fn}

    def as_torch(array: Any, dtype: str) -> Any:
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        return torch.from_numpy(flat.copy()).view(dtypes[dtype]).reshape(array.shape)

    # Not counted: the rank's parameters as the engine holds them, and what a refit feeds.
    with kda_tp.open_rank(args.checkpoint, tp_rank=args.tp_rank, tp_size=args.tp_size) as view:
        description = kda_tp.describe(view.source)
        if args.layout:
            layout = get_layout(args.layout)
        else:
            family = description.family
            layout = next(lay for lay in layouts_for(family.name, view.plan)
                          if lay.name.startswith("vllm-"))
        prefix = layout.state_dict_prefix(view.prefix)
        params = {}
        for layer, param in [(i, p) for i in view.layers for p in layout.params_for(view.plan)]:
            built = build(view, layout, param.suffix, layer, model_dtype=args.dtype)
            planned = layout.param_plan(param.suffix, view.plan, args.dtype)
            params[param_name(prefix, layer, param.suffix)] = as_torch(built, planned.dtype)
        fed = {}
        for name in view.source.names():
            if ".self_attn." in name and any(name.startswith(f"{view.prefix}{layer}.")
                                             for layer in view.layers):
                tensor = view.source.get(name)
                fed[name] = as_torch(np.asarray(tensor), tensor.dtype)
    COUNTS.clear()
    result = check(params, args.checkpoint, tp_rank=args.tp_rank, tp_size=args.tp_size,
                   engine=None, model_dtype=args.dtype, guard_mode="warn")
    print(f"guard: {result.line() if result is not None else 'not checked'} "
          f"({layout.name}, {len(params)} parameters)", file=sys.stderr)
    report("first-load guard (kda_tp.guard.check, one rank)")
    guard_module = importlib.import_module("kda_tp.guard")
    if hasattr(guard_module, "RankTarget"):  # built from the plan the first-load check built
        target = guard_module.RankTarget.of(result.plan, params)
        report("the rank's update target (RankTarget.of, once per model, from that check's "
               "plan)")
        session = guard_module.UpdateSession(target)
        for name, tensor in fed.items():
            session.feed(name, tensor)
        checked = session.close()
        heading = "one refit session (UpdateSession: feed, close)"
    else:
        session = update_check(args.checkpoint, params, tp_rank=args.tp_rank,
                               tp_size=args.tp_size)
        for name, tensor in fed.items():
            session.feed(name, tensor)
        checked = session.check(params)
        heading = "one refit session (UpdateCheck: construct, feed, check)"
    print(f"refit: {'passed' if checked.passed else checked.problems[:3]} "
          f"({checked.params} parameters, {checked.regions} regions, {len(fed)} tensors fed)",
          file=sys.stderr)
    report(heading)
    return 0 if (result is not None and result.passed and checked.passed) else 1


def main(argv: list[str]) -> int:
    if argv[:1] == ["guard"]:
        return guard(argv[1:])
    install()
    from kda_tp.cli import main as cli_main

    try:
        status = cli_main(argv)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    report()
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
