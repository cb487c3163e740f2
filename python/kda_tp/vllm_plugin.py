"""The guard inside vLLM 0.33: every tensor-parallel worker checks its KDA weights as they load.

``pip install kda_tp`` registers :func:`register` under vLLM's ``vllm.general_plugins`` entry
point group (``kda_tp_guard``). vLLM's ``load_general_plugins()`` runs it in every process,
each worker included, before the model loads (``vllm/v1/worker/worker_base.py``). It wraps:

* the ``load_weights`` of every model loader class (``DefaultModelLoader``,
  ``ShardedStateLoader``, ``RunaiModelStreamerLoader``, ...: every subclass of
  ``BaseModelLoader`` that defines one). ``BaseModelLoader.load_model`` calls it between
  building the model and ``process_weights_after_loading``, so the guard sees the values as
  the loader left them, before vLLM repacks any for its kernels;
* ``reload_weights`` (``vllm/model_executor/model_loader/reload/inplace.py``), the path of
  ``LLM.collective_rpc("reload_weights", kwargs={"weights_path": ...})``: after a reload from
  disk the guard runs again, on the new checkpoint.

It also gives vLLM's workers a method ``kda_tp_audit`` that :func:`audit_llm` calls on every
worker of a live ``LLM`` through ``collective_rpc``.

On each rank the guard is :func:`kda_tp.guard.check` with the rank and world size of vLLM's
own tensor-parallel group (``vllm.distributed.parallel_state``), the model's
``named_parameters()``, the KDA layers' derived decode buffers (K3's
``decode_conv1d_weight``, ``decode_norm_weight``, when the decode backend has them), and the
checkpoint: the model's local directory (a Hugging Face model id is resolved to its local
snapshot), or ``KDA_TP_GUARD_CHECKPOINT`` when set (needed for ``sharded_state``: its
directory holds the ranks' dumps, not the checkpoint). Skipped: the dummy loader (random
weights), a speculative-decoding draft model, models without KDA parameters. Under pipeline
parallelism a rank checks the KDA layers of its stage.

Importing this module imports no vLLM; :func:`register` and the wrapped functions import it.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import inspect
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from .guard import CHECKPOINT_ENV, DERIVED, GuardResult, check, holds_kda, looks_kda, mode

__all__ = ["WORKER_METHOD", "audit_llm", "guard_model", "register"]

#: The worker method :func:`register` adds, which :func:`audit_llm` calls.
WORKER_METHOD = "kda_tp_audit"

logger = logging.getLogger("kda_tp.guard")

# Loader classes whose load_weights only fill random or no weights: nothing to check.
_UNCHECKED_LOADERS = ("DummyModelLoader",)
# The derived copies' names any layout keeps (after `self_attn.`).
_DERIVED_NAMES = frozenset(n for copies in DERIVED.values() for n in copies)
_WRAPPED = "__kda_tp_guard__"
_state = threading.local()  # nested load_weights calls (a subclass calling super()): guard once
_installed = False


def register() -> None:
    """vLLM's entry point (``vllm.general_plugins``): install the guard on the model-loading
    path of this process. vLLM may call it several times per process; it installs once, and
    imports nothing of vLLM itself.

    Wraps the ``load_weights`` of every ``BaseModelLoader`` subclass vLLM defines (and of
    those later given to ``register_model_loader``), vLLM's in-place ``reload_weights``, and
    adds the worker method ``kda_tp_audit`` to ``WorkerBase``: at once for the modules this
    process has imported already, else as soon as it imports them (an import hook), so that a
    process that never loads a model (vLLM's API server) pays nothing.
    """
    global _installed
    if _installed:
        return
    _installed = True
    pending = {name: install for name, install in _INSTALLERS.items()
               if not _apply(name, install)}
    if pending:
        sys.meta_path.insert(0, _AfterImport(pending))


def _apply(name: str, install: Callable[[Any], None]) -> bool:
    """Run ``install`` on module ``name`` if it is imported (fully); whether it was."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    if module is None or getattr(spec, "_initializing", False):
        return False
    install(module)
    return True


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs an installer right after one of vLLM's modules is imported (it finds nothing
    itself: it wraps the loader that the other finders return)."""

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


def _install_loaders(model_loader: Any) -> None:
    """Wrap every loader class's ``load_weights`` and ``register_model_loader``
    (``vllm.model_executor.model_loader``, which imports every loader class)."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    for cls in _subclasses(BaseModelLoader):
        _wrap_loader(cls)
    original_register = model_loader.register_model_loader
    if getattr(original_register, _WRAPPED, False):
        return

    @functools.wraps(original_register)
    def register_model_loader(load_format: str) -> Callable[[type], type]:
        decorate = original_register(load_format)

        def wrap(cls: type) -> type:
            out: type = decorate(cls)
            for sub in (cls, *_subclasses(cls)):
                _wrap_loader(sub)
            return out
        return wrap

    setattr(register_model_loader, _WRAPPED, True)
    model_loader.register_model_loader = register_model_loader


def _add_worker_method(worker_base: Any) -> None:
    setattr(worker_base.WorkerBase, WORKER_METHOD, _worker_audit)


