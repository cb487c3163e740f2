"""The oracle's MLA plan (``kda_tp.oracle.mla_plan``) against the numbers written in its spec,
``tests/data/spec/mla.md`` (section 1's released shapes, section 2's per-rank slices), with no
Rust involved."""

from __future__ import annotations

import pytest

from kda_tp.errors import PlanError
from kda_tp.oracle import INDEXER_TENSOR_NAMES, mla_plan


def shapes(plan):
    return {t.name: t.disk_shape for t in plan.tensors}


def test_the_released_shapes_of_section_1():
    kimi = mla_plan(0, 1, 2304, 32, 512, 128, 64, 128)
    assert shapes(kimi) == {"q_proj": (6144, 2304), "kv_a_proj_with_mqa": (576, 2304),
                            "kv_a_layernorm": (512,), "kv_b_proj": (8192, 512),
                            "o_proj": (2304, 4096)}
    k3 = mla_plan(0, 1, 7168, 96, 512, 128, 64, 128, q_lora_rank=1536, output_gate=True)
    assert shapes(k3) == {"q_a_proj": (1536, 7168), "q_a_layernorm": (1536,),
                          "q_b_proj": (18432, 1536), "kv_a_proj_with_mqa": (576, 7168),
                          "kv_a_layernorm": (512,), "kv_b_proj": (24576, 512),
                          "g_proj": (12288, 7168), "o_proj": (7168, 12288)}
    glm = mla_plan(0, 1, 4096, 64, 512, 256, 0, 256, q_lora_rank=1536, indexer=(32, 128, 16))
    assert shapes(glm) == {"q_a_proj": (1536, 4096), "q_a_layernorm": (1536,),
                           "q_b_proj": (16384, 1536), "kv_a_proj_with_mqa": (512, 4096),
                           "kv_a_layernorm": (512,), "kv_b_proj": (32768, 512),
                           "o_proj": (4096, 16384), "indexer.wq_b": (4096, 1536),
                           "indexer.wk": (128, 4096), "indexer.weights_proj": (32, 4096),
                           "indexer.k_norm": (128,), "indexer.k_norm.bias": (128,),
                           "indexer.index_kpool_compress_ape": (16, 128),
                           "indexer.index_kpool_compress_gate": (128, 4096)}
    assert [n for n in shapes(glm) if n.startswith("indexer.")] == list(INDEXER_TENSOR_NAMES)


@pytest.mark.parametrize("rank", range(4))
def test_section_2_rank_r_holds_its_head_blocks(rank):
    """K3 at TP 4: Hl = 24; q_b_proj rows r*Hl*(P+Pr), kv_b_proj r*Hl*(P+V), g_proj rows and
    o_proj columns r*Hl*V; the latents and norms whole."""
    plan = mla_plan(rank, 4, 7168, 96, 512, 128, 64, 128, q_lora_rank=1536, output_gate=True)
    hl = 24
    placement = {t.name: (t.kind, t.local_rows, t.local_row_elems, t.src_row_offset,
                          t.src_col_offset) for t in plan.tensors}
    assert placement["q_b_proj"] == ("CHANNEL_ROWS", hl * 192, 1536, rank * hl * 192, 0)
    assert placement["kv_b_proj"] == ("CHANNEL_ROWS", hl * 256, 512, rank * hl * 256, 0)
    assert placement["g_proj"] == ("CHANNEL_ROWS", hl * 128, 7168, rank * hl * 128, 0)
    assert placement["o_proj"] == ("CHANNEL_COLS", 7168, hl * 128, 0, rank * hl * 128)
    for name in ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm"):
        assert placement[name][0] == "REPLICATED" and placement[name][3:] == (0, 0)
    assert plan.local_heads == hl


def test_the_heads_are_num_attention_heads_and_must_divide():
    with pytest.raises(PlanError, match=r"num_attention_heads \(96\) divisible by tp_size \(64\)"):
        mla_plan(0, 64, 7168, 96, 512, 128, 64, 128, q_lora_rank=1536)
    with pytest.raises(PlanError, match="qk_rope_head_dim is -1"):
        mla_plan(0, 1, 4096, 64, 512, 256, -1, 256)
