"""``kda-tp shard`` and ``verify`` as a torchrun job: which process does what, and one outcome
that every process agrees on.

Run under ``torchrun --nproc-per-node P kda-tp shard ...`` (or ``verify``), the command finds
the job with :func:`torchrun_processes` and runs inside :func:`torchrun_job`: process 0 is the
one that speaks (progress, warnings, the result, a refusal), every process returns the same
verdict, so each exits with the same status. The work itself is :mod:`kda_tp.torch`'s
(:func:`~kda_tp.shard.distributed.shard_checkpoint_distributed`,
:func:`~kda_tp.shard.distributed.check_tp_equivalence_distributed`); this module only orchestrates it, and
imports torch only inside :func:`torchrun_job` (the command line asks
:func:`torchrun_processes` on every run).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import KdaTpError, PlanError
from ..model.json_reader import ascii_int

if TYPE_CHECKING:
    from .writer import ShardResult, ShardSizes
    from .verify import VerifyReport

__all__ = ["TorchrunJob", "VerifyOutcome", "torchrun_job", "torchrun_processes"]


def torchrun_processes() -> int:
    """The number of processes of the torchrun job this process belongs to; 1 outside torchrun
    (no ``TORCHELASTIC_RUN_ID`` in the environment). Imports nothing.

    Raises:
        PlanError: torchrun's ``WORLD_SIZE`` is not a positive integer.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return 1
    world = os.environ.get("WORLD_SIZE", "1")
    try:
        found = ascii_int(world)
    except OverflowError:
        found = None
    if found is None or found < 1:
        raise PlanError(f"WORLD_SIZE={world[:40]!r} (set by torchrun) is not a positive integer")
    return found


@dataclass(frozen=True)
class VerifyOutcome:
    """What :meth:`TorchrunJob.verify` found, on every process.

    Attributes:
        report: process 0's report (the byte check, and ``--numeric``'s results on it); None
            on the other processes and when the check was refused.
        error: process 0's refusal (None on the other processes, and when not refused).
        refused: the check was refused on process 0 (the same on every process).
        passed: every byte, and the numeric check when asked, passed (the same on every
            process; False when refused).
    """

    report: VerifyReport | None
    error: KdaTpError | None
    refused: bool
    passed: bool


@dataclass(frozen=True)
class TorchrunJob:
    """One process of a torchrun job, in its gloo group (:func:`torchrun_job`).

    Attributes:
        process: this process's number, ``0 .. processes - 1``.
        processes: the job's process count.
    """

    process: int
    processes: int

    @property
    def speaks(self) -> bool:
        """Whether this process reports for the job (process 0)."""
        return self.process == 0

    def shard(
        self,
        checkpoint: Path,
        out_dir: Path,
        tp_size: int,
        *,
        progress: Callable[[int], Callable[[int], None]] | None = None,
        report_sizes: Callable[[ShardSizes], None] | None = None,
        **options: Any,
    ) -> ShardResult:
        """:func:`~kda_tp.shard.distributed.shard_checkpoint_distributed` over this job: the same result on
        every process, or the same error class raised on every process.

        ``progress`` and ``report_sizes`` are used on process 0 alone (pass them on every
        process); ``options`` are ``shard_checkpoint``'s other keyword arguments.
        """
        from .distributed import shard_checkpoint_distributed

        return shard_checkpoint_distributed(
            checkpoint, out_dir, tp_size,
            progress=progress if self.speaks else None,
            report_sizes=report_sizes if self.speaks else None,
            **options,
        )

    def verify(
        self, checkpoint: Path, out_dir: Path, *, numeric: bool, seq_len: int, seed: int
    ) -> VerifyOutcome:
        """``verify`` over this job: process 0 checks every byte
        (:func:`~kda_tp.shard.verify_shards`); when that passes and ``numeric`` is set, the
        numeric check runs the ranks' forwards over all the processes with a real all-reduce
        (:func:`~kda_tp.shard.distributed.check_tp_equivalence_distributed`, with the world size, layers
        and q|k rule recorded in ``out_dir``'s rank files), its result added to process 0's
        report. The verdict is then shared, so every process returns the same ``refused`` and
        ``passed``.

        Raises:
            KdaTpError: the numeric check was refused (e.g. ``out_dir`` has no kda-tp
                metadata), on the processes where it was.
        """
        import torch.distributed as dist

        from .verify import verify_shards
        from .distributed import check_tp_equivalence_distributed
        from .rankdir import rank_dir_metadata

        report: VerifyReport | None = None
        error: KdaTpError | None = None
        if self.speaks:
            try:
                report = verify_shards(checkpoint, out_dir)
            except KdaTpError as e:
                error = e
        state = [report is not None and report.ok, error is not None]
        dist.broadcast_object_list(state, src=0)
        if state[0] and numeric:
            start = time.perf_counter()
            meta = rank_dir_metadata(out_dir)
            result = check_tp_equivalence_distributed(
                checkpoint, meta["tp_size"], shard_dir=out_dir, layers=meta["layers"],
                seq_len=seq_len, seed=seed, qk_multiple=meta["qk_multiple"],
            )
            if report is not None:
                report.numeric = result
                report.numeric_seconds = time.perf_counter() - start
        verdict = [report is not None and report.ok]
        dist.broadcast_object_list(verdict, src=0)
        return VerifyOutcome(report, error, refused=bool(state[1]), passed=bool(verdict[0]))


@contextmanager
def torchrun_job() -> Iterator[TorchrunJob]:
    """This process's place in its torchrun job, inside the job's gloo process group
    (:func:`~kda_tp.shard.distributed.torchrun_group`: created from torchrun's ``env://`` variables and
    destroyed on exit, or an already initialized group, left alone).

    Raises:
        MissingDependencyError: torch is not installed (torchrun jobs need it).
    """
    from .distributed import torchrun_group

    with torchrun_group() as (process, processes):
        yield TorchrunJob(process, processes)

