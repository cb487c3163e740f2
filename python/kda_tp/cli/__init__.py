"""The ``kda-tp`` command line: :func:`main` parses the arguments and dispatches
(``entry``); the commands' bodies (``commands``), what they print (``format``) and their
progress on stderr (``progress``).
"""

from . import entry
from .entry import *  # noqa: F403

__all__ = entry.__all__
