//! `Checkpoint::read_spans` with arbitrary arguments (end offsets that overflow included) on a
//! fixed valid file, on both backends: never a panic and never an allocation past the tensor;
//! both backends accept or refuse alike; accepted spans are the tensor's bytes, `count * span`
//! of them.
#![no_main]

#[path = "fixture.rs"]
mod fixture;

use fixture::{opened, tensor_bytes, Size, NAMES};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (u8, Size, Size, Size, Size)| {
    let (which, start, span, stride, count) = input;
    let name = NAMES[usize::from(which) % NAMES.len()];
    let (start, span, stride, count) = (start.get(), span.get(), stride.get(), count.get());
    let [mapped, copied] = opened();
    let read =
        |ckpt: &kda_tp::checkpoint::Checkpoint| ckpt.read_spans(name, start, span, stride, count);
    match (read(mapped), read(copied)) {
        (Ok(m), Ok(c)) => {
            // Empty spans may come in any number: only non-empty ones are counted out.
            let bytes = tensor_bytes(name);
            let spans = if span == 0 { 0 } else { count };
            let want: Vec<u8> = (0..spans)
                .flat_map(|i| bytes[start + i * stride..][..span].to_vec())
                .collect();
            assert_eq!(m.as_slice(), &want[..]);
            assert_eq!(c.as_slice(), &want[..]);
        }
        (Err(m), Err(c)) => assert_eq!(m.to_string(), c.to_string(), "backends disagree"),
        (m, c) => panic!(
            "backends disagree on {name} {start} {span} {stride} {count}: {:?} {:?}",
            m.is_ok(),
            c.is_ok()
        ),
    }
});
