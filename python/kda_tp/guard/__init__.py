"""The guard: one rank's KDA parameters checked against the checkpoint at the first
load (:func:`check`, behind the mode switch ``KDA_TP_GUARD``) and after every weight update
(:class:`UpdateCheck`). The engine plugins are ``kda_tp.guard.vllm`` and
``kda_tp.guard.sglang`` (their ``register`` is each engine's entry point), with the import
hooks they install (``kda_tp.guard.hooks``).
"""

from . import first_load, updates
from .first_load import *  # noqa: F403
from .updates import *  # noqa: F403

__all__ = first_load.__all__ + updates.__all__
