"""The faces say what a user may touch (ARCHITECTURE.md, "Faces"): each folder's ``__init__.py``
lists its API by hand, a short list, and every name on it is documented in ``docs/api/``: a
``::: kda_tp.FACE.NAME`` directive (or one of the name's own module, or of the package face for
the same object), or a ``members:`` entry of a directive of the face or of one of its modules."""

from __future__ import annotations

import importlib
import re
import types

import pytest

from paths import ROOT

#: The faces this test holds to the rule: the package face and its folders' faces.
FACES = ("kda_tp", "kda_tp.checkpoint", "kda_tp.model", "kda_tp.rank", "kda_tp.output",
         "kda_tp.synth", "kda_tp.shard", "kda_tp.reference", "kda_tp.cli", "kda_tp.oracle",
         "kda_tp.engines", "kda_tp.audit", "kda_tp.guard", "kda_tp.guard.vllm",
         "kda_tp.guard.sglang")
#: The most names a face may list.
MOST_NAMES = 25

_DIRECTIVE = re.compile(r"^::: ([\w.]+)\n((?:[ \t]+.*\n)*)", re.M)
_MEMBERS = re.compile(r"members:\s*\[([^\]]*)\]")


def documented() -> set[str]:
    """Every dotted name docs/api/*.md renders: each directive's object, and the members it
    lists (``kda_tp.model`` with ``members: [dequantize]`` gives ``kda_tp.model.dequantize``)."""
    text = "\n".join(page.read_text() for page in sorted((ROOT / "docs" / "api").glob("*.md")))
    found = set()
    for name, options in _DIRECTIVE.findall(text + "\n"):
        found.add(name)
        for listed in _MEMBERS.findall(options):
            found |= {f"{name}.{member.strip()}" for member in listed.split(",") if member.strip()}
    return found


def _paths(face: str, name: str, value: object) -> set[str]:
    """The dotted names under which ``value`` (``face.name``) may be documented."""
    paths = {f"{face}.{name}"}
    if isinstance(value, types.ModuleType):
        return paths | {value.__name__}
    module = getattr(value, "__module__", None)
    if isinstance(module, str) and module.startswith("kda_tp"):
        paths.add(f"{module}.{name}")
    top = importlib.import_module("kda_tp")
    if name in top.__all__ and getattr(top, name) is value:
        paths.add(f"kda_tp.{name}")
    return paths


@pytest.mark.parametrize("face", FACES)
def test_a_face_lists_a_few_names_each_documented(face):
    module = importlib.import_module(face)
    names = list(module.__all__)
    assert len(names) <= MOST_NAMES, f"{face} lists {len(names)} names"
    assert len(set(names)) == len(names), f"{face} lists a name twice"
    docs = documented()
    undocumented = [name for name in names if name != "__version__"
                    and not _paths(face, name, getattr(module, name)) & docs]
    assert undocumented == [], f"{face}: not in docs/api/*.md"


def test_a_face_is_written_by_hand():
    """Each folder face imports its names one by one: no ``import *``, no ``__all__`` summed
    from its modules'."""
    for face in FACES[1:]:
        source = (ROOT / "python" / face.replace(".", "/") / "__init__.py").read_text()
        assert "import *" not in source, face
        assert not re.search(r"\w\.__all__", source), face
