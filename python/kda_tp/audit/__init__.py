"""What a serving engine loaded against what it must hold: :func:`audit` and
:func:`audit_path` (byte for byte, each wrong parameter diagnosed), the report
(:class:`AuditReport`), the parameters an engine must hold written as a ``save_sharded_state``
dump (:func:`write_engine_dump`) or hashed as vLLM's weight checksums
(:func:`engine_digests`), and the trainer's side of an RL refit (:func:`expected_digests`).
"""

from . import auditor, digests, dump, dump_files, report
from .auditor import *  # noqa: F403
from .report import *  # noqa: F403
from .dump import *  # noqa: F403
from .digests import *  # noqa: F403
from .dump_files import *  # noqa: F403

__all__ = auditor.__all__ + report.__all__ + dump.__all__ + digests.__all__ + dump_files.__all__
