//! Hints to the kernel about the memory a large copy or gather is about to write (Linux only;
//! elsewhere they do nothing). They change how pages are faulted in, never their contents, and
//! a refusal (an old kernel, a mapping that does not support the hint) changes only the speed.

/// Faults in, writable, every page of `buf` that is not resident yet, in one
/// `madvise(MADV_POPULATE_WRITE)` per run of such pages, before a copy writes them. `buf` is
/// borrowed exclusively because it is about to be written: the hint itself writes nothing.
///
/// Fresh memory (a new mapping, or a large new array) is otherwise faulted in one 4 KiB page
/// at a time by the copy's own stores, and each fault then zeroes a page into the cache that
/// the copy's streaming stores must evict again. On the 2-vCPU VMs this project measures on,
/// populating a fresh 8-32 MiB range first cost 20-25 % less CPU time than letting the
/// stores fault it (and half as much as faulting it under streaming stores); see
/// docs/performance.md. Resident pages are left alone: `mincore` finds them (a page table
/// walk, microseconds for 32 MiB), so memory that is already in use pays nothing.
///
/// Every page touched holds a byte of `buf`, so it lies in a writable mapping of this process.
/// Populating a page does not change what it holds (a new anonymous page reads as zeros either
/// way; a file or copy-on-write page is faulted in exactly as the copy's first store would).
pub fn prefault_for_write<T>(buf: &mut [T]) {
    #[cfg(target_os = "linux")]
    linux::prefault_for_write(buf.as_mut_ptr() as usize, std::mem::size_of_val(buf));
    #[cfg(not(target_os = "linux"))]
    let _ = buf;
}

/// Asks the kernel to back the whole pages inside `buf` with transparent huge pages
/// (`MADV_HUGEPAGE`), before a gather writes them. A large new array is usually fresh memory,
/// which the gather must fault in page by page: with 2 MiB pages it faults 512x less often
/// (measured 2x faster into fresh memory on a 2-vCPU VM). Memory already in use (malloc reusing
/// its heap) is unaffected. Only pages wholly inside `buf` are advised, so no byte outside it
/// changes how it is backed; call it on memory kda_tp allocated itself, since the advice stays
/// with those pages after `buf` is handed on.
pub fn advise_huge_pages<T>(buf: &mut [T]) {
    #[cfg(target_os = "linux")]
    linux::advise_huge_pages(buf.as_mut_ptr() as usize, std::mem::size_of_val(buf));
    #[cfg(not(target_os = "linux"))]
    let _ = buf;
}

#[cfg(target_os = "linux")]
mod linux {
    /// The kernel's base page size in bytes (4096 on x86_64; 4, 16 or 64 KiB on arm64).
    fn page_size() -> usize {
        // SAFETY: sysconf has no preconditions.
        let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(size)
            .ok()
            .filter(|s| s.is_power_of_two())
            .unwrap_or(4096)
    }

    pub(super) fn prefault_for_write(addr: usize, len: usize) {
        if len == 0 {
            return;
        }
        let page = page_size();
        let start = addr / page * page;
        let Some(end) = (addr + len).checked_next_multiple_of(page) else {
            return;
        };
        let pages = (end - start) / page;
        let mut resident = vec![0u8; pages];
        // SAFETY: `start` is page-aligned, `[start, end)` covers only pages holding bytes of the
        // caller's slice (a live, writable borrow: `super::prefault_for_write`), and `resident` has one byte per page, as mincore(2) requires. mincore
        // reads page tables only.
        if unsafe {
            libc::mincore(
                start as *mut libc::c_void,
                end - start,
                resident.as_mut_ptr(),
            )
        } != 0
        {
            return;
        }
        let mut i = 0;
        while i < pages {
            if resident[i] & 1 != 0 {
                i += 1;
                continue;
            }
            let run = resident[i..].iter().take_while(|r| *r & 1 == 0).count();
            // SAFETY: a page-aligned run of pages inside `[start, end)`, each holding a byte of
            // the caller's writable slice; MADV_POPULATE_WRITE faults them in without writing to them.
            unsafe {
                libc::madvise(
                    (start + i * page) as *mut libc::c_void,
                    run * page,
                    libc::MADV_POPULATE_WRITE,
                )
            };
            i += run;
        }
    }

    pub(super) fn advise_huge_pages(addr: usize, len: usize) {
        let page = page_size();
        let start = addr.next_multiple_of(page);
        let end = (addr + len) / page * page;
        if start < end {
            // SAFETY: whole pages inside the caller's live, exclusively borrowed slice
            // (`super::advise_huge_pages`); MADV_HUGEPAGE changes no data, only how future page
            // faults in them are served.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
}

#[cfg(test)]
mod tests;
