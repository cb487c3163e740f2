"""What kda-tp writes and what it may touch: the names of rank directories, locks and
marks (``names``), kda-tp's marks and the refusal to touch what it did not write (``marks``),
and output-directory safety: locks, build-then-replace, ``demo --keep``'s directory, mode bits
(``dirs``).
"""

from . import dirs, marks, names
from .names import *  # noqa: F403
from .marks import *  # noqa: F403
from .dirs import *  # noqa: F403

__all__ = names.__all__ + marks.__all__ + dirs.__all__
