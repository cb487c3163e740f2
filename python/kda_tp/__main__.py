"""``python -m kda_tp``: the ``kda-tp`` command line."""

import sys

from .cli import main

sys.exit(main())
