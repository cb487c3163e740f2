//! Tests of the page hints: they fault pages in and change no byte.
#![allow(clippy::unwrap_used)]

use super::*;

#[test]
fn prefaulting_keeps_the_bytes_of_memory_in_use() {
    let mut buf: Vec<u8> = (0..(5 << 20) + 77).map(|i| (i * 31 % 251) as u8).collect();
    let want = buf.clone();
    // unaligned start and end, a zero length, and the whole buffer
    let len = buf.len();
    prefault_for_write(&mut buf[13..len - 87]);
    prefault_for_write(&mut buf[5..5]);
    prefault_for_write(&mut buf[..]);
    assert_eq!(buf, want);
}

#[test]
fn huge_page_advice_keeps_the_bytes() {
    let mut buf: Vec<u8> = (0..(6 << 20) + 3).map(|i| (i % 253) as u8).collect();
    let want = buf.clone();
    let len = buf.len();
    advise_huge_pages(&mut buf[1..len - 1]);
    assert_eq!(buf, want);
}

#[cfg(target_os = "linux")]
#[test]
fn fresh_pages_become_resident_and_read_as_zeros() {
    let len = 3 << 20;
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap();
    // SAFETY: a new private anonymous mapping, unmapped below; nothing else uses it.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    let resident = |p: *mut libc::c_void| {
        let mut v = vec![0u8; len / page];
        // SAFETY: `p` is the page-aligned mapping of `len` bytes, one byte per page in `v`.
        assert_eq!(unsafe { libc::mincore(p, len, v.as_mut_ptr()) }, 0);
        v.iter().filter(|r| *r & 1 != 0).count()
    };
    assert_eq!(resident(p), 0);
    // one page written by hand first: a run of missing pages on either side of it
    // SAFETY: inside the mapping.
    unsafe { *(p as *mut u8).add(100 * page + 5) = 7 };
    // SAFETY: inside the mapping, which nothing else uses while this borrow lives.
    prefault_for_write(unsafe {
        std::slice::from_raw_parts_mut((p as *mut std::mem::MaybeUninit<u8>).add(10), len - 20)
    });
    assert_eq!(resident(p), len / page);
    // SAFETY: the whole mapping is readable and now faulted in.
    let bytes = unsafe { std::slice::from_raw_parts(p as *const u8, len) };
    assert_eq!(bytes[100 * page + 5], 7);
    assert_eq!(bytes.iter().map(|b| usize::from(*b)).sum::<usize>(), 7);
    // SAFETY: unmaps the mapping created above; `bytes` is not used after this.
    assert_eq!(unsafe { libc::munmap(p, len) }, 0);
}
