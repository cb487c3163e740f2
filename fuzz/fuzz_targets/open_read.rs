//! The file path: the input is written to a file in /dev/shm (RAM) and opened as a checkpoint on
//! both backends; every tensor is read, its length checked against the header, mmap and pread
//! compared, and every tensor of a small fixed KDA plan applied to it with `shard_bytes`
//! (mostly refused for the length; sliced when the sizes happen to agree). Nothing may panic.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use kda_tp::checkpoint::{Backend, Checkpoint};
use kda_tp::{slice, KdaTpPlan, PlanOptions};
use libfuzzer_sys::fuzz_target;

fn scratch() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = if std::path::Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        dir.join(format!("kda_tp_fuzz_{}.safetensors", std::process::id()))
    })
}

fn plans() -> &'static Vec<KdaTpPlan> {
    static PLANS: OnceLock<Vec<KdaTpPlan>> = OnceLock::new();
    PLANS.get_or_init(|| {
        let options = PlanOptions {
            qk_multiple: 1,
            ..PlanOptions::default()
        };
        // hidden 4, head_dim 2, 2 heads, conv 2, gate 2: every tensor is a few bytes.
        (0..2)
            .map(|rank| {
                KdaTpPlan::with_options(rank, 2, 4, 2, 2, 2, 2, &options).expect("a valid plan")
            })
            .collect()
    })
}

fuzz_target!(|file: &[u8]| {
    let path = scratch();
    if std::fs::write(path, file).is_err() {
        return;
    }
    let opened = [Backend::Mmap, Backend::Pread].map(|b| Checkpoint::open(path, b));
    match &opened {
        [Ok(mapped), Ok(copied)] => {
            assert_eq!(mapped.names(), copied.names());
            for name in mapped.names() {
                let (_, info) = mapped.locate(&name).expect("a listed tensor");
                let (b, e) = info.data_offsets;
                let m = mapped.read(&name).expect("mmap read of a validated file");
                let c = copied.read(&name).expect("pread read of a validated file");
                assert_eq!(m.as_slice().len(), e - b);
                assert_eq!(m.as_slice(), c.as_slice());
                for plan in plans() {
                    for t in &plan.tensors {
                        if let Ok(local) = slice::shard_bytes(t, m.as_slice()) {
                            assert_eq!(local.len(), t.local_bytes());
                        }
                    }
                }
            }
        }
        [Err(a), Err(b)] => assert_eq!(a.to_string(), b.to_string(), "backends disagree"),
        _ => panic!("one backend opened the file and the other refused it"),
    }
});
