//! An exact digest of a byte buffer: XXH3-128 over fixed chunks hashed in parallel.
//!
//! The guard keeps one digest per region of a parameter it judges (`kda_tp.guard`): before an
//! update for the regions that were not fed, after their full verification for those that were,
//! and again at the session's close. Every byte is read; nothing is sampled.
//!
//! The buffer is split into [`CHUNK_BYTES`] chunks (the last one shorter); each chunk's
//! XXH3-128 is computed on rayon's pool, and the digest is the XXH3-128 of the buffer's length
//! followed by the chunk digests in order. The chunk size is fixed, so the digest depends only
//! on the bytes, never on the number of threads; chunks in another order give another digest.
//!
//! XXH3 is not a cryptographic hash: it tells regions apart that differ by accident (a missed
//! or misplaced write, a wrong rank's rows), which is what the guard judges, not regions made
//! by an adversary to collide. Two different buffers share a 128-bit digest with probability
//! about 2^-128 per comparison.

use rayon::prelude::*;
use xxhash_rust::xxh3::xxh3_128;

/// Bytes per chunk hashed by one task: large enough to amortise scheduling, small enough
/// that a few MiB spread over every core.
pub const CHUNK_BYTES: usize = 1 << 20;

/// Bytes of one digest.
pub const DIGEST_BYTES: usize = 16;

/// The digest of `data` (see the module docs): XXH3-128 of the length and the in-order chunk
/// digests, big-endian, computed on the current rayon pool.
#[must_use]
pub fn digest(data: &[u8]) -> [u8; DIGEST_BYTES] {
    let chunks: Vec<[u8; DIGEST_BYTES]> = if data.len() <= CHUNK_BYTES {
        vec![xxh3_128(data).to_be_bytes()]
    } else {
        data.par_chunks(CHUNK_BYTES)
            .map(|chunk| xxh3_128(chunk).to_be_bytes())
            .collect()
    };
    combine(data.len(), &chunks)
}

/// The digest of `data` (as [`digest`] gives it) when `data` and `expected` hold the same
/// bytes, in one pass over both (each chunk compared, then hashed while it is in cache); `None`
/// when they differ anywhere (lengths included). The guard's verification of a fed region: a
/// region that holds exactly what was fed keeps this digest without a second read.
#[must_use]
pub fn digest_if_equal(data: &[u8], expected: &[u8]) -> Option<[u8; DIGEST_BYTES]> {
    if data.len() != expected.len() {
        return None;
    }
    let one =
        |(chunk, want): (&[u8], &[u8])| (chunk == want).then(|| xxh3_128(chunk).to_be_bytes());
    let chunks: Option<Vec<[u8; DIGEST_BYTES]>> = if data.len() <= CHUNK_BYTES {
        one((data, expected)).map(|d| vec![d])
    } else {
        data.par_chunks(CHUNK_BYTES)
            .zip(expected.par_chunks(CHUNK_BYTES))
            .map(one)
            .collect()
    };
    chunks.map(|chunks| combine(data.len(), &chunks))
}

/// The XXH3-128 of `len` (8 bytes, little-endian) followed by `chunks` in order.
fn combine(len: usize, chunks: &[[u8; DIGEST_BYTES]]) -> [u8; DIGEST_BYTES] {
    let mut joined = Vec::with_capacity(8 + chunks.len() * DIGEST_BYTES);
    joined.extend_from_slice(&(len as u64).to_le_bytes());
    for chunk in chunks {
        joined.extend_from_slice(chunk);
    }
    xxh3_128(&joined).to_be_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `len` bytes of a fixed pseudo-random pattern.
    fn bytes(len: usize) -> Vec<u8> {
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state.to_le_bytes()[0]
            })
            .collect()
    }

    /// The digest computed chunk by chunk on this thread, for comparison.
    fn sequential(data: &[u8]) -> [u8; DIGEST_BYTES] {
        let chunks: Vec<_> = data
            .chunks(CHUNK_BYTES)
            .map(|c| xxh3_128(c).to_be_bytes())
            .collect();
        let chunks = if chunks.is_empty() {
            vec![xxh3_128(&[]).to_be_bytes()]
        } else {
            chunks
        };
        combine(data.len(), &chunks)
    }

    #[test]
    fn same_bytes_give_the_same_digest() {
        for len in [
            0,
            1,
            4095,
            CHUNK_BYTES,
            CHUNK_BYTES + 1,
            5 * CHUNK_BYTES + 17,
        ] {
            let data = bytes(len);
            assert_eq!(digest(&data), digest(&data.clone()), "len {len}");
            assert_eq!(digest(&data), sequential(&data), "len {len}");
        }
    }

    #[test]
    fn any_one_byte_changed_changes_the_digest() {
        let data = bytes(3 * CHUNK_BYTES + 100);
        let base = digest(&data);
        for at in [
            0,
            1,
            CHUNK_BYTES - 1,
            CHUNK_BYTES,
            2 * CHUNK_BYTES + 5,
            data.len() - 1,
        ] {
            for flip in [1u8, 0x80] {
                let mut changed = data.clone();
                changed[at] ^= flip;
                assert_ne!(digest(&changed), base, "byte {at} xor {flip:#x}");
            }
        }
    }

    #[test]
    fn two_chunks_swapped_change_the_digest() {
        let data = bytes(4 * CHUNK_BYTES);
        let mut swapped = data.clone();
        let (first, rest) = swapped.split_at_mut(CHUNK_BYTES);
        first.swap_with_slice(&mut rest[2 * CHUNK_BYTES..3 * CHUNK_BYTES]);
        assert_ne!(digest(&swapped), digest(&data));
    }

    #[test]
    fn a_prefix_or_a_zero_extension_changes_the_digest() {
        let data = vec![0u8; 2 * CHUNK_BYTES];
        assert_ne!(digest(&data[..CHUNK_BYTES]), digest(&data));
        assert_ne!(digest(&data[..0]), digest(&data[..1]));
    }

    #[test]
    fn digest_if_equal_is_the_digest_or_none() {
        for len in [0, 5, CHUNK_BYTES, 3 * CHUNK_BYTES + 9] {
            let data = bytes(len);
            assert_eq!(
                digest_if_equal(&data, &data.clone()),
                Some(digest(&data)),
                "len {len}"
            );
            if len > 0 {
                let mut other = data.clone();
                other[len - 1] ^= 1;
                assert_eq!(digest_if_equal(&data, &other), None, "len {len}");
                assert_eq!(digest_if_equal(&data, &data[..len - 1]), None, "len {len}");
            }
        }
    }

    #[test]
    fn the_digest_does_not_depend_on_the_thread_count() {
        let data = bytes(7 * CHUNK_BYTES + 3);
        let want = sequential(&data);
        for threads in [1, 2, 3, 8] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("a rayon pool");
            assert_eq!(pool.install(|| digest(&data)), want, "{threads} threads");
        }
    }
}
