//! The only module with `unsafe` code: a shared, writable memory mapping of one segment file (and
//! `prefetch`, a cache hint for reads of it).
//!
//! The mapping is split in two regions with different rules:
//!
//! * the **header** `[0, SEGMENT_HEADER_LEN)`: read and written only while holding `header_lock`, by copy;
//! * the **data** `[SEGMENT_HEADER_LEN, len)`: a prefix `[SEGMENT_HEADER_LEN, published)` that readers on any thread
//!   may borrow, and a suffix `[published, len)` that only the one [`DataWriter`] may touch.
//!
//! Soundness rests on three invariants, each kept by this module alone:
//!
//! 1. **Disjointness.** At most one `DataWriter` exists per mapping (`writer_taken`), and it only
//!    hands out `&mut` slices of `[published, len)`. Readers only get `&` slices of
//!    `[SEGMENT_HEADER_LEN, published)`. The two never overlap, so no byte is read and written at once.
//! 2. **Immutability after publication.** `published` only grows (`DataWriter::publish` asserts
//!    it), so a byte a reader may see never changes again for the life of the mapping.
//! 3. **Happens-before.** The writer stores `published` with `Release` after writing the bytes;
//!    readers load it with `Acquire` before reading, so they see every byte below it.
//!
//! A read-only mapping (`new_read_only`) is of a sealed segment, or of a file that another
//! process may still be writing: the offline tools beside a running server. Invariant 2 does
//! not hold for the second beyond the other writer's end, which this process cannot know; such
//! bytes are only ever taken as a frame once its checksum holds, and a frame that reads as
//! damaged there is read again before it is judged (`recovery::scan_beside_writer`).
//!
//! Access through the mapping never faults for lack of disk space. A segment file has its full
//! length before it is mapped and is never shrunk while mapped, so no access lies past its end.
//! Its disk blocks are reserved as the writer needs them (`fallocate`, `Segment::allocate`), not
//! all at once, so that a log takes the disk its records take: reads of a hole see zeros, and
//! writes, which would need a block the disk may not have, go only where blocks are reserved —
//! the writer's slice ends at `allocated`, and `DataWriter::zero` leaves pages of zeros (holes,
//! perhaps) alone.

use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use memmap2::{MmapOptions, MmapRaw};

/// Bytes at the start of every segment reserved for its header.
pub(crate) const SEGMENT_HEADER_LEN: usize = 64;

pub(crate) struct Mapping {
    raw: MmapRaw,
    len: usize,
    published: AtomicUsize,
    /// End of the bytes whose disk blocks are reserved (see the module comment).
    allocated: AtomicUsize,
    writer_taken: AtomicBool,
    writable: bool,
    header_lock: Mutex<()>,
}

