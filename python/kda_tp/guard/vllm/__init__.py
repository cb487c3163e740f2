"""The guard inside vLLM 0.33 (the entry point ``kda_tp.guard.vllm:register`` of the group
``vllm.general_plugins``): vLLM's adapter to the guard's one flow (``facts``: ranks,
config, draft models, the checkpoint; ``repacked``: what vLLM holds after its post-load
repack, read back), the hooks on its loading and weight-update paths (``plugin``), the
weight-transfer engines' sessions and the trainer's digests (``transfer``) and a live audit of a
running ``LLM`` on every worker (``audit``).

Importing it imports no vLLM.
"""

from .audit import WORKER_METHOD, audit_llm
from .plugin import REPAIR_ENV, follow_updates, guard_model, register, status
from .transfer import DIGESTS_METHOD, expect_digests

__all__ = ["DIGESTS_METHOD", "REPAIR_ENV", "WORKER_METHOD", "audit_llm", "expect_digests",
           "follow_updates", "guard_model", "register", "status"]
