"""What every part of the guard shares: its mode (``KDA_TP_GUARD``), where its verdicts go, a
check that cannot run, one warning per process, and which local checkpoint a load is checked
against.

Where verdicts go is written here once (:func:`passed`, :func:`failed`): the logger
``kda_tp.guard`` (:data:`LOGGER`), at INFO for an OK line and ERROR for a failing verdict in
every mode; in mode ``warn`` a failing verdict is also a :class:`~kda_tp.errors.GuardWarning`
through Python's ``warnings``. The logger is the guard's own, never an engine's: its level is
INFO unless someone set another, and its own handler (:class:`StderrFallback`) writes to
stderr every record that no handler above it shows, so an engine's logging level
(``VLLM_LOGGING_LEVEL=ERROR``, as TRL sets it) never hides a verdict, and a record an
application's own handlers show is not written twice.

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

import contextlib
import contextvars
import logging
import os
import sys
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import GuardError, GuardModeError, GuardWarning

__all__ = ["CHECKPOINT_ENV", "LOGGER", "MODES", "MODE_ENV", "REPAIR_ENV", "LoadSource",
           "StderrFallback", "audited", "cannot_check", "checkpoint_env", "explicit_checkpoint",
           "failed", "held_verdicts", "load_checkpoint", "mode", "passed", "repair_on",
           "resolve_checkpoint", "verdict_line", "warn_once"]

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

#: The guard's logger: every line of the guard, in every process, goes to it.
LOGGER = "kda_tp.guard"
_warned: set[str] = set()


class StderrFallback(logging.StreamHandler):  # type: ignore[type-arg]
    """The guard logger's own handler: a record goes to stderr (the stream ``sys.stderr`` is
    when the record comes: a worker's redirected stderr too) unless a handler it reaches
    anyway shows it: another handler of the record's logger, or, while it propagates, one of
    an ancestor's (the root's ``logging.basicConfig``, SGLang's, pytest's capture) whose level
    lets it through. Never an engine's handler: vLLM keeps its own on the logger ``vllm``, at
    ``VLLM_LOGGING_LEVEL``, which the guard's lines never pass through."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s",
                                            "%m-%d %H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        if _shown_elsewhere(self, record):
            return
        self.stream = sys.stderr
        super().emit(record)


def _shown_elsewhere(own: logging.Handler, record: logging.LogRecord) -> bool:
    """Whether a handler other than ``own`` that ``record`` reaches lets its level through."""
    node: logging.Logger | None = logging.getLogger(record.name)
    while node is not None:
        if any(h is not own and record.levelno >= h.level for h in node.handlers):
            return True
        node = node.parent if node.propagate else None
    return False


def _guard_logger() -> logging.Logger:
    """The logger ``kda_tp.guard`` with its :class:`StderrFallback` (once per process), at
    INFO unless a level was set on it."""
    guard = logging.getLogger(LOGGER)
    if not any(isinstance(h, StderrFallback) for h in guard.handlers):
        guard.addHandler(StderrFallback())
    if guard.level == logging.NOTSET:
        guard.setLevel(logging.INFO)
    return guard


logger = _guard_logger()
_held: contextvars.ContextVar[bool] = contextvars.ContextVar("kda_tp_guard_held", default=False)


@contextlib.contextmanager
def held_verdicts() -> Iterator[None]:
    """Inside it :func:`passed` and :func:`failed` log nothing and warn nothing (``failed``
    still raises in mode ``fail``): a live audit's checks, whose one line, with its reference,
    the audit logs itself (:func:`audited`)."""
    token = _held.set(True)
    try:
        yield
    finally:
        _held.reset(token)


def passed(line: str) -> None:
    """A passing verdict (``... : OK``): one INFO line on :data:`LOGGER`."""
    if not _held.get():
        logger.info("%s", line)


def audited(line: str, ok: bool | None) -> None:
    """A live audit's line for one rank: ERROR when it failed (``ok`` False), else INFO
    (passed, not checked, or not judged)."""
    logger.log(logging.ERROR if ok is False else logging.INFO, "%s", line)


def failed(text: str, wrong: Iterable[str], guard_mode: str, *, go_on: str = "go on anyway",
           report: Any = None, result: Any = None) -> None:
    """A failing verdict (``text``: its line, then the diagnosis), shown as every mode shows
    it: logged at ERROR on :data:`LOGGER` before anything is raised (a stack that masks the
    exception, or waits forever for its answer, still has it in the worker's log), in mode
    ``fail`` as one line, the verdict and the ``wrong`` parameters' names
    (:func:`verdict_line`; the exception carries the diagnosis), in mode ``warn`` as the whole
    diagnosis, also issued as a :class:`~kda_tp.errors.GuardWarning`; nothing in ``off``.

    Args:
        text: the verdict line, then the diagnosis.
        wrong: the wrong parameters' names.
        guard_mode: the mode that judges it.
        go_on: what ``KDA_TP_GUARD=warn`` lets the engine do, for the error's message.
        report, result: the ``GuardError``'s ``report`` and ``result``.

    Raises:
        GuardError: mode ``fail``: ``text`` and how to go on anyway.
    """
    if guard_mode == "off":
        return
    if guard_mode == "fail":
        if not _held.get():
            logger.error("%s", verdict_line(text.splitlines()[0], wrong))
        raise GuardError(f"{text}\n(set {MODE_ENV}=warn to {go_on})", report, result)
    if not _held.get():
        logger.error("%s", text)
        warnings.warn(text, GuardWarning, stacklevel=3)


def verdict_word(problems: int, unchecked: int) -> str:
    """An update's verdict word: ``FAIL (N wrong)`` when ``problems`` (a count) is not 0, else
    ``NOT CHECKED (N checks could not run)`` when ``unchecked`` is not 0, else ``OK``."""
    if problems:
        return f"FAIL ({problems} wrong)"
    if unchecked:
        return f"NOT CHECKED ({unchecked} checks could not run)"
    return "OK"


def verdict_line(line: str, wrong: Iterable[str]) -> str:
    """A failing verdict ``line`` with the wrong parameters' names (the first 3, then ``+N
    more``): the one line an engine's log carries where the engine cannot carry the
    diagnosis to its caller (vLLM's ``LLM()`` raises only "Engine core initialization
    failed" and logs the ``GuardError``'s lines one by one)."""
    names = list(dict.fromkeys(wrong))
    more = f" +{len(names) - 3} more" if len(names) > 3 else ""
    return f"{line}: {', '.join(names[:3])}{more}" if names else line


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
