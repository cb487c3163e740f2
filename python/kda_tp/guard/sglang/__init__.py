"""The guard inside SGLang 0.5.23 (the entry point ``kda_tp.guard.sglang:register`` of the
group ``sglang.srt.plugins``): SGLang's adapter to the guard's one flow (``facts``: its
attention tensor-parallel ranks, pipeline stage, the checkpoint) and the hooks SGLang's
``HookRegistry`` applies (``plugin``).

Importing it imports no SGLang.
"""

from .plugin import (RPC_METHOD, TARGETS, audit_engine, audit_runner, checkpoint_of,
                     guard_runner, rank_and_size, register, status)

__all__ = ["RPC_METHOD", "TARGETS", "audit_engine", "audit_runner", "checkpoint_of",
           "guard_runner", "rank_and_size", "register", "status"]
