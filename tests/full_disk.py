"""A full disk, injected: a stand-in for the ``open(fd, "wb")`` kda-tp's writers call
(``monkeypatch.setattr(writer, "open", FullDisk(budget), raising=False)``)."""

from __future__ import annotations

import errno
import os
import threading
from typing import Any


class FullDisk:
    """``open(fd, mode)`` whose files' writes fail with ENOSPC past ``budget`` bytes (one budget
    shared by every file and thread, like a disk) or, with ``at="flush"``, whose flush fails."""

    def __init__(self, budget: int, at: str = "write") -> None:
        self.budget, self.at, self.lock = budget, at, threading.Lock()

    def __call__(self, fd: int, mode: str) -> Any:
        real = open(fd, mode)  # noqa: SIM115
        disk = self

        class File:
            def write(self, data: Any) -> int:
                n = memoryview(data).nbytes
                with disk.lock:
                    if disk.at == "write" and n > disk.budget:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    disk.budget -= n
                return real.write(data)

            def flush(self) -> None:
                if disk.at == "flush":
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                real.flush()

            def __getattr__(self, name: str) -> object:
                return getattr(real, name)

        return File()
