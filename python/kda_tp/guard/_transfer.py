"""The end of a weight-transfer session whose bytes did not pass through the model's
``load_weights``: what can be checked without the values, and the trainer's digests.

Some transports write a rank's parameters without calling the model's ``load_weights``, so the
guard sees nothing fed and has no reference from the update itself: vLLM 0.33's
``sharded_rdt`` replays scatters it recorded once into freshly materialized parameters
(``distributed/weight_transfer/sharded_rdt_engine.py``: "``_layerwise_process`` minus the loader
replay"), ``nccl_m2n`` reshards some parameters straight into live storage, an RL stack's own
worker code may ``param.copy_`` kernel-format tensors. At the end of such a session
(:func:`end_session`: the engine adapter calls it where the engine's session ends) this rank's
KDA parameters are checked for what needs no fed values (:func:`check_transfer`):

* every padding row is zero (K3's ``in_proj_qkvgfab``: vLLM's loader zeroes its padding rows
  after every load; a replay that skips the loader leaves what the allocation held);
* every derived copy the layout keeps (:data:`kda_tp.engines.derived.DERIVED`: K3's decode
  buffers, GLM-5.3's ``_merged_conv_weight``) equals what its parameters make of it now
  (``kda_tp.guard._derived``);

and, when the trainer handed this process its expected digests for the session
(:func:`expect`, from ``kda_tp.audit.expected_digests``: vLLM's key format), each KDA parameter
of this rank is hashed as vLLM's ``compute_weight_checksums`` hashes it
(``kda_tp.audit.digests.param_digest``) and compared: a mismatch names the parameter and the
rank. The verdict line says which: ``checked by digests`` or ``invariants only`` (the values
themselves not compared), never a bare OK. A session that did feed KDA tensors through
``load_weights`` keeps its verdict on what it fed (``kda_tp.guard._live.Follower.close``); the
digests, when handed over, are then checked after it too (``nccl_m2n`` feeds some parameters
through the loader and writes the others in place).

This module imports no engine; torch tensors come from the engine.
"""

from __future__ import annotations

import re
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..audit.digests import DIGEST_KEY, param_digest
from ..checkpoint.values import as_record
from ..engines.derived import DERIVED, derived_copies
from ..errors import KdaTpError, UsageError
from ._derived import derived_problem
from ._live import Follower, repair
from ._modes import failed, mode, passed, verdict_word
from ._record import RECORD
from ._repacked import GEMM
from ._target import PADDING, RankTarget

__all__ = ["TransferReport", "check_transfer", "checked_digests", "end_session", "expect"]


#: What a digest must be: vLLM's ``compute_weight_checksums`` value, a SHA-256 in hex.
_HEX = re.compile(r"[0-9a-f]{64}")

_expected: weakref.WeakKeyDictionary[Any, dict[str, str]] = weakref.WeakKeyDictionary()


def checked_digests(digests: Any) -> dict[str, str]:
    """``digests`` as a plain dict, checked: ``kda_tp.audit.expected_digests``' result (or any
    mapping of its keys, ``dp0:pp0:pcp0:tp{r}:<name>``, to 64-digit hex SHA-256 strings).

    Raises:
        UsageError: not a mapping, or an entry that is not such a key and digest (named).
    """
    if not isinstance(digests, Mapping):
        raise UsageError(f"digests: expected kda_tp.audit.expected_digests' mapping of keys to "
                         f"SHA-256 hex strings, got {type(digests).__name__}")
    for key, value in digests.items():
        if not isinstance(key, str) or not isinstance(value, str) or not _HEX.fullmatch(value):
            raise UsageError(f"digests: entry {key!r}: {value!r:.80} is not a SHA-256 hex "
                             "string keyed dp0:pp0:pcp0:tp{r}:<name> "
                             "(kda_tp.audit.expected_digests)")
    return dict(digests)


def expect(model: Any, digests: Mapping[str, str]) -> None:
    """Hand this process the trainer's expected digests for the next weight-transfer session of
    ``model``: kept until that session ends (:func:`end_session`), which consumes them; a
    second call before it replaces them.

    Args:
        model: the engine's model (a ``torch.nn.Module``; kept weakly).
        digests: ``kda_tp.audit.expected_digests``' result (every rank's keys: each rank
            compares its own), as :func:`checked_digests` takes it.

    Raises:
        UsageError: as :func:`checked_digests`.
    """
    _expected[model] = checked_digests(digests)


