//! CRC32C (Castagnoli), the checksum of everything the log writes: frames, segment headers,
//! cursor slots, index files. And the CRC32C of a byte range from two running checksums, without
//! reading the range again.
//!
//! The checksums come from `crc-fast`: for the frame of a small record (tens of bytes, the hot
//! case) it takes about a fifth less time than the `crc32c` crate, for a megabyte half
//! (`docs/benchmarks.md`). The tests check it against `crc32c`.
//!
//! Recovery checks many overlapping candidate frames in a damaged segment; each claims a length
//! to be checksummed, and in random bytes the claims are long (up to the segment's size). With
//! this, one pass over the segment keeps a running checksum, and each candidate costs a few
//! dozen multiplications instead of a pass over its bytes.
//!
//! CRC is linear: with `S(x)` the CRC32C of `data[base..x]`, the CRC32C of `data[a..b]` is
//! `S(b) ^ S(a) · x^(8(b-a)) mod P` (the register after `a`, carried over `b - a` bytes; the
//! initial and final inversions cancel). The `crc32c` crate's `crc32c_combine` computes the
//! same product by squaring 32×32 bit matrices, about a hundred times slower.

/// The CRC32C of `data`.
#[inline]
pub(crate) fn crc32c(data: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(data)
}

/// A CRC32C carried over consecutive slices: at any point, that of all of them so far.
pub(crate) struct Running(crc_fast::Digest);

impl Running {
    pub fn new() -> Running {
        Running(crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi))
    }

    pub fn update(&mut self, data: &[u8]) {
        self.0.update(data);
    }

    /// The CRC32C of the slices given so far.
    pub fn value(&self) -> u32 {
        self.0.finalize() as u32
    }
}

/// The Castagnoli polynomial, bit-reflected: bit 31 is the coefficient of x^0, bit 0 of x^31,
/// and x^32 is implied.
const POLY: u32 = 0x82F6_3B78;

/// `x^0` in the reflected representation.
const ONE: u32 = 1 << 31;

/// `a · b mod P`.
const fn multiply(a: u32, mut b: u32) -> u32 {
    let mut product = 0;
    let mut bit = ONE;
    while bit != 0 {
        if a & bit != 0 {
            product ^= b;
        }
        // b · x: every coefficient moves one place up; x^31's becomes x^32 = P - x^32.
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
        bit >>= 1;
    }
    product
}

/// `X_POW_2K[k] = x^(2^k) mod P`, for exponents up to 2^66 (8 × any byte count).
const X_POW_2K: [u32; 67] = {
    let mut table = [0u32; 67];
    table[0] = ONE >> 1; // x^1
    let mut k = 1;
    while k < table.len() {
        table[k] = multiply(table[k - 1], table[k - 1]);
        k += 1;
    }
    table
};

/// `x^(8 · bytes) mod P`: what carrying a register over `bytes` bytes multiplies it by.
fn x_pow_bytes(bytes: u64) -> u32 {
    let mut product = ONE;
    let mut rest = bytes;
    let mut k = 3; // 8 · bytes = bytes · 2^3
    while rest != 0 {
        if rest & 1 != 0 {
            product = multiply(X_POW_2K[k], product);
        }
        rest >>= 1;
        k += 1;
    }
    product
}

/// The CRC32C of `data[a..b]`, given `before` = CRC32C of `data[base..a]` and `through` =
/// CRC32C of `data[base..b]` for any `base <= a`, and `len = b - a`.
pub(crate) fn of_range(before: u32, through: u32, len: usize) -> u32 {
    through ^ multiply(x_pow_bytes(len as u64), before)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn the_checksum_agrees_with_the_crc32c_crate_at_every_length_and_alignment() {
        let data = bytes(5000, 3);
        for start in 0..16 {
            for len in (0..600).chain([1000, 4095, 4096, 4097, 4900]) {
                let slice = &data[start..start + len];
                assert_eq!(crc32c(slice), ::crc32c::crc32c(slice), "{len} bytes from {start}");
            }
        }
        let mut running = Running::new();
        assert_eq!(running.value(), 0);
        for (a, b) in [(0, 3), (3, 3), (3, 64), (64, 1000), (1000, 5000)] {
            running.update(&data[a..b]);
            assert_eq!(running.value(), ::crc32c::crc32c(&data[..b]), "through {b}");
        }
    }

    #[test]
    fn the_checksum_of_a_range_matches_a_direct_one() {
        let data = bytes(5000, 7);
        for (base, a, b) in [(0, 0, 0), (0, 0, 1), (0, 4, 4096), (3, 17, 4999), (100, 100, 5000), (0, 1, 2)] {
            let before = crc32c(&data[base..a]);
            let through = crc32c(&data[base..b]);
            assert_eq!(of_range(before, through, b - a), crc32c(&data[a..b]), "[{a}, {b}) from {base}");
        }
    }

    #[test]
    fn carrying_over_bytes_agrees_with_the_crate() {
        for (i, len) in [0usize, 1, 7, 8, 4095, 1 << 20, (1 << 28) + 13, (1 << 32) - 1].into_iter().enumerate() {
            let crc = 0x1234_5678u32.rotate_left(i as u32);
            assert_eq!(multiply(x_pow_bytes(len as u64), crc), ::crc32c::crc32c_combine(crc, 0, len), "{len} bytes");
        }
    }
}
