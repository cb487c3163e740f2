//! A fixed, valid checkpoint for the read targets: written once per process to a file in
//! /dev/shm (RAM) and opened on both backends.

use std::path::PathBuf;
use std::sync::OnceLock;

use kda_tp::checkpoint::{Backend, Checkpoint};

/// `(name, dtype, shape, bytes)`: an empty tensor, a 16 x 24 byte matrix and an F32 vector,
/// back to back in this order.
const TENSORS: [(&str, &str, &[usize], usize); 3] = [
    ("e", "U8", &[0], 0),
    ("w", "U8", &[16, 24], 384),
    ("v", "F32", &[5], 20),
];

/// The tensor names the targets read; `"missing"` is in no file.
pub const NAMES: [&str; 4] = ["e", "w", "v", "missing"];

/// The fixture's data bytes: byte `i` of the data section is `i * 7 + 3` (mod 256), so every
/// tensor's bytes differ from every other's.
fn data() -> Vec<u8> {
    let total: usize = TENSORS.iter().map(|t| t.3).sum();
    (0..total).map(|i| (i * 7 + 3) as u8).collect()
}

/// The bytes of tensor `name` (empty for an unknown name).
pub fn tensor_bytes(name: &str) -> Vec<u8> {
    let all = data();
    let mut start = 0;
    for (n, _, _, len) in TENSORS {
        if n == name {
            return all[start..start + len].to_vec();
        }
        start += len;
    }
    Vec::new()
}

/// The fixture opened with mmap and with pread.
pub fn opened() -> &'static [Checkpoint; 2] {
    static OPENED: OnceLock<[Checkpoint; 2]> = OnceLock::new();
    OPENED.get_or_init(|| {
        let mut header = serde_json::Map::new();
        let mut start = 0;
        for (name, dtype, shape, len) in TENSORS {
            header.insert(
                name.to_string(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [start, start + len]}),
            );
            start += len;
        }
        let header = serde_json::Value::Object(header).to_string();
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header.as_bytes());
        file.extend(data());
        let dir = if std::path::Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let path = dir.join(format!("kda_tp_fuzz_read_{}.safetensors", std::process::id()));
        std::fs::write(&path, file).expect("the fixture is written");
        let opened = [Backend::Mmap, Backend::Pread]
            .map(|b| Checkpoint::open(&path, b).expect("the fixture is valid"));
        // The open files and the mapping keep the bytes; the name is not needed any more.
        let _ = std::fs::remove_file(&path);
        opened
    })
}

/// An offset or length as libFuzzer draws it: small (in and around the fixture's tensors), or
/// any 64-bit value (where sums and products overflow).
#[derive(Debug, arbitrary::Arbitrary)]
pub enum Size {
    Small(u16),
    Raw(u64),
}

impl Size {
    pub fn get(&self) -> usize {
        match *self {
            Size::Small(v) => usize::from(v % 512),
            Size::Raw(v) => usize::try_from(v).unwrap_or(usize::MAX),
        }
    }
}
