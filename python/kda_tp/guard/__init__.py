"""The guard: one rank's KDA parameters checked against the checkpoint at the first load
(:func:`check`, behind the mode switch ``KDA_TP_GUARD``) and after every weight update (an
:class:`UpdateSession` on the rank's :class:`RankTarget`, driven by the model's
:class:`Follower`), in one flow for every engine (:func:`on_load`, given an :class:`Engine`
adapter). The engine plugins are ``kda_tp.guard.vllm`` and ``kda_tp.guard.sglang`` (their
``register`` is each engine's entry point).

The engine-neutral core, in-room modules: ``_modes`` (the mode, the repair switch, a check
that cannot run, which checkpoint a load is checked against), ``_names`` (which names are a KDA
layer's), ``_derived`` (an engine's derived copies), ``_repacked`` (what a post-load repack
leaves checkable), ``_target`` (a rank's KDA parameters), ``_updates`` (one update's check),
``_first_load`` (the check at load), ``_live`` (a live model's updates), ``_record`` (this
process's hooks, verdicts and a live audit's ranks) and ``_load`` (the one flow and the
:class:`Engine` protocol). No engine fact is in them: each is in its adapter
(``kda_tp.guard.vllm``, ``kda_tp.guard.sglang``).
"""

from ._first_load import GuardResult, check
from ._live import Follower, follow, followed
from ._load import Engine, on_load
from ._modes import (CHECKPOINT_ENV, MODE_ENV, MODES, REPAIR_ENV, LoadSource, load_checkpoint,
                     mode)
from ._names import looks_kda
from ._record import rank_report
from ._repacked import read_back_difference
from ._target import RankTarget
from ._updates import UpdateReport, UpdateSession

__all__ = ["CHECKPOINT_ENV", "MODES", "MODE_ENV", "REPAIR_ENV", "Engine", "Follower",
           "GuardResult", "LoadSource", "RankTarget", "UpdateReport", "UpdateSession", "check",
           "follow", "followed", "load_checkpoint", "looks_kda", "mode", "on_load",
           "rank_report", "read_back_difference"]
