"""KdaShardedSource.read_into: this rank's bytes written into a caller-owned buffer.

Bytes equal ``get()`` for every tensor kind, rank and TP of the fixture; every kind of buffer
the docstring promises is accepted; bad buffers raise the named errors and are left untouched;
the GIL is released during a large gather (another Python thread runs meanwhile); and what
that release relies on holds (a SafetensorsSource's bytes cannot be made writable, an output
overlapping its source is refused).
"""

from __future__ import annotations

import mmap
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from kda_tp import _native
from kda_tp.checkpoint.reader import readonly_bytes
from kda_tp import (
    BufferLayoutError,
    CheckpointError,
    DtypeMismatchError,
    KdaShardedSource,
    KdaTpPlan,
    SafetensorsSource,
    ShapeMismatchError,
    Tensor,
    TensorNotFoundError,
    UsageError,
)

from paths import DATA

FIXTURE = DATA / "kda_small"
O_PROJ = "model.layers.0.self_attn.o_proj.weight"
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def sharded(tp: int, rank: int, backend: str = "mmap") -> KdaShardedSource:
    source = SafetensorsSource(FIXTURE, backend)
    # The fixture's 4 heads of 64 break the 256-channel rule at TP=4; the rule is not the point.
    return KdaShardedSource(source, KdaTpPlan.from_config(source, rank, tp, qk_multiple=1))


def kind_of(shard: KdaShardedSource, name: str) -> str:
    if not shard.is_sharded(name):
        return "PASSED_THROUGH"
    tail = name.rsplit("self_attn.", 1)[1].removesuffix(".weight")
    return shard.plan[tail].kind.name


@pytest.mark.parametrize("backend", ["mmap", "pread"])
@pytest.mark.parametrize("tp", [2, 4])
def test_bytes_equal_get_for_every_tensor_rank_and_tp(tp, backend):
    kinds = set()
    for rank in range(tp):
        shard = sharded(tp, rank, backend)
        for name in shard.names():
            want = shard[name].data
            out = np.full(want.nbytes, 0xAB, np.uint8)  # stale bytes must all be overwritten
            assert shard.read_into(name, out) is None
            assert np.array_equal(out, want), (name, rank)
            kinds.add(kind_of(shard, name))
    assert kinds == {
        "PASSED_THROUGH", "REPLICATED", "HEAD_ROWS", "CHANNEL_ROWS", "CHANNEL_COLS"
    }


def test_typed_and_shaped_numpy_outputs():
    shard = sharded(2, 1)
    for name in (O_PROJ, Q_PROJ, "model.layers.0.self_attn.A_log"):
        t = shard[name]
        out = np.zeros(t.shape, t.array.dtype)  # bfloat16 / float32, the local shape
        shard.read_into(name, out)
        assert np.array_equal(out.view(np.uint8).reshape(-1), t.data), name
        assert np.array_equal(out.view(np.uint8), t.array.view(np.uint8)), name
    # int16 has BF16's item size but other numbers: refused, as float16 is.
    for wrong in (np.int16, np.float16):
        with pytest.raises(DtypeMismatchError, match="BF16"):
            shard.read_into(O_PROJ, np.zeros(shard.info(O_PROJ)[1], wrong))


