//! Tests of the MLA plan: each family's released geometry tensor by tensor, the refusals with
//! their exact fields, and the plan's arithmetic over every rank.
#![allow(clippy::unwrap_used)]

use super::*;

/// Kimi-Linear's MLA: hidden 2304, 32 heads, no q-LoRA, L 512, P 128, Pr 64, V 128.
fn kimi_linear() -> MlaGeometry {
    MlaGeometry {
        hidden: 2304,
        heads: 32,
        q_lora_rank: None,
        kv_lora_rank: 512,
        qk_nope_head_dim: 128,
        qk_rope_head_dim: 64,
        v_head_dim: 128,
        output_gate: false,
        indexer: None,
    }
}

/// Kimi K3's MLA: hidden 7168, 96 heads, Q 1536, L 512, P 128, Pr 64, V 128, output gate.
fn k3() -> MlaGeometry {
    MlaGeometry {
        hidden: 7168,
        heads: 96,
        q_lora_rank: Some(1536),
        output_gate: true,
        ..kimi_linear()
    }
}

/// GLM-5.3-Flash's MLA: hidden 4096, 64 heads, Q 1536, L 512, P 256, NoPE, V 256, indexer
/// 32 heads of 128, kpool 16.
fn glm() -> MlaGeometry {
    MlaGeometry {
        hidden: 4096,
        heads: 64,
        q_lora_rank: Some(1536),
        kv_lora_rank: 512,
        qk_nope_head_dim: 256,
        qk_rope_head_dim: 0,
        v_head_dim: 256,
        output_gate: false,
        indexer: Some(IndexerGeometry {
            heads: 32,
            head_dim: 128,
            kpool: 16,
        }),
    }
}

