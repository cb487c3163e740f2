//! Kimi K3: a full-rank output gate replacing the low-rank pair, and an `A_log` padded past
//! the head count.

use super::*;

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