// SAFETY: all shared access to the mapped bytes follows the invariants in the module comment;
// the raw pointer itself is valid for the whole life of `raw`.
unsafe impl Send for Mapping {}
// SAFETY: shared references only read published bytes (invariants 1–3) or touch the header
// under `header_lock`; the one writer of unpublished bytes holds the `DataWriter`.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps the whole of `file`, which must be at least `SEGMENT_HEADER_LEN` bytes and already allocated
    /// on disk. Nothing is published yet; the data region is reachable only through `writer()`
    /// until `DataWriter::publish`.
    pub(crate) fn new(file: &File, len: usize) -> io::Result<Mapping> {
        assert!(len >= SEGMENT_HEADER_LEN, "segment shorter than its header");
        let raw = MmapOptions::new().len(len).map_raw(file)?;
        Ok(Mapping {
            raw,
            len,
            published: AtomicUsize::new(SEGMENT_HEADER_LEN),
            allocated: AtomicUsize::new(SEGMENT_HEADER_LEN),
            writer_taken: AtomicBool::new(false),
            writable: true,
            header_lock: Mutex::new(()),
        })
    }

    /// Maps `file` read-only with `[SEGMENT_HEADER_LEN, published)` published: for sealed segments and
    /// offline tools. There is no writer and the header cannot be written.
    pub(crate) fn new_read_only(file: &File, len: usize, published: usize) -> io::Result<Mapping> {
        assert!(len >= SEGMENT_HEADER_LEN, "segment shorter than its header");
        assert!((SEGMENT_HEADER_LEN..=len).contains(&published), "published end out of range");
        let raw = MmapOptions::new().len(len).map_raw_read_only(file)?;
        Ok(Mapping {
            raw,
            len,
            published: AtomicUsize::new(published),
            allocated: AtomicUsize::new(SEGMENT_HEADER_LEN),
            writer_taken: AtomicBool::new(true),
            writable: false,
            header_lock: Mutex::new(()),
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn is_writable(&self) -> bool {
        self.writable
    }

    /// End of the bytes whose disk blocks are reserved: the writer writes below it only.
    pub(crate) fn allocated(&self) -> usize {
        self.allocated.load(Ordering::Acquire)
    }

    /// Records that the file's blocks below `end` are reserved (after a successful `fallocate`
    /// of them, or for bytes already written), so the writer may write there.
    pub(crate) fn set_allocated(&self, end: usize) {
        assert!(end <= self.len, "allocation past the mapping");
        self.allocated.fetch_max(end, Ordering::Release);
    }

    /// End of the published data region (`SEGMENT_HEADER_LEN` when nothing is published).
    pub(crate) fn published_end(&self) -> usize {
        self.published.load(Ordering::Acquire)
    }

    /// The published data region, addressed by file position.
    pub(crate) fn published(&self) -> Published<'_> {
        let end = self.published.load(Ordering::Acquire);
        // SAFETY: [SEGMENT_HEADER_LEN, end) is published: by invariants 1–3 no one writes it any more
        // and its contents are visible to this thread. `end <= len` (asserted in `publish`).
        let data =
            unsafe { std::slice::from_raw_parts(self.raw.as_ptr().add(SEGMENT_HEADER_LEN), end - SEGMENT_HEADER_LEN) };
        Published { data }
    }

    /// Takes the single data writer of this mapping; `None` if it was already taken.
    pub(crate) fn writer(self: &Arc<Self>) -> Option<DataWriter> {
        if self.writer_taken.swap(true, Ordering::AcqRel) {
            return None;
        }
        Some(DataWriter { map: Arc::clone(self) })
    }

    pub(crate) fn read_header(&self) -> [u8; SEGMENT_HEADER_LEN] {
        let _guard = self.header_lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = [0u8; SEGMENT_HEADER_LEN];
        // SAFETY: the header is only touched under `header_lock`, which we hold.
        unsafe { std::ptr::copy_nonoverlapping(self.raw.as_ptr(), out.as_mut_ptr(), SEGMENT_HEADER_LEN) };
        out
    }

    pub(crate) fn write_header(&self, header: &[u8; SEGMENT_HEADER_LEN]) {
        assert!(self.writable, "header write to a read-only mapping");
        let _guard = self.header_lock.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the header is only touched under `header_lock`, which we hold.
        unsafe { std::ptr::copy_nonoverlapping(header.as_ptr(), self.raw.as_mut_ptr(), SEGMENT_HEADER_LEN) };
    }

    /// `write_header` for a segment just made, faulting in its first page alone: a fault on a
    /// file mapping reads ahead around it, which for fallocated (unwritten) extents allocates
    /// and zeroes up to 128 KiB of page cache — a server's whole first segment of a queue — for
    /// 64 bytes. Advice only: errors are ignored.
    pub(crate) fn write_first_header(&self, header: &[u8; SEGMENT_HEADER_LEN]) {
        let _ = self.raw.advise_range(memmap2::Advice::Random, 0, SEGMENT_HEADER_LEN);
        self.write_header(header);
        let _ = self.raw.advise_range(memmap2::Advice::Normal, 0, SEGMENT_HEADER_LEN);
    }

    /// Makes everything written to the file through any mapping durable: `msync(MS_SYNC)`, which
    /// on Linux writes the dirty pages and syncs the file's data as `fdatasync` does, with no
    /// descriptor needed (the mapping holds the file).
    pub(crate) fn sync(&self) -> io::Result<()> {
        self.raw.flush()
    }

    /// Asks the kernel to fault in `[from, to)` of the data region writable ahead of the writer,
    /// so appends do not stop on page faults. Advice only: errors are ignored.
    pub(crate) fn prefault_write(&self, from: usize, to: usize) {
        let page = 4096;
        let from = from / page * page;
        // Only where blocks are reserved: a write fault on a hole would take disk space that the
        // writer has not asked for (and that a full disk may not have).
        let to = to.min(self.allocated());
        if !self.writable || from >= to {
            return;
        }
        // SAFETY: MADV_POPULATE_WRITE does not change the contents of the mapping (it faults in
        // pages as if written with their current contents), so it cannot race with readers or
        // the writer; the range lies within the mapping.
        unsafe {
            let _ = rustix::mm::madvise(
                self.raw.as_mut_ptr().add(from).cast(),
                to - from,
                rustix::mm::Advice::LinuxPopulateWrite,
            );
        }
    }
}

/// Asks the CPU to start loading the cache line holding `at`, so that the misses of many random
/// reads overlap instead of following one another.
#[inline]
pub(crate) fn prefetch<T>(at: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint: it never faults and changes nothing the program can observe,
    // and `at` is a live reference besides.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>((at as *const T).cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}

/// The published frames of a segment, indexed by file position.
#[derive(Clone, Copy)]
pub(crate) struct Published<'a> {
    data: &'a [u8],
}

impl<'a> Published<'a> {
    /// File position one past the last published byte.
    pub(crate) fn end(&self) -> usize {
        SEGMENT_HEADER_LEN + self.data.len()
    }

    /// The published bytes from file position `pos` (must be `>= SEGMENT_HEADER_LEN`) to the end.
    pub(crate) fn from(&self, pos: usize) -> &'a [u8] {
        &self.data[pos - SEGMENT_HEADER_LEN..]
    }

    /// Asks the CPU to start loading the cache line at file position `pos` (published).
    #[inline]
    pub(crate) fn prefetch(&self, pos: usize) {
        prefetch(&self.data[pos - SEGMENT_HEADER_LEN]);
    }
}

