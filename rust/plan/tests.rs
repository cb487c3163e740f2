//! Tests of the shard plan: the geometry of every tensor, every refusal with its exact fields, and
//! properties over random geometries.
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use safetensors::Dtype;

use super::*;

/// GLM-5.3-Flash's KDA geometry: hidden 4096, 64 heads of 128, conv kernel 4, gate rank 128.
fn glm(rank: usize, tp: usize) -> KdaTpPlan {
    KdaTpPlan::new(rank, tp, 4096, 128, 64, 4, 128).unwrap()
}

/// Kimi-Linear's KDA geometry: hidden 2304, 32 heads of 128, conv kernel 4, gate rank 128.
fn kimi(rank: usize, tp: usize) -> KdaTpPlan {
    KdaTpPlan::new(rank, tp, 2304, 128, 32, 4, 128).unwrap()
}

fn opts(qk_multiple: usize, dtypes: &[(&str, Dtype)]) -> PlanOptions {
    PlanOptions {
        qk_multiple,
        dtypes: dtypes.iter().map(|(n, d)| (n.to_string(), *d)).collect(),
        ..PlanOptions::default()
    }
}

// ---------------------------------------------------------------------------------------------
// The GLM-5.3 geometry, tensor by tensor.
// ---------------------------------------------------------------------------------------------

/// (name, kind, dtype, full_rows, full_row_elems, local_rows, local_row_elems, src_row_offset,
/// src_col_offset, disk_shape) at GLM-5.3 geometry, TP=2, rank 1. full_ch = 64 * 128 = 8192,
/// local_ch = 4096, rank 1's channel offset 4096 and head offset 32.
#[allow(clippy::type_complexity)]
#[rustfmt::skip]
const GLM_RANK1: [(&str, KdaShard, Dtype, usize, usize, usize, usize, usize, usize, &[usize]); 15] = {
    use KdaShard::{ChannelCols as CC, ChannelRows as CR, HeadRows as HR, Replicated as R};
    [
        ("q_proj", CR, Dtype::BF16, 8192, 4096, 4096, 4096, 4096, 0, &[8192, 4096]),
        ("k_proj", CR, Dtype::BF16, 8192, 4096, 4096, 4096, 4096, 0, &[8192, 4096]),
        ("v_proj", CR, Dtype::BF16, 8192, 4096, 4096, 4096, 4096, 0, &[8192, 4096]),
        ("q_conv1d", CR, Dtype::BF16, 8192, 4, 4096, 4, 4096, 0, &[8192, 1, 4]),
        ("k_conv1d", CR, Dtype::BF16, 8192, 4, 4096, 4, 4096, 0, &[8192, 1, 4]),
        ("v_conv1d", CR, Dtype::BF16, 8192, 4, 4096, 4, 4096, 0, &[8192, 1, 4]),
        ("f_a_proj", R, Dtype::BF16, 128, 4096, 128, 4096, 0, 0, &[128, 4096]),
        ("f_b_proj", CR, Dtype::BF16, 8192, 128, 4096, 128, 4096, 0, &[8192, 128]),
        ("g_a_proj", R, Dtype::BF16, 128, 4096, 128, 4096, 0, 0, &[128, 4096]),
        ("g_b_proj", CR, Dtype::BF16, 8192, 128, 4096, 128, 4096, 0, &[8192, 128]),
        ("b_proj", HR, Dtype::BF16, 64, 4096, 32, 4096, 32, 0, &[64, 4096]),
        ("A_log", HR, Dtype::F32, 64, 1, 32, 1, 32, 0, &[1, 1, 64, 1]),
        ("dt_bias", CR, Dtype::F32, 8192, 1, 4096, 1, 4096, 0, &[8192]),
        ("o_norm", R, Dtype::BF16, 128, 1, 128, 1, 0, 0, &[128]),
        ("o_proj", CC, Dtype::BF16, 4096, 8192, 4096, 4096, 0, 4096, &[4096, 8192]),
    ]
};

#[test]
fn glm_rank1_every_tensor_by_hand() {
    let p = glm(1, 2);
    assert_eq!(p.tensors.len(), 15);
    for (t, want) in p.tensors.iter().zip(GLM_RANK1) {
        let (name, kind, dtype, fr, fre, lr, lre, ro, co, shape) = want;
        assert_eq!(t.name, name);
        assert_eq!(t.kind, kind, "{name}");
        assert_eq!(t.dtype, dtype, "{name}");
        assert_eq!(
            t.elem_bytes,
            if dtype == Dtype::F32 { 4 } else { 2 },
            "{name}"
        );
        assert_eq!((t.full_rows, t.full_row_elems), (fr, fre), "{name} full");
        assert_eq!((t.local_rows, t.local_row_elems), (lr, lre), "{name} local");
        assert_eq!(
            (t.src_row_offset, t.src_col_offset),
            (ro, co),
            "{name} offsets"
        );
        assert_eq!(t.disk_shape, shape, "{name} disk shape");
        assert_eq!(t.row_bytes(), fre * t.elem_bytes, "{name}");
        assert_eq!(t.full_bytes(), fr * fre * t.elem_bytes, "{name}");
        assert_eq!(t.local_bytes(), lr * lre * t.elem_bytes, "{name}");
    }
    assert_eq!(
        (
            p.tp_rank,
            p.tp_size,
            p.hidden,
            p.head_dim,
            p.full_heads,
            p.local_heads
        ),
        (1, 2, 4096, 128, 64, 32)
    );
    assert_eq!((p.conv_kernel, p.gate_rank, p.qk_multiple), (4, 128, 256));
    assert!(p.needs_output_all_reduce());
}

