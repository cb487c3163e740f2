//! Tests of applying a plan entry to bytes: row ranges, the strided `o_proj` gather (serial and
//! parallel), size refusals, and per-rank reassembly properties.
#![allow(clippy::unwrap_used)]

use std::borrow::Cow;

use proptest::prelude::*;
use safetensors::Dtype;

use super::*;
use crate::error::Error;
use crate::plan::{KdaTpPlan, PlanOptions};

/// GLM-5.3's real KDA geometry at TP=2.
fn glm(rank: usize) -> KdaTpPlan {
    KdaTpPlan::new(rank, 2, 4096, 128, 64, 4, 128).unwrap()
}

/// The smallest legal stand-in under the 256 rule: 4 heads of 64 at TP=2, hidden 4, so q_proj
/// is [256, 4] and o_proj [4, 256].
fn small(rank: usize) -> KdaTpPlan {
    KdaTpPlan::new(rank, 2, 4, 64, 4, 2, 4).unwrap()
}

/// `rows` rows of `row_bytes` bytes, every byte of row r equal to r (mod 256).
fn rows_pattern(rows: usize, row_bytes: usize) -> Vec<u8> {
    (0..rows)
        .flat_map(|r| std::iter::repeat_n(r as u8, row_bytes))
        .collect()
}

/// Deterministic, position-dependent bytes (xorshift), so any misplaced byte shows.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 32) as u8
        })
        .collect()
}

/// The obvious per-row column slice, for comparison.
fn naive_cols(t: &KdaTensorPlan, full: &[u8]) -> Vec<u8> {
    let row = t.full_row_elems * t.elem_bytes;
    let lo = t.src_col_offset * t.elem_bytes;
    let width = t.local_row_elems * t.elem_bytes;
    let mut out = Vec::new();
    for r in 0..t.local_rows {
        out.extend_from_slice(&full[r * row + lo..r * row + lo + width]);
    }
    out
}

fn buffer_size(r: Result<impl std::fmt::Debug>) -> (String, usize, usize, usize, usize, usize) {
    error_fields!(
        r,
        BufferSize {
            tensor,
            actual,
            expected,
            rows,
            row_elems,
            elem_bytes,
        }
    )
}

// ---------------------------------------------------------------------------------------------
// The tp_bind spec's tests, on the Rust side.
// ---------------------------------------------------------------------------------------------

/// Row slices are contiguous, and the two ranks partition the tensor exactly, in rank order.
#[test]
fn channel_rows_partition_the_tensor() {
    let q0 = small(0).get("q_proj").unwrap().clone();
    let q1 = small(1).get("q_proj").unwrap().clone();
    assert_eq!(q0.kind, KdaShard::ChannelRows);
    assert_eq!(
        (q0.full_rows, q0.full_row_elems, q0.local_rows),
        (256, 4, 128)
    );
    // [256, 4] BF16, every byte of row r is r.
    let full = rows_pattern(256, 8);
    let r0 = shard_bytes(&q0, &full).unwrap();
    let r1 = shard_bytes(&q1, &full).unwrap();
    assert_eq!(
        r0.len() + r1.len(),
        full.len(),
        "the two ranks partition it"
    );
    assert_eq!(
        [&r0[..], &r1[..]].concat(),
        full,
        "and rejoin in rank order"
    );
    assert!(r0.iter().all(|b| *b < 128), "rank 0 keeps the low rows");
    assert!(r1.iter().all(|b| *b >= 128), "rank 1 keeps the high rows");
    // Row r starts at byte 8r: rank 1's first row is 128.
    assert_eq!(&r1[..8], &[128u8; 8]);
    assert_eq!(row_byte_range(&q1), Some(1024..2048));
}

