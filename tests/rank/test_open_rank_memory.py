"""``open_rank`` of a trainer's tensors (issue 39, item 3): a numpy state dict gives the same
view, plan, refusals and bytes as its checkpoint, for every family and several TP sizes (K3's
padded ``A_log``, FP8 blocks with their scales); and safe_open parity (item 4):
``metadata()``, ``get_slice()``; the API's refusals (item 6, F18)."""

from __future__ import annotations

import numpy as np
import pytest
import tp_fixtures

import kda_tp
from kda_tp import CheckpointError, PlanError, SafetensorsSource, UsageError, open_rank


def _plan(plan):
    return repr(plan), [(t.name, t.kind, t.dtype, t.byte_range, t.local_bytes, t.full_bytes)
                        for t in plan.tensors]


def _state_dict(path):
    source = SafetensorsSource(path)
    return {n: source.get(n).array for n in source.names()}


@pytest.mark.parametrize("fixture", list(tp_fixtures.FIXTURES.values()), ids=lambda f: f.name)
def test_a_numpy_state_dict_opens_as_its_checkpoint(fixture, tmp_path_factory):
    path = tp_fixtures.checkpoint(fixture, tmp_path_factory.getbasetemp())
    tensors = _state_dict(path)
    pairs = list(tensors.items())
    for tp_size in (1, *fixture.tp_sizes):
        for rank in sorted({0, tp_size - 1}):
            kw = dict(tp_rank=rank, tp_size=tp_size, qk_multiple=fixture.qk_multiple)
            with open_rank(path, **kw) as want:
                for given in (tensors, pairs):
                    got = open_rank(given, config=path / "config.json", **kw)
                    assert _plan(got.plan) == _plan(want.plan)
                    assert got.names() == want.names()
                    for name in want.names():
                        a, b = want[name], got[name]
                        assert (a.dtype, a.shape) == (b.dtype, b.shape), name
                        assert a.data.tobytes() == b.data.tobytes(), (name, tp_size, rank)
                        assert got.info(name) == want.info(name)


def test_the_same_refusals_as_the_checkpoint():
    path = tp_fixtures.DATA / "k3_small"
    tensors = _state_dict(path)
    a_log = next(n for n in tensors if n.endswith("A_log"))
    bad = dict(tensors)
    bad[a_log] = np.array(tensors[a_log], copy=True)
    bad[a_log][-1] = 1.0  # a non-zero padding entry
    with pytest.raises(CheckpointError, match="padding entry"):
        open_rank(bad, config=path, tp_rank=0, tp_size=2, qk_multiple=1)
    missing = {k: v for k, v in tensors.items() if not k.endswith("q_proj.weight")}
    with pytest.raises(CheckpointError, match="lacks"):
        open_rank(missing, config=path, tp_rank=0, tp_size=2, qk_multiple=1)


def test_row_slices_are_views_of_the_callers_memory():
    path = tp_fixtures.DATA / "kda_small"
    tensors = {k: np.ascontiguousarray(v) for k, v in _state_dict(path).items()}
    view = open_rank(tensors, config=path, tp_rank=1, tp_size=2, qk_multiple=1)
    name = next(n for n in tensors if n.endswith("q_proj.weight"))
    got = view[name].data
    base = tensors[name].__array_interface__["data"][0]
    assert base <= got.__array_interface__["data"][0] < base + tensors[name].nbytes


def test_config_is_for_tensors_and_needed_by_them():
    path = tp_fixtures.DATA / "kda_small"
    with pytest.raises(UsageError, match="config= is for in-memory tensors"):
        open_rank(path, config={}, tp_rank=0, tp_size=1)
    with pytest.raises(UsageError, match="need config="):
        open_rank(_state_dict(path), tp_rank=0, tp_size=1)


def test_metadata_and_get_slice_as_safe_open():
    path = tp_fixtures.DATA / "kda_small"
    with open_rank(path, tp_rank=1, tp_size=2, qk_multiple=1) as view:
        files = SafetensorsSource(path).files()
        assert view.metadata() == (files[0][1] if files[0][1] is None else dict(files[0][1]))
        for name in view.keys():
            s = view.get_slice(name)
            assert s.get_shape() == list(view[name].shape)
            assert s.get_dtype() == view[name].dtype
            full = view[name].array
            assert np.array_equal(s[...].view(np.uint8), full.view(np.uint8))
            if full.ndim == 2:
                assert np.array_equal(s[:, 1:3].view(np.uint8), full[:, 1:3].view(np.uint8))
    assert open_rank(_state_dict(path), config=path, tp_rank=0, tp_size=2,
                     qk_multiple=1).metadata() is None


def test_api_refusals_say_as_much_as_the_cli():
    path = tp_fixtures.DATA / "kda_small"
    with pytest.raises(PlanError, match=r"tp_rank 2 is outside 0\.\.1 .*pass tp_rank in 0\.\.1"):
        open_rank(path, tp_rank=2, tp_size=2)
    with pytest.raises(UsageError, match=r"got bytes \(decode it: os.fsdecode\(path\)\)"):
        open_rank(bytes(path), tp_rank=0, tp_size=2)
    with pytest.raises(UsageError, match="tp_rank must be an integer"):
        open_rank(path, tp_rank=1.0, tp_size=2)
    view = open_rank(path, tp_rank=np.int64(1), tp_size=np.int32(2), qk_multiple=1)
    assert (view.plan.tp_rank, view.plan.tp_size) == (1, 2)
    assert isinstance(kda_tp.TensorNotFoundError("x"), KeyError)
