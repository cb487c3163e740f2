"""The NaN-sentinel copy a sparse patch into SGLang is loaded with is followed only when it is
verl's own (``_masked_copy()`` of verl 0.9.1's SGLang delta loader, known by its code object),
never another replacement of ``torch.Tensor.copy_`` (issue 38, F6). verl is not installed
here: a module of the same name holding a context of the same shape as verl's stands in for
it (``verl/workers/rollout/sglang_rollout/delta_loader.py:203-228``)."""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from kda_tp.guard.sglang.facts import VERL_DELTA_LOADER, SglangEngine


class _Tensor:
    """Where the stand-in context installs its copy, as verl's does on ``torch.Tensor``."""

    def copy_(self, src: Any) -> Any:
        return src


def _delta_loader() -> types.ModuleType:
    module = types.ModuleType(VERL_DELTA_LOADER)

    @contextlib.contextmanager
    def _masked_copy() -> Iterator[None]:
        orig_copy = _Tensor.copy_

        def masked_copy_(self: Any, src: Any, *args: Any, **kwargs: Any) -> Any:
            return orig_copy(self, src)

        _Tensor.copy_ = masked_copy_  # type: ignore[method-assign]
        try:
            yield
        finally:
            _Tensor.copy_ = orig_copy  # type: ignore[method-assign]

    module._masked_copy = _masked_copy  # type: ignore[attr-defined]
    return module


@pytest.fixture
def verl(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = _delta_loader()
    monkeypatch.setitem(sys.modules, VERL_DELTA_LOADER, module)
    return module


def test_verls_own_masked_copy_is_followed(verl: types.ModuleType) -> None:
    reader = SglangEngine.reader
    with verl._masked_copy():
        assert reader.masked_copy(_Tensor.copy_)
    assert not reader.masked_copy(_Tensor.copy_)  # the plain copy again


def test_a_wrapper_of_verls_copy_or_any_other_copy_is_not(verl: types.ModuleType) -> None:
    reader = SglangEngine.reader
    with verl._masked_copy():
        masked = _Tensor.copy_

        @functools.wraps(masked)
        def wrapper(self: Any, src: Any) -> Any:
            return masked(self, src)

        assert not reader.masked_copy(wrapper)
    assert not reader.masked_copy(lambda self, src: src)
    assert not reader.masked_copy(None)


def test_without_verl_nothing_is_followed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, VERL_DELTA_LOADER, raising=False)
    copy = _delta_loader()
    with copy._masked_copy():
        assert not SglangEngine.reader.masked_copy(_Tensor.copy_)
