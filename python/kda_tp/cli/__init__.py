"""The ``kda-tp`` command line: :func:`main` parses the arguments and dispatches
(``entry``); the commands' bodies (``_commands``), what they print (``_format``) and their
progress on stderr (``_progress``) are its own.
"""

from .entry import main

__all__ = ["main"]
