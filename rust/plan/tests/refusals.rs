//! Refusals, with their exact fields.

use super::*;

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

/// The fields of an [`Error::QkWidth`]: `(channels, multiple, local_heads, head_dim, heads,
/// tp_size)`; panics on anything else.
fn qk_width(r: Result<KdaTpPlan>) -> (usize, usize, usize, usize, usize, usize) {
    error_fields!(
        r,
        QkWidth {
            channels,
            multiple,
            local_heads,
            head_dim,
            heads,
            tp_size,
        }
    )
}

/// Spec: the smallest legal stand-in is heads=4, head_dim=64 at TP=2 (local width 2*2*64 = 256).
/// At TP=4 the local width is 128 and the 256 rule refuses it.
#[test]
fn qk_width_256_rule() {
    assert!(KdaTpPlan::new(0, 2, 4, 64, 4, 2, 4).is_ok());
    assert_eq!(
        qk_width(KdaTpPlan::new(0, 4, 4, 64, 4, 2, 4)),
        (128, 256, 1, 64, 4, 4)
    );
    // Width 2 * 3 * 128 = 768 = 3 * 256 passes; 2 * 3 * 64 = 384 does not.
    assert!(KdaTpPlan::new(0, 1, 8, 128, 3, 2, 4).is_ok());
    assert_eq!(
        qk_width(KdaTpPlan::new(0, 1, 8, 64, 3, 2, 4)),
        (384, 256, 3, 64, 3, 1)
    );
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
    assert_eq!(
        qk_width(KdaTpPlan::with_options(1, 2, 4, 8, 6, 2, 2, &opts(64, &[]))),
        (48, 64, 3, 8, 6, 2)
    );
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
