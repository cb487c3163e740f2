//! Properties over random geometries.

use proptest::prelude::*;

use super::*;

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
