"""Tensors handed to torch are torch's to write (issue 39, item 1): every tensor
``kda_tp.torch.load_rank`` and ``Tensor.to_torch()`` return takes in-place ops (``mul_``,
``add_``, an optimizer step after ``load_state_dict(..., assign=True)``) on both read backends,
the process never crashes, and the checkpoint's files and the view's numpy bytes never change."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tp_fixtures

from kda_tp import SafetensorsSource, open_rank

torch = pytest.importorskip("torch")
import kda_tp.torch as kt  # noqa: E402 - after the importorskip

BACKENDS = ("mmap", "pread")


def _digests(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.iterdir()) if p.suffix == ".safetensors"}


@pytest.fixture(params=list(tp_fixtures.FIXTURES), scope="module")
def checkpoint(request, tmp_path_factory):
    """A private copy of each fixture (a write that reached the file would change it)."""
    fixture = tp_fixtures.FIXTURES[request.param]
    made = tp_fixtures.checkpoint(fixture, tmp_path_factory.getbasetemp())
    copy = tmp_path_factory.mktemp("writes") / fixture.name
    shutil.copytree(made, copy)
    return fixture, copy


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_loaded_tensor_takes_in_place_ops_and_the_file_never_changes(checkpoint, backend):
    fixture, path = checkpoint
    before = _digests(path)
    tp_size = fixture.tp_sizes[-1]
    source = SafetensorsSource(path, backend)
    view = open_rank(path, tp_rank=tp_size - 1, tp_size=tp_size, backend=backend,
                     qk_multiple=fixture.qk_multiple)
    loaded = kt.load_rank(source, tp_size - 1, tp_size, qk_multiple=fixture.qk_multiple)
    for name, tensor in loaded.items():
        want = view[name].data.tobytes()
        if tensor.dtype.is_floating_point and tensor.element_size() > 1:
            tensor.mul_(2).add_(1)
        else:  # FP8 and integer tensors: overwrite the bytes in place
            tensor.view(torch.uint8).add_(1)
        assert view[name].data.tobytes() == want, f"{name}: the view keeps the file's bytes"
        assert source.get(name) is None or view.is_sharded(name) or (
            source.get(name).data.tobytes() == want), name
    # Tensor.to_torch() of every view tensor, written in place, again.
    for name in view.keys():
        t = view[name]
        want = t.data.tobytes()
        written = t.to_torch()
        written.view(torch.uint8).fill_(0x5A)
        assert view[name].data.tobytes() == want, name
        # t.data is the file's bytes, or memory t owned (o_proj's gather), now writable.
        assert t.data.tobytes() == want or t.data.flags.writeable, name
    view.close()
    source.close()
    assert _digests(path) == before


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_optimizer_step_after_assign_load(checkpoint, backend):
    """torch's meta-device recipe: ``load_state_dict(assign=True)`` takes the loaded tensors as
    the parameters themselves; an optimizer step then writes them in place."""
    fixture, path = checkpoint
    before = _digests(path)
    loaded = kt.load_rank(path, 0, fixture.tp_sizes[0], qk_multiple=fixture.qk_multiple,
                          backend=backend)
    floats = {n: t for n, t in loaded.items()
              if t.dtype in (torch.float32, torch.bfloat16, torch.float16) and t.numel()}
    module = torch.nn.ParameterDict()
    with torch.device("meta"):
        for i, (name, t) in enumerate(floats.items()):
            module[f"p{i}"] = torch.nn.Parameter(torch.empty(t.shape, dtype=t.dtype))
    module.load_state_dict({f"p{i}": t for i, t in enumerate(floats.values())}, assign=True)
    first = {k: p.detach().clone() for k, p in module.items()}
    loss = sum((p.float() ** 2).sum() for p in module.values())
    loss.backward()
    torch.optim.SGD(module.parameters(), lr=0.1).step()
    changed = [k for k, p in module.items() if not torch.equal(p.detach(), first[k])]
    assert changed, "the step wrote the parameters"
    assert _digests(path) == before


def test_a_write_in_a_child_process_does_not_crash_it(checkpoint):
    """The issue's crash, in a child (a SIGSEGV there would not take pytest down)."""
    fixture, path = checkpoint
    code = textwrap.dedent(f"""
        import kda_tp.torch as kt
        loaded = kt.load_rank({str(path)!r}, 0, {fixture.tp_sizes[0]}, backend="mmap",
                              qk_multiple={fixture.qk_multiple})
        for t in loaded.values():
            t.view(__import__("torch").uint8).add_(1)
        print("ok", len(loaded))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith("ok")


def test_numpy_views_stay_read_only_and_writable_data_is_private(checkpoint):
    fixture, path = checkpoint
    source = SafetensorsSource(path)
    name = source.names()[0]
    t = source.get(name)
    assert not t.data.flags.writeable
    w = t.writable_data()
    if w.nbytes:
        w[:] = np.uint8(0xA5)
        assert source.get(name).data.tobytes() != w.tobytes() or set(t.data.tobytes()) == {0xA5}
