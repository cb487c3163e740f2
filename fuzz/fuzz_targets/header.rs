//! Header parsing from memory: the input is a whole safetensors file (8-byte header length, JSON
//! header, data). `parse_header` must never panic; when it accepts, every tensor's byte range must
//! lie inside the data section, back to back, covering it exactly.
#![no_main]

use std::path::Path;

use kda_tp::checkpoint::parse_header;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|file: &[u8]| {
    if file.len() < 8 {
        return;
    }
    let header_len = u64::from_le_bytes(file[..8].try_into().unwrap_or_default());
    let Ok(header_len) = usize::try_from(header_len) else {
        return;
    };
    if header_len > file.len() - 8 {
        return;
    }
    let header = &file[8..8 + header_len];
    let data = &file[8 + header_len..];
    let Ok(metadata) = parse_header(Path::new("fuzz.safetensors"), header, data.len() as u64)
    else {
        return;
    };
    let mut end = 0;
    for name in metadata.offset_keys() {
        let info = metadata.info(&name).expect("offset_keys names a tensor");
        let (b, e) = info.data_offsets;
        assert_eq!(b, end, "{name}: not back to back");
        assert!(
            e >= b && e <= data.len(),
            "{name}: [{b}, {e}) outside {}",
            data.len()
        );
        let elems: usize = info.shape.iter().product();
        assert_eq!(elems * info.dtype.bitsize(), (e - b) * 8, "{name}: size");
        let _bytes = &data[b..e];
        end = e;
    }
    assert_eq!(end, data.len(), "the tensors must cover the data section");
});
