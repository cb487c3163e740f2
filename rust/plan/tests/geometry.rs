//! The GLM-5.3 geometry, tensor by tensor.

use super::*;

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
