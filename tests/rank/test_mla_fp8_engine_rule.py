"""The MLA plan's block-FP8 split rule judged by vLLM 0.33's own check: ``MlaTpPlan`` refuses a
split exactly when vLLM's ``validate_fp8_block_shape`` (what ``Fp8LinearMethod.create_weights``
runs for every block-FP8 linear) raises for one of its quantized projections, built as vLLM
builds them (``ColumnParallelLinear`` rows, ``RowParallelLinear`` ``o_proj`` columns,
``ReplicatedLinear`` latents)."""

from __future__ import annotations

import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kda_tp.errors import PlanError
from kda_tp.rank import MlaTpPlan

pytestmark = pytest.mark.engines
pytest.importorskip("vllm")

K3 = (7168, 96, 512, 128, 64, 128)


@pytest.fixture()
def vllm_check(monkeypatch):
    """``check(tp_size, input_size, output_size, input_per_rank, output_per_rank)``: whether
    vLLM's ``validate_fp8_block_shape`` accepts a 128 x 128 block-FP8 linear of that split."""
    import vllm.distributed
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (
        validate_fp8_block_shape,
    )

    world = [1]
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size",
                        lambda: world[0])

    def check(tp_size: int, input_size: int, output_size: int, input_per_rank: int,
              output_per_rank: int, block: tuple[int, int]) -> bool:
        world[0] = tp_size
        try:
            validate_fp8_block_shape(types.SimpleNamespace(), input_size, output_size,
                                     input_per_rank, [output_per_rank], list(block))
        except ValueError:
            return False
        return True

    return check


def vllm_accepts(check, split: MlaTpPlan, quantized: list[str], block: tuple[int, int]) -> bool:
    """Whether vLLM builds every projection in ``quantized`` at ``split``'s world size
    (``split``: the unquantized plan, which never refuses a block split)."""
    t = split.tp_size
    for entry in split.tensors:
        if entry.name not in quantized:
            continue
        rows, cols = entry.full_rows, entry.full_row_elems
        kind = entry.kind.name
        if kind == "CHANNEL_ROWS":  # ColumnParallelLinear(input=cols, output=rows)
            ok = check(t, cols, rows, cols, rows // t, block)
        elif kind == "CHANNEL_COLS":  # RowParallelLinear(input=cols, output=rows)
            ok = check(t, cols, rows, cols // t, rows, block)
        else:  # ReplicatedLinear: the whole weight on every rank
            ok = check(t, cols, rows, cols, rows, block)
        if not ok:
            return False
    return True


def refused(*args, **options) -> bool:
    """Whether ``MlaTpPlan(*args, **options)`` refuses the split (with the sizes that pass)."""
    try:
        MlaTpPlan(*args, **options)
    except PlanError as error:
        assert error.allowed_tp_sizes is not None and args[1] not in error.allowed_tp_sizes
        return True
    return False


PROJECTIONS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj", "o_proj"]


@pytest.mark.parametrize("tp_size", [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96])
def test_k3_every_tp_size_is_refused_exactly_when_vllm_refuses_it(vllm_check, tp_size):
    options = {"q_lora_rank": 1536, "output_gate": True}
    split = MlaTpPlan(0, tp_size, *K3, **options)
    accepted = vllm_accepts(vllm_check, split, PROJECTIONS, (128, 128))
    assert refused(0, tp_size, *K3, **options, quant_block=(128, 128)) == (not accepted)
    assert accepted == (tp_size != 32 and tp_size != 96)


@st.composite
def geometries(draw):
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]))
    tp_size = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
    args = (draw(st.sampled_from([128, 256, 384])), heads, draw(st.sampled_from([128, 256])),
            draw(st.sampled_from([32, 64, 128, 192])), draw(st.sampled_from([0, 32, 64])),
            draw(st.sampled_from([32, 64, 128])))
    q_lora = draw(st.sampled_from([None, 128, 384]))
    options = {"q_lora_rank": q_lora, "output_gate": q_lora is not None and draw(st.booleans())}
    names = [t.name for t in MlaTpPlan(0, 1, *args, **options).tensors
             if t.name.endswith("_proj") or t.name.endswith("_mqa")]
    quantized = draw(st.lists(st.sampled_from(names), min_size=1, unique=True))
    block = (draw(st.sampled_from([64, 128])), draw(st.sampled_from([64, 128])))
    return tp_size, args, options, quantized, block


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(geometries())
def test_random_geometries_are_refused_exactly_when_vllm_refuses_them(vllm_check, geometry):
    tp_size, args, options, quantized, block = geometry
    split = MlaTpPlan(0, tp_size, *args, **options)
    accepted = vllm_accepts(vllm_check, split, quantized, block)
    assert refused(0, tp_size, *args, **options, quant_block=block,
                   quantized=quantized) == (not accepted)
