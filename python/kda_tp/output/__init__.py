"""What kda-tp writes and what it may touch: the names of rank directories, locks and
marks, kda-tp's marks and the refusal to touch what it did not write, the locks of an output
(one world size per output, one writer per rank), moving outputs into place, aside and away,
output-directory safety (build-then-replace, mode bits), and ``demo --keep``'s directory.

The face lists what a user may touch; the modules (``names``, ``marks``, ``locks``, ``moves``,
``dirs``, ``demo``) hold the rest for the commands that write.
"""

from .demo import DEMO_MAX_LAYERS, claim_demo_dir
from .dirs import check_out_dir, discard, prepare_out_dir
from .locks import OutputLocks, lock_output
from .marks import Mark, file_marked, read_mark, write_mark
from .moves import put_aside, take_name
from .names import FILE_MARK, LOCK_FILE, MARK_NAME, PARTIAL_DIR, RANK_DIR, WORLD_LOCK, rank_dir

__all__ = [
    "MARK_NAME",
    "FILE_MARK",
    "RANK_DIR",
    "PARTIAL_DIR",
    "LOCK_FILE",
    "WORLD_LOCK",
    "rank_dir",
    "Mark",
    "read_mark",
    "write_mark",
    "file_marked",
    "OutputLocks",
    "lock_output",
    "prepare_out_dir",
    "check_out_dir",
    "take_name",
    "put_aside",
    "discard",
    "DEMO_MAX_LAYERS",
    "claim_demo_dir",
]

