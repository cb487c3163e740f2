//! Kimi-Linear at TP=8, rank 3: on-disk shapes, sharded axes, local shapes.

use super::*;

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