#[test]
fn glm_rank0_has_zero_offsets_and_the_same_shapes() {
    let p0 = glm(0, 2);
    let p1 = glm(1, 2);
    for (a, b) in p0.tensors.iter().zip(&p1.tensors) {
        assert_eq!((a.src_row_offset, a.src_col_offset), (0, 0), "{}", a.name);
        assert_eq!(
            (
                a.kind,
                a.full_rows,
                a.full_row_elems,
                a.local_rows,
                a.local_row_elems
            ),
            (
                b.kind,
                b.full_rows,
                b.full_row_elems,
                b.local_rows,
                b.local_row_elems
            ),
            "{}",
            a.name
        );
    }
}

#[test]
fn glm_block_byte_totals_by_hand() {
    // On disk: q/k/v_proj 3 x 8192x4096x2, convs 3 x 8192x4x2, f_a/g_a 2 x 128x4096x2,
    // f_b/g_b 2 x 8192x128x2, b_proj 64x4096x2, A_log 64x4, dt_bias 8192x4, o_norm 128x2,
    // o_proj 4096x8192x2.
    let full =
        201_326_592 + 196_608 + 2_097_152 + 4_194_304 + 524_288 + 256 + 32_768 + 256 + 67_108_864;
    assert_eq!(full, 275_481_088);
    // Per rank at TP=2: everything halves except f_a/g_a (2_097_152) and o_norm (256).
    let local =
        100_663_296 + 98_304 + 2_097_152 + 2_097_152 + 262_144 + 128 + 16_384 + 256 + 33_554_432;
    assert_eq!(local, 138_789_248);
    for rank in 0..2 {
        let p = glm(rank, 2);
        assert_eq!(p.full_bytes(), full);
        assert_eq!(p.local_bytes(), local);
    }
    let p1 = glm(0, 1);
    assert_eq!((p1.full_bytes(), p1.local_bytes()), (full, full));
}

#[test]
fn glm_tp4_and_tp8_are_legal_and_tp128_is_not() {
    // Local q|k width 2 * 16 * 128 = 4096 and 2 * 8 * 128 = 2048: multiples of 256.
    assert_eq!(glm(3, 4).local_heads, 16);
    assert_eq!(glm(7, 8).get("o_proj").unwrap().src_col_offset, 7 * 1024);
    // TP=64: one head per rank, width 256, still legal.
    assert_eq!(glm(63, 64).get("A_log").unwrap().src_row_offset, 63);
    // TP=128 does not divide 64 heads.
    assert!(matches!(
        KdaTpPlan::new(0, 128, 4096, 128, 64, 4, 128),
        Err(Error::HeadsNotDivisible {
            heads: 64,
            tp_size: 128,
            head_dim: 128,
            qk_multiple: 256,
        })
    ));
}

/// Spec: `A_log` is per head, `dt_bias` per channel, so rank 1's offsets differ by head_dim.
#[test]
fn a_log_and_dt_bias_shard_at_different_granularity() {
    let p = glm(1, 2);
    let a = p.get("A_log").unwrap();
    let d = p.get("dt_bias").unwrap();
    assert_eq!(
        (a.kind, d.kind),
        (KdaShard::HeadRows, KdaShard::ChannelRows)
    );
    assert_eq!((a.full_rows, a.local_rows), (64, 32), "A_log is per head");
    assert_eq!(
        (d.full_rows, d.local_rows),
        (8192, 4096),
        "dt_bias is per channel"
    );
    assert_eq!(d.src_row_offset, a.src_row_offset * 128);
    // b_proj (beta) is per head too.
    assert_eq!(p.get("b_proj").unwrap().src_row_offset, a.src_row_offset);
}

/// Spec: `o_norm` is shared by every head and `f_a`/`g_a` are low-rank down-projections, so
/// they are replicated; only the `_b` up-projections carry head structure.
#[test]
fn replicated_and_sharded_sets() {
    let p = glm(1, 2);
    let of = |kind| -> Vec<&str> {
        p.tensors
            .iter()
            .filter(|t| t.kind == kind)
            .map(|t| t.name)
            .collect()
    };
    assert_eq!(of(KdaShard::Replicated), ["f_a_proj", "g_a_proj", "o_norm"]);
    assert_eq!(of(KdaShard::HeadRows), ["b_proj", "A_log"]);
    assert_eq!(
        of(KdaShard::ChannelRows),
        [
            "q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_b_proj",
            "g_b_proj", "dt_bias"
        ]
    );
    assert_eq!(
        of(KdaShard::ChannelCols),
        ["o_proj"],
        "o_proj alone is column-sliced"
    );
}

#[test]
fn tensors_follow_tensor_names_and_get_finds_each() {
    let p = glm(0, 2);
    let names: Vec<&str> = p.tensors.iter().map(|t| t.name).collect();
    assert_eq!(names, TENSOR_NAMES);
    for (i, name) in TENSOR_NAMES.iter().enumerate() {
        assert_eq!(p.get(name), Some(&p.tensors[i]));
    }
    for missing in [
        "",
        "q_proj.weight",
        "self_attn.q_proj",
        "Q_PROJ",
        "a_log",
        "o_proj ",
    ] {
        assert_eq!(p.get(missing), None, "{missing:?}");
    }
}

#[test]
fn tp1_is_the_identity_and_needs_no_all_reduce() {
    let p = glm(0, 1);
    assert_eq!(p.local_heads, 64);
    for t in &p.tensors {
        assert_eq!(
            (t.local_rows, t.local_row_elems),
            (t.full_rows, t.full_row_elems)
        );
        assert_eq!((t.src_row_offset, t.src_col_offset), (0, 0), "{}", t.name);
        assert_eq!(t.local_bytes(), t.full_bytes(), "{}", t.name);
        assert_eq!(
            t.local_shape(&t.disk_shape).unwrap(),
            t.disk_shape,
            "{}",
            t.name
        );
    }
    assert!(!p.needs_output_all_reduce());
}

#[test]
fn plans_compare_by_value() {
    assert_eq!(glm(1, 2), glm(1, 2));
    assert_ne!(glm(0, 2), glm(1, 2));
    assert_eq!(
        KdaTpPlan::with_options(1, 2, 4096, 128, 64, 4, 128, &PlanOptions::default()).unwrap(),
        glm(1, 2)
    );
}

