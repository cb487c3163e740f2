"""Every file path the user-facing pages cite is a file of this repository.

README.md, ARCHITECTURE.md and docs/**/*.md: markdown links to relative files (resolved against
the page) and backticked paths that look like this repository's files (``tests/guard/x.py``,
``python/kda_tp/...``, ``docs/x.md``, ``notes/x.md``, ...; resolved against the repository
root) must exist. Paths about other repositories or a user's machine (``owner/repo:path``,
``/models/...``, ``~/...``, URLs) are not this repository's and are left alone.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PAGES = sorted(
    [ROOT / "README.md", ROOT / "ARCHITECTURE.md"]
    + [p for p in (ROOT / "docs").rglob("*.md") if "ext" not in p.relative_to(ROOT / "docs").parts[:1]]
)

# The repository's top-level folders a backticked path can start with (and the notes folders
# pages used to cite, which this repository does not hold).
TOP = ("notes", "shared", "tests", "python", "tools", "docs", "rust", "benchmarks", ".ci", "examples")
BACKTICKED = re.compile(r"(?<!`)`([^`\s]+)`(?!`)")
LOOKS_LIKE_PATH = re.compile(r"^(?:%s)/[\w.*/-]*$" % "|".join(re.escape(t) for t in TOP))
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose(text: str) -> str:
    """The page without its fenced code blocks (commands and logs, not citations)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return "\n".join(out)


def cited_path(raw: str) -> str | None:
    """The repository path a backticked string cites, or None if it cites none."""
    path = raw.split("::", 1)[0]  # a test's node id
    path = re.sub(r":\d[\d,-]*$", "", path)  # a line number
    path = path.rstrip(".,;")
    if not LOOKS_LIKE_PATH.match(path) or path.endswith("/..."):
        return None
    return path


def exists(path: Path) -> bool:
    if any(c in str(path) for c in "*?["):
        return bool(glob.glob(str(path)))
    return path.exists()


def missing_citations(page: Path) -> list[str]:
    text = prose(page.read_text(encoding="utf-8"))
    rel = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
    missing = []
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith(("#", "/", "~")):
            continue  # a URL, an anchor on the page, a path on someone's machine
        target = target.split("#", 1)[0].split("?", 1)[0]
        if target and not exists((page.parent / target).resolve()):
            missing.append(f"{rel}: link {m.group(1)!r}")
    for m in BACKTICKED.finditer(text):
        path = cited_path(m.group(1))
        if path is not None and not exists(ROOT / path):
            missing.append(f"{rel}: `{m.group(1)}`")
    return missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_paths_exist(page: Path) -> None:
    missing = missing_citations(page)
    assert not missing, "cited but not in this repository:\n" + "\n".join(missing)


def test_the_checker_catches_what_it_must() -> None:
    assert cited_path("notes/rl_sync.md") == "notes/rl_sync.md"
    assert cited_path("tests/guard/test_vllm_refits.py::test_x") == "tests/guard/test_vllm_refits.py"
    assert cited_path("python/kda_tp/guard/_load.py:12") == "python/kda_tp/guard/_load.py"
    assert cited_path("THUDM/slime:docker/Dockerfile") is None
    assert cited_path("/models/Kimi-K3") is None
    assert cited_path("~/ckpt") is None
    assert cited_path("https://example.org/x.md") is None
    assert not exists(ROOT / "notes/rl_sync.md")
    assert exists(ROOT / "tests/guard/test_vllm_refits.py")


def test_a_page_citing_missing_files_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "See `notes/rl_sync.md`, `tests/unit/test_gone.py::test_x`, [a page](missing.md#anchor)\n"
        "and ![a picture](img/none.svg); not `THUDM/slime:docker/Dockerfile`, `/models/K3`,\n"
        "[a site](https://example.org/x.md) or [this page](#top).\n"
        "```sh\ncat notes/in_a_command.md\n```\n",
        encoding="utf-8")
    missing = missing_citations(page)
    assert [m.split(": ", 1)[1] for m in missing] == [
        "link 'missing.md#anchor'", "link 'img/none.svg'",
        "`notes/rl_sync.md`", "`tests/unit/test_gone.py::test_x`"]
