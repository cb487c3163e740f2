"""The region digest the guard keeps (``kda_tp._native.digest``, ``digest_if_equal``:
``rust/digest.rs``), through the built module: every byte counts, chunks in order, a
non-contiguous buffer refused by the core and copied contiguous by the guard."""

from __future__ import annotations

import numpy as np
import pytest

from kda_tp._native import digest, digest_if_equal
from kda_tp.errors import BufferLayoutError
from kda_tp.guard._updates import _host_digest

CHUNK = 1 << 20


def _bytes(n: int) -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8)


def test_the_same_bytes_give_the_same_16_byte_digest() -> None:
    data = _bytes(3 * CHUNK + 5)
    assert len(digest(data)) == 16
    assert digest(data) == digest(data.copy())


@pytest.mark.parametrize("at", [0, CHUNK - 1, CHUNK, 3 * CHUNK + 4])
def test_one_byte_changed_anywhere_changes_the_digest(at: int) -> None:
    data = _bytes(3 * CHUNK + 5)
    changed = data.copy()
    changed[at] ^= 1
    assert digest(changed) != digest(data)
    assert digest_if_equal(data, changed) is None


def test_two_chunks_swapped_change_the_digest() -> None:
    data = _bytes(3 * CHUNK)
    swapped = np.concatenate([data[2 * CHUNK:], data[CHUNK:2 * CHUNK], data[:CHUNK]])
    assert digest(swapped) != digest(data)


def test_digest_if_equal_is_the_digest_of_equal_bytes() -> None:
    data = _bytes(2 * CHUNK + 1)
    assert digest_if_equal(data, data.copy()) == digest(data)
    assert digest_if_equal(data, data[:-1]) is None


def test_a_non_contiguous_buffer_is_refused_by_the_core_and_copied_by_the_guard() -> None:
    data = _bytes(2 * CHUNK)
    with pytest.raises(BufferLayoutError, match="C-contiguous"):
        digest(data[::2])
    rows = data.view(np.uint16).reshape(1024, -1)[:, :8]  # a column slice: strided
    assert _host_digest(rows) == digest(np.ascontiguousarray(rows).reshape(-1).view(np.uint8))
