"""``open_rank``'s view is a mapping of names: it iterates and counts its names like a dict;
``5 in view`` is False, and membership after ``close()`` raises the closed-view error as
``view[name]`` does. Opening a rank directory ``shard`` wrote says it is already a shard.

(The ``kept`` fixture, a ``demo --keep`` directory, is tests/conftest.py's.)
"""

from __future__ import annotations

from pathlib import Path

import kda_tp
import pytest
from kda_tp.errors import CheckpointError


def test_the_rank_view_iterates_and_counts_its_names_like_a_dict(kept: Path) -> None:
    view = kda_tp.open_rank(kept / "checkpoint", tp_rank=0, tp_size=2)
    names = view.names()
    assert list(view) == names and [n for n in view] == names and len(view) == len(names)
    assert len(names) == 20 and "model.layers.0.self_attn.q_proj.weight" in view
    assert 5 not in view and None not in view and "no.such.tensor" not in view
    assert dict(zip(view, view.keys())) == {n: n for n in names}
    view.close()
    for use in (lambda: names[0] in view, lambda: 5 in view, lambda: list(view),
                lambda: len(view), lambda: view[names[0]]):
        with pytest.raises(CheckpointError, match="(view|checkpoint) is closed"):
            use()


def test_open_rank_on_a_rank_directory_says_it_is_already_a_shard(kept: Path) -> None:
    with pytest.raises(CheckpointError) as raised:
        kda_tp.open_rank(kept / "tp2" / "rank0", tp_rank=0, tp_size=2)
    assert "already a tensor-parallel shard (rank 0 of 2, its header says); open the original " \
        "checkpoint" in str(raised.value)
    assert str(kept / "tp2" / "rank0") in str(raised.value)