/// `o_proj` is column-sliced; a row slice of the same tensor has the same length and different
/// bytes, so only a value check tells them apart.
#[test]
fn o_proj_is_column_sliced_not_row_sliced() {
    let p = small(1);
    let o = p.get("o_proj").unwrap();
    assert_eq!(o.kind, KdaShard::ChannelCols);
    assert_eq!(o.full_rows, 4, "hidden");
    assert_eq!(o.full_row_elems, 256, "heads * head_dim");
    assert_eq!(o.local_rows, 4, "every row is kept");
    assert_eq!(o.local_row_elems, 128, "half the input dim");
    assert_eq!(row_byte_range(o), None, "no single byte range");

    // [4, 256] BF16: each element's low byte is its column index.
    let full: Vec<u8> = (0..4)
        .flat_map(|_| (0..=255u8).flat_map(|c| [c, 0]))
        .collect();
    let got = shard_bytes(o, &full).unwrap();
    assert!(matches!(got, Cow::Owned(_)), "a gather is a fresh buffer");
    // Rank 1 keeps columns 128..256 of every row.
    let want: Vec<u8> = (0..4)
        .flat_map(|_| (128..=255u8).flat_map(|c| [c, 0]))
        .collect();
    assert_eq!(got, want);

    // Rows 2..4 have the same length and other bytes: what a size check cannot catch.
    let row_sliced = &full[full.len() / 2..];
    assert_eq!(row_sliced.len(), got.len());
    assert_ne!(row_sliced, &got[..]);

    // Rank 0 keeps columns 0..128.
    let p0 = small(0);
    let got0 = shard_bytes(p0.get("o_proj").unwrap(), &full).unwrap();
    let want0: Vec<u8> = (0..4)
        .flat_map(|_| (0..=127u8).flat_map(|c| [c, 0]))
        .collect();
    assert_eq!(got0, want0);
}

/// `o_norm` and the low-rank down-projections come through verbatim.
#[test]
fn o_norm_and_the_low_rank_down_projections_are_replicated() {
    let p = glm(1);
    for n in ["o_norm", "f_a_proj", "g_a_proj"] {
        let t = p.get(n).unwrap();
        assert_eq!(t.kind, KdaShard::Replicated, "{n}");
        let full = vec![0xABu8; t.full_bytes()];
        let got = shard_bytes(t, &full).unwrap();
        assert_eq!(got.as_ptr(), full.as_ptr(), "{n} is borrowed whole");
        assert_eq!(&got[..], &full[..], "{n} must be verbatim");
        assert_eq!(row_byte_range(t), Some(0..t.full_bytes()));
    }
    assert_eq!(p.get("o_norm").unwrap().full_bytes(), 256);
    // Distinct bytes, not a constant: still verbatim.
    let t = p.get("o_norm").unwrap();
    let full = noise(256, 7);
    assert_eq!(&shard_bytes(t, &full).unwrap()[..], &full[..]);
}

/// At TP=1 every tensor comes back whole, so TP=1 and TP>1 share one code path.
#[test]
fn tp1_is_the_identity() {
    let p = KdaTpPlan::new(0, 1, 4096, 128, 64, 4, 128).unwrap();
    for t in &p.tensors {
        assert_eq!(t.local_bytes(), t.full_bytes(), "{}", t.name);
        let full = vec![0x5Au8; t.full_bytes()];
        let got = shard_bytes(t, &full).unwrap();
        assert_eq!(got.len(), full.len(), "{}", t.name);
        assert!(got.iter().all(|b| *b == 0x5A), "{}", t.name);
    }
    assert!(!p.needs_output_all_reduce());
}

/// A buffer whose size disagrees with the plan is refused, not truncated.
#[test]
fn a_size_mismatch_is_refused() {
    let p = glm(0);
    let q = p.get("q_proj").unwrap();
    let full = q.full_bytes();
    assert_eq!(full, 8192 * 4096 * 2);
    for len in [full - 2, full + 2, 0, full / 2] {
        let got = buffer_size(shard_bytes(q, &vec![0u8; len]));
        assert_eq!(got, ("q_proj".to_string(), len, full, 8192, 4096, 2));
    }
    let e = shard_bytes(q, &vec![0u8; full - 2]).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("q_proj: buffer is {} bytes, the plan's full shape [8192, 4096] x 2 bytes implies {full} bytes", full - 2)
    );
    // Every kind refuses, including the replicated and column-sliced ones.
    for name in ["o_norm", "o_proj", "A_log"] {
        let t = p.get(name).unwrap();
        let got = buffer_size(shard_bytes(t, &vec![0u8; t.full_bytes() + 1]));
        assert_eq!(got.0, name);
        assert_eq!((got.1, got.2), (t.full_bytes() + 1, t.full_bytes()));
        assert!(check_full_len(t, t.full_bytes()).is_ok());
    }
}

