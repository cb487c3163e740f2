//! Files that change while they are open: truncated, rewritten in place (the same inode), given
//! a new mtime, or replaced by rename. A view never reads a file that changed since it was
//! opened, on either backend and through every read path (`read`, `read_range`, `read_spans`,
//! `file_range`); a file replaced by rename still reads its old, unchanged bytes.

use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, SystemTime};

use super::*;

/// The three tensors of `three_tensor_file` with their header padded by `pad` spaces (the same
/// tensors at data offsets `pad` bytes further into the file).
fn padded_three_tensors(bytes: &[u8], pad: usize) -> Vec<u8> {
    let mut h = header_for(&[
        ("z", "F32", &[2, 3]),
        ("a", "BF16", &[4]),
        ("m", "U8", &[5]),
    ]);
    h["__metadata__"] = json!({"format": "pt", "origin": "kda_tp test"});
    let text = h.to_string();
    let padded = format!("{text:<width$}", width = text.len() + pad);
    st_raw(padded.as_bytes(), bytes)
}

/// Rewrites `path` in place: the same inode, truncated on open (O_TRUNC), then `contents`.
fn rewrite_in_place(path: &Path, contents: &[u8]) {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)
        .unwrap();
    f.write_all(contents).unwrap();
    f.sync_all().unwrap();
}

/// Waits (for a state, not a time) until a change made now gets a later ctime than `opened`'s,
/// on file systems whose timestamps are coarse (since Linux 6.13 the first change after an
/// `fstat` always does).
fn wait_for_a_later_ctime(dir: &TempDir, opened: &std::fs::Metadata) {
    let probe = dir.path().join("probe");
    loop {
        std::fs::write(&probe, b"x").unwrap();
        let p = std::fs::metadata(&probe).unwrap();
        if (p.ctime(), p.ctime_nsec()) > (opened.ctime(), opened.ctime_nsec()) {
            return;
        }
    }
}

/// The refusal's reason, checked to name the file, the tensor and the change.
fn changed_reason<T>(result: Result<T>, path: &Path, name: &str, context: &str) -> String {
    match result {
        Err(Error::Checkpoint { path: p, reason }) => {
            assert_eq!(p, path, "{context}");
            assert_contains(&reason, &format!("tensor {name:?} cannot be"));
            assert_contains(&reason, "the file changed since it was opened (");
            assert_contains(&reason, "reopen it");
            reason
        }
        Err(e) => panic!("{context}: {e:?}"),
        Ok(_) => panic!("{context}: read a file that changed since it was opened"),
    }
}

#[test]
fn a_file_rewritten_in_place_with_a_longer_header_is_refused_on_every_read_path() {
    let dir = TempDir::new("rewritten");
    for backend in BACKENDS {
        let (path, bytes) = three_tensor_file(&dir, "m.safetensors", 3);
        let before = std::fs::metadata(&path).unwrap();
        let f = SafetensorsFile::open(&path, backend).unwrap();
        let ckpt = Checkpoint::open(&path, backend).unwrap();
        // The same tensors, 16 bytes further on: read at the old offsets, `z` would be 16 bytes
        // of header and 8 of its own data.
        rewrite_in_place(&path, &padded_three_tensors(&bytes, 16));
        let after = std::fs::metadata(&path).unwrap();
        assert_eq!(
            after.ino(),
            before.ino(),
            "rewritten in place, not replaced"
        );
        let (old, new) = (before.len(), after.len());
        assert_eq!(new, old + 16);
        let context = format!("{backend:?}");
        for name in ["z", "a", "m"] {
            let reason = changed_reason(f.read(name), &path, name, &context);
            assert_contains(&reason, &format!("size {old} -> {new} bytes, mtime "));
            changed_reason(f.read_range(name, 1..3), &path, name, &context);
            changed_reason(ckpt.read(name), &path, name, &context);
            changed_reason(ckpt.read_range(name, 0..2), &path, name, &context);
            changed_reason(f.file_range(name, 0..usize::MAX), &path, name, &context);
        }
        // Strided spans (several reads of a column block), and the contiguous case.
        changed_reason(f.read_spans("z", 0, 4, 12, 2), &path, "z", &context);
        changed_reason(f.read_spans("z", 0, 12, 12, 2), &path, "z", &context);
        // A view opened now reads the new file.
        let fresh = SafetensorsFile::open(&path, backend).unwrap();
        assert_eq!(fresh.read("z").unwrap().as_slice(), &bytes[..24]);
    }
}

