"""``read_into`` with torch destinations (issue 39, item 2): a parameter of the tensor's dtype
and shape is filled in place (``view.read_into(name, param)``, README's recipe); another dtype
(fp16 for a BF16 tensor) or shape is refused naming both and the fix; a uint8 tensor takes the
raw bytes; a device other than the CPU goes through host staging."""

from __future__ import annotations

import numpy as np
import pytest
import tp_fixtures

from kda_tp import DtypeMismatchError, ShapeMismatchError, open_rank

torch = pytest.importorskip("torch")
import kda_tp.torch as kt  # noqa: E402 - after the importorskip


@pytest.mark.parametrize("backend", ["mmap", "pread"])
@pytest.mark.parametrize("fixture", ["kda_small", "k3_fp8_small"])
def test_parameters_of_the_right_dtype_and_shape_are_filled_in_place(fixture, backend):
    path = tp_fixtures.FIXTURES[fixture].path
    with open_rank(path, tp_rank=1, tp_size=2, qk_multiple=1, backend=backend) as view:
        for name in view.keys():
            dtype, shape = view.info(name)
            param = torch.nn.Parameter(torch.empty(shape, dtype=kt.torch_dtype(dtype)))
            view.read_into(name, param)
            assert param.view(torch.uint8).reshape(-1).numpy().tobytes() == (
                view[name].data.tobytes()), name
            raw = torch.empty(view[name].nbytes, dtype=torch.uint8)
            view.read_into(name, raw)
            assert raw.numpy().tobytes() == view[name].data.tobytes(), name


def test_an_fp16_parameter_for_a_bf16_tensor_is_refused():
    with open_rank(tp_fixtures.DATA / "kda_small", tp_rank=0, tp_size=2, qk_multiple=1) as view:
        name = "model.layers.0.self_attn.o_proj.weight"
        dtype, shape = view.info(name)
        assert dtype == "BF16"
        with pytest.raises(DtypeMismatchError,
                           match=r"o_proj.*torch.float16.*BF16 \(torch.bfloat16\); pass a"):
            view.read_into(name, torch.empty(shape, dtype=torch.float16))
        with pytest.raises(ShapeMismatchError, match=r"o_proj.*shape"):
            view.read_into(name, torch.empty(tuple(reversed(shape)), dtype=torch.bfloat16))
        with pytest.raises(ShapeMismatchError, match="bytes"):
            view.read_into(name, torch.empty(3, dtype=torch.uint8))


def test_a_device_destination_is_staged_through_host_memory(monkeypatch):
    """The staging path, on the meta-free stand-in torch offers everywhere: a tensor whose
    ``device`` is not the CPU. Without CUDA the path is driven through a CPU tensor posing as
    one; with CUDA (device checks) the real device is used."""
    device = "cuda" if torch.cuda.is_available() else None
    with open_rank(tp_fixtures.DATA / "kda_small", tp_rank=1, tp_size=2, qk_multiple=1) as view:
        name = "model.layers.0.self_attn.o_proj.weight"
        dtype, shape = view.info(name)
        if device is None:
            pytest.skip("no CUDA device: the staging path needs one")
        out = torch.empty(shape, dtype=kt.torch_dtype(dtype), device=device)
        view.read_into(name, out)
        got = out.cpu().view(torch.uint8).reshape(-1).numpy()
        assert np.array_equal(got, view[name].data)