def _subclasses(cls: type) -> list[type]:
    found: list[type] = []
    todo: list[type] = list(cls.__subclasses__())
    while todo:
        sub = todo.pop()
        found.append(sub)
        todo.extend(sub.__subclasses__())
    return found


def _wrap_loader(cls: type) -> None:
    """Wrap ``cls.load_weights`` (if ``cls`` defines it) to run the guard after it."""
    original = cls.__dict__.get("load_weights")
    if original is None or getattr(original, _WRAPPED, False) or inspect.isabstract(cls):
        return

    @functools.wraps(original)
    def load_weights(self: Any, model: Any, model_config: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_state, "depth", 0)
        _state.depth = depth + 1
        try:
            out = original(self, model, model_config, *args, **kwargs)
        finally:
            _state.depth = depth
        if depth == 0:
            guard_model(model, model_config, loader=type(self).__name__)
        return out

    setattr(load_weights, _WRAPPED, True)
    cls.load_weights = load_weights  # type: ignore[attr-defined]


def _wrap_reload(inplace: Any) -> None:  # vllm.model_executor.model_loader.reload.inplace
    """Wrap vLLM's in-place ``reload_weights`` (and rebind it where vLLM imported it already)
    so that a reload from disk is checked against the new checkpoint."""
    original = inplace.reload_weights
    if getattr(original, _WRAPPED, False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def reload_weights(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        bound = signature.bind_partial(*args, **kwargs).arguments
        if bound.get("weights_iterator") is None and bound.get("is_checkpoint_format", True):
            config = bound["vllm_config"]
            path = bound.get("weights_path")
            guard_model(bound["model"], config.model_config, loader="reload_weights",
                        vllm_config=config, checkpoint=str(path) if path else None)
        return out

    setattr(reload_weights, _WRAPPED, True)
    inplace.reload_weights = reload_weights
    for name, module in list(sys.modules.items()):  # `from ... import reload_weights`
        if name.startswith("vllm.") and getattr(module, "reload_weights", None) is original:
            setattr(module, "reload_weights", reload_weights)


# What register() installs, by the vLLM module it patches.
_INSTALLERS: dict[str, Callable[[Any], None]] = {
    "vllm.model_executor.model_loader": _install_loaders,
    "vllm.model_executor.model_loader.reload.inplace": _wrap_reload,
    "vllm.v1.worker.worker_base": _add_worker_method,
}


def _checkpoint(model_config: Any, loader: str, given: str | None = None) -> str | None:
    """The checkpoint to check against: ``given`` (the ``weights_path`` a reload loaded
    from: that path, whatever ``KDA_TP_GUARD_CHECKPOINT`` says), else
    ``KDA_TP_GUARD_CHECKPOINT``, else the model's local directory (a Hugging Face id
    resolved to its cached snapshot); None for a ``sharded_state`` directory without the
    variable."""
    override = os.environ.get(CHECKPOINT_ENV)
    if given is None and override:
        return override
    if given is None and loader == "ShardedStateLoader":
        return None
    path = given or str(getattr(model_config, "model_weights", "") or model_config.model)
    if "://" in path or os.path.exists(path):
        return path
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(path, revision=getattr(model_config, "revision", None),
                                     local_files_only=True))
    except Exception:  # not in the local cache: check() warns that it is not local
        return path


def _attach_vllm_logging() -> None:
    """Show the guard's lines where vLLM's own go, unless logging was set up elsewhere."""
    guard = logging.getLogger("kda_tp.guard")
    if guard.handlers or logging.getLogger().handlers:
        return
    vllm_logger = logging.getLogger("vllm")
    for handler in vllm_logger.handlers:
        guard.addHandler(handler)
    if vllm_logger.handlers:
        guard.setLevel(min(vllm_logger.getEffectiveLevel(), logging.INFO))
        guard.propagate = False


def guard_model(model: Any, model_config: Any, *, loader: str = "",
                vllm_config: Any = None, guard_mode: str | None = None,
                checkpoint: str | None = None) -> GuardResult | None:
    """Run the guard on this worker's freshly loaded ``model`` (what the wrapped loaders call).

    Args:
        model: the ``torch.nn.Module`` vLLM loaded.
        model_config: the vLLM ``ModelConfig`` it was loaded with (``.model``,
            ``.model_weights``, ``.revision``).
        loader: the loader class's name (``"ShardedStateLoader"``...), or
            ``"reload_weights"``.
        vllm_config: vLLM's config, to tell a draft model apart (None: the current one).
        guard_mode: as for :func:`kda_tp.guard.check` (None: ``KDA_TP_GUARD``'s).
        checkpoint: the path the weights were just loaded from (``reload_weights``'s
            ``weights_path``): checked against it, ``KDA_TP_GUARD_CHECKPOINT`` ignored; None:
            the variable, else the model's path.

    Returns:
        The :class:`~kda_tp.guard.GuardResult`, or None when nothing was checked (see
        :func:`kda_tp.guard.check`; also the dummy loader, a draft model, a
        ``sharded_state`` load without ``KDA_TP_GUARD_CHECKPOINT``: one warning).

    Raises:
        GuardError: as :func:`kda_tp.guard.check` (mode ``fail``).
    """
    if (guard_mode or mode()) == "off" or loader in _UNCHECKED_LOADERS:
        return None
    params = {n: _as_processed(n, p) for n, p in model.named_parameters()}
    if not looks_kda(params):  # no KDA name (check() warns for one without A_log/dt_bias)
        return None
    from vllm.distributed import parallel_state

    if vllm_config is None:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None and model_config is getattr(spec, "draft_model_config", None):
        return None  # a draft / MTP model: not the KDA stack
    _attach_vllm_logging()
    tp = parallel_state.get_tp_group()
    rank, size = int(tp.rank_in_group), int(tp.world_size)
    where = f"vllm {loader}" if loader else "vllm"
    checkpoint = _checkpoint(model_config, loader, checkpoint)
    if checkpoint is None:
        warnings.warn(
            f"kda_tp guard: {where}: tp rank {rank}/{size}: a sharded_state load holds the "
            f"ranks' own dumps, not the checkpoint; set {CHECKPOINT_ENV} to the checkpoint it "
            "was saved from to check its KDA weights (not checked)",
            RuntimeWarning, stacklevel=2,
        )
        return None
    derived = {n: b for n, b in model.named_buffers()
               if b is not None and n.rpartition(".")[2] in _DERIVED_NAMES}
    return check(params, checkpoint, tp_rank=rank, tp_size=size, derived=derived,
                 where=where, layers=_stage_layers(params, parallel_state),
                 guard_mode=guard_mode, model_dtype=_model_dtype(model_config))


def _model_dtype(config: Any) -> str | None:
    """The engine's model dtype (its ``ModelConfig.dtype``, a torch dtype) as
    ``kda_tp.guard.check`` takes it; None when the config has none."""
    dtype = getattr(config, "dtype", None)
    return None if dtype is None else str(dtype)


def _as_processed(name: str, param: Any) -> Any:
    """``param`` as the layouts describe it: a ModelOpt ``FP8_PB_WO`` block scale is loaded
    ``[ob, 1, ib, 1]`` and squeezed to ``[ob, ib]`` only by ``process_weights_after_loading``
    (vLLM's ``KFp8Block128.process``), which runs after the guard; the squeezed view holds the
    same bytes. Every other parameter as it is."""
    shape = tuple(getattr(param, "shape", ()))
    if name.endswith(".weight_scale") and len(shape) == 4 and shape[1] == shape[3] == 1:
        return param.squeeze(3).squeeze(1)
    return param


def _stage_layers(names: Iterable[str], parallel_state: Any) -> list[int] | None:
    """Under pipeline parallelism, the decoder layers whose KDA parameters this stage holds;
    None (every KDA layer) without it."""
    try:
        stages = int(parallel_state.get_pp_group().world_size)
    except AssertionError:  # no pipeline group (a single process, as in tests)
        return None
    if stages <= 1:
        return None
    from .engines import param_location

    return sorted({loc[1] for n in names if holds_kda([n]) and (loc := param_location(n))})


def _worker_audit(worker: Any) -> dict[str, Any]:
    """The worker method ``kda_tp_audit``: this worker's guard report as a plain dict
    (collective_rpc results cross processes as msgpack)."""
    from vllm.distributed import parallel_state

    model = worker.model_runner.get_model()
    model_config = worker.vllm_config.model_config
    tp = parallel_state.get_tp_group()
    rank, size = int(tp.rank_in_group), int(tp.world_size)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        # Report, never raise, in a running engine.
        result = guard_model(model, model_config, loader="audit",
                             vllm_config=worker.vllm_config, guard_mode="warn")
    if result is None:
        why = "; ".join(str(w.message) for w in seen) or "no KDA parameter to check"
        return {"ok": None, "tp_rank": rank, "tp_size": size, "line": f"not checked: {why}",
                "report": None}
    return {"ok": result.passed, "tp_rank": rank, "tp_size": size, "line": result.line(),
            "params": result.params, "bytes": result.bytes, "seconds": result.seconds,
            "report": result.report.to_dict()}


def audit_llm(llm: Any) -> list[dict[str, Any]]:
    """Audit the KDA weights a live vLLM ``LLM`` holds, on every worker, now.

    Calls the worker method ``kda_tp_audit`` through ``llm.collective_rpc`` (the plugin
    must be installed in the workers: it is, when kda_tp is installed in vLLM's environment).
    Each worker checks its parameters as they are now (after any ``reload_weights``, against
    the model path vLLM now has) and reports; nothing is raised for a wrong rank.

    Args:
        llm: a ``vllm.LLM``.

    Returns:
        One dict per worker, in vLLM's worker order: ``ok`` (True, False, or None when
        nothing was checked), ``tp_rank``, ``tp_size``, ``line`` (the guard's one-line
        verdict, or why nothing was checked), ``params``, ``bytes``, ``seconds`` and
        ``report`` (``AuditReport.to_dict()``: every parameter's verdict and diagnosis).
    """
    return list(llm.collective_rpc(WORKER_METHOD))