/// The conv tensors are `[C, 1, K]` on disk and the local shape keeps that rank.
#[test]
fn local_shape_preserves_the_on_disk_rank() {
    let p = glm(1);
    let c = p.get("q_conv1d").unwrap();
    assert_eq!(c.local_shape(&[8192, 1, 4]).unwrap(), [4096, 1, 4]);
    let o = p.get("o_proj").unwrap();
    assert_eq!(o.local_shape(&[4096, 8192]).unwrap(), [4096, 4096]);
    let n = p.get("o_norm").unwrap();
    assert_eq!(n.local_shape(&[128]).unwrap(), [128]);
    let a = p.get("A_log").unwrap();
    assert_eq!(a.local_shape(&[1, 1, 64, 1]).unwrap(), [1, 1, 32, 1]);
}

/// End to end, the way the adapter uses the core: a planned checkpoint tensor becomes this
/// rank's bytes with a local shape; a name the plan lacks passes through untouched.
#[test]
fn planned_tensors_become_local_and_the_rest_pass_through() {
    let p = small(1);
    let source: Vec<(&str, Vec<usize>, Vec<u8>)> = vec![
        ("q_proj", vec![256, 4], rows_pattern(256, 8)),
        ("input_layernorm", vec![4], vec![0xEE; 8]),
    ];
    let mut view = Vec::new();
    for (name, shape, bytes) in &source {
        view.push(match p.get(name) {
            Some(t) => (
                t.local_shape(shape).unwrap(),
                shard_bytes(t, bytes).unwrap().into_owned(),
            ),
            None => (shape.clone(), bytes.clone()),
        });
    }
    let q = p.get("q_proj").unwrap();
    assert_eq!(view[0].0, [128, 4], "local rows, full row width");
    assert_eq!(view[0].1.len(), q.local_bytes());
    assert!(
        view[0].1.iter().all(|b| *b >= 128),
        "rank 1 keeps the high rows"
    );
    assert_eq!(
        view[1],
        (vec![4], vec![0xEE; 8]),
        "not a KDA tensor: untouched"
    );
}

// ---------------------------------------------------------------------------------------------
// Row ranges, borrowing and the gather itself.
// ---------------------------------------------------------------------------------------------

#[test]
fn row_slices_borrow_from_the_full_buffer() {
    let p = small(1);
    for t in p.tensors.iter().filter(|t| t.kind != KdaShard::ChannelCols) {
        let full = noise(t.full_bytes(), 3);
        let got = shard_bytes(t, &full).unwrap();
        let range = row_byte_range(t).unwrap();
        assert!(matches!(got, Cow::Borrowed(_)), "{}", t.name);
        assert_eq!(
            got.as_ptr(),
            full[range.clone()].as_ptr(),
            "{}: zero copy",
            t.name
        );
        assert_eq!(range.len(), t.local_bytes(), "{}", t.name);
        assert_eq!(range.start, t.src_row_offset * t.row_bytes(), "{}", t.name);
    }
}

#[test]
fn glm_row_ranges_by_hand() {
    let p = glm(1);
    // q_proj rank 1: rows 4096..8192 of 8192 B each.
    assert_eq!(
        row_byte_range(p.get("q_proj").unwrap()),
        Some(33_554_432..67_108_864)
    );
    // A_log rank 1: heads 32..64, 4 B each.
    assert_eq!(row_byte_range(p.get("A_log").unwrap()), Some(128..256));
    // dt_bias rank 1: channels 4096..8192, 4 B each.
    assert_eq!(
        row_byte_range(p.get("dt_bias").unwrap()),
        Some(16_384..32_768)
    );
    // b_proj rank 1: heads 32..64 of 4096 x 2 B.
    assert_eq!(
        row_byte_range(p.get("b_proj").unwrap()),
        Some(262_144..524_288)
    );
    // q_conv1d rank 1: channels 4096..8192 of 4 x 2 B.
    assert_eq!(
        row_byte_range(p.get("q_conv1d").unwrap()),
        Some(32_768..65_536)
    );
}