// ---------------------------------------------------------------------------------------------
// Refusals, with their exact fields.
// ---------------------------------------------------------------------------------------------

#[test]
fn rank_out_of_range() {
    for (rank, tp) in [(2, 2), (5, 4), (usize::MAX, 1), (1, 1)] {
        match KdaTpPlan::new(rank, tp, 4096, 128, 64, 4, 128) {
            Err(Error::RankOutOfRange { tp_rank, tp_size }) => {
                assert_eq!((tp_rank, tp_size), (rank, tp));
            }
            other => panic!("({rank}, {tp}): {other:?}"),
        }
    }
    let e = KdaTpPlan::new(2, 2, 4096, 128, 64, 4, 128).unwrap_err();
    assert_eq!(e.to_string(), "tp_rank 2 >= tp_size 2");
}

#[test]
fn a_zero_tp_size_is_named_before_the_rank() {
    assert!(matches!(
        KdaTpPlan::new(0, 0, 4096, 128, 64, 4, 128),
        Err(Error::ZeroSize { field: "tp_size" })
    ));
}

#[test]
fn the_rank_is_checked_before_every_other_field() {
    assert!(matches!(
        KdaTpPlan::new(3, 3, 0, 0, 64, 0, 0),
        Err(Error::RankOutOfRange {
            tp_rank: 3,
            tp_size: 3
        })
    ));
}

#[test]
fn zero_size_names_each_field() {
    let cases: [(&str, [usize; 5], usize); 6] = [
        ("hidden", [0, 128, 64, 4, 128], 256),
        ("head_dim", [4096, 0, 64, 4, 128], 256),
        ("full_heads", [4096, 128, 0, 4, 128], 256),
        ("conv_kernel", [4096, 128, 64, 0, 128], 256),
        ("gate_rank", [4096, 128, 64, 4, 0], 256),
        ("qk_multiple", [4096, 128, 64, 4, 128], 0),
    ];
    for (want, [hidden, head_dim, heads, kernel, gate], qk) in cases {
        let got =
            KdaTpPlan::with_options(0, 2, hidden, head_dim, heads, kernel, gate, &opts(qk, &[]));
        match got {
            Err(Error::ZeroSize { field }) => assert_eq!(field, want),
            other => panic!("{want}: {other:?}"),
        }
    }
    let e = KdaTpPlan::new(0, 1, 4096, 0, 64, 4, 128).unwrap_err();
    assert_eq!(e.to_string(), "degenerate KDA TP geometry: head_dim is 0");
}

