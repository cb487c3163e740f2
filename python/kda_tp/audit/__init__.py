"""What a serving engine loaded against what it must hold: :func:`audit` and
:func:`audit_path` (byte for byte, each wrong parameter diagnosed), the report
(:class:`AuditReport`), the parameters an engine must hold written as a ``save_sharded_state``
dump (:func:`write_engine_dump`) or hashed as vLLM's weight checksums
(:func:`engine_digests`), and the trainer's side of an RL refit (:func:`expected_digests`).

The face lists what a user may touch. The modules other rooms use keep their other names
(``auditor.audit_rank``, the guard's one-rank audit; ``expected_params``, every parameter an
engine rank must hold); the audit's own plumbing is in underscore modules (``_diagnosis``: the
bounded diagnosis of a wrong parameter; ``_dump_files``: dump-file names, ranks and metadata).
"""

from ._dump_files import dump_world_size, sharded_state_files
from .auditor import audit, audit_path
from .digests import DIGEST_KEY, engine_digests, expected_digests, param_digest
from .dump import DumpResult, write_engine_dump
from .report import AuditReport, ParamAudit, PartDifference

__all__ = [
    "audit",
    "audit_path",
    "AuditReport",
    "ParamAudit",
    "PartDifference",
    "write_engine_dump",
    "DumpResult",
    "engine_digests",
    "expected_digests",
    "param_digest",
    "DIGEST_KEY",
    "sharded_state_files",
    "dump_world_size",
]
