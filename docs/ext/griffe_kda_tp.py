"""Griffe extension for the API reference (mkdocs.yml loads it; not part of the package).

* PyO3 classes are built by ``__new__`` and have no ``__init__``, so griffe finds no parameters
  for them and their ``Args:`` sections look unknown. A class whose own members (in the
  ``_native.pyi`` stub) have ``__new__`` but no ``__init__`` gets an ``__init__`` with
  ``__new__``'s parameters, which ``merge_init_into_class`` then shows as the class signature.
* The docstrings use Sphinx roles (``:class:`KdaTensorPlan```, ``:func:`~kda_tp.torch.load_rank```)
  so that they read well in an editor; they become autorefs cross-references
  (``[`KdaTensorPlan`][KdaTensorPlan]``), which ``scoped_crossrefs`` resolves like a name in the
  docstring's scope. A target that resolves to nothing fails ``mkdocs build --strict``.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj):`(~?)([\w.]+?)(\(\))?`")


def _crossref(match: re.Match[str]) -> str:
    short, target, call = match.group(1), match.group(2), match.group(3) or ""
    title = target.rsplit(".", 1)[-1] if short else target
    return f"[`{title}{call}`][{target}]"


class KdaTpDocs(griffe.Extension):
    """Constructor parameters for PyO3 classes; Sphinx roles as cross-references."""

    def on_class_members(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        new = cls.members.get("__new__")
        if not isinstance(new, griffe.Function) or "__init__" in cls.members:
            return
        params = list(new.parameters)[1:]  # drop cls
        init = griffe.Function(
            "__init__",
            lineno=new.lineno,
            endlineno=new.endlineno,
            parameters=griffe.Parameters(
                griffe.Parameter("self", kind=griffe.ParameterKind.positional_or_keyword),
                *params,
            ),
            returns="None",
        )
        cls.set_member("__init__", init)

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for obj in _walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = _ROLE.sub(_crossref, obj.docstring.value)


def _walk(obj: griffe.Object) -> Any:
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)  # type: ignore[arg-type]