#[test]
fn zero_size_reports_the_first_zero_field_in_order() {
    match KdaTpPlan::new(0, 1, 4096, 0, 0, 0, 0) {
        Err(Error::ZeroSize { field }) => assert_eq!(field, "head_dim"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn heads_not_divisible() {
    for (heads, tp) in [(64, 3), (32, 5), (6, 4), (1, 2)] {
        match KdaTpPlan::with_options(0, tp, 16, 128, heads, 4, 8, &opts(1, &[])) {
            Err(Error::HeadsNotDivisible {
                heads: h,
                tp_size,
                head_dim,
                qk_multiple,
            }) => assert_eq!((h, tp_size, head_dim, qk_multiple), (heads, tp, 128, 1)),
            other => panic!("{heads}/{tp}: {other:?}"),
        }
    }
    let e = KdaTpPlan::new(0, 3, 4096, 128, 64, 4, 128).unwrap_err();
    assert_eq!(
        e.to_string(),
        "KDA TP requires heads (64) divisible by tp_size (3); tp_size may be one of 1, 2, 4, 8, \
         16, 32, 64"
    );
}

/// Spec: the smallest legal stand-in is heads=4, head_dim=64 at TP=2 (local width 2*2*64 = 256).
/// At TP=4 the local width is 128 and the 256 rule refuses it.
#[test]
fn qk_width_256_rule() {
    assert!(KdaTpPlan::new(0, 2, 4, 64, 4, 2, 4).is_ok());
    match KdaTpPlan::new(0, 4, 4, 64, 4, 2, 4) {
        Err(Error::QkWidth {
            channels,
            multiple,
            local_heads,
            head_dim,
            heads,
            tp_size,
        }) => {
            assert_eq!(
                (channels, multiple, local_heads, head_dim, heads, tp_size),
                (128, 256, 1, 64, 4, 4)
            );
        }
        other => panic!("{other:?}"),
    }
    // Width 2 * 3 * 128 = 768 = 3 * 256 passes; 2 * 3 * 64 = 384 does not.
    assert!(KdaTpPlan::new(0, 1, 8, 128, 3, 2, 4).is_ok());
    assert!(matches!(
        KdaTpPlan::new(0, 1, 8, 64, 3, 2, 4),
        Err(Error::QkWidth {
            channels: 384,
            multiple: 256,
            local_heads: 3,
            head_dim: 64,
            heads: 3,
            tp_size: 1,
        })
    ));
    // Kimi-Linear at TP=32 keeps one head (width 256): legal. GLM at TP=64 also one head.
    assert_eq!(kimi(31, 32).local_heads, 1);
    let e = KdaTpPlan::new(0, 4, 4, 64, 4, 2, 4)
        .unwrap_err()
        .to_string();
    assert!(e.contains("(128) must be a multiple of 256"), "{e}");
    assert!(e.contains("qk_multiple=1"), "{e}");
}

#[test]
fn qk_multiple_1_switches_the_rule_off() {
    let p = KdaTpPlan::with_options(3, 4, 4, 64, 4, 2, 4, &opts(1, &[])).unwrap();
    assert_eq!((p.local_heads, p.qk_multiple), (1, 1));
    assert_eq!(p.get("q_proj").unwrap().src_row_offset, 3 * 64);
    // Odd sizes everywhere, one head of one channel.
    let p = KdaTpPlan::with_options(0, 1, 3, 1, 1, 1, 1, &opts(1, &[])).unwrap();
    assert_eq!(p.get("o_proj").unwrap().full_row_elems, 1);
}

#[test]
fn a_custom_qk_multiple() {
    // 6 heads of 8 at TP=1: width 96.
    assert_eq!(
        KdaTpPlan::with_options(0, 1, 4, 8, 6, 2, 2, &opts(96, &[]))
            .unwrap()
            .qk_multiple,
        96
    );
    assert!(KdaTpPlan::with_options(0, 1, 4, 8, 6, 2, 2, &opts(32, &[])).is_ok());
    match KdaTpPlan::with_options(1, 2, 4, 8, 6, 2, 2, &opts(64, &[])) {
        Err(Error::QkWidth {
            channels,
            multiple,
            local_heads,
            head_dim,
            heads,
            tp_size,
        }) => {
            assert_eq!(
                (channels, multiple, local_heads, head_dim, heads, tp_size),
                (48, 64, 3, 8, 6, 2)
            );
        }
        other => panic!("{other:?}"),
    }
    // A multiple larger than any width: refused, not a panic.
    assert!(matches!(
        KdaTpPlan::with_options(0, 1, 4, 8, 6, 2, 2, &opts(usize::MAX, &[])),
        Err(Error::QkWidth {
            channels: 96,
            multiple: usize::MAX,
            ..
        })
    ));
}

fn overflow_tensor(r: Result<KdaTpPlan>) -> String {
    match r {
        Err(Error::Overflow { tensor }) => tensor,
        other => panic!("expected Overflow, got {other:?}"),
    }
}

#[test]
fn overflow_of_a_tensor_size() {
    // hidden = usize::MAX / 2: q_proj is 8192 x hidden x 2 bytes.
    assert_eq!(
        overflow_tensor(KdaTpPlan::new(0, 2, usize::MAX / 2, 128, 64, 4, 128)),
        "q_proj"
    );
    // The gate rank only enters at f_a_proj (gate_rank x hidden).
    assert_eq!(
        overflow_tensor(KdaTpPlan::new(0, 2, 4096, 128, 64, 4, usize::MAX / 2)),
        "f_a_proj"
    );
    // The conv kernel first enters at q_conv1d.
    assert_eq!(
        overflow_tensor(KdaTpPlan::new(0, 2, 4096, 128, 64, usize::MAX / 4, 128)),
        "q_conv1d"
    );
}

#[test]
fn overflow_of_the_qk_width_and_the_channel_count() {
    // 2 * local_heads * head_dim overflows before the multiple is even looked at.
    assert_eq!(
        overflow_tensor(KdaTpPlan::with_options(
            0,
            1,
            8,
            usize::MAX / 2,
            4,
            2,
            2,
            &opts(1, &[])
        )),
        "q|k width"
    );
    // The local width fits (2 * 1 * 2^50) but full_ch = 2^20 heads x 2^50 does not.
    assert_eq!(
        overflow_tensor(KdaTpPlan::new(0, 1 << 20, 8, 1 << 50, 1 << 20, 2, 2)),
        "q_proj"
    );
}

#[test]
fn overflow_past_isize_max_even_when_usize_holds_it() {
    // q_proj = 256 x 2^54 x 2 = 2^63 bytes: fits in u64, not in isize.
    assert_eq!(
        overflow_tensor(KdaTpPlan::new(0, 1, 1 << 54, 128, 2, 1, 1)),
        "q_proj"
    );
    // Each of q_proj and k_proj is 2^62 bytes; together they pass isize::MAX.
    assert_eq!(
        overflow_tensor(KdaTpPlan::new(0, 1, 1 << 53, 128, 2, 1, 1)),
        "KDA block"
    );
    let e = KdaTpPlan::new(0, 1, 1 << 53, 128, 2, 1, 1).unwrap_err();
    assert_eq!(
        e.to_string(),
        "KDA TP geometry too large: KDA block byte size overflows"
    );
}

#[test]
fn dtype_override_of_an_unknown_tensor() {
    for bad in ["x_proj", "q_proj.weight", "self_attn.A_log", ""] {
        match KdaTpPlan::with_options(
            0,
            2,
            4096,
            128,
            64,
            4,
            128,
            &opts(256, &[(bad, Dtype::F32)]),
        ) {
            Err(Error::UnknownTensor { name, known }) => {
                assert_eq!(name, bad);
                assert_eq!(known, TENSOR_NAMES.join(", "));
                assert!(known.starts_with("q_proj, k_proj, ") && known.ends_with("o_norm, o_proj"));
            }
            other => panic!("{bad:?}: {other:?}"),
        }
    }
}

#[test]
fn dtype_override_with_a_non_float_dtype() {
    for dtype in [
        Dtype::I32,
        Dtype::U8,
        Dtype::BOOL,
        Dtype::F8_E4M3,
        Dtype::I64,
        Dtype::C64,
        Dtype::F4,
    ] {
        match KdaTpPlan::with_options(
            0,
            2,
            4096,
            128,
            64,
            4,
            128,
            &opts(256, &[("o_proj", dtype)]),
        ) {
            Err(Error::UnsupportedDtype { tensor, dtype: d }) => {
                assert_eq!((tensor.as_str(), d), ("o_proj", dtype.to_string()));
            }
            other => panic!("{dtype:?}: {other:?}"),
        }
    }
    let e = KdaTpPlan::with_options(
        0,
        2,
        4096,
        128,
        64,
        4,
        128,
        &opts(256, &[("A_log", Dtype::I32)]),
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "A_log: dtype I32 is not allowed for a KDA tensor: BF16, F16, F32 or F64, and F8_E4M3 \
         or F8_E5M2 only for a block-quantized projection (with its scale)"
    );
}

#[test]
fn dtype_override_changes_elem_bytes_and_byte_counts() {
    let o = opts(
        256,
        &[
            ("o_proj", Dtype::F32),
            ("A_log", Dtype::BF16),
            ("q_proj", Dtype::F64),
            ("k_proj", Dtype::F16),
        ],
    );
    let p = KdaTpPlan::with_options(1, 2, 4096, 128, 64, 4, 128, &o).unwrap();
    let base = glm(1, 2);
    let check = |name: &str, dtype: Dtype, elem: usize| {
        let t = p.get(name).unwrap();
        assert_eq!((t.dtype, t.elem_bytes), (dtype, elem), "{name}");
        assert_eq!(
            t.full_bytes(),
            t.full_rows * t.full_row_elems * elem,
            "{name}"
        );
        assert_eq!(
            t.local_bytes(),
            t.local_rows * t.local_row_elems * elem,
            "{name}"
        );
    };
    check("o_proj", Dtype::F32, 4);
    check("A_log", Dtype::BF16, 2);
    check("q_proj", Dtype::F64, 8);
    check("k_proj", Dtype::F16, 2);
    check("dt_bias", Dtype::F32, 4);
    check("v_proj", Dtype::BF16, 2);
    assert_eq!(p.get("o_proj").unwrap().full_bytes(), 4096 * 8192 * 4);
    assert_eq!(p.get("A_log").unwrap().local_bytes(), 32 * 2);
    // o_proj doubles (+64 MiB on disk), A_log halves (-128 B), q_proj quadruples (+192 MiB).
    assert_eq!(
        p.full_bytes(),
        base.full_bytes() + 67_108_864 - 128 + 3 * 67_108_864
    );
    assert_eq!(
        p.local_bytes(),
        base.local_bytes() + 33_554_432 - 64 + 3 * 33_554_432
    );
    // Rows and offsets do not depend on the dtype.
    for (a, b) in p.tensors.iter().zip(&base.tensors) {
        assert_eq!(
            (
                a.full_rows,
                a.full_row_elems,
                a.local_rows,
                a.local_row_elems,
                a.src_row_offset,
                a.src_col_offset
            ),
            (
                b.full_rows,
                b.full_row_elems,
                b.local_rows,
                b.local_row_elems,
                b.src_row_offset,
                b.src_col_offset
            )
        );
    }
}

#[test]
fn the_last_override_of_a_name_wins() {
    let o = opts(256, &[("o_proj", Dtype::F32), ("o_proj", Dtype::F16)]);
    let p = KdaTpPlan::with_options(0, 2, 4096, 128, 64, 4, 128, &o).unwrap();
    assert_eq!(p.get("o_proj").unwrap().dtype, Dtype::F16);
}

#[test]
fn a_dtype_override_can_overflow() {
    // q_proj at BF16 = 256 x 2^53 x 2 = 2^62 fits; at F64 it is 2^64.
    let o = opts(256, &[("q_proj", Dtype::F64)]);
    assert_eq!(
        overflow_tensor(KdaTpPlan::with_options(0, 1, 1 << 53, 128, 2, 1, 1, &o)),
        "q_proj"
    );
}

// ---------------------------------------------------------------------------------------------
// Kimi-Linear at TP=8, rank 3: on-disk shapes, sharded axes, local shapes.
// ---------------------------------------------------------------------------------------------

#[test]
fn kimi_tp8_rank3_offsets() {
    let p = kimi(3, 8);
    assert_eq!(p.local_heads, 4);
    let q = p.get("q_proj").unwrap();
    assert_eq!((q.local_rows, q.src_row_offset), (512, 1536));
    let a = p.get("A_log").unwrap();
    assert_eq!((a.local_rows, a.src_row_offset), (4, 12));
    let o = p.get("o_proj").unwrap();
    assert_eq!(
        (o.local_rows, o.local_row_elems, o.src_col_offset),
        (2304, 512, 1536)
    );
    assert_eq!(p.full_bytes(), 79_036_800);
    assert_eq!(p.local_bytes(), 10_912_016);
}

fn shape_err(t: &KdaTensorPlan, shape: &[usize]) {
    for r in [
        t.sharded_axis(shape).map(|_| ()),
        t.local_shape(shape).map(|_| ()),
    ] {
        match r {
            Err(Error::Shape {
                tensor,
                actual,
                rows,
                row_elems,
                example,
            }) => {
                assert_eq!(tensor, t.name);
                assert_eq!(actual, shape);
                assert_eq!((rows, row_elems), (t.full_rows, t.full_row_elems));
                assert_eq!(example, t.disk_shape);
            }
            other => panic!("{} {shape:?}: {other:?}", t.name),
        }
    }
}

fn axis_and_local(t: &KdaTensorPlan, shape: &[usize], axis: Option<usize>, local: &[usize]) {
    assert_eq!(t.sharded_axis(shape).unwrap(), axis, "{} {shape:?}", t.name);
    assert_eq!(t.local_shape(shape).unwrap(), local, "{} {shape:?}", t.name);
}

#[test]
fn kimi_a_log_layouts() {
    let p = kimi(3, 8);
    let a = p.get("A_log").unwrap();
    assert_eq!(a.disk_shape, [1, 1, 32, 1]);
    axis_and_local(a, &[1, 1, 32, 1], Some(2), &[1, 1, 4, 1]);
    axis_and_local(a, &[32], Some(0), &[4]);
    axis_and_local(a, &[32, 1, 1, 1], Some(0), &[4, 1, 1, 1]);
    axis_and_local(a, &[1, 32], Some(1), &[1, 4]);
    axis_and_local(a, &[1, 1, 1, 32], Some(3), &[1, 1, 1, 4]);
    shape_err(a, &[2, 16]); // right numel, the head axis is split
    shape_err(a, &[1, 2, 16]);
    shape_err(a, &[33]); // wrong numel
    shape_err(a, &[1, 1, 64, 1]);
    shape_err(a, &[]);
    shape_err(a, &[0, 32]);
    shape_err(a, &[usize::MAX, 2, 3]); // numel overflows
}

#[test]
fn kimi_o_proj_layouts() {
    let p = kimi(3, 8);
    let o = p.get("o_proj").unwrap();
    axis_and_local(o, &[2304, 4096], Some(1), &[2304, 512]);
    axis_and_local(o, &[2, 1152, 4096], Some(2), &[2, 1152, 512]);
    // Transposed: same element count, the input dim is first. Refused.
    shape_err(o, &[4096, 2304]);
    // Trailing unit axes are skipped, as in ModelOpt's [ob, 1, ib, 1] scale grids.
    axis_and_local(o, &[2304, 4096, 1], Some(1), &[2304, 512, 1]);
    shape_err(o, &[2304 * 4096]);
    shape_err(o, &[2304, 512]);
}

#[test]
fn kimi_row_tensor_layouts() {
    let p = kimi(3, 8);
    let conv = p.get("q_conv1d").unwrap();
    axis_and_local(conv, &[4096, 1, 4], Some(0), &[512, 1, 4]);
    axis_and_local(conv, &[4096, 4], Some(0), &[512, 4]);
    axis_and_local(conv, &[1, 4096, 4], Some(1), &[1, 512, 4]);
    shape_err(conv, &[4, 4096]);
    shape_err(conv, &[4, 1, 4096]);
    shape_err(conv, &[4096, 1, 3]);

    let q = p.get("q_proj").unwrap();
    axis_and_local(q, &[4096, 2304], Some(0), &[512, 2304]);
    shape_err(q, &[2304, 4096]);

    let d = p.get("dt_bias").unwrap();
    axis_and_local(d, &[4096], Some(0), &[512]);
    axis_and_local(d, &[1, 4096], Some(1), &[1, 512]);
    shape_err(d, &[32, 128]);

    let b = p.get("b_proj").unwrap();
    axis_and_local(b, &[32, 2304], Some(0), &[4, 2304]);
    shape_err(b, &[2304, 32]);

    let fb = p.get("f_b_proj").unwrap();
    axis_and_local(fb, &[4096, 128], Some(0), &[512, 128]);
}

#[test]
fn kimi_replicated_layouts() {
    let p = kimi(3, 8);
    let n = p.get("o_norm").unwrap();
    axis_and_local(n, &[128], None, &[128]);
    axis_and_local(n, &[1, 128], None, &[1, 128]);
    shape_err(n, &[64]);
    let fa = p.get("f_a_proj").unwrap();
    axis_and_local(fa, &[128, 2304], None, &[128, 2304]);
    // Replicated tensors only need the right element count.
    axis_and_local(fa, &[2304, 128], None, &[2304, 128]);
    shape_err(fa, &[128, 2305]);
}

#[test]
fn every_disk_shape_is_accepted_by_its_own_plan() {
    for p in [glm(1, 2), kimi(3, 8), kimi(0, 1)] {
        for t in &p.tensors {
            let local = t.local_shape(&t.disk_shape).unwrap();
            assert_eq!(local.len(), t.disk_shape.len(), "{}", t.name);
            assert_eq!(
                local.iter().product::<usize>(),
                t.local_rows * t.local_row_elems,
                "{}",
                t.name
            );
        }
    }
}

/// A single head: the head axis has extent 1, so leading unit axes cannot locate it; the plan
/// takes axis 0.
#[test]
fn one_head_a_log() {
    let p = KdaTpPlan::new(0, 1, 8, 128, 1, 2, 2).unwrap();
    let a = p.get("A_log").unwrap();
    assert_eq!(a.disk_shape, [1, 1, 1, 1]);
    axis_and_local(a, &[1, 1, 1, 1], Some(0), &[1, 1, 1, 1]);
    axis_and_local(a, &[1], Some(0), &[1]);
    shape_err(a, &[]);
}

#[test]
fn error_display_of_a_shape_mismatch() {
    let p = kimi(3, 8);
    let e = p.get("A_log").unwrap().local_shape(&[2, 16]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "A_log: on-disk shape [2, 16] does not match the plan; expected 32 elements as [32, 1] \
         (e.g. [1, 1, 32, 1])"
    );
}

// ---------------------------------------------------------------------------------------------
// Properties.
// ---------------------------------------------------------------------------------------------

/// A small geometry: (heads, head_dim, hidden, conv_kernel, gate_rank, qk_multiple).
fn small_geometry() -> impl Strategy<Value = (usize, usize, usize, usize, usize, usize)> {
    (
        1usize..=12,
        prop_oneof![1usize..=16, Just(64usize), Just(128usize)],
        1usize..=6,
        1usize..=4,
        1usize..=4,
        prop_oneof![Just(1usize), Just(2usize), Just(256usize)],
    )
}

fn legal(heads: usize, head_dim: usize, tp: usize, qk: usize) -> bool {
    heads % tp == 0 && (2 * (heads / tp) * head_dim) % qk == 0
}

#[test]
fn allowed_tp_sizes_lists_the_world_sizes_the_plan_accepts() {
    // 4 heads of 64: the 256 rule keeps TP 1 and 2 (widths 512, 256), not 4 (128).
    assert_eq!(allowed_tp_sizes(4, 64, 256), Some(vec![1, 2]));
    assert_eq!(allowed_tp_sizes(4, 64, 1), Some(vec![1, 2, 4]));
    // GLM-5.3 (64 heads of 128): every divisor passes; Kimi K3 (96 of 128) too.
    assert_eq!(
        allowed_tp_sizes(64, 128, 256),
        Some(vec![1, 2, 4, 8, 16, 32, 64])
    );
    assert_eq!(
        allowed_tp_sizes(96, 128, 256),
        Some(vec![1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96])
    );
    // No size passes a rule no width meets; widths that overflow pass nothing; and absurd head
    // counts get no list (and no loop over them).
    assert_eq!(allowed_tp_sizes(6, 8, usize::MAX), Some(vec![]));
    assert_eq!(allowed_tp_sizes(1, usize::MAX, 1), Some(vec![]));
    assert_eq!(allowed_tp_sizes(1 << 62, 1, 1), None);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// `allowed_tp_sizes` is exactly the TP sizes whose plan is built: no trial plan needed.
    #[test]
    fn allowed_tp_sizes_agrees_with_the_plan((heads, head_dim, hidden, kernel, gate, qk) in small_geometry()) {
        let o = opts(qk, &[]);
        let built: Vec<usize> = (1..=heads + 1)
            .filter(|&tp| KdaTpPlan::with_options(0, tp, hidden, head_dim, heads, kernel, gate, &o).is_ok())
            .collect();
        prop_assert_eq!(allowed_tp_sizes(heads, head_dim, qk), Some(built));
    }

    /// For every TP size dividing the heads: either the plan refuses with the exact QkWidth
    /// fields, or the ranks' offsets tile each sharded axis in order, without gaps or overlaps.
    #[test]
    fn ranks_tile_every_sharded_axis((heads, head_dim, hidden, kernel, gate, qk) in small_geometry()) {
        for tp in 1..=heads + 1 {
            let o = opts(qk, &[]);
            let first = KdaTpPlan::with_options(0, tp, hidden, head_dim, heads, kernel, gate, &o);
            if heads % tp != 0 {
                prop_assert!(matches!(first, Err(Error::HeadsNotDivisible { .. })), "{first:?}");
                continue;
            }
            if !legal(heads, head_dim, tp, qk) {
                let want = (2 * (heads / tp) * head_dim, qk, heads / tp, head_dim);
                match first {
                    Err(Error::QkWidth { channels, multiple, local_heads, head_dim, .. }) =>
                        prop_assert_eq!((channels, multiple, local_heads, head_dim), want),
                    other => prop_assert!(false, "{other:?}"),
                }
                continue;
            }
            let plans: Vec<KdaTpPlan> = (0..tp)
                .map(|r| KdaTpPlan::with_options(r, tp, hidden, head_dim, heads, kernel, gate, &o).unwrap())
                .collect();
            for (i, name) in TENSOR_NAMES.iter().enumerate() {
                let mut next_row = 0;
                let mut next_col = 0;
                for (r, p) in plans.iter().enumerate() {
                    let t = &p.tensors[i];
                    prop_assert_eq!(t.name, *name);
                    prop_assert_eq!(p.local_heads * tp, heads);
                    match t.kind {
                        KdaShard::Replicated => {
                            prop_assert_eq!((t.local_rows, t.local_row_elems), (t.full_rows, t.full_row_elems));
                            prop_assert_eq!((t.src_row_offset, t.src_col_offset), (0, 0));
                        }
                        KdaShard::HeadRows | KdaShard::ChannelRows => {
                            prop_assert_eq!(t.src_row_offset, next_row, "{} rank {}", name, r);
                            prop_assert_eq!(t.src_col_offset, 0);
                            prop_assert_eq!(t.local_rows * tp, t.full_rows);
                            prop_assert_eq!(t.local_row_elems, t.full_row_elems);
                            next_row += t.local_rows;
                        }
                        KdaShard::ChannelCols => {
                            prop_assert_eq!(t.src_col_offset, next_col, "{} rank {}", name, r);
                            prop_assert_eq!(t.src_row_offset, 0);
                            prop_assert_eq!(t.local_row_elems * tp, t.full_row_elems);
                            prop_assert_eq!(t.local_rows, t.full_rows);
                            next_col += t.local_row_elems;
                        }
                    }
                    if t.kind != KdaShard::Replicated {
                        prop_assert_eq!(t.local_bytes() * tp, t.full_bytes());
                    }
                    // The plan's own disk shape is accepted and reduces to the local extent.
                    let local = t.local_shape(&t.disk_shape).unwrap();
                    prop_assert_eq!(local.iter().product::<usize>(), t.local_rows * t.local_row_elems);
                    prop_assert_eq!(t.sharded_axis(&t.disk_shape).unwrap().is_none(), t.kind == KdaShard::Replicated);
                }
                let t = &plans[0].tensors[i];
                match t.kind {
                    KdaShard::HeadRows | KdaShard::ChannelRows => prop_assert_eq!(next_row, t.full_rows),
                    KdaShard::ChannelCols => prop_assert_eq!(next_col, t.full_row_elems),
                    KdaShard::Replicated => {}
                }
            }
            prop_assert_eq!(plans.iter().all(KdaTpPlan::needs_output_all_reduce), tp > 1);
        }
    }

    /// Any geometry, legal or not, huge or not: `with_options` returns, and a returned plan's
    /// byte arithmetic and shape helpers do not overflow (tests build with overflow checks).
    #[test]
    fn arbitrary_geometry_never_panics(
        rank in prop_oneof![0usize..4, any::<usize>()],
        tp in prop_oneof![0usize..9, any::<usize>()],
        hidden in prop_oneof![0usize..5000, any::<usize>(), Just(usize::MAX / 2)],
        head_dim in prop_oneof![0usize..300, any::<usize>()],
        heads in prop_oneof![0usize..70, any::<usize>()],
        kernel in prop_oneof![0usize..5, any::<usize>()],
        gate in prop_oneof![0usize..200, any::<usize>()],
        qk in prop_oneof![Just(1usize), Just(256usize), 0usize..1000, any::<usize>()],
        f32_o_proj in any::<bool>(),
    ) {
        let dtypes: &[(&str, Dtype)] = if f32_o_proj { &[("o_proj", Dtype::F64)] } else { &[] };
        if let Ok(p) = KdaTpPlan::with_options(rank, tp, hidden, head_dim, heads, kernel, gate, &opts(qk, dtypes)) {
            prop_assert!(p.tp_rank < p.tp_size);
            prop_assert!(p.local_bytes() <= p.full_bytes());
            prop_assert!(isize::try_from(p.full_bytes()).is_ok());
            for t in &p.tensors {
                let _ = t.local_shape(&t.disk_shape).unwrap();
                prop_assert!(t.local_bytes() <= t.full_bytes());
                prop_assert!(t.src_row_offset + t.local_rows <= t.full_rows);
                prop_assert!(t.src_col_offset + t.local_row_elems <= t.full_row_elems);
            }
        }
    }

    /// Random shapes, including overflowing ones, give a shape or a Shape error, never a panic.
    #[test]
    fn arbitrary_disk_shapes_never_panic(
        shape in proptest::collection::vec(prop_oneof![0usize..40, any::<usize>()], 0..5),
    ) {
        let p = KdaTpPlan::new(1, 4, 8, 64, 8, 4, 2).unwrap();
        for t in &p.tensors {
            match t.local_shape(&shape) {
                Ok(local) => {
                    prop_assert_eq!(local.len(), shape.len());
                    prop_assert_eq!(shape.iter().product::<usize>(), t.full_rows * t.full_row_elems);
                }
                Err(Error::Shape { .. }) => {}
                Err(e) => prop_assert!(false, "{e:?}"),
            }
        }
    }
}

/// Kimi K3's KDA geometry: hidden 7168, 96 heads of 128, conv 4, forget-gate rank 128, full-rank
/// output gate, `A_log` stored with 128 entries (96 heads + 32 zeros).
fn k3(tp_rank: usize, tp_size: usize) -> Result<KdaTpPlan> {
    let options = PlanOptions {
        full_rank_gate: true,
        a_log_len: Some(128),
        ..PlanOptions::default()
    };
    KdaTpPlan::with_options(tp_rank, tp_size, 7168, 128, 96, 4, 128, &options)
}

#[test]
fn k3_full_rank_gate_replaces_the_low_rank_pair() {
    let p = k3(3, 8).unwrap();
    assert_eq!(p.names(), FULL_RANK_GATE_TENSOR_NAMES);
    assert!(p.get("g_a_proj").is_none() && p.get("g_b_proj").is_none());
    let g = p.get("g_proj").unwrap();
    assert_eq!(g.kind, KdaShard::ChannelRows);
    assert_eq!((g.full_rows, g.full_row_elems), (12288, 7168));
    assert_eq!((g.local_rows, g.src_row_offset), (1536, 3 * 1536));
    assert_eq!(g.local_shape(&[12288, 7168]).unwrap(), vec![1536, 7168]);
    let o = p.get("o_proj").unwrap();
    assert_eq!(o.local_shape(&[7168, 12288]).unwrap(), vec![7168, 1536]);
    assert_eq!(o.src_col_offset, 3 * 1536);
    // f_a_proj stays: the forget gate is still low-rank.
    assert_eq!(p.get("f_a_proj").unwrap().kind, KdaShard::Replicated);
    assert!(p.full_rank_gate);
}

#[test]
fn k3_padded_a_log_gives_each_rank_its_heads_not_an_even_split_of_the_padding() {
    for tp in [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96] {
        for r in 0..tp {
            let p = k3(r, tp).unwrap();
            let a = p.get("A_log").unwrap();
            assert_eq!(a.disk_shape, vec![128]);
            assert_eq!(a.full_rows, 128, "the stored length");
            assert_eq!(a.local_rows, 96 / tp, "heads, not 128 / tp");
            assert_eq!(a.src_row_offset, r * 96 / tp);
            assert_eq!(a.local_shape(&[128]).unwrap(), vec![96 / tp]);
            assert_eq!(p.a_log_len, 128);
        }
    }
    // Rank 3 of 8 holds heads 36..48: bytes [144, 192) of the F32 tensor.
    let a = k3(3, 8).unwrap();
    let a = a.get("A_log").unwrap();
    assert_eq!(crate::slice::row_byte_range(a), Some(144..192));
}

#[test]
fn k3_refuses_tp_64_and_a_short_a_log() {
    let err = k3(0, 64).unwrap_err();
    assert!(matches!(
        err,
        Error::HeadsNotDivisible {
            heads: 96,
            tp_size: 64,
            ..
        }
    ));
    assert!(err
        .to_string()
        .ends_with("tp_size may be one of 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96"));
    // Absurd head counts (fuzzing) get no list, and no loop over 2^62 candidates.
    let huge = KdaTpPlan::new(0, 3, 1, 1, 1 << 62, 1, 1).unwrap_err();
    assert!(huge
        .to_string()
        .ends_with("tp_size may be one of a divisor of the head count"));
    let short = PlanOptions {
        a_log_len: Some(95),
        ..PlanOptions::default()
    };
    let err = KdaTpPlan::with_options(0, 1, 7168, 128, 96, 4, 128, &short).unwrap_err();
    assert_eq!(
        err.to_string(),
        "A_log stores 95 entries, fewer than the 96 heads"
    );
    // An unpadded length keeps Kimi-Linear's canonical [1, 1, H, 1].
    let exact = PlanOptions {
        a_log_len: Some(96),
        ..PlanOptions::default()
    };
    let p = KdaTpPlan::with_options(0, 2, 7168, 128, 96, 4, 128, &exact).unwrap();
    assert_eq!(p.get("A_log").unwrap().disk_shape, vec![1, 1, 96, 1]);
}

#[test]
fn dtype_overrides_must_name_a_tensor_of_this_layout() {
    let g_proj_without_gate = opts(256, &[("g_proj", Dtype::BF16)]);
    let err = KdaTpPlan::with_options(0, 1, 64, 128, 2, 4, 8, &g_proj_without_gate).unwrap_err();
    assert!(matches!(err, Error::UnknownTensor { ref name, .. } if name == "g_proj"));
    let low_rank_with_gate = PlanOptions {
        full_rank_gate: true,
        ..opts(256, &[("g_a_proj", Dtype::BF16)])
    };
    let err = KdaTpPlan::with_options(0, 1, 64, 128, 2, 4, 8, &low_rank_with_gate).unwrap_err();
    assert!(matches!(err, Error::UnknownTensor { ref known, .. } if known.contains("g_proj")));
}
