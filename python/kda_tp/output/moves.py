"""Moving what kda-tp writes into place, aside and away, each path judged at the moment it is
taken, moved or removed: a check made when a run starts says nothing of what another process
put there while the run was writing.

* :func:`take_name` renames without ever replacing: a name that was free is taken, one that is
  taken now is refused (``EEXIST``), whatever appeared under it meanwhile.
* :func:`put_aside` checks a path is kda-tp's, moves it aside in one rename, and checks it
  again where it now is; what appeared between the two looks is moved back and refused.
* :func:`discard_ours` removes a directory kda-tp moved aside entry by entry, each entry
  judged by its own mark (:mod:`kda_tp.output.marks`), the directory last with ``rmdir``
  (which fails on anything put there since): what is not kda-tp's is never removed.
* :func:`keep_foreign` puts a directory holding what is not kda-tp's back where it was, or
  beside it when that name is taken now.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from collections.abc import Callable
from pathlib import Path

from ..checkpoint.files import TEMP_FILE
from ..errors import OutputError
from .locks import is_lock_file
from .marks import Mark, foreign_entry, read_mark, refuse
from .names import ASIDE_DIR, LOCK_FILE, MARK_NAME, PARTIAL_DIR, RANK_DIR, WORLD_LOCK

__all__ = ["discard_ours", "keep_foreign", "put_aside", "take_name"]

#: ``renameat2``'s "the current directory" and its flag that refuses an existing target.
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def _load_renameat2() -> Callable[..., int] | None:
    """glibc's ``renameat2`` (Linux >= 3.15, glibc >= 2.28), or None where there is none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                         ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_RENAMEAT2 = _load_renameat2()


def _rename(src: Path, dst: Path) -> None:
    """``rename(src, dst)`` that never replaces ``dst`` (see :func:`take_name`)."""
    if _RENAMEAT2 is not None:
        if _RENAMEAT2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst),
                      _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        # A file system or kernel without the flag: the fallback below.
        if code not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(code, os.strerror(code), str(src), None, str(dst))
    if src.is_dir() and not src.is_symlink():
        # rename(2) refuses a file or a non-empty directory under dst; only an empty directory
        # created between this look and the rename would be replaced: nothing holding data.
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(src), None,
                                  str(dst))
        os.rename(src, dst)
        return
    os.link(src, dst, follow_symlinks=False)  # EEXIST when dst is taken
    os.unlink(src)


def take_name(src: Path, dst: Path) -> None:
    """Rename ``src`` (a file or directory kda-tp wrote) to ``dst`` in one step, only while
    ``dst`` is free: ``renameat2(RENAME_NOREPLACE)`` where the kernel, the C library and the
    file system have it; else a hard link and an unlink for a file, and for a directory a
    rename after checking ``dst`` is absent (``rename(2)`` itself refuses a file or a
    non-empty directory there).

    Raises:
        FileExistsError: ``dst`` exists (nothing was moved).
        OSError: the rename fails otherwise.
    """
    _rename(src, dst)


def put_aside(path: Path, aside: Path, judge: Callable[[Path], str | None], what: str) -> None:
    """Move ``path`` to the free name ``aside`` in one rename, once ``judge(path)`` (why it is
    not kda-tp's, or None) says it may be, and judge it again where it now is: something put
    into it between the two looks sends it back to ``path`` and refuses.

    Args:
        judge: ``foreign_dir`` or ``foreign_file``
            with their arguments bound.
        what: the refusal's fix (``"replaces"`` or ``"removes"``, ``refuse``).

    Raises:
        OutputError: ``path`` is not kda-tp's, before or after the move (then it is back
            under ``path``, or, where that name was taken meanwhile, left under ``aside``,
            which the message names), or the rename fails.
    """
    why = judge(path)
    if why is not None:
        raise refuse(path, why, what)
    try:
        take_name(path, aside)
    except OSError as e:
        raise OutputError(f"{path}: cannot move it aside to {aside.name}: {e}") from e
    why = judge(aside)
    if why is None:
        return
    try:
        take_name(aside, path)
    except OSError:
        raise refuse(path, f"{why}; it was put there while kda-tp moved it aside, and is "
                           f"kept as {aside}", what) from None
    raise refuse(path, f"{why} (put there while kda-tp was writing)", what)


def discard_ours(path: Path) -> list[str]:
    """Remove the directory ``path`` (one kda-tp moved aside) entry by entry, then itself,
    removing only what is kda-tp's: an entry its mark names and that its own mark says kda-tp
    wrote (:func:`~kda_tp.output.marks.foreign_entry`), kda-tp's temporary files, and in an
    unmarked shard output its lock files and rank directories (each in turn the same way).

    Returns:
        The entries left because they are not kda-tp's (``sub/name`` below a rank directory),
        sorted; empty when ``path`` is gone. With entries left, ``path`` stays, holding only
        them (kda-tp's mark removed too: what is left is not kda-tp's).
    """
    mark = read_mark(path)
    left: list[str] = []
    try:
        names = sorted(os.listdir(path))
    except FileNotFoundError:
        return []
    for name in names:
        entry = path / name
        if name == MARK_NAME:
            continue
        if entry.is_dir() and not entry.is_symlink():
            ours = (mark is not None and name in mark.entries) or (
                mark is None and bool(RANK_DIR.match(name) or PARTIAL_DIR.match(name)
                                      or ASIDE_DIR.match(name)))
            if ours:
                left += [f"{name}/{n}" for n in discard_ours(entry)]
            else:
                left.append(name)
            continue
        if _ours(entry, mark):
            entry.unlink(missing_ok=True)
        else:
            left.append(name)
    (path / MARK_NAME).unlink(missing_ok=True)
    if not left:
        try:
            os.rmdir(path)
        except OSError:  # ENOTEMPTY: something was put there meanwhile
            return sorted(os.listdir(path))
    return left


def _ours(entry: Path, mark: Mark | None) -> bool:
    """Whether the file ``entry`` is kda-tp's (see :func:`discard_ours`)."""
    if entry.is_symlink():
        return False
    name = entry.name
    if TEMP_FILE.match(name):
        return True
    if mark is None:
        return bool(LOCK_FILE.match(name) or WORLD_LOCK.match(name)) and is_lock_file(entry)
    return name in mark.entries and foreign_entry(entry, mark) is None


def keep_foreign(aside: Path, home: Path) -> Path:
    """Put back ``aside``, a directory left holding what is not kda-tp's (:func:`discard_ours`),
    under ``home``, its name before kda-tp moved it, or, when another directory has taken that
    name, beside it as ``home.kept-<pid>``. Returns where it now is (``aside`` itself when
    neither name is free)."""
    for name in (home, home.with_name(f"{home.name}.kept-{os.getpid()}")):
        try:
            take_name(aside, name)
            return name
        except OSError:
            continue
    return aside
