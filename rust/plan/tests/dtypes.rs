//! Dtype overrides: refused for unknown tensors and non-float dtypes, applied to element and
//! byte counts otherwise.

use super::*;

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