#[test]
fn a_log_rank1_bytes_are_heads_32_to_64() {
    let p = glm(1);
    let a = p.get("A_log").unwrap();
    // F32 little-endian head index.
    let full: Vec<u8> = (0..64u32).flat_map(|h| (h as f32).to_le_bytes()).collect();
    let got = shard_bytes(a, &full).unwrap();
    let heads: Vec<f32> = got
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(heads, (32..64).map(|h| h as f32).collect::<Vec<_>>());
}

#[test]
fn gather_cols_refuses_wrong_lengths() {
    let p = small(1);
    let o = p.get("o_proj").unwrap();
    let full = vec![0u8; o.full_bytes()];
    let mut out = vec![0u8; o.local_bytes() - 1];
    assert_eq!(
        buffer_size(gather_cols(o, &full, &mut out)),
        ("o_proj (local output)".to_string(), 1023, 1024, 4, 128, 2)
    );
    let mut out = vec![0u8; o.local_bytes() + 2];
    assert_eq!(buffer_size(gather_cols(o, &full, &mut out)).1, 1026);
    let mut out = vec![0u8; o.local_bytes()];
    assert_eq!(
        buffer_size(gather_cols(o, &full[1..], &mut out)),
        ("o_proj".to_string(), 2047, 2048, 4, 256, 2)
    );
    assert!(gather_cols(o, &full, &mut out).is_ok());
}

/// `write` (a slicer filling a caller's buffer), given a buffer of `fill` bytes, leaves in it
/// exactly the bytes `shard_bytes` gives for `t` on `rank`.
fn assert_writes_shard_bytes(
    write: fn(&KdaTensorPlan, &[u8], &mut [u8]) -> Result<()>,
    t: &KdaTensorPlan,
    full: &[u8],
    fill: u8,
    rank: usize,
) {
    let mut out = vec![fill; t.local_bytes()];
    write(t, full, &mut out).unwrap();
    assert!(
        out[..] == shard_bytes(t, full).unwrap()[..],
        "{} rank {rank}",
        t.name
    );
}

/// `gather_cols` is public; on a row-sliced plan it must give this rank's rows, not rank 0's.
#[test]
fn gather_cols_on_row_kinds_matches_shard_bytes() {
    for rank in 0..2 {
        let p = small(rank);
        for t in &p.tensors {
            let full = noise(t.full_bytes(), 11);
            assert_writes_shard_bytes(gather_cols, t, &full, 0, rank);
        }
    }
}

/// One case large enough (8 MiB of output) for the rayon path: hidden 2048 x full_ch 4096 BF16
/// at TP=2, rows of 4 KiB so tasks of 256 rows.
#[test]
fn parallel_gather_equals_the_naive_gather() {
    let full = noise(2048 * 4096 * 2, 0x9E37_79B9);
    let mut outs = Vec::new();
    for rank in 0..2 {
        let p = KdaTpPlan::new(rank, 2, 2048, 128, 32, 4, 16).unwrap();
        let o = p.get("o_proj").unwrap();
        assert_eq!(
            (o.full_rows, o.full_row_elems, o.local_row_elems),
            (2048, 4096, 2048)
        );
        assert!(o.local_bytes() >= PARALLEL_MIN_BYTES);
        let got = shard_bytes(o, &full).unwrap();
        assert_eq!(got.len(), 8 << 20);
        assert!(got[..] == naive_cols(o, &full)[..], "rank {rank}");
        outs.push(got.into_owned());
    }
    // Interleave the two halves back, row by row.
    let row = 4096 * 2;
    for r in 0..2048 {
        assert!(
            [
                &outs[0][r * row / 2..(r + 1) * row / 2],
                &outs[1][r * row / 2..(r + 1) * row / 2]
            ]
            .concat()
                == full[r * row..(r + 1) * row],
            "row {r}"
        );
    }
}

