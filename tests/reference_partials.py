"""A fixture's stored per-rank reference outputs, checked (tests/integration/test_k3.py; for
any fixture directory that holds ``x.npy``, ``y.npy`` and ``y_partial_tp{N}_rank{r}.npy``, as
tests/data/k3_small and k3_fp8_small do)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from kda_tp.reference import kda_layer_forward


def assert_rank_partials(fixture: Path, rank_weights: Callable[[int], dict[str, np.ndarray]],
                         *, tp_size: int = 2, head_dim: int = 64,
                         gate_lower_bound: float | None = None) -> None:
    """Each rank's reference forward (:func:`kda_layer_forward` of ``rank_weights(rank)``, the
    rank's KDA weights by plan name, on the fixture's ``x.npy``) equals the fixture's
    ``y_partial_tp{tp_size}_rank{rank}.npy`` within 1e-5, and the ranks' partials sum to its
    ``y.npy`` within 1e-5. Raises AssertionError otherwise."""
    x, y = np.load(fixture / "x.npy"), np.load(fixture / "y.npy")
    partials = []
    for rank in range(tp_size):
        partial = kda_layer_forward(rank_weights(rank), x, head_dim=head_dim,
                                    gate_lower_bound=gate_lower_bound)
        want = np.load(fixture / f"y_partial_tp{tp_size}_rank{rank}.npy")
        assert np.max(np.abs(partial - want)) < 1e-5, rank
        partials.append(partial)
    assert np.max(np.abs(sum(partials) - y)) < 1e-5
