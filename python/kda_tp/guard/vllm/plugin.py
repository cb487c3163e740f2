"""The guard inside vLLM 0.33: every tensor-parallel worker checks its KDA weights as they load
and after every weight update.

Installing kda_tp into vLLM's environment (the wheel, or ``pip install`` of the checkout)
registers :func:`register` under vLLM's ``vllm.general_plugins`` entry point group
(``kda_tp_guard``). vLLM's ``load_general_plugins()`` runs it in every process, each worker
included, before the model loads (``vllm/v1/worker/worker_base.py``); it logs one INFO line
(``kda_tp guard: registered in vLLM ...``). It wraps:

* the ``load_weights`` of every model loader class (``DefaultModelLoader``,
  ``ShardedStateLoader``, ``DummyModelLoader``, ...: every subclass of ``BaseModelLoader``
  that defines one). ``BaseModelLoader.load_model`` calls it between building the model and
  ``process_weights_after_loading``, so the guard sees the values as the loader left them. The
  main model is checked against its checkpoint (a dummy load is not: random values; its first
  update must fill every KDA region); a speculative draft (EAGLE, MTP: ``runner="draft"``) is
  skipped, while n-gram, suffix or ``custom_class`` decoding (the target's config) is not;
* the loaded model's own ``load_weights`` (an instance attribute, ``kda_tp.guard._live``):
  every later call, a direct ``collective_rpc`` refit included, feeds the update session open
  on the model, or is one update by itself, checked when it returns;
* ``initialize_layerwise_reload`` / ``finalize_layerwise_processing``
  (``vllm/model_executor/model_loader/reload/layerwise.py``): the layerwise reload, whoever
  runs it (vLLM's weight-transfer engines, ``reload_weights``, an RL stack directly), is one
  update session from the first to the second, checked when it finalizes: inside it vLLM
  holds the parameters on the meta device and applies each layer when all of it is in;
* ``reload_weights`` (``reload/inplace.py``): a reload from disk is checked against the new
  checkpoint; one with a ``weights_iterator`` is one update session; a kernel-format one
  (``is_checkpoint_format=False``) cannot be checked, which one warning says;
* ``WeightTransferEngineFactory.create_engine``: every weight-transfer engine (nccl, ipc,
  sparse_nccl, nccl_m2n, sharded_rdt, or a user's) is followed (``transfer``):
  ``start_weight_update`` opens an update session, ``finish_weight_update`` checks it (one
  that bypassed ``load_weights``: padding rows, derived copies, the trainer's digests handed
  over by ``expect_digests``) and raises the diagnosis in mode ``fail``;
* ``process_weights_after_loading`` (``model_loader/utils.py``), which ends a refit made of
  plain ``load_weights`` calls (verl, NeMo-RL): after a dummy load, a KDA part the refit never
  loaded is named there; the MLA layers' ``W_UK_T`` / ``W_UV``, which it builds (at the first
  load after the first-load check, and at every refit's end), are judged against what the
  local ``kv_b_proj`` derives (``Follower.derived_built``);
* the tensorizer loader's path for a model that is not vLLM-tensorized (no checkpoint
  directory): one warning that its load is not checked.

After every update the derived copies kda_tp knows (``kda_tp.engines.derived.DERIVED``: K3's
decode buffers, GLM-5.3's ``_merged_conv_weight``) are checked against their parameters; with
``KDA_TP_GUARD_REPAIR=1`` (:data:`REPAIR_ENV`, off by default) GLM-5.3's
``_merged_conv_weight`` is dropped after every load and update instead, so that vLLM rebuilds
it on the next forward (vLLM #55087).

It also gives vLLM's workers the method ``kda_tp_audit`` (``kda_tp.guard.vllm.audit``) that
``audit_llm`` calls on every worker of a live ``LLM`` through ``collective_rpc``: each rank's
verdict and its reference, the engine and kda_tp versions, the hooks armed and missing, the
checks run and the last verdict.

On each rank the first-load guard is :func:`kda_tp.guard.check` with the rank and world size of
vLLM's own tensor-parallel group, the model's ``named_parameters()`` and derived copies, the
engine's model dtype and the checkpoint of :func:`kda_tp.guard.load_checkpoint`; under
pipeline parallelism a rank checks the KDA layers of its stage.

Importing this module imports no vLLM; :func:`register` and the wrapped functions import it.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from ...errors import GuardModeError
from .._first_load import GuardResult
from .._live import Follower, followed, repair
from .._load import follow_model, on_load
from .._modes import MODE_ENV, REPAIR_ENV, LoadSource, cannot_check, mode, warn_once
from .._names import looks_kda
from .._record import RECORD
from .._record import status as _status
from ._hooks import after_import, subclasses
from .audit import WORKER_METHOD, worker_audit
from .facts import VllmEngine
from .transfer import add_digests_method, follow_transfer

__all__ = ["REPAIR_ENV", "follow_updates", "guard_model", "register", "status"]

logger = logging.getLogger("kda_tp.guard")

_WRAPPED = "__kda_tp_guard__"
_F = TypeVar("_F", bound=Callable[..., Any])
_state = threading.local()  # nested load_weights calls (a subclass calling super()): guard once
_installed = False
_LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"


def status() -> dict[str, Any]:
    """This process's guard: ``kda_tp.guard._record.status`` for vLLM."""
    return _status("vllm")