@pytest.mark.parametrize("make", ["bytearray", "memoryview", "mmap", "2d_memoryview"])
def test_other_buffer_protocol_outputs(make):
    shard = sharded(4, 3)
    for name in (O_PROJ, Q_PROJ, "model.norm.weight"):
        want = shard[name].data
        n = want.nbytes
        if make == "bytearray":
            out = bytearray(n)
        elif make == "memoryview":
            out = memoryview(bytearray(n))
        elif make == "mmap":
            out = mmap.mmap(-1, n)
        else:
            out = memoryview(bytearray(n)).cast("B", (2, n // 2))
        shard.read_into(name, out)
        assert bytes(out) == want.tobytes(), name
        if make == "mmap":
            out.close()


def test_a_generic_source_without_read_range():
    """Any object with names() and get() works: the row kinds take the full-tensor path."""
    full = SafetensorsSource(FIXTURE)

    class Plain:
        config = full.config

        def names(self):
            return full.names()

        def get(self, name):
            return full.get(name)

    shard = KdaShardedSource(Plain(), KdaTpPlan.from_config(full, 1, 2))
    reference = sharded(2, 1)
    for name in shard.names():
        want = reference[name].data
        out = np.empty(want.nbytes, np.uint8)
        shard.read_into(name, out)
        assert np.array_equal(out, want), name


def test_a_wrong_size_is_a_shape_mismatch_naming_both_sizes():
    shard = sharded(2, 0)
    n = shard[O_PROJ].nbytes  # [256, 128] BF16
    assert n == 65536
    for name, size in ((O_PROJ, n - 2), (O_PROJ, n + 2), (Q_PROJ, 0), ("model.norm.weight", 1)):
        out = np.full(size, 7, np.uint8)
        expected = shard[name].nbytes
        with pytest.raises(ShapeMismatchError) as e:
            shard.read_into(name, out)
        message = str(e.value)
        assert name in message
        assert f"{size} bytes" in message and f"{expected} bytes" in message, message
        assert isinstance(e.value, ValueError)
        assert (out == 7).all(), "nothing is written on refusal"


def test_a_wrong_dtype_is_a_dtype_mismatch_naming_both_and_the_fix():
    shard = sharded(2, 0)
    out = np.zeros(shard[O_PROJ].nbytes // 4, np.float32)  # right bytes, BF16 is 2 each
    with pytest.raises(DtypeMismatchError,
                       match=r"o_proj.*numpy float32.*BF16 \(numpy bfloat16\); pass an array"):
        shard.read_into(O_PROJ, out)


def test_unusable_buffers_raise_buffer_layout_error_naming_the_tensor():
    shard = sharded(2, 1)
    n = shard[O_PROJ].nbytes
    readonly = np.zeros(n, np.uint8)
    readonly.flags.writeable = False
    strided = np.zeros(2 * n, np.uint8)[::2]
    fortran = np.zeros((256, 128), np.uint16, order="F")
    cases = {
        "read-only": readonly,
        "bytes": bytes(n),
        "strided": strided,
        "fortran": fortran,
        "strided memoryview": memoryview(bytearray(2 * n))[::2],
        "objects": np.empty(n // 8, object),
        "not a buffer": [0] * n,
    }
    for what, out in cases.items():
        with pytest.raises(BufferLayoutError) as e:
            shard.read_into(O_PROJ, out)
        assert O_PROJ in str(e.value), what
        assert isinstance(e.value, ValueError), what
    assert not strided.any() and not fortran.any(), "nothing is written on refusal"


def test_an_unknown_name_is_a_checkpoint_error():
    shard = sharded(2, 0)
    with pytest.raises(CheckpointError, match="nope"):
        shard.read_into("nope", np.empty(4, np.uint8))


class _LazySource:
    """A one-KDA-layer source whose only materialised tensor is a large o_proj."""

    def __init__(self, plan: KdaTpPlan):
        self.plan = plan
        self.o_proj = np.arange(plan["o_proj"].full_bytes // 8, dtype=np.uint64).view(np.uint8)

    def names(self):
        return [f"model.layers.0.self_attn.{self._suffix(t.name)}" for t in self.plan.tensors]

    @staticmethod
    def _suffix(name):
        return name if name in ("A_log", "dt_bias") else f"{name}.weight"

    def info(self, name):
        entry = self.plan[name.rsplit("self_attn.", 1)[1].removesuffix(".weight")]
        return entry.dtype, tuple(entry.disk_shape)

    def get(self, name):
        assert name == O_PROJ, "only o_proj is read"
        dtype, shape = self.info(name)
        return Tensor(name, dtype, shape, self.o_proj)


def _large_o_proj(tp_rank: int = 0) -> tuple[KdaShardedSource, _LazySource]:
    # hidden 16384, 64 heads of 128: o_proj [16384, 8192] BF16 = 256 MiB, 128 MiB per rank.
    plan = KdaTpPlan(tp_rank, 2, 16384, 128, 64, 4, 128)
    source = _LazySource(plan)
    return KdaShardedSource(source, plan, layers=[0]), source


def test_a_large_parallel_gather_equals_numpy():
    shard, source = _large_o_proj(tp_rank=1)
    entry = shard.plan["o_proj"]
    out = np.empty(entry.local_bytes, np.uint8)
    shard.read_into(O_PROJ, out)
    lo, w = entry.src_col_offset, entry.local_row_elems
    want = source.o_proj.view(np.uint16).reshape(entry.full_rows, -1)[:, lo : lo + w]
    assert np.array_equal(out.view(np.uint16).reshape(entry.full_rows, w), want)
    assert np.array_equal(shard[O_PROJ].data, out)


def counter_moves(work: Callable[[], object], tries: int, until_moved: bool) -> list[int]:
    """How far a counter thread moved during each of up to ``tries`` calls of ``work`` (stopping
    at the first call it moved during, with ``until_moved``).

    The switch interval is set huge, so this thread never hands the GIL over on its own, and the
    counter thread gives it back after every step (time.sleep releases it): the counter moves
    during a call only if the call releases the GIL."""
    counter = [0]
    stop = threading.Event()

    def count():
        while not stop.is_set():
            counter[0] += 1
            time.sleep(0)  # releases the GIL

    old = sys.getswitchinterval()
    worker = threading.Thread(target=count)
    sys.setswitchinterval(1000.0)
    try:
        worker.start()
        moved = []
        for _ in range(tries):
            before = counter[0]
            work()
            moved.append(counter[0] - before)
            if until_moved and moved[-1]:
                break
    finally:
        stop.set()
        sys.setswitchinterval(old)
        worker.join()
    return moved


def test_the_gil_is_released_during_a_large_gather():
    """Another Python thread makes progress while read_into gathers 128 MiB.

    With a huge switch interval this thread never hands the GIL over on its own, and the
    counter thread gives it back after every step (time.sleep releases it). So the counter can
    only move during the read_into call if the call itself releases the GIL: no timing
    threshold is involved. The OS may not schedule the counter thread during one call on a busy
    machine, so the call is repeated until it does (up to 50 times).
    """
    shard, _ = _large_o_proj()
    out = np.empty(shard.plan["o_proj"].local_bytes, np.uint8)
    shard.read_into(O_PROJ, out)  # fault the output in once
    moved = counter_moves(lambda: shard.read_into(O_PROJ, out), tries=50, until_moved=True)
    assert any(moved), f"the counter never moved during read_into: {moved}"


def test_the_gil_test_would_catch_a_gil_holding_copy():
    """The same harness around a copy that holds the GIL sees the counter stand still, so the
    test above is not passing by accident (numpy's tobytes() copies under the GIL)."""
    _, source = _large_o_proj()
    data = source.o_proj[: 64 << 20]
    moved = counter_moves(data.tobytes, tries=3, until_moved=False)
    assert moved == [0, 0, 0]



# ----------------------------------------------------------------------------------------------
# What a GIL-released copy relies on (rust/py/slice.rs): the source is not written meanwhile,
# the output not shared. Both are checked here where they can be checked.


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_safetensors_sources_bytes_cannot_be_made_writable(backend: str) -> None:
    """What SafetensorsSource hands out views kda_tp's own TensorBytes (a read-only mapping, or
    a copy that object owns): numpy refuses to make any of it writable, so no Python thread can
    write a source while read_into copies it with the GIL released."""
    view = sharded(2, 1, backend)
    source = view.source
    entry = view.plan["q_proj"]
    arrays = {
        "get": source.get(Q_PROJ).data,
        "read_range": source.read_range(Q_PROJ, *entry.byte_range),
        "view[q_proj]": view[Q_PROJ].data,
        "what read_into copies from": readonly_bytes(source.get(Q_PROJ).data),
    }
    for what, array in arrays.items():
        assert not array.flags.writeable, what
        with pytest.raises(ValueError, match="cannot set WRITEABLE flag"):
            array.setflags(write=True)
        owner = array
        while isinstance(owner, np.ndarray):
            owner = owner.base
        assert type(owner).__name__ == "TensorBytes", what


def test_an_output_overlapping_the_source_is_refused_not_raced() -> None:
    """numpy's borrow flags, held for the whole GIL-released call, refuse an output that overlaps
    the source (a custom source's array passed as its own output) before any byte is copied."""
    data = np.arange(4096, dtype=np.uint8)
    want = data.copy()
    with pytest.raises(TypeError, match="already borrowed"):
        _native.copy_into(data[:2048], data[1024:3072])
    assert np.array_equal(data, want)
    _native.copy_into(data[:2048], data[2048:])  # disjoint parts of one array: copied
    assert np.array_equal(data[2048:], want[:2048])


def test_a_transposed_typed_destination_is_a_shape_mismatch():
    shard = sharded(2, 0)
    rows, cols = shard.info(O_PROJ)[1]
    typed = np.zeros((cols, rows), shard[O_PROJ].array.dtype)  # right dtype and bytes
    with pytest.raises(ShapeMismatchError,
                       match=rf"o_proj.*shape \[{cols}, {rows}\].*BF16 \[{rows}, {cols}\]; pass"):
        shard.read_into(O_PROJ, typed)


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_byte_destinations_of_any_shape_are_checked_by_byte_count(backend):
    shard = sharded(2, 1, backend)
    for name in (O_PROJ, Q_PROJ, "model.norm.weight"):
        want = shard[name].data
        for out in (np.zeros(want.nbytes, np.uint8), np.zeros((2, want.nbytes // 2), np.int8)):
            shard.read_into(name, out)
            assert out.tobytes() == want.tobytes(), name
        with pytest.raises(ShapeMismatchError, match=rf"{want.nbytes} bytes; pass a buffer"):
            shard.read_into(name, np.zeros(want.nbytes + 2, np.uint8))


def test_an_unknown_name_is_the_same_key_error_everywhere():
    shard = sharded(2, 0)
    for call in (lambda: shard["nope"], lambda: shard.read_into("nope", bytearray(4)),
                 lambda: shard.get_slice("nope")):
        with pytest.raises(TensorNotFoundError, match="no tensor named 'nope'") as raised:
            call()
        assert isinstance(raised.value, KeyError)


def test_a_bytes_name_is_a_usage_error_with_the_fix():
    shard = sharded(2, 0)
    for call in (lambda: shard.read_into(O_PROJ.encode(), bytearray(4)),
                 lambda: shard[O_PROJ.encode()]):
        with pytest.raises(UsageError, match=r"a tensor name is a str, got bytes.*name.decode\(\)"):
            call()
