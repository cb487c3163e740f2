"""``python -m kda_tp.oracle verify CHECKPOINT OUT``: the oracle's checkpoint verifier.

A separate module from the oracle itself, which the package imports: running an imported
module as ``__main__`` would execute it twice (and Python warns about it).
"""

import sys

from . import main

sys.exit(main())
