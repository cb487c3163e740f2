"""Zero-copy reads: row-sliced and replicated tensors view the mapped file; the views stay
valid after the source is gone; reads from several threads agree."""

from __future__ import annotations

import gc
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import kda_tp
from kda_tp.synth import write_small_checkpoint

from mappings import in_file_copy_on_write


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_small_checkpoint(
        tmp_path_factory.mktemp("zc") / "ckpt", hidden=96, heads=4, head_dim=64, conv_kernel=4,
        gate_rank=16, num_layers=2, kda_layers=[0, 1], seed=3,
    )


def _inside(array: np.ndarray, ranges: list[tuple[int, int]]) -> bool:
    start = array.__array_interface__["data"][0]
    return any(lo <= start and start + array.nbytes <= hi for lo, hi in ranges)


def test_get_views_the_mapping(checkpoint):
    source = kda_tp.SafetensorsSource(checkpoint)
    ranges = source.mappings()
    assert ranges
    for name in source.names():
        t = source.get(name)
        assert _inside(t.data, ranges), name
        assert not t.data.flags.writeable
        assert not t.array.flags.writeable


def test_sharded_rows_and_replicated_view_the_mapping(checkpoint):
    source = kda_tp.SafetensorsSource(checkpoint)
    shard = kda_tp.KdaShardedSource(source, kda_tp.KdaTpPlan.from_config(source, 1, 2))
    ranges = source.mappings()
    for name in source.names():
        t = shard[name]
        if name.endswith("o_proj.weight"):
            assert not _inside(t.data, ranges)  # a gather: new memory
        else:
            assert _inside(t.data, ranges), name
        assert not t.data.flags.writeable


def test_views_outlive_the_source(checkpoint):
    source = kda_tp.SafetensorsSource(checkpoint)
    name = "model.layers.0.self_attn.q_proj.weight"
    expected = bytes(source.get(name))
    shard = kda_tp.KdaShardedSource(source, kda_tp.KdaTpPlan.from_config(source, 1, 2))
    local = shard[name].array
    view = source.get(name).data
    del source, shard
    gc.collect()
    assert view.tobytes() == expected
    assert local.tobytes() == expected[len(expected) // 2 :]


def test_pread_backend_copies_and_agrees(checkpoint, monkeypatch):
    mapped = kda_tp.SafetensorsSource(checkpoint)
    monkeypatch.setenv("KDA_TP_BACKEND", "pread")
    pread = kda_tp.SafetensorsSource(checkpoint)
    assert pread.backend == "pread" and pread.mappings() == []
    for name in mapped.names():
        assert np.array_equal(mapped.get(name).data, pread.get(name).data)


def test_eight_threads_read_the_same_bytes(checkpoint):
    source = kda_tp.SafetensorsSource(checkpoint)
    shard = kda_tp.KdaShardedSource(source, kda_tp.KdaTpPlan.from_config(source, 0, 2))
    names = source.names()
    single = {n: bytes(shard[n]) for n in names}

    def read_all(_):
        return {n: bytes(shard[n]) for n in names}

    with ThreadPoolExecutor(8) as pool:
        for result in pool.map(read_all, range(8)):
            assert result == single


def test_shard_bytes_views_its_input_for_rows():
    plan = kda_tp.KdaTpPlan(1, 2, 4, 64, 4, 2, 4)
    full = np.arange(256 * 8, dtype=np.uint32).astype(np.uint8)
    out = kda_tp.shard_bytes(plan["q_proj"], full)
    assert np.shares_memory(out, full) and not out.flags.writeable
    cols = kda_tp.shard_bytes(plan["o_proj"], np.zeros(4 * 256 * 2, np.uint8))
    assert not np.shares_memory(cols, full)


def test_to_torch_views_the_files_copy_on_write_mapping(checkpoint):
    torch = pytest.importorskip("torch")
    source = kda_tp.SafetensorsSource(checkpoint)
    t = source.get("model.layers.0.self_attn.q_proj.weight")
    tensor = t.to_torch()
    assert tensor.dtype == torch.bfloat16 and tuple(tensor.shape) == t.shape
    # No copy: a private, writable mapping of the checkpoint's file, not the read-only one.
    assert in_file_copy_on_write(tensor.data_ptr(), checkpoint)
    assert not any(lo <= tensor.data_ptr() < hi for lo, hi in source.mappings())
    assert np.array_equal(tensor.view(torch.int16).numpy().view(np.uint8).ravel(), t.data)
    before = t.data.tobytes()
    tensor.mul_(2)
    assert t.data.tobytes() == before, "the numpy view keeps the file's bytes"
    assert source.get(t.name).data.tobytes() == before


def test_release_keeps_views_valid(checkpoint):
    source = kda_tp.SafetensorsSource(checkpoint)
    name = "model.embed_tokens.weight"
    t = source.get(name)
    before = t.data.tobytes()
    for n in source.names():
        source.release(n)
    assert t.data.tobytes() == before
    kda_tp.SafetensorsSource(checkpoint, backend="pread").release(name)  # a no-op


def test_sharded_reads_agree_across_backends(checkpoint):
    views = []
    for backend in ("mmap", "pread"):
        source = kda_tp.SafetensorsSource(checkpoint, backend=backend)
        shard = kda_tp.KdaShardedSource(source, kda_tp.KdaTpPlan.from_config(source, 1, 2))
        views.append({n: (shard[n].shape, bytes(shard[n])) for n in source.names()})
    assert views[0] == views[1]


def test_read_range(checkpoint):
    for backend in ("mmap", "pread"):
        source = kda_tp.SafetensorsSource(checkpoint, backend=backend)
        name = "model.layers.0.self_attn.q_proj.weight"
        full = bytes(source.get(name))
        assert bytes(source.read_range(name, 10, 30)) == full[10:30]
        assert bytes(source.read_range(name, 10, 10**12)) == full[10:]
        with pytest.raises(kda_tp.CheckpointError, match="past its"):
            source.read_range(name, len(full) + 1, len(full) + 2)
        with pytest.raises(kda_tp.CheckpointError, match="no tensor named"):
            source.read_range("nope", 0, 1)