def register() -> None:
    """vLLM's entry point (``vllm.general_plugins``): install the guard on the model-loading
    and weight-update paths of this process (at once for the modules imported already, else
    as soon as they are: a process that never loads a model pays nothing), and say so in one
    INFO line. vLLM may call it several times per process; it installs once.

    A hook target this vLLM lacks (a release that keeps its loaders elsewhere) never stops
    the engine: the guard arms what it can and says in one WARNING per missing target what
    it could not; a KDA model loaded later is refused in mode ``fail`` at its first load,
    naming the vLLM version, what is missing and ``KDA_TP_GUARD=warn``;
    a model with no KDA layer loads as without the guard.

    Raises:
        GuardModeError: ``KDA_TP_GUARD`` holds another value than ``fail``, ``warn``, ``off``
            (vLLM lets a plugin's exception stop the start-up); the hooks are installed first,
            so that every load they see raises it too (vLLM marks its plugins loaded before
            it calls them: a retry in the same process is guarded).
    """
    global _installed
    if _installed:
        return
    _installed = True
    try:
        chosen = mode()
    except GuardModeError:
        after_import(_INSTALLERS)  # every load these hooks see raises the same error
        raise
    what = (f"checks nothing ({MODE_ENV}=off); audit_llm still audits on request"
            if chosen == "off" else
            "checks the KDA weights of every model load and weight update on every rank")
    logger.info("kda_tp guard: registered in vLLM (mode %s): %s", chosen, what)
    after_import(_INSTALLERS)


def _version() -> str:
    """The running vLLM's version (``"?"`` when it says none)."""
    return str(getattr(sys.modules.get("vllm"), "__version__", "?"))


def _hook(target: str, found: Any) -> bool:
    """Record hook ``target`` as armed (``found`` is not None) or missing; whether it is
    armed. A missing one is one WARNING, never an exception into vLLM's import: the engine
    starts, and a KDA model is refused at its first load in mode ``fail`` (``_unhooked``)."""
    if found is not None:
        RECORD.hooks[target] = "armed"
        return True
    _missing(target, f"not in vLLM {_version()}")
    return False


def _missing(target: str, why: str) -> None:
    """Hook ``target`` could not be armed (``why``): recorded, and said in one WARNING."""
    RECORD.hooks[target] = f"missing: {why}"
    logger.warning("kda_tp guard: cannot hook %s (%s); the engine starts, and a model with "
                   "no KDA layer loads as without the guard; the KDA weights this path loads "
                   "are not checked: in mode fail a KDA model is refused at its first load "
                   "(%s=warn serves it unchecked)", target, why, MODE_ENV)


_judged: weakref.WeakSet[Any] = weakref.WeakSet()


def _unhooked(model: Any, engine: Callable[[], VllmEngine]) -> None:
    """A model loaded while some hook target is missing (``_hook``): a KDA model (not a
    draft: ``engine()``, its adapter, made only then) cannot be checked on every path, which
    ``cannot_check`` says (a warning once per model in mode ``warn``), naming vLLM's version,
    each missing target and the setting that proceeds; a model with no KDA layer, or every
    hook armed: nothing.

    Raises:
        GuardError: mode ``fail``, a KDA model and a missing hook target.
    """
    missing = sorted(t for t, why in RECORD.hooks.items() if why.startswith("missing: "))
    if not missing or model in _judged:
        return
    names = [n for n, _ in model.named_parameters()]
    if looks_kda(names) and not engine().is_draft():
        cannot_check(f"kda_tp guard: vllm {_version()}: this KDA model's weights cannot be "
                     f"checked on every path: the guard could not hook {', '.join(missing)} in "
                     "this vLLM version")
    _judged.add(model)