/// Exclusive access to the unpublished data region of one mapping.
pub(crate) struct DataWriter {
    map: Arc<Mapping>,
}

impl DataWriter {
    /// File position where the unpublished region starts.
    pub(crate) fn published_end(&self) -> usize {
        self.map.published.load(Ordering::Relaxed)
    }

    /// The unpublished region with reserved blocks, `[published, allocated)`, as a slice
    /// starting at file position `published_end()`.
    pub(crate) fn unpublished_mut(&mut self) -> &mut [u8] {
        let start = self.map.published.load(Ordering::Relaxed);
        let end = self.map.allocated().max(start);
        // SAFETY: invariant 1 — this is the only DataWriter, `&mut self` prevents two live
        // slices from it, and readers never look at or past `published`. `end <= len`
        // (`set_allocated`).
        unsafe { std::slice::from_raw_parts_mut(self.map.raw.as_mut_ptr().add(start), end - start) }
    }

    /// The whole unpublished region `[published, len)`, to read (recovery's scan of what a
    /// crash left), as a slice starting at file position `published_end()`.
    pub(crate) fn unpublished(&self) -> &[u8] {
        let start = self.map.published.load(Ordering::Relaxed);
        // SAFETY: invariant 1 — only this DataWriter writes there, and it cannot while this
        // shared borrow of it lives.
        unsafe { std::slice::from_raw_parts(self.map.raw.as_ptr().add(start), self.map.len - start) }
    }

    /// Zeroes `[from, to)` of the unpublished region (positions relative to `published_end()`,
    /// as `unpublished` gives them), skipping the pages that already read as zeros: those may be
    /// holes, and writing them would take disk blocks a full disk may not have.
    pub(crate) fn zero(&mut self, from: usize, to: usize) {
        const PAGE: usize = 4096;
        let start = self.map.published.load(Ordering::Relaxed);
        assert!(from <= to && start + to <= self.map.len, "zeroing out of range");
        // Back to front, a page at a time: a process killed meanwhile leaves the range's front as
        // it was (a torn tail, or frames of a batch that did not finish, which the next open cuts
        // again), never zeros before frames left whole, which would read as corruption.
        let mut end = to;
        while end > from {
            let at = (((start + end - 1) / PAGE) * PAGE).saturating_sub(start).max(from);
            // SAFETY: as `unpublished_mut`, for `[start + at, start + end)`, inside the mapping
            // (asserted above). It is written only if it holds data, whose blocks are reserved.
            let bytes = unsafe { std::slice::from_raw_parts_mut(self.map.raw.as_mut_ptr().add(start + at), end - at) };
            if bytes.iter().any(|&b| b != 0) {
                // Back to front within the page too, with volatile writes: plain ones may be
                // merged into a forward fill.
                for byte in bytes.iter_mut().rev() {
                    // SAFETY: `byte` is a valid, exclusive reference into the slice above.
                    unsafe { std::ptr::write_volatile(byte, 0) };
                }
            }
            end = at;
        }
    }

    /// Stops writes at `end` and above (not below the published end), before their blocks are
    /// given back (`Segment::release_unwritten`): the writer must reserve them again first.
    pub(crate) fn unallocate_from(&mut self, end: usize) {
        let end = end.max(self.published_end());
        self.map.allocated.fetch_min(end, Ordering::Release);
    }

    /// Makes `[published, end)` visible to readers, for good.
    pub(crate) fn publish(&mut self, end: usize) {
        let current = self.map.published.load(Ordering::Relaxed);
        assert!(end >= current && end <= self.map.len, "publish out of range");
        self.map.published.store(end, Ordering::Release);
    }
}

/// Maps a small private file (a consumer group's cursor) for reading and writing through a plain
/// `&mut [u8]`.
///
/// The returned `MmapMut` is an ordinary exclusive slice; the one thing the compiler cannot check
/// is that nobody else writes the file while it is mapped. That holds because cursor files are
/// written only by the process holding the log directory's lock, through the one open handle of
/// that group (the group registry refuses a second), and offline tools only read them.
/// `len` is the file's length, as the caller checked or wrote it.
pub(crate) fn map_private_file(file: &File, len: usize) -> io::Result<memmap2::MmapMut> {
    // SAFETY: see above — no other writer exists while the mapping lives, and the file is never
    // truncated while mapped (its length is fixed when it is created, and is `len`).
    unsafe { MmapOptions::new().len(len).map_mut(file) }
}

impl Mapping {
    /// Drops this process's page-table entries for the whole mapping, so its pages stop counting
    /// toward resident memory; the next access faults them back in from the page cache (or the
    /// disk). The data is untouched: for a shared file mapping, dirty pages stay dirty in the
    /// page cache and are written back as usual.
    pub(crate) fn release_pages(&self) {
        // SAFETY: MADV_DONTNEED on a MAP_SHARED file mapping does not change what the mapping
        // reads (the page cache is the truth), so it cannot race with readers or the writer; the
        // range is exactly the mapping.
        unsafe {
            let _ = rustix::mm::madvise(self.raw.as_mut_ptr().cast(), self.len, rustix::mm::Advice::LinuxDontNeed);
        }
    }
}
