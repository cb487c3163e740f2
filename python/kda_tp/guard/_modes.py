"""What every part of the guard shares: its mode (``KDA_TP_GUARD``), a check that cannot run,
one warning per process, and which local checkpoint a load is checked against.

The mode (:func:`mode`) is read from the environment at every decision, so that a process can
change it between loads. A check that could not run is never silent (:func:`cannot_check`): a
:class:`~kda_tp.errors.GuardError` in mode ``fail``, a warning in ``warn``, nothing in ``off``.

Which checkpoint a load is checked against is decided once for both engine plugins
(:func:`load_checkpoint`): ``KDA_TP_GUARD_CHECKPOINT`` when set, else the engine's model path
(a Hugging Face repository id resolved to its local snapshot); a ``sharded_state`` load
without the variable is not checked at load (its directory holds the ranks' dumps), a
``dummy`` load is not checked at load at all (random weights: the first update must fill
them).

This module imports no engine and no torch.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any

from ..errors import GuardError, GuardModeError

__all__ = ["CHECKPOINT_ENV", "MODES", "MODE_ENV", "REPAIR_ENV", "LoadSource", "cannot_check",
           "checkpoint_env", "explicit_checkpoint", "load_checkpoint", "mode", "repair_on",
           "resolve_checkpoint", "warn_once"]

#: The environment variable that sets the guard's mode.
MODE_ENV = "KDA_TP_GUARD"
#: The environment variable an engine plugin reads for the checkpoint to check against when
#: the engine's own model path is not it: a ``sharded_state`` directory (it holds the ranks'
#: dumps, not the checkpoint they came from), or a model the engine streams from elsewhere
#: while a local copy exists.
CHECKPOINT_ENV = "KDA_TP_GUARD_CHECKPOINT"
#: The guard's modes; the first is the default.
MODES = ("fail", "warn", "off")
#: The opt-in repair switch: ``1`` drops every stale-prone derived copy kda_tp knows
#: (GLM-5.3's ``_merged_conv_weight`` in vLLM) after every load and update, so that the engine
#: rebuilds it from the new weights on the next forward (vLLM #55087).
REPAIR_ENV = "KDA_TP_GUARD_REPAIR"
_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")

logger = logging.getLogger("kda_tp.guard")
_warned: set[str] = set()


def mode() -> str:
    """The guard's mode from ``KDA_TP_GUARD``: ``"fail"`` when unset or empty, else its value
    (case and surrounding spaces ignored).

    Raises:
        GuardModeError: a value that is not one of :data:`MODES`.
    """
    value = os.environ.get(MODE_ENV, "").strip().lower()
    if not value:
        return MODES[0]
    if value not in MODES:
        raise GuardModeError(
            f"{MODE_ENV}={os.environ[MODE_ENV]!r} is not a guard mode; use fail (the default), "
            "warn or off"
        )
    return value


def repair_on() -> bool:
    """Whether ``KDA_TP_GUARD_REPAIR`` (:data:`REPAIR_ENV`) asks for the repair: ``1``,
    ``true``, ``yes``, ``on`` (case and surrounding spaces ignored); unset, empty, ``0``,
    ``false``, ``no``, ``off``: not.

    Raises:
        GuardModeError: any other value (refused as an invalid mode is: never silently off).
    """
    value = os.environ.get(REPAIR_ENV, "").strip().lower()
    if value in _ON or value in _OFF:
        return value in _ON
    raise GuardModeError(f"{REPAIR_ENV}={os.environ[REPAIR_ENV]!r} is not a repair setting; "
                         "use 1 (on) or 0 (off, the default)")


def cannot_check(text: str, guard_mode: str | None = None) -> None:
    """A check that could not run, as the mode says: in ``fail`` a :class:`GuardError`
    carrying ``text`` (and how to go on anyway), in ``warn`` one ``RuntimeWarning`` and a
    WARNING line on ``kda_tp.guard``; nothing in ``off``.

    Raises:
        GuardError: mode ``fail``.
        GuardModeError: ``KDA_TP_GUARD`` holds another value than the modes.
    """
    chosen = mode() if guard_mode is None else guard_mode
    if chosen == "off":
        return
    if chosen == "fail":
        raise GuardError(f"{text} (set {MODE_ENV}=warn to start anyway)")
    logger.warning("%s", text)
    warnings.warn(text, RuntimeWarning, stacklevel=3)


def warn_once(text: str) -> None:
    """One ``RuntimeWarning`` per process for a load or update path the guard cannot check
    (the same text again is not repeated)."""
    if text not in _warned:
        _warned.add(text)
        warnings.warn(text, RuntimeWarning, stacklevel=3)


def checkpoint_env() -> str | None:
    """``KDA_TP_GUARD_CHECKPOINT`` (:data:`CHECKPOINT_ENV`) with surrounding spaces stripped;
    None when unset or blank."""
    return os.environ.get(CHECKPOINT_ENV, "").strip() or None


def explicit_checkpoint(where: str, guard_mode: str | None = None) -> str | None:
    """The checkpoint ``KDA_TP_GUARD_CHECKPOINT`` names (stripped), when set; None when unset.
    A value that cannot be checked against, a URL (any value holding ``://``) or a path that
    is not there, is a check that cannot run (:func:`cannot_check`: a ``GuardError`` in
    ``fail``; in ``warn`` one warning and ``""``, which the caller checks nothing against).

    Raises:
        GuardError: mode ``fail`` and the variable holds ``://`` or names a path that does
            not exist.
    """
    chosen = checkpoint_env()
    if chosen is not None and "://" in chosen:
        cannot_check(f"kda_tp guard: {where}: {CHECKPOINT_ENV}={chosen!r} is not a local path "
                     "(it holds '://'); the KDA weights are not checked (set it to a local copy "
                     "of the checkpoint directory: its config.json and safetensors files)",
                     guard_mode)
        return ""
    if chosen is None or os.path.exists(chosen):
        return chosen
    cannot_check(f"kda_tp guard: {where}: {CHECKPOINT_ENV}={chosen!r} does not exist; the KDA "
                 "weights are not checked (a typo? set it to the checkpoint directory the "
                 "engine loaded)", guard_mode)
    return ""


def resolve_checkpoint(path: str, *, revision: str | None = None,
                       download_dir: str | None = None) -> str:
    """A model path as the local checkpoint both engine plugins check against: a URL or an
    existing path as it is; a Hugging Face repository id as its snapshot in the local cache
    (in ``download_dir`` when the engine downloads there; never a download); anything else
    unchanged (the check then warns that it is not local).

    Args:
        path: the engine's model path or repository id.
        revision: the repository revision the engine loaded (None: the default branch).
        download_dir: the engine's download directory (None: the Hugging Face cache).

    Returns:
        The local path, or ``path`` unchanged.
    """
    if "://" in path or os.path.exists(path):
        return path
    try:  # a repository id: the snapshot the engine downloaded
        from huggingface_hub import snapshot_download

        return str(snapshot_download(path, revision=revision, cache_dir=download_dir,
                                     local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached or no huggingface_hub: the check warns
        return path


@dataclass(frozen=True)
class LoadSource:
    """What a load is checked against (:func:`load_checkpoint`).

    Attributes:
        checkpoint: the local checkpoint (directory or file) whose config gives the plan, or
            None when there is none to check against (then ``why`` says why); ``""`` for a
            ``KDA_TP_GUARD_CHECKPOINT`` that is not there in mode ``warn`` (warned).
        check_load: whether the loaded values are checked against it now (False for a dummy
            load: random values; its updates are followed, the first must fill every region).
        dummy: the load filled random values (vLLM's ``DummyModelLoader``, SGLang's
            ``load_format="dummy"``).
        why: why there is no checkpoint (a ``sharded_state`` load without the variable).
    """

    checkpoint: str | None
    check_load: bool
    dummy: bool = False
    why: str = ""


def load_checkpoint(model_path: str, load_format: str, where: str, *,
                    given: str | None = None, revision: str | None = None,
                    download_dir: str | None = None) -> LoadSource:
    """Which local checkpoint one rank's load is checked against, the same for both engines.

    ``given`` (the path a reload from disk read: that path, whatever the variable says), else
    ``KDA_TP_GUARD_CHECKPOINT`` (``explicit_checkpoint``), else ``model_path`` resolved by
    ``resolve_checkpoint``. A ``sharded_state`` load without the variable has no checkpoint
    (its directory holds the ranks' dumps); a ``dummy`` load is followed but not checked.

    Args:
        model_path: the engine's model path or repository id.
        load_format: the engine's load format (``"auto"``, ``"sharded_state"``, ``"dummy"``,
            a loader class name such as ``"ShardedStateLoader"``; any case).
        where: the label for messages (``"vllm: tp rank 1/4"``).
        given: a path the weights were just read from.
        revision: the repository revision the engine loaded.
        download_dir: the engine's download directory.

    Raises:
        GuardError: mode ``fail`` and ``KDA_TP_GUARD_CHECKPOINT`` names a path that is not there.
    """
    fmt = load_format.lower().removesuffix("modelloader").removesuffix("loader")
    dummy = fmt == "dummy"
    if given is not None:
        return LoadSource(given, True)
    override = explicit_checkpoint(where)
    if override is not None:
        return LoadSource(override, not dummy, dummy)
    if fmt in ("sharded_state", "shardedstate"):
        return LoadSource(None, False, why=(
            f"kda_tp guard: {where}: a sharded_state load holds the ranks' own dumps, not the "
            f"checkpoint; set {CHECKPOINT_ENV} to the checkpoint it was saved from to check its "
            "KDA weights and its updates (not checked)"))
    return LoadSource(resolve_checkpoint(model_path, revision=revision,
                                         download_dir=download_dir), not dummy, dummy)


def update_checkpoint(found: LoadSource, opened: Any, where: str) -> Any:
    """What a model's later updates are checked against, the same for both engines: what the
    first load's check built (``opened``: its plan), else ``found``'s checkpoint path.

    Returns:
        The plan or local path; None when there is none (the load's warning said why)
        or it is not a local checkpoint (a repository id not in the cache, a URL): then a
        warning, once, says its updates are not checked and how to name a local copy.
    """
    if found.why or found.checkpoint == "":
        return None
    checkpoint = opened if opened is not None else found.checkpoint
    if not checkpoint or (isinstance(checkpoint, str) and
                          ("://" in checkpoint or not os.path.exists(checkpoint))):
        warn_once(f"kda_tp guard: {where}: no local checkpoint config for the model "
                  f"({checkpoint!r}); its weight updates are not checked (set "
                  f"{CHECKPOINT_ENV} to a local copy of its config.json and safetensors files)")
        return None
    return checkpoint
