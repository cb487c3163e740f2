"""The names of what ``kda-tp`` writes into an output directory, shared by the writer
(:mod:`kda_tp.shard`), the output-directory safety (:mod:`kda_tp.output`) and the dump
(:mod:`kda_tp.audit`), which all must agree on them:

* ``OUT/rank{r}/`` is rank ``r``'s directory (:func:`rank_dir`); ``OUT/.rank{r}.partial-<run>``
  a directory being written (or left by a killed run), named by its run (:func:`run_id`); ``OUT/.rank{r}.replaced-*`` a rank
  directory moved aside while a new one takes its place (:data:`ASIDE_DIR`);
  ``OUT/.rank{r}.lock`` the lock of its writers (``shard`` and ``dump`` alike);
  ``OUT/.tp{T}.lock`` the lock every writer of world size ``T`` shares (:data:`WORLD_LOCK`):
  one world size per output;
* kda-tp's mark :data:`MARK_NAME` in every directory it makes, and :data:`FILE_MARK` in the
  ``__metadata__`` of every safetensors file it writes.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

__all__ = ["ASIDE_DIR", "FILE_MARK", "LOCK_FILE", "MARK_NAME", "PARTIAL_DIR", "RANK_DIR",
           "WORLD_LOCK", "rank_dir", "run_id"]

#: A finished rank directory's name: ``rank{r}``.
RANK_DIR = re.compile(r"^rank([0-9]{1,10})$")
#: A rank directory being written, a replaced one kept aside, or one a killed run left.
PARTIAL_DIR = re.compile(r"^\.rank([0-9]{1,10})\.partial-")
#: A finished rank directory moved aside (one rename) while a new one takes its name, or before
#: it is removed; removed once checked again, never before (``kda_tp.output.moves``), and only
#: beside the rank that replaced it: one left by a killed run without its rank is put back.
ASIDE_DIR = re.compile(r"^\.rank([0-9]{1,10})\.replaced-")
#: The lock file of a rank's writers.
LOCK_FILE = re.compile(r"^\.rank([0-9]{1,10})\.lock$")
#: The lock file every writer of one world size holds (shared) while it writes into an output.
WORLD_LOCK = re.compile(r"^\.tp([0-9]{1,10})\.lock$")

#: The mark kda-tp writes into every directory it makes (a rank directory, a partial one, a
#: ``demo --keep`` directory): a JSON object ``{"written_by": "kda-tp", "version", "kind",
#: "entries"}`` naming the entries kda-tp wrote there. kda-tp removes or replaces a directory
#: only when it carries this mark and holds nothing the mark does not name (see
#: :mod:`kda_tp.output`).
MARK_NAME = ".kda-tp.json"

#: The ``__metadata__`` key every safetensors file kda-tp writes carries (its version): the
#: mark by which ``--force`` recognises the safetensors files it may replace.
FILE_MARK = "kda_tp_version"

def rank_dir(out_dir: str | os.PathLike[str], tp_rank: int) -> Path:
    """The directory holding rank ``tp_rank``'s checkpoint under ``out_dir``."""
    return Path(out_dir) / f"rank{tp_rank}"


def run_id() -> str:
    """A new name for one run's hidden entries (``<pid>-<16 random hex digits>``): unique to the
    run, not only to the process, since two containers writing into one volume both run their
    writer as pid 1. A run removes only entries named by its own id."""
    return f"{os.getpid()}-{secrets.token_hex(8)}"
