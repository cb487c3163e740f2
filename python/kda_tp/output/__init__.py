"""What kda-tp writes and what it may touch: the names of rank directories, locks and
marks (``names``), kda-tp's marks and the refusal to touch what it did not write (``marks``),
the locks of an output (``locks``: one world size per output, one writer per rank), moving
outputs into place, aside and away with each path judged at that moment (``moves``),
output-directory safety: build-then-replace, mode bits (``dirs``), and ``demo --keep``'s
directory (``demo``).
"""

from . import demo, dirs, locks, marks, moves, names
from .names import *  # noqa: F403
from .marks import *  # noqa: F403
from .locks import *  # noqa: F403
from .moves import *  # noqa: F403
from .dirs import *  # noqa: F403
from .demo import *  # noqa: F403

__all__ = (names.__all__ + marks.__all__ + locks.__all__ + moves.__all__ + dirs.__all__
           + demo.__all__)
