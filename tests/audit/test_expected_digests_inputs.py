"""``expected_digests`` refuses ``A_log``/``dt_bias`` of a layer its config does not list as KDA
(another model's config), and items that are not ``(name, tensor)`` pairs.

(The ``kept`` fixture, a ``demo --keep`` directory, is tests/conftest.py's.)
"""

from __future__ import annotations

from pathlib import Path

import kda_tp
import pytest
from kda_tp.errors import CheckpointError, UsageError


def test_expected_digests_refuses_kda_tensors_of_a_layer_the_config_does_not_list(
    kept: Path,
) -> None:
    source = kda_tp.SafetensorsSource(kept / "checkpoint")
    tensors = {n: source.get(n) for n in source.names()}
    engine = {"engine": "vllm-0.33-kimi-linear", "tp_size": 2}
    digests = kda_tp.audit.expected_digests(tensors, kept / "checkpoint", **engine)
    assert digests == kda_tp.audit.engine_digests(kept / "checkpoint", **engine)
    copies = {n.replace("layers.0.", "layers.2."): t for n, t in tensors.items()
              if n.startswith("model.layers.0.self_attn.")}
    with pytest.raises(CheckpointError) as raised:
        kda_tp.audit.expected_digests({**tensors, **copies}, kept / "checkpoint", **engine)
    message = str(raised.value)
    assert message.startswith("model.layers.2.self_attn.A_log, model.layers.2.self_attn.dt_bias:"
                               " layer 2 holds KDA tensors, but the ")
    assert message.endswith("lists no KDA layer 2 (its KDA layers: [0]); is this the config of "
                            "the model being updated?")


@pytest.mark.parametrize("tensors", [["model.layers.0.self_attn.A_log"], [("a", 1, 2)], [7]])
def test_expected_digests_refuses_what_is_not_name_tensor_pairs(
    kept: Path, tensors: list[object]
) -> None:
    with pytest.raises(UsageError, match=r"^tensors: expected \(name, tensor\) pairs or a "
                       r"mapping of names to tensors, got an item "):
        kda_tp.audit.expected_digests(tensors, kept / "checkpoint",  # type: ignore[arg-type]
                                      engine="vllm-0.33-kimi-linear", tp_size=2)