/// The parallel path with a row width that does not divide the 1 MiB task size (600 B rows,
/// 1747 rows a task, a short last task) and an F32 override.
#[test]
fn parallel_gather_with_odd_widths() {
    let o_opts = |dtype| PlanOptions {
        qk_multiple: 1,
        dtypes: vec![("o_proj".into(), dtype)],
        ..PlanOptions::default()
    };
    for (dtype, elem) in [(Dtype::BF16, 2usize), (Dtype::F32, 4)] {
        // 6 heads of 100 at TP=2: 300 local channels.
        let hidden = 9000;
        let full = noise(hidden * 600 * elem, elem as u64);
        for rank in 0..2 {
            let p = KdaTpPlan::with_options(rank, 2, hidden, 100, 6, 2, 2, &o_opts(dtype)).unwrap();
            let o = p.get("o_proj").unwrap();
            assert_eq!(o.elem_bytes, elem);
            assert!(o.local_bytes() >= PARALLEL_MIN_BYTES, "{}", o.local_bytes());
            let mut out = vec![0u8; o.local_bytes()];
            gather_cols(o, &full, &mut out).unwrap();
            assert!(out == naive_cols(o, &full), "{dtype} rank {rank}");
        }
    }
}

/// `shard_into` writes exactly `shard_bytes`'s bytes for every kind and rank, on the serial path
/// (small) and the parallel streaming path (the 8 MiB `q_proj`/`o_proj` slices of the large
/// geometry), overwriting whatever the buffer held.
#[test]
fn shard_into_equals_shard_bytes_for_every_kind() {
    for (tp, make) in [
        (2, small as fn(usize) -> KdaTpPlan),
        (2, |rank| {
            KdaTpPlan::new(rank, 2, 2048, 128, 32, 4, 16).unwrap()
        }),
    ] {
        for rank in 0..tp {
            let p = make(rank);
            for t in &p.tensors {
                let full = noise(t.full_bytes(), 23 + rank as u64);
                assert_writes_shard_bytes(shard_into, t, &full, 0xEE, rank);
            }
        }
    }
    let big = KdaTpPlan::new(1, 2, 2048, 128, 32, 4, 16).unwrap();
    assert!(big.get("q_proj").unwrap().local_bytes() >= PARALLEL_MIN_BYTES);
    assert!(big.get("o_proj").unwrap().local_bytes() >= PARALLEL_MIN_BYTES);
}

#[test]
fn shard_into_refuses_wrong_lengths() {
    let p = small(1);
    for name in ["q_proj", "o_proj", "o_norm"] {
        let t = p.get(name).unwrap();
        let full = vec![0u8; t.full_bytes()];
        let mut out = vec![9u8; t.local_bytes() + 1];
        let got = buffer_size(shard_into(t, &full, &mut out));
        assert_eq!(got.0, format!("{name} (local output)"));
        assert_eq!((got.1, got.2), (t.local_bytes() + 1, t.local_bytes()));
        let mut out = vec![9u8; t.local_bytes()];
        let got = buffer_size(shard_into(t, &full[1..], &mut out));
        assert_eq!((got.0.as_str(), got.1), (name, t.full_bytes() - 1));
        assert!(
            out.iter().all(|b| *b == 9),
            "{name}: nothing written on refusal"
        );
    }
}

/// The streaming copy handles every destination alignment and a tail that is not a whole
/// 64-byte block, and writes nothing outside its destination.
#[test]
fn copy_parallel_at_unaligned_offsets() {
    let len = PARALLEL_MIN_BYTES + 77;
    let src = noise(len, 5);
    let mut buf = vec![0u8; len + 64];
    for offset in [0, 1, 3, 8, 15, 16, 17, 33, 63] {
        buf.fill(0);
        copy_parallel(&src, &mut buf[offset..offset + len]);
        assert!(buf[offset..offset + len] == src[..], "offset {offset}");
        assert!(
            buf[..offset].iter().all(|b| *b == 0),
            "offset {offset}: before"
        );
        assert!(
            buf[offset + len..].iter().all(|b| *b == 0),
            "offset {offset}: after"
        );
    }
    let mut small_dst = [0u8; 5];
    copy_parallel(&src[..5], &mut small_dst);
    assert_eq!(small_dst, src[..5]);
}

// ---------------------------------------------------------------------------------------------
// Properties.
// ---------------------------------------------------------------------------------------------