#[test]
fn a_file_truncated_after_open_is_refused_on_both_backends() {
    let dir = TempDir::new("truncated-later");
    for backend in BACKENDS {
        let (path, _) = three_tensor_file(&dir, "m.safetensors", 1);
        let f = SafetensorsFile::open(&path, backend).unwrap();
        let len = std::fs::metadata(&path).unwrap().len();
        // Cut inside `a`: even `z`, whose bytes are all still there, is refused (the file is no
        // longer the one whose header was read).
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(len - 5 - 3)
            .unwrap();
        for name in ["z", "a", "m"] {
            let reason = changed_reason(f.read(name), &path, name, &format!("{backend:?}"));
            assert_contains(
                &reason,
                &format!("size {len} -> {} bytes (truncated while open)", len - 8),
            );
        }
    }
}

#[test]
fn a_rewrite_to_the_same_size_is_refused_by_its_mtime() {
    let dir = TempDir::new("same-size");
    let t0 = SystemTime::UNIX_EPOCH + Duration::new(1_700_000_000, 123_456_789);
    for backend in BACKENDS {
        let (path, bytes) = three_tensor_file(&dir, "m.safetensors", 5);
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(t0)
            .unwrap();
        let f = SafetensorsFile::open(&path, backend).unwrap();
        assert_eq!(f.read("a").unwrap().as_slice(), &bytes[24..32]);
        // Other bytes, the same length, written in place; the mtime set one second on (as a
        // copy that keeps timestamps could do, to any value but the old one).
        let mut file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        let size = file.metadata().unwrap().len();
        file.seek(SeekFrom::End(-5)).unwrap();
        file.write_all(&[9; 5]).unwrap();
        file.set_modified(t0 + Duration::from_secs(1)).unwrap();
        drop(file);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), size);
        let reason = changed_reason(f.read("m"), &path, "m", &format!("{backend:?}"));
        assert_contains(
            &reason,
            "mtime 1700000000.123456789 -> 1700000001.123456789",
        );
        assert_contains(&reason, "(seconds since the epoch)");
        assert!(!reason.contains("size "), "{reason}");
    }
}

#[test]
fn a_file_replaced_by_rename_keeps_reading_its_old_bytes() {
    let dir = TempDir::new("renamed-over");
    for backend in BACKENDS {
        let (path, bytes) = three_tensor_file(&dir, "m.safetensors", 7);
        let f = SafetensorsFile::open(&path, backend).unwrap();
        let other = dir.write("new.safetensors", &padded_three_tensors(&data(37, 99), 16));
        std::fs::rename(&other, &path).unwrap();
        // The open handle still reaches the old file, which did not change.
        assert_eq!(f.read("z").unwrap().as_slice(), &bytes[..24], "{backend:?}");
        assert_eq!(
            f.read("m").unwrap().as_slice(),
            &bytes[32..37],
            "{backend:?}"
        );
        assert!(f.file_range("a", 0..8).unwrap().is_some());
    }
}

/// A ctime that moved while the path still names the open file is refused, the link count
/// changed or not: a hard link made, or made and removed again, cannot be told from a rewrite
/// that put the old mtime back.
#[test]
fn a_hard_link_made_or_made_and_removed_is_refused() {
    let dir = TempDir::new("linked");
    for backend in BACKENDS {
        let (path, _) = three_tensor_file(&dir, "m.safetensors", 11);
        let f = SafetensorsFile::open(&path, backend).unwrap();
        let g = SafetensorsFile::open(&path, backend).unwrap();
        wait_for_a_later_ctime(&dir, &std::fs::metadata(&path).unwrap());
        let link = dir.path().join("link.safetensors");
        std::fs::hard_link(&path, &link).unwrap();
        let reason = changed_reason(f.read("a"), &path, "a", &format!("{backend:?}"));
        assert_contains(&reason, "ctime ");
        std::fs::remove_file(&link).unwrap();
        let reason = changed_reason(g.read("m"), &path, "m", &format!("{backend:?}"));
        assert_contains(&reason, "ctime ");
    }
}

