"""``open_rank`` of a torch state dict (issue 39, item 3): the same view and bytes as the
checkpoint for every family at several TP sizes, CPU tensors (and CUDA ones where a device is
there: sliced on the device); ``load_rank``'s tensors are such a state dict too."""

from __future__ import annotations

import pytest
import tp_fixtures

from kda_tp import SafetensorsSource, open_rank

torch = pytest.importorskip("torch")
import kda_tp.torch as kt  # noqa: E402 - after the importorskip

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fixture", list(tp_fixtures.FIXTURES.values()), ids=lambda f: f.name)
def test_a_torch_state_dict_opens_as_its_checkpoint(fixture, device, tmp_path_factory):
    path = tp_fixtures.checkpoint(fixture, tmp_path_factory.getbasetemp())
    source = SafetensorsSource(path)  # the checkpoint's tensors as stored (K3's padded A_log)
    state = {n: source.get(n).to_torch().clone().to(device) for n in source.names()}
    for tp_size in fixture.tp_sizes:
        for rank in sorted({0, tp_size - 1}):
            kw = dict(tp_rank=rank, tp_size=tp_size, qk_multiple=fixture.qk_multiple)
            with open_rank(path, **kw) as want:
                got = open_rank(state, config=path, **kw)
                assert got.names() == want.names()
                for name in want.names():
                    a, b = want[name], got[name]
                    assert (a.dtype, a.shape) == (b.dtype, b.shape), name
                    assert a.data.tobytes() == b.data.tobytes(), (name, tp_size, rank)
