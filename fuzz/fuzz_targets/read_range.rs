//! `Checkpoint::read_range` with arbitrary arguments on a fixed valid file, on both backends:
//! never a panic; both backends accept or refuse alike; an accepted range is the tensor's bytes
//! `[start, min(stop, len))`.
#![no_main]

#[path = "fixture.rs"]
mod fixture;

use fixture::{opened, tensor_bytes, Size, NAMES};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (u8, Size, Size)| {
    let (which, start, stop) = input;
    let name = NAMES[usize::from(which) % NAMES.len()];
    let part = start.get()..stop.get();
    let [mapped, copied] = opened();
    match (
        mapped.read_range(name, part.clone()),
        copied.read_range(name, part.clone()),
    ) {
        (Ok(m), Ok(c)) => {
            let bytes = tensor_bytes(name);
            let want = &bytes[part.start..part.end.min(bytes.len())];
            assert_eq!(m.as_slice(), want, "{name} {part:?}");
            assert_eq!(c.as_slice(), want, "{name} {part:?}");
        }
        (Err(m), Err(c)) => assert_eq!(m.to_string(), c.to_string(), "backends disagree"),
        (m, c) => panic!(
            "backends disagree on {name} {part:?}: {:?} {:?}",
            m.is_ok(),
            c.is_ok()
        ),
    }
});