def _safely(name: str, install: Callable[[Any], None]) -> Callable[[Any], None]:
    """``install`` for vLLM module ``name``, whose error never reaches vLLM's import: the
    module's hooks are then missing (``_missing``), the engine starts."""
    def run(module: Any) -> None:
        try:
            install(module)
        except Exception as error:  # noqa: BLE001 - a vLLM of another shape: never break it
            _missing(name, f"{type(error).__name__}: {error}")
    return run


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


def _rebind(original: Any, wrapper: Any, attr: str) -> None:
    """``wrapper`` wherever a vLLM module imported ``original`` under ``attr`` already."""
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm.") and getattr(module, attr, None) is original:
            setattr(module, attr, wrapper)


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
        RECORD.running(register_model_loader)
        decorate = original_register(load_format)

        def wrap(cls: type) -> type:
            out: type = decorate(cls)
            for sub in (cls, *subclasses(cls)):
                _wrap_loader(sub)
            return out
        return wrap

    RECORD.install("vllm.model_executor.model_loader.register_model_loader", model_loader,
                   "register_model_loader", register_model_loader)


def _add_worker_method(worker_base: Any) -> None:
    target = getattr(worker_base, "WorkerBase", None)
    if _hook("vllm.v1.worker.worker_base.WorkerBase", target):
        RECORD.install("vllm.v1.worker.worker_base.WorkerBase", target, WORKER_METHOD,
                       worker_audit)
        add_digests_method(target)


def _wrap_loader(cls: type) -> None:
    """Wrap ``cls.load_weights`` (if ``cls`` defines it) to run the guard after it and to
    follow the model's later updates."""
    original = cls.__dict__.get("load_weights")
    if original is None or getattr(original, _WRAPPED, False) or inspect.isabstract(cls):
        return

    @_mark
    @functools.wraps(original)
    def load_weights(self: Any, model: Any, model_config: Any, *args: Any, **kwargs: Any) -> Any:
        RECORD.running(load_weights)
        depth = getattr(_state, "depth", 0)
        _state.depth = depth + 1
        try:
            how = followed(model)
            if how is not None:
                with how.quietly():
                    out = original(self, model, model_config, *args, **kwargs)
            else:
                out = original(self, model, model_config, *args, **kwargs)
        finally:
            _state.depth = depth
        if depth == 0:
            loader = type(self).__name__
            _unhooked(model, lambda: VllmEngine(model_config, loader=loader))
            on_load(VllmEngine(model_config, loader=loader), model, where=f"vllm {loader}")
            repair(model)
        return out

    RECORD.install(f"{cls.__module__}.{cls.__qualname__}.load_weights", cls, "load_weights",
                   load_weights)


def _wrap_reload(inplace: Any) -> None:  # vllm.model_executor.model_loader.reload.inplace
    """Wrap vLLM's in-place ``reload_weights`` (and rebind it where vLLM imported it already):
    a reload from disk is checked against the new checkpoint, one from an iterator is one
    update session (the layerwise reload inside it joins it)."""
    original = _unwrapped(inplace, "reload_weights",
                          "vllm.model_executor.model_loader.reload.inplace.reload_weights")
    if original is None:
        return
    signature = inspect.signature(original)

    @_mark
    @functools.wraps(original)
    def reload_weights(*args: Any, **kwargs: Any) -> Any:
        RECORD.running(reload_weights)
        bound = signature.bind_partial(*args, **kwargs).arguments
        model, config = bound["model"], bound["vllm_config"]
        checkpoint_format = bound.get("is_checkpoint_format", True)
        how = followed(model)
        if bound.get("weights_iterator") is None:
            if how is not None:
                with how.quietly():
                    out = original(*args, **kwargs)
            else:
                out = original(*args, **kwargs)
            if checkpoint_format:
                path = bound.get("weights_path")
                guard_model(model, config.model_config, loader="reload_weights",
                            vllm_config=config, checkpoint=str(path) if path else None)
                repair(model)
            else:
                warn_once("kda_tp guard: a reload_weights from disk with "
                          "is_checkpoint_format=False is not checked (vLLM itself warns that "
                          "weights read from disk are in checkpoint format)")
            return out
        if not checkpoint_format:
            warn_once("kda_tp guard: a reload_weights with is_checkpoint_format=False feeds "
                      "kernel-format tensors (already sharded and repacked), which kda_tp "
                      "cannot place by the plan; its KDA weights are not checked")
            return original(*args, **kwargs)
        follow_updates(model, config.model_config, config)
        return _in_session(followed(model), "reload_weights", original, *args, **kwargs)

    RECORD.install("vllm.model_executor.model_loader.reload.inplace.reload_weights", inplace,
                   "reload_weights", reload_weights)
    _rebind(original, reload_weights, "reload_weights")


