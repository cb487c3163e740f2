//! Tests of the block-scale plan: Kimi K3's real FP8 shapes, the covering-block rule, refusals.
#![allow(clippy::unwrap_used)]

use super::*;
use crate::plan::{KdaTpPlan, PlanOptions};

fn k3_fp8(tp_rank: usize, tp_size: usize, layout: ScaleLayout) -> Result<KdaTpPlan> {
    let options = PlanOptions {
        full_rank_gate: true,
        a_log_len: Some(128),
        block_quant: Some(BlockQuant {
            block: [128, 128],
            tensors: [
                "q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "f_b_proj", "b_proj", "o_proj",
            ]
            .map(String::from)
            .to_vec(),
            layout,
        }),
        ..PlanOptions::default()
    };
    KdaTpPlan::with_options(tp_rank, tp_size, 7168, 128, 96, 4, 128, &options)
}

#[test]
fn k3_rank3_of_8_scale_grids() {
    let p = k3_fp8(3, 8, ScaleLayout::ModelOpt).unwrap();
    let q = p.get("q_proj").unwrap();
    assert_eq!(q.dtype, Dtype::F8_E4M3);
    assert_eq!(q.block, Some([128, 128]));
    assert_eq!(q.local_shape(&[12288, 7168]).unwrap(), vec![1536, 7168]);
    let qs = q.scale.as_deref().unwrap();
    assert_eq!(qs.disk_shape, vec![96, 1, 56, 1]);
    assert_eq!(qs.local_shape(&[96, 1, 56, 1]).unwrap(), vec![12, 1, 56, 1]);
    assert_eq!((qs.src_row_offset, qs.local_rows), (36, 12));
    // b_proj: rows 36..48 of 96 lie inside block row 0, which every rank keeps.
    let bs = p.get("b_proj").unwrap().scale.as_deref().unwrap();
    assert_eq!(bs.local_shape(&[1, 1, 56, 1]).unwrap(), vec![1, 1, 56, 1]);
    assert_eq!(bs.src_row_offset, 0);
    // o_proj: input columns 4608..6144 are input blocks 36..48.
    let os = p.get("o_proj").unwrap().scale.as_deref().unwrap();
    assert_eq!(os.local_shape(&[56, 1, 96, 1]).unwrap(), vec![56, 1, 12, 1]);
    assert_eq!((os.src_col_offset, os.local_row_elems), (36, 12));
    assert_eq!(
        crate::slice::row_byte_range(os),
        None,
        "a strided gather of the grid"
    );
    // f_a_proj is replicated: the whole grid. Unquantized tensors have no scale.
    let fa = p.get("f_a_proj").unwrap().scale.as_deref().unwrap();
    assert_eq!(fa.local_shape(&[1, 1, 56, 1]).unwrap(), vec![1, 1, 56, 1]);
    for name in ["q_conv1d", "A_log", "dt_bias", "o_norm"] {
        assert!(p.get(name).unwrap().scale.is_none(), "{name}");
    }
    // The 2-D layout slices the same way.
    let p2 = k3_fp8(3, 8, ScaleLayout::Grid).unwrap();
    let os2 = p2.get("o_proj").unwrap().scale.as_deref().unwrap();
    assert_eq!(os2.local_shape(&[56, 96]).unwrap(), vec![56, 12]);
}

#[test]
fn every_k3_tp_size_is_block_aligned() {
    for tp in [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96] {
        for r in 0..tp {
            let p = k3_fp8(r, tp, ScaleLayout::ModelOpt).unwrap();
            let s = p.get("g_proj").unwrap().scale.as_deref().unwrap();
            assert_eq!((s.local_rows, s.src_row_offset), (96 / tp, r * 96 / tp));
        }
    }
}

#[test]
fn a_rank_starting_inside_a_block_is_refused_with_its_range() {
    // 6 heads of 64 at TP=2: rank 1's q_proj rows are 192..384, starting inside block 1.
    let options = PlanOptions {
        qk_multiple: 1,
        block_quant: Some(BlockQuant {
            block: [128, 128],
            tensors: vec!["q_proj".into()],
            layout: ScaleLayout::Grid,
        }),
        ..PlanOptions::default()
    };
    for rank in 0..2 {
        let err = KdaTpPlan::with_options(rank, 2, 256, 64, 6, 4, 64, &options).unwrap_err();
        assert_eq!(
            err.to_string(),
            "q_proj: rank 1's rows 192..384 start inside block 1 of 128 rows, so the block scales \
             cannot be sliced to match; a rank's range must start on a block boundary or lie \
             inside one block (choose another tp_size)"
        );
    }
    // At TP=3 each rank has 128 rows: aligned.
    assert!(KdaTpPlan::with_options(2, 3, 256, 64, 6, 4, 64, &options).is_ok());
}

#[test]
fn covering_blocks_of_sub_block_ranges() {
    assert_eq!(covering(36, 12, 128), (0, 1));
    assert_eq!(covering(4608, 1536, 128), (36, 12));
    assert_eq!(covering(0, 192, 128), (0, 2), "ends inside block 1: kept");
    assert_eq!(covering(100, 20, 128), (0, 1));
}

#[test]
fn refusals_of_the_options() {
    let mut q = BlockQuant {
        block: [128, 0],
        tensors: vec![],
        layout: ScaleLayout::Grid,
    };
    let names = ["q_proj", "A_log", "o_norm"];
    assert!(matches!(
        check(&q, &names),
        Err(Error::ZeroSize { field: "block" })
    ));
    q.block = [MAX_BLOCK + 1, 128];
    assert!(matches!(check(&q, &names), Err(Error::BlockSize { .. })));
    q.block = [128, 128];
    q.tensors = vec!["A_log".into()];
    assert_eq!(
        check(&q, &names).unwrap_err().to_string(),
        "A_log is never block-quantized (conv weights, A_log, dt_bias and o_norm stay \
         floating-point); a checkpoint that quantizes it is not supported"
    );
    q.tensors = vec!["g_proj".into()];
    assert!(matches!(
        check(&q, &names),
        Err(Error::UnknownTensor { .. })
    ));
}

#[test]
fn fp8_dtypes_only_for_quantized_projections() {
    let mut options = PlanOptions {
        dtypes: vec![("q_proj".into(), Dtype::F8_E5M2)],
        ..PlanOptions::default()
    };
    let err = KdaTpPlan::with_options(0, 1, 64, 128, 2, 4, 8, &options).unwrap_err();
    assert!(matches!(err, Error::UnsupportedDtype { .. }), "{err}");
    assert!(err
        .to_string()
        .contains("only for a block-quantized projection"));
    options.block_quant = Some(BlockQuant {
        block: [128, 128],
        tensors: vec!["q_proj".into()],
        layout: ScaleLayout::Grid,
    });
    let p = KdaTpPlan::with_options(0, 1, 64, 128, 2, 4, 8, &options).unwrap();
    assert_eq!(p.get("q_proj").unwrap().dtype, Dtype::F8_E5M2);
    assert_eq!(p.get("q_proj").unwrap().elem_bytes, 1);
}
