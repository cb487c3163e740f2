"""Which file mapping of this process holds an address (``/proc/self/maps``): how the tests
tell a zero-copy view of a checkpoint file from a copy, and a copy-on-write mapping from the
read-only one."""

from __future__ import annotations

from pathlib import Path


def file_mapping(address: int) -> tuple[Path, str] | None:
    """``(file, permissions)`` of the file mapping holding ``address`` (permissions as
    ``/proc/self/maps`` writes them, e.g. ``"rw-p"``: readable, writable, private), or None
    when the address lies in no file mapping (anonymous memory: a copy)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            if len(fields) < 6 or not fields[5].startswith("/"):
                return None
            return Path(fields[5].removesuffix(" (deleted)")), fields[1]
    return None


def in_file_copy_on_write(address: int, file: Path) -> bool:
    """Whether ``address`` lies in a private, writable mapping of ``file`` (or of a file of
    the directory ``file``)."""
    found = file_mapping(address)
    if found is None:
        return False
    path, perms = found
    file = Path(file).resolve()
    inside = path.resolve() == file or path.resolve().parent == file
    return inside and perms.startswith("rw") and perms.endswith("p")