def _in_session(how: Follower | None, owner: str, call: Callable[..., Any], *args: Any,
                **kwargs: Any) -> Any:
    """``call(*args, **kwargs)`` as one update session owned by ``owner`` (unless one is open
    already: then it joins it), checked when it returns.

    Raises:
        GuardError: mode ``fail`` and the session left a KDA parameter wrong.
    """
    if how is None or not how.open(owner, owner):
        return call(*args, **kwargs)
    try:
        out = call(*args, **kwargs)
    except BaseException:
        how.abandon(owner)
        raise
    how.close(owner)
    return out


def _wrap_layerwise(layerwise: Any) -> None:  # vllm.model_executor.model_loader.reload.layerwise
    """Wrap the layerwise reload's two ends: ``initialize_layerwise_reload(model)`` opens an
    update session (before vLLM moves the parameters to the meta device), and
    ``finalize_layerwise_processing`` (what ``finalize_layerwise_reload`` runs) checks it."""
    start = _unwrapped(layerwise, "initialize_layerwise_reload",
                       f"{_LAYERWISE}.initialize_layerwise_reload")
    finish = _unwrapped(layerwise, "finalize_layerwise_processing",
                        f"{_LAYERWISE}.finalize_layerwise_processing")
    if start is None or finish is None:
        return

    @_mark
    @functools.wraps(start)
    def initialize_layerwise_reload(model: Any, *args: Any, **kwargs: Any) -> Any:
        RECORD.running(initialize_layerwise_reload)
        how = followed(model)
        opened = how is not None and how.open("layerwise", "layerwise reload")
        try:
            return start(model, *args, **kwargs)
        except BaseException:
            if opened and how is not None:
                how.abandon("layerwise")
            raise

    @_mark
    @functools.wraps(finish)
    def finalize_layerwise_processing(model: Any, *args: Any, **kwargs: Any) -> Any:
        RECORD.running(finalize_layerwise_processing)
        how = followed(model)
        try:
            out = finish(model, *args, **kwargs)
        except BaseException:
            if how is not None:
                how.abandon("layerwise")
            raise
        if how is not None:
            how.close("layerwise")
            how.derived_built("layerwise reload")  # it ran each layer's post-processing
        return out

    RECORD.install(f"{_LAYERWISE}.initialize_layerwise_reload", layerwise,
                   "initialize_layerwise_reload", initialize_layerwise_reload)
    RECORD.install(f"{_LAYERWISE}.finalize_layerwise_processing", layerwise,
                   "finalize_layerwise_processing", finalize_layerwise_processing)
    _rebind(start, initialize_layerwise_reload, "initialize_layerwise_reload")
    _rebind(finish, finalize_layerwise_processing, "finalize_layerwise_processing")


def _wrap_process(utils: Any) -> None:  # vllm.model_executor.model_loader.utils
    """Wrap ``process_weights_after_loading``: the end of a refit made of plain
    ``load_weights`` calls (after a dummy load, the parts it never loaded are named)."""
    original = _unwrapped(utils, "process_weights_after_loading",
                          "vllm.model_executor.model_loader.utils.process_weights_after_loading")
    if original is None:
        return

    @_mark
    @functools.wraps(original)
    def process_weights_after_loading(model: Any, *args: Any, **kwargs: Any) -> Any:
        RECORD.running(process_weights_after_loading)
        out = original(model, *args, **kwargs)
        _unhooked(model, lambda: VllmEngine(args[0] if args else kwargs.get("model_config")))
        how = followed(model)
        if how is not None:
            how.end_of_refit("process_weights_after_loading")
            how.derived_built("process_weights_after_loading")
        return out

    RECORD.install("vllm.model_executor.model_loader.utils.process_weights_after_loading",
                   utils, "process_weights_after_loading", process_weights_after_loading)
    _rebind(original, process_weights_after_loading, "process_weights_after_loading")


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
        RECORD.running(create_engine)
        engine = create(klass, config, vllm_config, device, model)
        follow_transfer(engine, vllm_config)
        return engine

    RECORD.install("vllm.distributed.weight_transfer.factory.WeightTransferEngineFactory."
                   "create_engine", cls, "create_engine", classmethod(create_engine))


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
        RECORD.running(load)
        model = original(self, *args, **kwargs)
        if looks_kda(n for n, _ in model.named_parameters()):
            warn_once("kda_tp guard: a tensorizer load of a model that is not vLLM-tensorized "
                      "streams its weights from a tensorizer URI, not a checkpoint directory; "
                      "its KDA weights are not checked at load (later updates are)")
            follow_updates(model, None)
        return model

    RECORD.install("vllm.model_executor.model_loader.tensorizer_loader.TensorizerLoader."
                   "_load_model_serialized_cpu", cls, "_load_model_serialized_cpu", load)


