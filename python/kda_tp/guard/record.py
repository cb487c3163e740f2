"""This process's guard record, one for both engine plugins: the hooks armed (or why not), the
checks run by kind and the last verdict line, as :func:`status` reports them (the live audits
``kda_tp.guard.vllm.audit_llm`` and ``kda_tp.guard.sglang.audit_engine`` return it per rank).

This module imports no engine.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from .._native import __version__
from ..errors import KdaTpError
from .modes import mode

__all__ = ["RECORD", "Record", "status"]


@dataclass
class Record:
    """The hooks installed in this process and those that could not be (target -> ``"armed"``
    or why not), the checks run by kind (``first load``, ``update``, ...) and the last verdict
    line."""

    hooks: dict[str, str] = field(default_factory=dict)
    checks: dict[str, int] = field(default_factory=dict)
    last: str = ""

    def ran(self, kind: str, line: str) -> None:
        """Count one verdict of ``kind`` (a pass, a failure, raised or not) and keep its line."""
        self.checks[kind] = self.checks.get(kind, 0) + 1
        self.last = line


#: This process's record.
RECORD = Record()


def status(engine: str) -> dict[str, Any]:
    """This process's guard as a plain dict: ``versions`` (the engine's, ``engine`` being its
    module name ``"vllm"`` or ``"sglang"``, and kda_tp's), ``mode`` (or ``"invalid: ..."``),
    ``hooks`` (each target: ``"armed"`` or why it is not), ``checks`` (how many verdicts, by
    kind) and ``last`` (the last verdict line)."""
    module = sys.modules.get(engine)
    try:
        chosen = mode()
    except KdaTpError as error:
        chosen = f"invalid: {error}"
    return {"versions": {engine: str(getattr(module, "__version__", "not imported")),
                         "kda_tp": __version__},
            "mode": chosen, "hooks": dict(RECORD.hooks), "checks": dict(RECORD.checks),
            "last": RECORD.last}
