"""Checks of a checkpoint's tensor-parallel split that several test modules make
(tests/integration/test_k3.py; tests/model/test_fp8.py makes the same on the FP8 fixture): a
fixture's stored per-rank reference outputs, and the CLI's shard + numeric verify."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from kda_tp.cli import main
from kda_tp.reference import kda_layer_forward


def assert_rank_partials(fixture: Path, rank_weights: Callable[[int], dict[str, np.ndarray]],
                         *, tp_size: int = 2, head_dim: int = 64,
                         gate_lower_bound: float | None = None) -> None:
    """For a fixture directory holding ``x.npy``, ``y.npy`` and ``y_partial_tp{N}_rank{r}.npy``
    (tests/data/k3_small, k3_fp8_small): each rank's reference forward
    (:func:`kda_layer_forward` of ``rank_weights(rank)``, the rank's KDA weights by plan name,
    on the fixture's ``x.npy``) equals the fixture's ``y_partial_tp{tp_size}_rank{rank}.npy``
    within 1e-5, and the ranks' partials sum to its ``y.npy`` within 1e-5. Raises
    AssertionError otherwise."""
    x, y = np.load(fixture / "x.npy"), np.load(fixture / "y.npy")
    partials = []
    for rank in range(tp_size):
        partial = kda_layer_forward(rank_weights(rank), x, head_dim=head_dim,
                                    gate_lower_bound=gate_lower_bound)
        want = np.load(fixture / f"y_partial_tp{tp_size}_rank{rank}.npy")
        assert np.max(np.abs(partial - want)) < 1e-5, rank
        partials.append(partial)
    assert np.max(np.abs(sum(partials) - y)) < 1e-5


def cli_shard_and_verify(ckpt: Path, out: Path, tp_size: int, capsys, *extra: str) -> None:
    """``kda-tp shard CKPT --tp-size N --out OUT --quiet [extra]`` and ``kda-tp verify CKPT OUT
    --numeric`` exit 0, and verify says the numerical TP equivalence passes (``capsys``:
    pytest's fixture; what was printed so far is consumed)."""
    assert main(["shard", str(ckpt), "--tp-size", str(tp_size), "--out", str(out),
                 "--quiet", *extra]) == 0
    assert main(["verify", str(ckpt), str(out), "--numeric"]) == 0
    assert "numerical TP equivalence passes" in capsys.readouterr().out