@dataclass
class TransferReport:
    """What :func:`check_transfer` found on one rank.

    Attributes:
        params: the rank's KDA parameters checked.
        bytes: their bytes.
        seconds: wall time of the check, in seconds.
        digests: None when no digests were handed over (invariants only), else how many
            parameters were compared with one.
        problems: one line per wrong parameter, padding or derived copy, naming it.
        unchecked: one line per check that could not run (a parameter the engine left
            unreadable, a digest the trainer's set lacks): mode ``fail`` refuses it.
    """

    params: int = 0
    bytes: int = 0
    seconds: float = 0.0
    digests: int | None = None
    problems: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when every check ran and found nothing wrong."""
        return not self.problems and not self.unchecked

    @property
    def how(self) -> str:
        """What the verdict rests on: ``checked by digests`` or ``invariants only``."""
        if self.digests is None:
            return ("invariants only (padding rows zero, derived copies; no trainer digests "
                    "handed over: the values were not compared)")
        return f"checked by digests ({self.digests} parameters), padding rows, derived copies"


def check_transfer(target: RankTarget, model: Any, digests: Mapping[str, str] | None, *,
                   derived: bool = True) -> TransferReport:
    """Check one rank's KDA parameters as they are now, with no fed values: padding rows zero,
    derived copies (``derived``) equal to what their parameters make of them, and, given
    ``digests``, each parameter's SHA-256 equal to the trainer's for this rank
    (``DIGEST_KEY`` with the target's tensor-parallel rank and the parameter's name).

    Args:
        target: the rank's target (its parameters, regions and padding).
        model: the ``torch.nn.Module`` holding them (its derived copies).
        digests: the trainer's expected digests (every rank's, as
            ``kda_tp.audit.expected_digests`` returns them), or None.
        derived: check the derived copies (False when the session's own verdict did).

    Returns:
        The :class:`TransferReport`; nothing is raised for what it finds.
    """
    began = time.perf_counter()
    report = TransferReport(digests=None if digests is None else 0)
    values: dict[str, Any] = {}
    for name in sorted(target.params):
        try:
            value, how = target.read(name)
            if how is not None and how != GEMM:
                report.unchecked.append(f"{name}: cannot be read back ({how})")
                continue
            record = as_record(name, value)
        except KdaTpError as error:
            report.unchecked.append(f"{name}: cannot be read: {error}")
            continue
        values[name] = value
        report.params += 1
        report.bytes += record.data.nbytes
        array = np.ascontiguousarray(record.array)
        for place in target.regions.get(name, ()):
            if place.part == PADDING:
                _padding(name, array, place.start, place.stop, report)
        if digests is not None:
            _digest(name, array, digests, target.tp_rank, report)
    if derived and target.layout.name in DERIVED and model is not None:
        params = {name: values.get(name, target.params[name]) for name in target.params}
        for name, copy in derived_copies(model).items():
            problem = derived_problem(name, copy, params, target.layout.name)
            if isinstance(problem, str):
                report.problems.append(f"{name}: {problem}")
    report.seconds = time.perf_counter() - began
    return report


def _padding(name: str, array: np.ndarray, start: int, stop: int,
             report: TransferReport) -> None:
    """The padding elements ``[start, stop)`` of ``name`` (flat) must be zero (a negative zero
    is a wrong bit pattern too: the engine's ``zero_()`` writes +0)."""
    flat = array.reshape(-1)[start:stop]
    wrong = np.flatnonzero(flat.view(f"u{flat.dtype.itemsize}"))
    if not wrong.size:
        return
    first = start + int(wrong[0])
    where = [int(i) for i in np.unravel_index(first, array.shape)]
    report.problems.append(
        f"{name}: padding: {wrong.size} of {stop - start} elements are not zero (first at "
        f"{where}: {float(flat[int(wrong[0])])!r}, expected 0): the transport left the padding "
        "rows as it allocated them (the engine's loader zeroes them; a replay without the loader "
        "does not)")


def _digest(name: str, array: np.ndarray, digests: Mapping[str, str], rank: int,
            report: TransferReport) -> None:
    """``name``'s SHA-256 against the trainer's digest for this rank."""
    key = DIGEST_KEY.format(rank=rank, name=name)
    want = digests.get(key)
    if want is None:
        report.unchecked.append(
            f"{name}: the trainer's digests hold no {key!r} (computed for another tp_size or "
            "model? kda_tp.audit.expected_digests with the engine's layout and tp_size)")
        return
    report.digests = (report.digests or 0) + 1
    got = param_digest(array)
    if got != want:
        report.problems.append(
            f"{name}: SHA-256 {got[:16]}... differs from the trainer's expected digest "
            f"{want[:16]}... ({key}): this rank does not hold what the trainer sent")


def end_session(how: Follower, owner: str) -> TransferReport | None:
    """End ``owner``'s weight-transfer session on ``how``'s model: a session that fed KDA
    tensors through ``load_weights`` gets its verdict on what it fed (``Follower.close``);
    one that fed none (the transport bypassed the loader) is judged by :func:`check_transfer`
    instead. The trainer's digests handed over for it (:func:`expect`) are checked in both
    cases and consumed. Nothing when another owner's session is open.

    Returns:
        The transfer report, or None when no transfer check ran (a session that fed KDA
        tensors and no digests).

    Raises:
        GuardError: mode ``fail`` and a KDA parameter, padding row or derived copy is wrong,
            or a check could not run (the message names each, with the rank).
    """
    session = how.session
    if session is None or how.owner != owner:
        return None
    model = how.model()
    digests = _expected.pop(model, None) if model is not None else None
    if session.touched:
        how.close(owner)
        if digests is None:
            return None
        report = check_transfer(how.target, model, digests, derived=False)
    else:
        how.abandon(owner)
        if model is not None:
            repair(model)
        report = check_transfer(how.target, model, digests)
    _verdict(how, report, owner)
    return report


def _verdict(how: Follower, report: TransferReport, where: str) -> None:
    """Log, raise or record one transfer verdict."""
    target = how.target
    rank, size = target.tp_rank, target.tp_size
    verdict = verdict_word(len(report.problems), len(report.unchecked))
    line = (f"kda_tp guard: {how.engine} {where} (not through load_weights): tp rank "
            f"{rank}/{size}: {report.params} KDA parameters ({target.layout.name}), "
            f"{report.bytes} bytes, {report.seconds:.3f} s, {report.how}: {verdict}")
    RECORD.ran("update", line)
    if report.passed:
        passed(line)
        return
    text = (f"{line}\nthe KDA weights this rank holds after the transfer are wrong:\n"
            + "\n".join(f"  rank {rank} {p}" for p in report.problems)
            + "".join(f"\n  rank {rank} not checked: {u}" for u in report.unchecked))
    wrong = [p.split(": ", 1)[0] for p in report.problems + report.unchecked]
    failed(text, wrong, mode())
