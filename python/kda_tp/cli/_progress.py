"""Progress of the ``kda-tp`` commands on stderr: a tqdm bar on a terminal, else a plain line
every few seconds (for logs and pipes)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from ._format import format_bytes, in_unit

__all__ = ["make_progress"]


def make_progress(
    quiet: bool, what: str = "shard", unit: str = "B", every: float = 2.0
) -> Callable[[int], Callable[[int], None]] | None:
    """A progress factory for ``shard_checkpoint``/``verify_shards``: ``None`` when ``quiet``;
    a tqdm bar on a terminal; else plain lines on stderr (see :class:`_ProgressLines`), at
    most one every ``every`` seconds (0: one per step and one at the start).
    ``unit`` is ``"B"`` (bytes) or a count's unit (``"tensors"``, ``"KDA layers"``)."""
    if quiet:
        return None
    if not sys.stderr.isatty():
        return lambda total: _ProgressLines(what, total, unit, every)
    from tqdm import tqdm

    def start(total: int) -> Callable[[int], None]:
        bar = tqdm(total=total, unit=unit, unit_scale=unit == "B", desc=what, file=sys.stderr)
        def advance(n: int) -> None:
            bar.update(n)
            if bar.n >= total:
                bar.close()
        return advance

    return start


class _ProgressLines:
    """Progress for logs and pipes: a line on stderr at most every ``every`` seconds and one
    when ``total`` is reached, e.g. ``shard: 0.61 of 1.12 GB (54%), 2.0 s``. Thread-safe (the
    shard writers call it from several threads)."""

    def __init__(self, what: str, total: int, unit: str, every: float = 2.0) -> None:
        self.what, self.total, self.unit, self.every = what, total, unit, every
        self.done = 0
        self.start = self.last = time.monotonic()
        self.lock = threading.Lock()
        if every == 0:
            # Steps are slow (a Kimi K3 layer takes tens of seconds): say what starts now.
            self._print(self.start)

    def _print(self, now: float) -> None:
        if self.unit == "B":
            amount = f"{in_unit(self.done, self.total).split()[0]} of {format_bytes(self.total)}"
        else:
            amount = f"{self.done:,} of {self.total:,} {self.unit}"
        share = self.done / self.total if self.total else 1.0
        print(f"{self.what}: {amount} ({share:.0%}), {now - self.start:.1f} s",
              file=sys.stderr, flush=True)

    def __call__(self, n: int) -> None:
        with self.lock:
            self.done += n
            now = time.monotonic()
            if self.done < self.total and now - self.last < self.every:
                return
            self.last = now
            self._print(now)