/// Small legal geometries: (heads, head_dim, hidden, conv_kernel, gate_rank, qk_multiple), with
/// head_dim and the multiple chosen so the q|k rule holds at every TP dividing the heads.
fn legal_geometry() -> impl Strategy<Value = (usize, usize, usize, usize, usize, usize)> {
    prop_oneof![
        (
            1usize..=12,
            1usize..=9,
            1usize..=5,
            1usize..=4,
            1usize..=3,
            prop_oneof![Just(1usize), Just(2usize)]
        ),
        // 128 channels per head keeps 2 * local_heads * 128 a multiple of 256.
        (
            1usize..=8,
            Just(128usize),
            1usize..=3,
            1usize..=4,
            1usize..=3,
            Just(256usize)
        ),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// For every TP size dividing the heads: row slices concatenate to the full tensor in rank
    /// order, column slices interleave back row by row, replicated tensors come back whole, and
    /// every shard is `local_bytes` long.
    #[test]
    fn shards_reassemble_the_full_tensor(
        (heads, head_dim, hidden, kernel, gate, qk) in legal_geometry(),
        seed in any::<u64>(),
        f32_everything in any::<bool>(),
    ) {
        let dtypes = if f32_everything {
            crate::plan::TENSOR_NAMES.iter().map(|n| (n.to_string(), Dtype::F32)).collect()
        } else {
            Vec::new()
        };
        let o = PlanOptions { qk_multiple: qk, dtypes, ..PlanOptions::default() };
        for tp in (1..=heads).filter(|tp| heads % tp == 0) {
            let plans: Vec<KdaTpPlan> = (0..tp)
                .map(|r| KdaTpPlan::with_options(r, tp, hidden, head_dim, heads, kernel, gate, &o).unwrap())
                .collect();
            for i in 0..plans[0].tensors.len() {
                let t0 = &plans[0].tensors[i];
                let full = noise(t0.full_bytes(), seed ^ i as u64);
                let shards: Vec<Vec<u8>> = plans
                    .iter()
                    .map(|p| shard_bytes(&p.tensors[i], &full).unwrap().into_owned())
                    .collect();
                for (p, s) in plans.iter().zip(&shards) {
                    prop_assert_eq!(s.len(), p.tensors[i].local_bytes());
                }
                match t0.kind {
                    KdaShard::Replicated => {
                        for s in &shards {
                            prop_assert!(s == &full);
                        }
                    }
                    KdaShard::HeadRows | KdaShard::ChannelRows => {
                        // Disjoint and ordered: each range starts where the previous ended.
                        let ranges: Vec<_> = plans.iter().map(|p| row_byte_range(&p.tensors[i]).unwrap()).collect();
                        prop_assert_eq!(ranges[0].start, 0);
                        prop_assert_eq!(ranges[tp - 1].end, full.len());
                        for w in ranges.windows(2) {
                            prop_assert_eq!(w[0].end, w[1].start);
                        }
                        prop_assert!(shards.concat() == full, "{} tp {}", t0.name, tp);
                    }
                    KdaShard::ChannelCols => {
                        prop_assert_eq!(row_byte_range(t0), None);
                        let width = t0.local_row_elems * t0.elem_bytes;
                        let mut rebuilt = Vec::with_capacity(full.len());
                        for r in 0..t0.full_rows {
                            for s in &shards {
                                rebuilt.extend_from_slice(&s[r * width..(r + 1) * width]);
                            }
                        }
                        prop_assert!(rebuilt == full, "{} tp {}", t0.name, tp);
                    }
                }
                // gather_cols agrees with shard_bytes for every kind.
                for (p, s) in plans.iter().zip(&shards) {
                    let mut out = vec![0u8; s.len()];
                    gather_cols(&p.tensors[i], &full, &mut out).unwrap();
                    prop_assert!(&out == s, "{} gather", t0.name);
                }
            }
            if tp == 1 {
                for t in &plans[0].tensors {
                    let full = noise(t.full_bytes(), seed);
                    prop_assert!(shard_bytes(t, &full).unwrap()[..] == full[..], "{} tp1", t.name);
                }
            }
        }
    }

    /// Any buffer length other than the full size is refused with BufferSize, never a panic.
    #[test]
    fn wrong_lengths_are_refused(len in 0usize..5000, rank in 0usize..2) {
        let p = small(rank);
        for t in &p.tensors {
            let buf = vec![0u8; len];
            let r = shard_bytes(t, &buf);
            if len == t.full_bytes() {
                prop_assert_eq!(r.unwrap().len(), t.local_bytes());
            } else {
                prop_assert!(matches!(r, Err(Error::BufferSize { .. })), "{} len {}", t.name, len);
            }
        }
    }
}