/// Name, kind, full shape, local shape, row offset, column offset.
type Placement = (&'static str, KdaShard, Vec<usize>, Vec<usize>, usize, usize);

fn shapes(p: &MlaTpPlan) -> Vec<Placement> {
    p.tensors
        .iter()
        .map(|t| {
            let local = t.local_shape(&t.disk_shape).unwrap();
            (
                t.name,
                t.kind,
                t.disk_shape.clone(),
                local,
                t.src_row_offset,
                t.src_col_offset,
            )
        })
        .collect()
}

#[test]
fn kimi_linear_rank_1_of_4() {
    use KdaShard::{ChannelCols, ChannelRows, Replicated};
    let p = MlaTpPlan::new(1, 4, kimi_linear(), &[]).unwrap();
    assert_eq!(p.local_heads, 8);
    assert_eq!(
        shapes(&p),
        vec![
            (
                "q_proj",
                ChannelRows,
                vec![6144, 2304],
                vec![1536, 2304],
                1536,
                0
            ),
            (
                "kv_a_proj_with_mqa",
                Replicated,
                vec![576, 2304],
                vec![576, 2304],
                0,
                0
            ),
            ("kv_a_layernorm", Replicated, vec![512], vec![512], 0, 0),
            (
                "kv_b_proj",
                ChannelRows,
                vec![8192, 512],
                vec![2048, 512],
                2048,
                0
            ),
            (
                "o_proj",
                ChannelCols,
                vec![2304, 4096],
                vec![2304, 1024],
                0,
                1024
            ),
        ]
    );
}

#[test]
fn k3_rank_3_of_8_keeps_the_kda_shapes_of_g_proj_and_o_proj() {
    use KdaShard::{ChannelCols, ChannelRows, Replicated};
    let p = MlaTpPlan::new(3, 8, k3(), &[]).unwrap();
    assert_eq!(
        shapes(&p),
        vec![
            (
                "q_a_proj",
                Replicated,
                vec![1536, 7168],
                vec![1536, 7168],
                0,
                0
            ),
            ("q_a_layernorm", Replicated, vec![1536], vec![1536], 0, 0),
            (
                "q_b_proj",
                ChannelRows,
                vec![18432, 1536],
                vec![2304, 1536],
                3 * 2304,
                0
            ),
            (
                "kv_a_proj_with_mqa",
                Replicated,
                vec![576, 7168],
                vec![576, 7168],
                0,
                0
            ),
            ("kv_a_layernorm", Replicated, vec![512], vec![512], 0, 0),
            (
                "kv_b_proj",
                ChannelRows,
                vec![24576, 512],
                vec![3072, 512],
                3 * 3072,
                0
            ),
            (
                "g_proj",
                ChannelRows,
                vec![12288, 7168],
                vec![1536, 7168],
                3 * 1536,
                0
            ),
            (
                "o_proj",
                ChannelCols,
                vec![7168, 12288],
                vec![7168, 1536],
                0,
                3 * 1536
            ),
        ]
    );
    // The KDA layer's g_proj/o_proj at the same rank: the same names, shapes and slices.
    let kda = crate::plan::KdaTpPlan::with_options(
        3,
        8,
        7168,
        128,
        96,
        4,
        128,
        &crate::plan::PlanOptions {
            full_rank_gate: true,
            ..crate::plan::PlanOptions::default()
        },
    )
    .unwrap();
    for name in ["g_proj", "o_proj"] {
        assert_eq!(kda.get(name).unwrap(), p.get(name).unwrap());
    }
}

#[test]
fn glm_is_nope_with_a_replicated_indexer() {
    let p = MlaTpPlan::new(0, 2, glm(), &[]).unwrap();
    assert_eq!(
        p.names(),
        [
            "q_a_proj",
            "q_a_layernorm",
            "q_b_proj",
            "kv_a_proj_with_mqa",
            "kv_a_layernorm",
            "kv_b_proj",
            "o_proj",
            "indexer.wq_b",
            "indexer.wk",
            "indexer.weights_proj",
            "indexer.k_norm",
            "indexer.k_norm.bias",
            "indexer.index_kpool_compress_ape",
            "indexer.index_kpool_compress_gate",
        ]
    );
    assert_eq!(
        p.get("kv_a_proj_with_mqa").unwrap().disk_shape,
        vec![512, 4096]
    );
    assert_eq!(p.get("q_b_proj").unwrap().disk_shape, vec![16384, 1536]);
    assert_eq!(p.get("kv_b_proj").unwrap().disk_shape, vec![32768, 512]);
    assert_eq!(p.get("o_proj").unwrap().disk_shape, vec![4096, 16384]);
    assert_eq!(p.get("indexer.wq_b").unwrap().disk_shape, vec![4096, 1536]);
    for t in p.tensors.iter().filter(|t| t.name.starts_with("indexer.")) {
        assert_eq!(t.kind, KdaShard::Replicated, "{}", t.name);
        assert_eq!(t.local_shape(&t.disk_shape).unwrap(), t.disk_shape);
    }
    let ape = p.get("indexer.index_kpool_compress_ape").unwrap();
    assert_eq!(
        (ape.dtype, ape.disk_shape.clone()),
        (Dtype::F32, vec![16, 128])
    );
}

#[test]
fn the_ranks_tile_every_sharded_tensor() {
    for geometry in [kimi_linear(), k3(), glm()] {
        for tp in [1, 2, 4, 8, 16, 32] {
            let plans: Vec<_> = (0..tp)
                .map(|r| MlaTpPlan::new(r, tp, geometry, &[]).unwrap())
                .collect();
            for (i, t) in plans[0].tensors.iter().enumerate() {
                let mut next = 0;
                for p in &plans {
                    let e = &p.tensors[i];
                    let (offset, len, full) = match e.kind {
                        KdaShard::ChannelCols => {
                            (e.src_col_offset, e.local_row_elems, t.full_row_elems)
                        }
                        KdaShard::Replicated => (0, e.full_rows, e.full_rows),
                        _ => (e.src_row_offset, e.local_rows, t.full_rows),
                    };
                    if e.kind == KdaShard::Replicated {
                        assert_eq!((offset, len), (0, full));
                        continue;
                    }
                    assert_eq!(offset, next, "{} rank {}", e.name, p.tp_rank);
                    next += len;
                }
                if t.kind != KdaShard::Replicated {
                    let full = if t.kind == KdaShard::ChannelCols {
                        t.full_row_elems
                    } else {
                        t.full_rows
                    };
                    assert_eq!(next, full, "{}", t.name);
                }
            }
            let p = &plans[0];
            assert!(p.local_bytes() <= p.full_bytes());
        }
    }
}

#[test]
fn refusals_name_the_field_and_the_sizes() {
    let (heads, tp) = error_fields!(
        MlaTpPlan::new(0, 64, k3(), &[]),
        MlaHeadsNotDivisible { heads, tp_size }
    );
    assert_eq!((heads, tp), (96, 64));
    let message = MlaTpPlan::new(0, 64, k3(), &[]).unwrap_err().to_string();
    assert!(message.contains("num_attention_heads (96)"), "{message}");
    assert!(
        message.contains("1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96"),
        "{message}"
    );
    let field = error_fields!(
        MlaTpPlan::new(
            0,
            1,
            MlaGeometry {
                kv_lora_rank: 0,
                ..glm()
            },
            &[]
        ),
        MlaZeroSize { field }
    );
    assert_eq!(field, "kv_lora_rank");
    let field = error_fields!(
        MlaTpPlan::new(
            0,
            1,
            MlaGeometry {
                q_lora_rank: Some(0),
                ..glm()
            },
            &[]
        ),
        MlaZeroSize { field }
    );
    assert_eq!(field, "q_lora_rank");
    let (rank, size) = error_fields!(
        MlaTpPlan::new(2, 2, glm(), &[]),
        RankOutOfRange { tp_rank, tp_size }
    );
    assert_eq!((rank, size), (2, 2));
    let field = error_fields!(MlaTpPlan::new(0, 0, glm(), &[]), ZeroSize { field });
    assert_eq!(field, "tp_size");
    let name = error_fields!(
        MlaTpPlan::new(0, 1, kimi_linear(), &[("g_proj".into(), Dtype::BF16)]),
        MlaUnknownTensor { name }
    );
    assert_eq!(name, "g_proj");
    let (tensor, dtype) = error_fields!(
        MlaTpPlan::new(0, 1, kimi_linear(), &[("o_proj".into(), Dtype::F8_E4M3)]),
        MlaUnsupportedDtype { tensor, dtype }
    );
    assert_eq!((tensor.as_str(), dtype.as_str()), ("o_proj", "F8_E4M3"));
    let huge = MlaGeometry {
        hidden: usize::MAX / 2,
        ..kimi_linear()
    };
    assert!(matches!(
        MlaTpPlan::new(0, 1, huge, &[]),
        Err(Error::Overflow { .. })
    ));
}

#[test]
fn dtype_overrides_set_the_element_size() {
    let p = MlaTpPlan::new(
        0,
        2,
        kimi_linear(),
        &[("kv_a_layernorm".into(), Dtype::F32)],
    )
    .unwrap();
    let norm = p.get("kv_a_layernorm").unwrap();
    assert_eq!(
        (norm.dtype, norm.elem_bytes, norm.full_bytes()),
        (Dtype::F32, 4, 2048)
    );
    assert_eq!(p.get("kv_b_proj").unwrap().dtype, Dtype::BF16);
}

#[test]
fn the_first_refused_override_is_in_plan_order() {
    let overrides = [
        ("o_proj".to_string(), Dtype::F8_E4M3),
        ("nope".to_string(), Dtype::BF16),
        ("q_proj".to_string(), Dtype::F8_E4M3),
    ];
    let (tensor, _) = error_fields!(
        MlaTpPlan::new(0, 1, kimi_linear(), &overrides),
        MlaUnsupportedDtype { tensor, dtype }
    );
    assert_eq!(tensor, "q_proj");
    let name = error_fields!(
        MlaTpPlan::new(0, 1, kimi_linear(), &overrides[1..2]),
        MlaUnknownTensor { name }
    );
    assert_eq!(name, "nope");
}

fn modelopt(tensors: &[&str]) -> BlockQuant {
    BlockQuant {
        block: [128, 128],
        tensors: tensors.iter().map(|n| (*n).to_string()).collect(),
        layout: crate::quant::ScaleLayout::ModelOpt,
    }
}

#[test]
fn k3_fp8_rank_3_of_8_keeps_its_blocks_of_every_scale_grid() {
    let quant = modelopt(&[
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "g_proj",
        "o_proj",
    ]);
    let p = MlaTpPlan::with_quant(3, 8, k3(), &[], Some(&quant)).unwrap();
    let grid = |name: &str| {
        let t = p.get(name).unwrap();
        assert_eq!(
            (t.dtype, t.block),
            (Dtype::F8_E4M3, Some([128, 128])),
            "{name}"
        );
        let s = t.scale.as_deref().unwrap();
        (
            s.local_shape(&s.disk_shape).unwrap(),
            s.src_row_offset,
            s.src_col_offset,
        )
    };
    assert_eq!(grid("q_a_proj"), (vec![12, 1, 56, 1], 0, 0));
    assert_eq!(grid("q_b_proj"), (vec![18, 1, 12, 1], 54, 0));
    // 576 rows, replicated: the whole grid, its partial last block row included.
    assert_eq!(grid("kv_a_proj_with_mqa"), (vec![5, 1, 56, 1], 0, 0));
    assert_eq!(grid("kv_b_proj"), (vec![24, 1, 4, 1], 72, 0));
    assert_eq!(grid("g_proj"), (vec![12, 1, 56, 1], 36, 0));
    assert_eq!(grid("o_proj"), (vec![56, 1, 12, 1], 0, 36));
    assert!(p.get("q_a_layernorm").unwrap().scale.is_none());
}

#[test]
fn an_fp8_split_that_is_not_whole_blocks_is_refused_with_the_sizes_that_are() {
    let quant = modelopt(&["q_b_proj", "o_proj"]);
    let err = MlaTpPlan::with_quant(1, 32, k3(), &[], Some(&quant)).unwrap_err();
    match err {
        Error::MlaBlockSplit {
            ref tensor,
            axis,
            rank,
            start,
            end,
            local,
            block,
            tp_size,
            ref allowed,
        } => {
            assert_eq!(
                (
                    tensor.as_str(),
                    axis,
                    rank,
                    start,
                    end,
                    local,
                    block,
                    tp_size
                ),
                ("q_b_proj", "rows", 1, 576, 1152, 576, 128, 32)
            );
            assert_eq!(allowed, &vec![1, 2, 3, 4, 6, 8, 12, 16, 24, 48]);
        }
        other => panic!("unexpected {other:?}"),
    }
    // Whole blocks at TP 48 (2 heads: 384 q_b_proj rows, 256 o_proj columns); any split of
    // replicated FP8 weights; TP 1 holds everything whole.
    assert!(MlaTpPlan::with_quant(0, 48, k3(), &[], Some(&quant)).is_ok());
    let replicated = modelopt(&["q_a_proj", "kv_a_proj_with_mqa"]);
    assert!(MlaTpPlan::with_quant(5, 96, k3(), &[], Some(&replicated)).is_ok());
    let one_head = MlaGeometry { heads: 1, ..k3() };
    assert!(MlaTpPlan::with_quant(0, 1, one_head, &[], Some(&quant)).is_ok());
}

#[test]
fn fp8_norms_and_unknown_names_are_refused() {
    assert!(matches!(
        MlaTpPlan::with_quant(0, 1, k3(), &[], Some(&modelopt(&["q_a_layernorm"]))),
        Err(Error::MlaNotQuantizable { .. })
    ));
    assert!(matches!(
        MlaTpPlan::with_quant(0, 1, k3(), &[], Some(&modelopt(&["q_proj"]))),
        Err(Error::MlaUnknownTensor { .. })
    ));
    let fp8_unquantized = [("g_proj".to_string(), Dtype::F8_E4M3)];
    assert!(matches!(
        MlaTpPlan::with_quant(0, 1, k3(), &fp8_unquantized, Some(&modelopt(&["o_proj"]))),
        Err(Error::MlaUnsupportedDtype { .. })
    ));
}
