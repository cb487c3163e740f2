"""The guard: one rank's KDA parameters checked against the checkpoint at the first load
(:func:`check`, behind the mode switch ``KDA_TP_GUARD``) and after every weight update (an
:class:`UpdateSession` on the rank's :class:`RankTarget`, driven by the model's
:class:`Follower`). The engine plugins are ``kda_tp.guard.vllm`` and ``kda_tp.guard.sglang``
(their ``register`` is each engine's entry point), with the import hooks they install
(``kda_tp.guard.hooks``).

Its modules, bottom to top: ``modes`` (the mode, the repair switch, a check that cannot run,
which checkpoint a load is checked against), ``record`` (this process's hooks, their wrappers
still in place, verdicts, a live audit's ranks), ``repacked`` (what an engine holds after its
post-load repack), ``target`` (a rank's KDA parameters, built once per model), ``updates`` (one
update's check), ``first_load`` (the check at load), ``live`` (a live model's updates), then
the plugins (``vllm_facts``: what the vLLM plugin reads from vLLM).
"""

from . import first_load, live, modes, target, updates
from .modes import *  # noqa: F403
from .first_load import *  # noqa: F403
from .target import *  # noqa: F403
from .updates import *  # noqa: F403
from .live import *  # noqa: F403

__all__ = modes.__all__ + first_load.__all__ + target.__all__ + updates.__all__ + live.__all__
