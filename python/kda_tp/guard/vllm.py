"""The guard inside vLLM 0.33: every tensor-parallel worker checks its KDA weights as they load
and after every weight update.

Installing kda_tp into vLLM's environment (the wheel, or ``pip install`` of the checkout)
registers :func:`register` under vLLM's ``vllm.general_plugins`` entry point group
(``kda_tp_guard``). vLLM's ``load_general_plugins()`` runs it in every process, each worker
included, before the model loads (``vllm/v1/worker/worker_base.py``); it logs one INFO line
(``kda_tp guard: registered in vLLM ...``). It wraps:

* the ``load_weights`` of every model loader class (``DefaultModelLoader``,
  ``ShardedStateLoader``, ``RunaiModelStreamerLoader``, ...: every subclass of
  ``BaseModelLoader`` that defines one). ``BaseModelLoader.load_model`` calls it between
  building the model and ``process_weights_after_loading``, so the guard sees the values as
  the loader left them, before vLLM repacks any for its kernels. The main model is checked
  against its checkpoint; a speculative draft (EAGLE, MTP: a separate model, ``runner="draft"``)
  is not the KDA stack and is skipped, while with n-gram, suffix or ``custom_class`` decoding
  (which share the target's config) the main model is checked as always;
* the loaded model's own ``load_weights`` (an instance attribute): every later call, a direct
  ``collective_rpc`` refit included, is an update (:mod:`kda_tp.guard.updates`): what it feeds
  is the reference, and the KDA parameters it touched are checked when the call returns;
* ``reload_weights`` (``vllm/model_executor/model_loader/reload/inplace.py``): a reload from disk
  is checked against the new checkpoint; a reload with a ``weights_iterator`` is one update
  session, checked when it returns; a kernel-format one (``is_checkpoint_format=False``) cannot
  be checked, which one warning says;
* ``WeightTransferEngineFactory.create_engine``: every weight-transfer engine (nccl, ipc,
  sparse_nccl, nccl_m2n, sharded_rdt, or one registered by a user) is followed:
  ``start_weight_update`` opens an update session, each ``update_weights`` chunk feeds it through
  the model's ``load_weights``, and ``finish_weight_update`` checks every KDA parameter the
  session touched (a fused parameter whose parts came in several chunks included) and raises
  the diagnosis in mode ``fail``;
* the tensorizer loader's path for a model that is not vLLM-tensorized (it calls
  ``model.load_weights`` directly, with no checkpoint directory): one warning that it is not
  checked.

After every update the derived copies kda_tp knows (:data:`kda_tp.engines.DERIVED`: K3's decode
buffers, GLM-5.3's ``_merged_conv_weight``) are checked against their parameters; with
``KDA_TP_GUARD_REPAIR=1`` (:data:`REPAIR_ENV`, off by default) GLM-5.3's
``_merged_conv_weight`` is invalidated after every load and update instead, so that vLLM
rebuilds it on the next forward (vLLM #55087).

It also gives vLLM's workers a method ``kda_tp_audit`` that :func:`audit_llm` calls on every
worker of a live ``LLM`` through ``collective_rpc``: each rank's verdict, the engine and kda_tp
versions, the hooks armed and missing, the checks run and the last verdict.

On each rank the first-load guard is :func:`kda_tp.guard.check` with the rank and world size of
vLLM's own tensor-parallel group (``vllm.distributed.parallel_state``), the model's
``named_parameters()``, the derived copies, the engine's model dtype (``model_config.dtype``),
and the checkpoint: the model's local directory (a Hugging Face model id is resolved to its
local snapshot in the engine's ``download_dir``), or ``KDA_TP_GUARD_CHECKPOINT`` when set
(stripped; a path that is not there is a ``GuardError`` in mode ``fail``; needed for
``sharded_state``: its directory holds the ranks' dumps, not the checkpoint). Skipped: the dummy
loader (random weights; its later updates are checked), a draft model, models without KDA
parameters. Under pipeline parallelism a rank checks the KDA layers of its stage (every layer
with a KDA name: one whose ``A_log`` is missing is reported missing).

Importing this module imports no vLLM; :func:`register` and the wrapped functions import it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..engines.derived import DERIVED_ATTRIBUTES, derived_copies
from ..engines.dtype import model_dtype_name
from ..errors import KdaTpError
from .first_load import (
    CHECKPOINT_ENV,
    GuardResult,
    cannot_check,
    check,
    explicit_checkpoint,
    looks_kda,
    mode,
    rank_report,
    resolve_checkpoint,
    stage_layers,
)
from .hooks import after_import, subclasses
from .updates import Followed, follow, followed, warn_once

__all__ = ["REPAIR_ENV", "WORKER_METHOD", "audit_llm", "follow_updates", "guard_model",
           "register", "status"]

#: The worker method :func:`register` adds, which :func:`audit_llm` calls.
WORKER_METHOD = "kda_tp_audit"
#: The opt-in repair switch: ``1`` invalidates GLM-5.3's ``_merged_conv_weight`` after every
#: load and update, so that vLLM rebuilds it from the new conv weights (vLLM #55087).
REPAIR_ENV = "KDA_TP_GUARD_REPAIR"

logger = logging.getLogger("kda_tp.guard")

# Loader classes whose load_weights only fill random or no weights: nothing to check.
_UNCHECKED_LOADERS = ("DummyModelLoader",)
_WRAPPED = "__kda_tp_guard__"
_F = TypeVar("_F", bound=Callable[..., Any])
_state = threading.local()  # nested load_weights calls (a subclass calling super()): guard once
_installed = False


@dataclass
class _Armed:
    """This process's record: the hooks installed and those that could not be, the checks
    run and the last verdict (what :func:`status` reports)."""

    hooks: dict[str, str] = field(default_factory=dict)
    checks: dict[str, int] = field(default_factory=dict)
    last: str = ""

    def ran(self, kind: str, line: str) -> None:
        self.checks[kind] = self.checks.get(kind, 0) + 1
        self.last = line


_armed = _Armed()


def status() -> dict[str, Any]:
    """This process's guard: ``versions`` (vLLM's and kda_tp's), ``mode``, ``hooks`` (each
    target: ``"armed"`` or why it is not), ``checks`` (how many ran, by kind: ``first load``,
    ``update``) and ``last`` (the last verdict line)."""
    from .._native import __version__

    vllm = sys.modules.get("vllm")
    try:
        chosen = mode()
    except KdaTpError as error:
        chosen = f"invalid: {error}"
    return {"versions": {"vllm": str(getattr(vllm, "__version__", "not imported")),
                         "kda_tp": __version__},
            "mode": chosen, "hooks": dict(_armed.hooks), "checks": dict(_armed.checks),
            "last": _armed.last}


def register() -> None:
    """vLLM's entry point (``vllm.general_plugins``): install the guard on the model-loading
    and weight-update paths of this process, and say so in one INFO line. vLLM may call it
    several times per process; it installs once, and imports nothing of vLLM itself.

    What it wraps: see the module docstring. Each hook is installed at once for the modules
    this process has imported already, else as soon as it imports them (an import hook), so
    that a process that never loads a model (vLLM's API server) pays nothing.

    Raises:
        GuardModeError: ``KDA_TP_GUARD`` holds another value than ``fail``, ``warn``, ``off``
            (vLLM lets a plugin's exception stop the start-up).
        GuardError: mode ``fail`` and a hook target is missing in an imported vLLM module.
    """
    global _installed
    if _installed:
        return
    chosen = mode()
    _installed = True
    _attach_vllm_logging()
    logger.info("kda_tp guard: registered in vLLM (mode %s): checks the KDA weights of every "
                "model load and weight update on every rank", chosen)
    after_import(_INSTALLERS)


def _hook(target: str, found: Any) -> bool:
    """Record hook ``target`` as armed (``found`` is not None) or missing. A missing target is
    an error in mode ``fail`` (raised into vLLM's import of the module, which it does not
    swallow), a warning in ``warn``; whether it is armed."""
    if found is not None:
        _armed.hooks[target] = "armed"
        return True
    _armed.hooks[target] = "missing: not in this vLLM version"
    cannot_check(f"kda_tp guard: cannot hook {target} (not in this vLLM version); the weights "
                 "it loads are not checked (a vLLM version kda_tp does not know?)")
    return False


def _unwrapped(owner: Any, attr: str, target: str) -> Any:
    """``owner.attr`` (hook ``target``: :func:`_hook`) unless missing or wrapped already."""
    original = getattr(owner, attr, None)
    if not _hook(target, original) or getattr(original, _WRAPPED, False):
        return None
    return original


def _mark(wrapper: _F) -> _F:
    """``wrapper``, marked as kda_tp's (so that it is never wrapped again)."""
    setattr(wrapper, _WRAPPED, True)
    return wrapper


def _install_loaders(model_loader: Any) -> None:
    """Wrap every loader class's ``load_weights`` and ``register_model_loader``
    (``vllm.model_executor.model_loader``, which imports every loader class)."""
    base: Any = getattr(sys.modules.get("vllm.model_executor.model_loader.base_loader"),
                   "BaseModelLoader", None)
    if not _hook("vllm.model_executor.model_loader.base_loader.BaseModelLoader", base):
        return
    for cls in subclasses(base):
        _wrap_loader(cls)
    original_register = _unwrapped(model_loader, "register_model_loader",
                                   "vllm.model_executor.model_loader.register_model_loader")
    if original_register is None:
        return

    @_mark
    @functools.wraps(original_register)
    def register_model_loader(load_format: str) -> Callable[[type], type]:
        decorate = original_register(load_format)

        def wrap(cls: type) -> type:
            out: type = decorate(cls)
            for sub in (cls, *subclasses(cls)):
                _wrap_loader(sub)
            return out
        return wrap

    model_loader.register_model_loader = register_model_loader


def _add_worker_method(worker_base: Any) -> None:
    target = getattr(worker_base, "WorkerBase", None)
    if _hook("vllm.v1.worker.worker_base.WorkerBase", target):
        setattr(target, WORKER_METHOD, _worker_audit)


def _wrap_loader(cls: type) -> None:
    """Wrap ``cls.load_weights`` (if ``cls`` defines it) to run the guard after it and to
    follow the model's later updates."""
    original = cls.__dict__.get("load_weights")
    if original is None or getattr(original, _WRAPPED, False) or inspect.isabstract(cls):
        return

    @_mark
    @functools.wraps(original)
    def load_weights(self: Any, model: Any, model_config: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_state, "depth", 0)
        _state.depth = depth + 1
        try:
            with _quiet(model):
                out = original(self, model, model_config, *args, **kwargs)
        finally:
            _state.depth = depth
        if depth == 0:
            loader = type(self).__name__
            guard_model(model, model_config, loader=loader)
            follow_updates(model, model_config)
            _repair(model)
        return out

    cls.load_weights = load_weights  # type: ignore[attr-defined]


def _wrap_reload(inplace: Any) -> None:  # vllm.model_executor.model_loader.reload.inplace
    """Wrap vLLM's in-place ``reload_weights`` (and rebind it where vLLM imported it already):
    a reload from disk is checked against the new checkpoint, one from an iterator is an
    update session."""
    original = _unwrapped(inplace, "reload_weights",
                          "vllm.model_executor.model_loader.reload.inplace.reload_weights")
    if original is None:
        return
    signature = inspect.signature(original)

    @_mark
    @functools.wraps(original)
    def reload_weights(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs).arguments
        model, config = bound["model"], bound["vllm_config"]
        checkpoint_format = bound.get("is_checkpoint_format", True)
        if bound.get("weights_iterator") is None:
            with _quiet(model):
                out = original(*args, **kwargs)
            if checkpoint_format:
                path = bound.get("weights_path")
                guard_model(model, config.model_config, loader="reload_weights",
                            vllm_config=config, checkpoint=str(path) if path else None)
                _repair(model)
            else:
                warn_once("kda_tp guard: a reload_weights from disk with "
                          "is_checkpoint_format=False is not checked (vLLM itself warns that "
                          "weights read from disk are in checkpoint format)")
            return out
        if not checkpoint_format:
            warn_once("kda_tp guard: a reload_weights with is_checkpoint_format=False feeds kernel-format "
                            "tensors (already sharded and repacked), which kda_tp cannot place "
                            "by the plan; its KDA weights are not checked")
            return original(*args, **kwargs)
        follow_updates(model, config.model_config, config)
        with _session(model, "reload_weights"):
            return original(*args, **kwargs)

    inplace.reload_weights = reload_weights
    for name, module in list(sys.modules.items()):  # `from ... import reload_weights`
        if name.startswith("vllm.") and getattr(module, "reload_weights", None) is original:
            setattr(module, "reload_weights", reload_weights)


def _wrap_transfer(factory: Any) -> None:  # vllm.distributed.weight_transfer.factory
    """Wrap ``WeightTransferEngineFactory.create_engine``: every engine it makes is followed
    (its sessions checked at ``finish_weight_update``)."""
    cls: Any = getattr(factory, "WeightTransferEngineFactory", None)
    original = _unwrapped(cls, "create_engine", "vllm.distributed.weight_transfer.factory."
                          "WeightTransferEngineFactory.create_engine")
    if original is None:
        return
    create = original.__func__

    @_mark
    @functools.wraps(create)
    def create_engine(klass: Any, config: Any, vllm_config: Any, device: Any, model: Any
                      ) -> Any:
        engine = create(klass, config, vllm_config, device, model)
        follow_transfer(engine, vllm_config)
        return engine

    cls.create_engine = classmethod(create_engine)


def follow_transfer(engine: Any, vllm_config: Any) -> None:
    """Follow one weight-transfer engine (``WeightTransferEngine``): its
    ``start_weight_update`` opens an update session on the main model (a session aimed at a
    draft model is not checked), its ``finish_weight_update`` checks what the session touched.

    Raises:
        GuardError: from ``finish_weight_update``, in mode ``fail``, when a KDA parameter the
            session touched is wrong.
    """
    start, finish = engine.start_weight_update, engine.finish_weight_update
    if getattr(start, _WRAPPED, False):
        return
    follow_updates(engine.model, getattr(engine, "model_config", None), vllm_config)
    opened: list[Any] = []

    @_mark
    def start_weight_update() -> None:
        model = engine.model
        main = model is getattr(engine, "_default_model", model)
        how = followed(model) if main else None
        if how is not None and how.session is None and how.open("weight transfer"):
            opened.append(how)
        try:
            start()
        except BaseException:
            _drop(opened)
            raise

    def finish_weight_update() -> None:
        try:
            finish()
        except BaseException:
            _drop(opened)
            raise
        while opened:
            opened.pop().close("weight transfer")

    engine.start_weight_update = start_weight_update
    engine.finish_weight_update = finish_weight_update


def _drop(opened: list[Any]) -> None:
    """Forget the sessions of a failed transfer (vLLM reports that failure itself)."""
    while opened:
        opened.pop().session = None


def _wrap_tensorizer(module: Any) -> None:  # ...model_loader.tensorizer_loader
    """The tensorizer loader's path for a model that is not vLLM-tensorized calls
    ``model.load_weights`` itself with no checkpoint directory: one warning that it is not
    checked."""
    cls: Any = getattr(module, "TensorizerLoader", None)
    original = _unwrapped(cls, "_load_model_serialized_cpu", "vllm.model_executor.model_loader."
                          "tensorizer_loader.TensorizerLoader._load_model_serialized_cpu")
    if original is None:
        return

    @_mark
    @functools.wraps(original)
    def load(self: Any, *args: Any, **kwargs: Any) -> Any:
        model = original(self, *args, **kwargs)
        if looks_kda(n for n, _ in model.named_parameters()):
            warn_once("kda_tp guard: a tensorizer load of a model that is not vLLM-tensorized streams "
                            "its weights from a tensorizer URI, not a checkpoint directory; its "
                            "KDA weights are not checked at load (later updates are)")
            follow_updates(model, None)
        return model

    cls._load_model_serialized_cpu = load


# What register() installs, by the vLLM module it patches.
_INSTALLERS: dict[str, Callable[[Any], None]] = {
    "vllm.model_executor.model_loader": _install_loaders,
    "vllm.model_executor.model_loader.reload.inplace": _wrap_reload,
    "vllm.model_executor.model_loader.tensorizer_loader": _wrap_tensorizer,
    "vllm.distributed.weight_transfer.factory": _wrap_transfer,
    "vllm.v1.worker.worker_base": _add_worker_method,
}


def _checkpoint(model_config: Any, loader: str, given: str | None = None,
                download_dir: str | None = None, where: str = "vllm") -> str | None:
    """The checkpoint to check against: ``given`` (the ``weights_path`` a reload loaded
    from: that path, whatever ``KDA_TP_GUARD_CHECKPOINT`` says), else
    ``KDA_TP_GUARD_CHECKPOINT`` (stripped), else the model's local directory (a Hugging Face
    id resolved to its cached snapshot, in ``download_dir`` when the engine downloads there);
    None for a ``sharded_state`` directory without the variable, and ``""`` (checked against
    nothing) for a variable naming a path that is not there in mode ``warn``.

    Raises:
        GuardError: mode ``fail`` and ``KDA_TP_GUARD_CHECKPOINT`` names a path that is not there.
    """
    if given is None:
        override = explicit_checkpoint(where)
        if override is not None:
            return override
    if given is None and loader == "ShardedStateLoader":
        return None
    path = given or str(getattr(model_config, "model_weights", "") or model_config.model)
    return resolve_checkpoint(path, revision=getattr(model_config, "revision", None),
                              download_dir=download_dir)


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


def _current_config(vllm_config: Any) -> Any:
    if vllm_config is not None:
        return vllm_config
    from vllm.config import get_current_vllm_config_or_none

    return get_current_vllm_config_or_none()


def _is_draft(model_config: Any, vllm_config: Any) -> bool:
    """Whether ``model_config`` is a speculative draft's: a separate model (vLLM builds its
    ``ModelConfig`` with ``runner="draft"``: EAGLE, MTP, draft models), not the target's config
    that n-gram, suffix and ``custom_class`` decoding reuse as their "draft" config."""
    if getattr(model_config, "runner_type", None) == "draft":
        return True
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None)
    if spec is None or draft is None or model_config is not draft:
        return False
    targets = (getattr(spec, "target_model_config", None),
               getattr(vllm_config, "model_config", None))
    return not any(draft is target for target in targets)


def _rank() -> tuple[int, int]:
    from vllm.distributed import parallel_state

    tp = parallel_state.get_tp_group()
    return int(tp.rank_in_group), int(tp.world_size)


def guard_model(model: Any, model_config: Any, *, loader: str = "",
                vllm_config: Any = None, guard_mode: str | None = None,
                checkpoint: str | None = None) -> GuardResult | None:
    """Run the guard on this worker's freshly loaded ``model`` (what the wrapped loaders call).

    Args:
        model: the ``torch.nn.Module`` vLLM loaded.
        model_config: the vLLM ``ModelConfig`` it was loaded with (``.model``,
            ``.model_weights``, ``.revision``, ``.dtype``).
        loader: the loader class's name (``"ShardedStateLoader"``...), or
            ``"reload_weights"``.
        vllm_config: vLLM's config, to tell a draft model apart and find the download
            directory (None: the current one).
        guard_mode: as for :func:`kda_tp.guard.check` (None: ``KDA_TP_GUARD``'s).
        checkpoint: the path the weights were just loaded from (``reload_weights``'s
            ``weights_path``): checked against it, ``KDA_TP_GUARD_CHECKPOINT`` ignored; None:
            the variable, else the model's path.

    Returns:
        The :class:`~kda_tp.guard.GuardResult`, or None when nothing was checked (see
        :func:`kda_tp.guard.check`; also the dummy loader, a draft model, a
        ``sharded_state`` load without ``KDA_TP_GUARD_CHECKPOINT``: one warning).

    Raises:
        GuardError: as :func:`kda_tp.guard.check` (mode ``fail``); also a
            ``KDA_TP_GUARD_CHECKPOINT`` that is not there.
    """
    if (guard_mode or mode()) == "off" or loader in _UNCHECKED_LOADERS:
        return None
    params = {n: _as_processed(n, p) for n, p in model.named_parameters()}
    if not looks_kda(params):  # no KDA name (check() warns for one without A_log/dt_bias)
        return None
    vllm_config = _current_config(vllm_config)
    if _is_draft(model_config, vllm_config):
        return None  # a draft / MTP model: not the KDA stack
    _attach_vllm_logging()
    rank, size = _rank()
    where = f"vllm {loader}" if loader else "vllm"
    download = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
    found = _checkpoint(model_config, loader, checkpoint, download,
                        f"{where}: tp rank {rank}/{size}")
    if found is None:
        warnings.warn(
            f"kda_tp guard: {where}: tp rank {rank}/{size}: a sharded_state load holds the "
            f"ranks' own dumps, not the checkpoint; set {CHECKPOINT_ENV} to the checkpoint it "
            "was saved from to check its KDA weights (not checked)",
            RuntimeWarning, stacklevel=2,
        )
        return None
    if not found:
        return None  # a KDA_TP_GUARD_CHECKPOINT that is not there, in mode warn: warned
    result = check(params, found, tp_rank=rank, tp_size=size, derived=derived_copies(model),
                   where=where, layers=_stage_layers(params), guard_mode=guard_mode,
                   model_dtype=model_dtype_name(getattr(model_config, "dtype", None)))
    if result is not None:
        _armed.ran("first load" if loader not in ("audit", "reload_weights") else loader,
                   result.line())
    return result


def _as_processed(name: str, param: Any) -> Any:
    """``param`` as the layouts describe it: a ModelOpt ``FP8_PB_WO`` block scale is loaded
    ``[ob, 1, ib, 1]`` and squeezed to ``[ob, ib]`` only by ``process_weights_after_loading``
    (vLLM's ``KFp8Block128.process``), which runs after the guard; the squeezed view holds the
    same bytes. Every other parameter as it is."""
    shape = tuple(getattr(param, "shape", ()))
    if name.endswith(".weight_scale") and len(shape) == 4 and shape[1] == shape[3] == 1:
        return param.squeeze(3).squeeze(1)
    return param


def _stage_layers(names: Iterable[str]) -> list[int] | None:
    """Under pipeline parallelism, the decoder layers whose KDA parameters this stage holds
    (every layer with a KDA name, so that a layer whose markers are missing is reported);
    None (every KDA layer) without it."""
    from vllm.distributed import parallel_state

    try:
        stages = int(parallel_state.get_pp_group().world_size)
    except AssertionError:  # no pipeline group (a single process, as in tests)
        return None
    return stage_layers(names) if stages > 1 else None


# ------------------------------------------------------------------------------------------
# Updates: what the model's load_weights is fed after the first load


def follow_updates(model: Any, model_config: Any, vllm_config: Any = None) -> None:
    """Check every later update of ``model`` (the main model of this worker): its own
    ``load_weights`` is wrapped (:func:`kda_tp.guard.follow`) so that each call feeds
    the open update session, or is one update by itself, checked when it returns.
    Idempotent; a draft model or a model without KDA names is not followed.

    Args:
        model: the loaded ``torch.nn.Module``.
        model_config: its vLLM ``ModelConfig`` (None: the current vLLM config's).
        vllm_config: vLLM's config (None: the current one).
    """
    if followed(model) is not None or not callable(getattr(model, "load_weights", None)):
        return
    if not looks_kda(n for n, _ in model.named_parameters()):
        return
    try:
        vllm_config = _current_config(vllm_config)
    except ImportError:
        vllm_config = None
    model_config = model_config or getattr(vllm_config, "model_config", None)
    if _is_draft(model_config, vllm_config):
        return
    download = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
    ref: Callable[[], Any] = weakref.ref(model)  # the record must not keep the model alive

    def checkpoint() -> str | None:
        if model_config is None:
            return None
        rank, size = _rank()
        return _checkpoint(model_config, "update", None, download,
                           f"vllm update: tp rank {rank}/{size}")

    follow(model, Followed(
        "vllm", checkpoint, _rank,
        lambda: {n: _as_processed(n, p) for n, p in ref().named_parameters()},
        lambda: derived_copies(ref()), lambda: _repair(ref()),
        lambda line: _armed.ran("update", line)))
    _armed.hooks.setdefault("model.load_weights (updates)", "armed")


def _quiet(model: Any) -> contextlib.AbstractContextManager[Any]:
    """No update session while a loader fills ``model`` (its own check covers it)."""
    how = followed(model)
    return how.quietly() if how is not None else contextlib.nullcontext()


def _session(model: Any, where: str) -> contextlib.AbstractContextManager[Any]:
    """One update session on ``model``, checked when the block ends without an error."""
    how = followed(model)
    return how.update(where) if how is not None else contextlib.nullcontext()


def _repair(model: Any) -> None:
    """With ``KDA_TP_GUARD_REPAIR=1``: drop every stale-prone cached copy kda_tp knows
    (GLM-5.3's ``_merged_conv_weight``) so that the engine rebuilds it on the next forward."""
    if os.environ.get(REPAIR_ENV, "").strip() not in ("1", "true", "yes", "on"):
        return
    for module in model.modules():
        for attribute in DERIVED_ATTRIBUTES:
            if module.__dict__.get(attribute) is not None:
                setattr(module, attribute, None)


# ------------------------------------------------------------------------------------------
# A running engine


def _worker_audit(worker: Any) -> dict[str, Any]:
    """The worker method ``kda_tp_audit``: this worker's guard report as a plain dict
    (collective_rpc results cross processes as msgpack)."""
    model = worker.model_runner.get_model()
    model_config = worker.vllm_config.model_config
    rank, size = _rank()
    # "fail" to get the reason; a running engine is never stopped from here
    return {**rank_report(lambda: guard_model(model, model_config, loader="audit",
                                              vllm_config=worker.vllm_config, guard_mode="fail"),
                          tp_rank=rank, tp_size=size, where="vllm audit"), **status()}


def audit_llm(llm: Any) -> list[dict[str, Any]]:
    """Audit the KDA weights a live vLLM ``LLM`` holds, on every worker, now.

    Calls the worker method ``kda_tp_audit`` through ``llm.collective_rpc`` (the plugin
    must be installed in the workers: it is, when kda_tp is installed in vLLM's environment
    and ``VLLM_PLUGINS``, if set, names ``kda_tp_guard``). Each worker checks its parameters
    as they are now (after any update, against the model path vLLM now has) and reports;
    nothing is raised for a wrong rank.

    Args:
        llm: a ``vllm.LLM``.

    Returns:
        One dict per worker, in vLLM's worker order, with the keys of
        ``kda_tp.guard.rank_report`` (the SGLang plugin's audit returns the same): ``ok``
        (True, False, or None when nothing was checked), ``guarded`` (False for a worker
        without the guard, or one that did not answer), ``tp_rank``, ``tp_size``, ``where``
        (``"vllm audit"``), ``line`` (the guard's one-line verdict, or ``not checked:
        <why>``), ``skipped``, ``engine``, ``params``, ``bytes``, ``seconds``, ``summary``,
        ``text``, ``report`` (``AuditReport.to_dict()``: every parameter's verdict and
        diagnosis), and the worker's ``versions``, ``mode``, ``hooks`` (armed or missing),
        ``checks`` (run, by kind) and ``last`` (the last verdict before this audit).
    """
    plugins = os.environ.get("VLLM_PLUGINS")
    hint = ""
    if plugins is not None and "kda_tp_guard" not in [p.strip() for p in plugins.split(",")]:
        hint = f" (VLLM_PLUGINS={plugins!r} leaves out kda_tp_guard: the workers are unguarded)"
        warn_once(f"kda_tp guard: VLLM_PLUGINS={plugins!r} leaves out kda_tp_guard: vLLM does not "
                        "load the guard, no load or update is checked")
    try:
        answers = list(llm.collective_rpc(WORKER_METHOD))
    except Exception as error:  # noqa: BLE001 - a worker without the method: unguarded
        return [_unguarded(f"the workers do not answer {WORKER_METHOD} "
                           f"({type(error).__name__}: {error}){hint}")]
    return [answer if isinstance(answer, dict) else
            _unguarded(f"worker {i} answered {answer!r}{hint}") for i, answer in enumerate(answers)]


def _unguarded(why: str) -> dict[str, Any]:
    """A worker's report when it has no guard to answer (:func:`audit_llm`)."""
    return {"ok": None, "guarded": False, "tp_rank": None, "tp_size": None,
            "line": f"unguarded: {why}", "report": None}