# What register() installs, by the vLLM module it patches (an installer's error never
# reaches vLLM's import: _safely).
_INSTALLERS: dict[str, Callable[[Any], None]] = {
    name: _safely(name, install) for name, install in (
    ("vllm.model_executor.model_loader.utils", _wrap_process),
    (_LAYERWISE, _wrap_layerwise),
    ("vllm.model_executor.model_loader", _install_loaders),
    ("vllm.model_executor.model_loader.reload.inplace", _wrap_reload),
    ("vllm.model_executor.model_loader.tensorizer_loader", _wrap_tensorizer),
    ("vllm.distributed.weight_transfer.factory", _wrap_transfer),
    ("vllm.v1.worker.worker_base", _add_worker_method),
)}


def guard_model(model: Any, model_config: Any, *, loader: str = "",
                vllm_config: Any = None, guard_mode: str | None = None,
                checkpoint: str | None = None) -> GuardResult | None:
    """Run the guard on this worker's freshly loaded ``model`` (what the wrapped loaders call).

    Args:
        model: the ``torch.nn.Module`` vLLM loaded.
        model_config: its vLLM ``ModelConfig`` (``.model``, ``.model_weights``, ``.revision``,
            ``.dtype``).
        loader: the loader class's name, or ``"reload_weights"``, ``"audit"``.
        vllm_config: vLLM's config (a draft model, the download directory); None: current.
        guard_mode: as for :func:`kda_tp.guard.check` (None: ``KDA_TP_GUARD``'s).
        checkpoint: the path the weights were just loaded from (``reload_weights``'s
            ``weights_path``): checked against it, ``KDA_TP_GUARD_CHECKPOINT`` ignored; None:
            the variable, else the model's path.

    Returns:
        The :class:`~kda_tp.guard.GuardResult`, or None when nothing was checked (see
        :func:`kda_tp.guard.check`; also a dummy load, a draft model, a ``sharded_state``
        load without ``KDA_TP_GUARD_CHECKPOINT``: one warning).

    Raises:
        GuardError: as :func:`kda_tp.guard.check` (mode ``fail``); also a
            ``KDA_TP_GUARD_CHECKPOINT`` that is not there.
    """
    where = f"vllm {loader}" if loader else "vllm"
    kind = "first load" if loader != "reload_weights" else loader
    return on_load(VllmEngine(model_config, vllm_config, loader), model, where=where, kind=kind,
                   given=checkpoint, guard_mode=guard_mode, record=loader != "audit",
                   follows=False)[0]


def follow_updates(model: Any, model_config: Any, vllm_config: Any = None, *,
                   found: LoadSource | None = None) -> None:
    """Check every later update of ``model`` (the main model of this worker)
    (:func:`kda_tp.guard.follow`), against the model's checkpoint. Idempotent; a draft model or
    a model without KDA names is not followed; no local checkpoint config: one warning, not
    followed. (A model loaded through a wrapped loader is followed from its first load's
    check already.)

    Args:
        model: the loaded ``torch.nn.Module``.
        model_config: its vLLM ``ModelConfig`` (None: the current vLLM config's).
        vllm_config: vLLM's config (None: the current one).
        found: what the load was checked against (a dummy load's first update must fill
            every region); None: the model's checkpoint (:func:`kda_tp.guard.load_checkpoint`).

    Raises:
        GuardError: mode ``fail`` and the checkpoint's config gives no plan for the model's
            KDA parameters.
    """
    if followed(model) is None:
        follow_model(VllmEngine(model_config, vllm_config), model, found)