/// Issue 38 F14: the same size rewritten in place, the old mtime put back and a hard link made
/// meanwhile was read as unchanged (a ctime that moved with the link count was excused).
#[test]
fn a_same_size_rewrite_with_the_mtime_restored_and_a_link_made_is_refused() {
    let dir = TempDir::new("rewrite-linked");
    let t0 = SystemTime::UNIX_EPOCH + Duration::new(1_600_000_000, 7);
    for backend in BACKENDS {
        let (path, _) = three_tensor_file(&dir, "m.safetensors", 17);
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.set_modified(t0).unwrap();
        let f = SafetensorsFile::open(&path, backend).unwrap();
        let opened = std::fs::metadata(&path).unwrap();
        wait_for_a_later_ctime(&dir, &opened);
        let mut contents = std::fs::read(&path).unwrap();
        let len = contents.len();
        contents[len - 5..].fill(0x55);
        rewrite_in_place(&path, &contents);
        file.set_modified(t0).unwrap();
        let link = dir.path().join(format!("link-{backend:?}.safetensors"));
        std::fs::hard_link(&path, &link).unwrap();
        let now = std::fs::metadata(&path).unwrap();
        assert_eq!(
            (now.len(), now.mtime_nsec(), now.ino()),
            (opened.len(), 7, opened.ino())
        );
        assert_eq!(now.nlink(), opened.nlink() + 1);
        let reason = changed_reason(f.read("m"), &path, "m", &format!("{backend:?}"));
        assert_contains(&reason, "ctime ");
        std::fs::remove_file(&link).unwrap();
    }
}

/// The ctime an unlink or a rename over the path moves is excused: the path no longer names
/// the open file (no link left, or another file there now), also when the file kept another
/// link.
#[test]
fn a_file_unlinked_or_renamed_over_keeps_reading_its_old_bytes() {
    let dir = TempDir::new("unlinked");
    for backend in BACKENDS {
        // Unlinked: no link left.
        let (path, bytes) = three_tensor_file(&dir, "m.safetensors", 19);
        let f = SafetensorsFile::open(&path, backend).unwrap();
        wait_for_a_later_ctime(&dir, &std::fs::metadata(&path).unwrap());
        std::fs::remove_file(&path).unwrap();
        assert_eq!(f.read("z").unwrap().as_slice(), &bytes[..24], "{backend:?}");
        // Renamed over while another link keeps the old file.
        let (path, bytes) = three_tensor_file(&dir, "m.safetensors", 23);
        let keep = dir.path().join(format!("keep-{backend:?}.safetensors"));
        std::fs::hard_link(&path, &keep).unwrap();
        let f = SafetensorsFile::open(&path, backend).unwrap();
        wait_for_a_later_ctime(&dir, &std::fs::metadata(&path).unwrap());
        let other = dir.write("new.safetensors", &padded_three_tensors(&data(37, 99), 16));
        std::fs::rename(&other, &path).unwrap();
        assert_eq!(
            f.read("m").unwrap().as_slice(),
            &bytes[32..37],
            "{backend:?}"
        );
        std::fs::remove_file(&keep).unwrap();
    }
}

#[test]
fn a_rewrite_that_restores_the_mtime_is_refused_by_its_ctime() {
    let dir = TempDir::new("mtime-restored");
    let t0 = SystemTime::UNIX_EPOCH + Duration::new(1_600_000_000, 5);
    for backend in BACKENDS {
        let (path, _) = three_tensor_file(&dir, "m.safetensors", 13);
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.set_modified(t0).unwrap();
        let f = SafetensorsFile::open(&path, backend).unwrap();
        let opened = std::fs::metadata(&path).unwrap();
        wait_for_a_later_ctime(&dir, &opened);
        // Other bytes of the same length, then the old mtime put back (as `touch -r` would).
        let mut contents = std::fs::read(&path).unwrap();
        let len = contents.len();
        contents[len - 5..].fill(0xAA);
        rewrite_in_place(&path, &contents);
        file.set_modified(t0).unwrap();
        let now = std::fs::metadata(&path).unwrap();
        assert_eq!((now.len(), now.mtime_nsec()), (opened.len(), 5));
        let reason = changed_reason(f.read("z"), &path, "z", &format!("{backend:?}"));
        assert_contains(&reason, "ctime ");
        assert!(!reason.contains("mtime"), "{reason}");
    }
}
