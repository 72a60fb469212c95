//! One segment file: its name, its header, creation, the reservation of its disk blocks, and
//! syncing.
//!
//! ```text
//! header, 64 bytes, little-endian:
//! 0   8  magic             b"PETRELSG"
//! 8   4  format version    5 (1 to 4: segments written by earlier versions; still read)
//! 12  4  header length     64 (frames start here)
//! 16  8  base offset       offset of the first record; also in the file name
//! 24  8  segment length    the file's length (its blocks reserved as the writer reaches them)
//! 32  8  created           nanoseconds since the Unix epoch
//! 40  8  checkpoint pos    frames in [64, pos) were durable when this was written (0 = none)
//! 48  8  checkpoint offset offset of the record starting at `checkpoint pos`
//! 56  4  reserved          0
//! 60  4  crc32c            of bytes [0, 60)
//! ```

use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result, io_err};
use crate::frame::{self, Format};
use crate::mmap::{Mapping, SEGMENT_HEADER_LEN};

pub(crate) const SEGMENT_MAGIC: [u8; 8] = *b"PETRELSG";
/// The page size that reservations, holes and faults are reckoned in.
pub(crate) const PAGE: usize = 4096;
/// Bytes of a new segment reserved on disk when it is made (all of a small one).
const FIRST_ALLOCATION: usize = 4 << 20;
/// How far past its position the writer keeps its segment's disk blocks reserved, in steps of
/// `ALLOCATION_STEP`: beyond the prefault window, so the prefault thread never waits for it.
pub(crate) const ALLOCATE_AHEAD: usize = crate::prefault::WINDOW + ALLOCATION_STEP;
pub(crate) const ALLOCATION_STEP: usize = 16 << 20;
const SUFFIX: &str = ".log";
const TMP_SUFFIX: &str = ".log.tmp";

/// File name of the segment whose first record is `base`.
pub(crate) fn file_name(base: u64) -> String {
    format!("{base:020}{SUFFIX}")
}

/// The base offset in a segment file name, or `None` for other files.
pub(crate) fn parse_name(name: &str) -> Option<u64> {
    name.strip_suffix(SUFFIX).filter(|digits| is_base(digits))?.parse().ok()
}

/// A segment being made when the writer stopped (`<20 digits>.log.tmp`): nothing else in the
/// directory is taken for one.
pub(crate) fn is_leftover_tmp(name: &str) -> bool {
    name.strip_suffix(TMP_SUFFIX).is_some_and(is_base)
}

/// A base offset as file names write it: 20 digits.
fn is_base(digits: &str) -> bool {
    digits.len() == 20 && digits.bytes().all(|b| b.is_ascii_digit())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SegmentHeader {
    /// How its frames are laid out.
    pub format: Format,
    pub base_offset: u64,
    pub len: u64,
    pub created: u64,
    pub checkpoint_pos: u64,
    pub checkpoint_offset: u64,
}

impl SegmentHeader {
    pub(crate) fn encode(&self) -> [u8; SEGMENT_HEADER_LEN] {
        let mut b = [0u8; SEGMENT_HEADER_LEN];
        b[0..8].copy_from_slice(&SEGMENT_MAGIC);
        b[8..12].copy_from_slice(&self.format.version().to_le_bytes());
        b[12..16].copy_from_slice(&(SEGMENT_HEADER_LEN as u32).to_le_bytes());
        b[16..24].copy_from_slice(&self.base_offset.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b[32..40].copy_from_slice(&self.created.to_le_bytes());
        b[40..48].copy_from_slice(&self.checkpoint_pos.to_le_bytes());
        b[48..56].copy_from_slice(&self.checkpoint_offset.to_le_bytes());
        let crc = crate::checksum::crc32c(&b[0..60]);
        b[60..64].copy_from_slice(&crc.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8; SEGMENT_HEADER_LEN]) -> Result<SegmentHeader, HeaderError> {
        if b[0..8] != SEGMENT_MAGIC {
            return Err(HeaderError::Damaged("bad segment magic".into()));
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        if crate::checksum::crc32c(&b[0..60]) != u32_at(60) {
            return Err(HeaderError::Damaged("segment header CRC mismatch".into()));
        }
        // An intact header this build cannot read was written by a later one.
        let Some(format) = Format::from_version(u32_at(8)) else {
            return Err(HeaderError::Unsupported(format!("format version {}", u32_at(8))));
        };
        if u32_at(12) as usize != SEGMENT_HEADER_LEN {
            return Err(HeaderError::Unsupported(format!("header length {}", u32_at(12))));
        }
        Ok(SegmentHeader {
            format,
            base_offset: u64_at(16),
            len: u64_at(24),
            created: u64_at(32),
            checkpoint_pos: u64_at(40),
            checkpoint_offset: u64_at(48),
        })
    }

    /// Decodes the header of the segment whose file name says `base`; one that says another base
    /// is damaged (its checkpoint would name the wrong records).
    pub(crate) fn decode_for(b: &[u8; SEGMENT_HEADER_LEN], base: u64) -> Result<SegmentHeader, HeaderError> {
        let header = SegmentHeader::decode(b)?;
        if header.base_offset != base {
            let why = format!("header base offset {} does not match the file name", header.base_offset);
            return Err(HeaderError::Damaged(why));
        }
        Ok(header)
    }
}

/// Why a segment header was not taken.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum HeaderError {
    /// Its bytes are damaged: the segment can do without it (its frames say what it holds).
    Damaged(String),
    /// It is intact but of a format this build does not know: nothing in the segment can be
    /// judged, so the segment must not be opened (least of all cut as a torn tail).
    Unsupported(String),
}

impl std::fmt::Display for HeaderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HeaderError::Damaged(why) => f.write_str(why),
            HeaderError::Unsupported(what) => write!(f, "unsupported {what}"),
        }
    }
}

/// A segment file's mapping. The file itself is not kept open: the mapping holds it, and syncs
/// go through the mapping, so a log holds no descriptor per segment (a server with thousands of
/// queues would otherwise run out).
pub(crate) struct Segment {
    pub base: u64,
    /// How its frames are laid out (from its header, or judged by its frames when the header is
    /// damaged: `recovery::judge_format`).
    pub format: Format,
    pub path: PathBuf,
    pub map: Arc<Mapping>,
    /// Position after the last published frame (high 32 bits) and records published (low 32
    /// bits), stored together so a sync can checkpoint a consistent pair.
    tail: AtomicU64,
    pub index: crate::index::SparseIndex,
    /// Dense position index; dropped with the pages when the segment is released, and rebuilt
    /// by the next random read.
    positions: std::sync::Mutex<Option<Arc<crate::index::DenseIndex>>>,
    /// Readers currently positioned in this segment (its indexes stay while any is).
    pub users: std::sync::atomic::AtomicUsize,
    /// Its place in the page budget's least-recently-used order; 0 while it is not counted.
    pub lru_stamp: AtomicU64,
    /// Set when the writer replaced this segment, empty, by a larger one of the same base (its
    /// first record did not fit): readers still in it look up the segment again.
    pub replaced: std::sync::atomic::AtomicBool,
}

/// How many more times a read-only open reads a header that did not decode.
const HEADER_REREADS: usize = 3;

/// Where `Segment::create` may put its file.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Place {
    /// Under its name, in place of an empty segment there.
    Any,
    /// Under its name only if nothing is there.
    New,
}

impl Segment {
    /// Creates and maps a new segment of `len` bytes with the first `FIRST_ALLOCATION` of them
    /// (or its first page, on a nearly full disk) reserved on disk; the writer reserves the rest
    /// as it goes (`allocate`). The file appears under its final name only once sized, reserved
    /// and headed, so a crash or a full disk never leaves a half-made segment where the next
    /// open would trip on it. With `durable`, its data is synced before it takes its name. It takes the
    /// place of an empty segment of the same base (a roll whose first record did not fit),
    /// unless `Place::New`: then a segment already there is an error, never written over.
    /// The name itself is the caller's to sync (`sync_dir`): once the file is under its name, a
    /// failure is not undone here.
    pub(crate) fn create(dir: &Path, base: u64, len: u64, now: u64, durable: bool, place: Place) -> Result<Segment> {
        let path = dir.join(file_name(base));
        let tmp = dir.join(format!("{base:020}{TMP_SUFFIX}"));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(io_err("create segment", &tmp))?;
        let made = (|| {
            let allocation_error = |e: io::Error| Error::SegmentAllocation { path: path.clone(), size: len, source: e };
            file.set_len(len).map_err(allocation_error)?;
            // On a nearly full disk, the header's page alone: the writer takes what still fits.
            let reserve = |n: u64| rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, n);
            let mut reserved = len.min(FIRST_ALLOCATION as u64);
            if reserve(reserved).is_err() {
                reserved = len.min(PAGE as u64);
                reserve(reserved).map_err(|e| allocation_error(e.into()))?;
            }
            let map = Arc::new(Mapping::new(&file, len as usize).map_err(io_err("map segment", &tmp))?);
            map.set_allocated(reserved as usize);
            let header = SegmentHeader {
                format: Format::CURRENT,
                base_offset: base,
                len,
                created: now,
                checkpoint_pos: 0,
                checkpoint_offset: base,
            };
            map.write_first_header(&header.encode());
            if durable {
                rustix::fs::fdatasync(&file).map_err(|e| io_err("sync segment", &tmp)(e.into()))?;
            }
            match place {
                Place::Any => fs::rename(&tmp, &path).map_err(io_err("rename segment", &path))?,
                Place::New => rename_new(&tmp, &path, |from, to| {
                    use rustix::fs::{CWD, RenameFlags, renameat_with};
                    renameat_with(CWD, from, CWD, to, RenameFlags::NOREPLACE)
                })?,
            }
            Ok(map)
        })();
        match made {
            Ok(map) => Ok(Segment {
                base,
                format: Format::CURRENT,
                path,
                map,
                tail: AtomicU64::new(pack(SEGMENT_HEADER_LEN, 0)),
                index: crate::index::SparseIndex::ready(Vec::new()),
                users: Default::default(),
                lru_stamp: AtomicU64::new(0),
                replaced: Default::default(),
                positions: {
                    let positions = crate::index::DenseIndex::new(len as usize, Format::CURRENT);
                    positions.mark_built();
                    std::sync::Mutex::new(Some(Arc::new(positions)))
                },
            }),
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    /// Opens an existing segment. Returns its header, or why the header could not be trusted
    /// (the caller decides whether that matters).
    pub(crate) fn open(path: &Path, base: u64, writable: bool) -> Result<(Segment, Result<SegmentHeader, String>)> {
        let file = OpenOptions::new().read(true).write(writable).open(path).map_err(io_err("open segment", path))?;
        let file_len = file.metadata().map_err(io_err("stat segment", path))?.len();
        // Positions in a segment are 32-bit (`pack`, recovery's search): a longer file was not
        // made by a writer (junk appended, a bad copy).
        if !(SEGMENT_HEADER_LEN as u64..=crate::MAX_SEGMENT_BYTES).contains(&file_len) {
            return Err(Error::Corrupt {
                file: path.to_path_buf(),
                position: 0,
                offset: None,
                reason: crate::error::Reason::Other(format!(
                    "segment is {file_len} bytes, not between its header's {SEGMENT_HEADER_LEN} and the largest segment's {} \
                     (`petrel log repair` cannot read it either: truncate the file to its segment length, \
                     the one its header gives, or move it away)",
                    crate::MAX_SEGMENT_BYTES
                )),
                before_tail: false,
            });
        }
        // The header alone: the kernel's read-ahead for a first read would take the pages after
        // it too (zeros, in a server's idle queue). Advice only: errors are ignored.
        let _ = rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::Random);
        // Read-only, beside a writer that rewrites the header's checkpoint after each sync (a
        // durable log): a read during that write is torn. The header is read again before it
        // is judged damaged.
        let rereads = if writable { 0 } else { HEADER_REREADS };
        let header_bytes = read_header(|buf| read_exact_at(&file, buf, 0), base, rereads)
            .map_err(io_err("read segment header", path))?;
        let _ = rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::Normal);
        let header = match SegmentHeader::decode_for(&header_bytes, base) {
            Err(HeaderError::Unsupported(what)) => {
                return Err(Error::UnsupportedFormat { file: path.to_path_buf(), what });
            }
            header => header.map_err(|e| e.to_string()),
        };
        // A segment cut short (copied badly, or truncated by hand) is extended back to its
        // length so that no access through its mapping lies past the end of the file (the gap
        // is a hole, reserved when the writer reaches it).
        if writable
            && let Ok(h) = &header
            && file_len < h.len
        {
            file.set_len(h.len).map_err(|e| Error::SegmentAllocation {
                path: path.to_path_buf(),
                size: h.len,
                source: e,
            })?;
        }
        let len = file.metadata().map_err(io_err("stat segment", path))?.len();
        let format = match &header {
            Ok(h) => h.format,
            Err(_) => {
                let map =
                    Mapping::new_read_only(&file, len as usize, len as usize).map_err(io_err("map segment", path))?;
                crate::recovery::judge_format(map.published().from(SEGMENT_HEADER_LEN), base)
            }
        };
        let map = if writable {
            Mapping::new(&file, len as usize)
        } else {
            Mapping::new_read_only(&file, len as usize, len as usize)
        };
        let map = Arc::new(map.map_err(io_err("map segment", path))?);
        let tail = AtomicU64::new(pack(SEGMENT_HEADER_LEN, 0));
        let index = crate::index::SparseIndex::default();
        let positions = Default::default();
        let users = Default::default();
        let lru_stamp = AtomicU64::new(0);
        let replaced = Default::default();
        let segment =
            Segment { base, format, path: path.to_path_buf(), map, tail, index, positions, users, lru_stamp, replaced };
        Ok((segment, header))
    }

    /// This read-only segment with only `[SEGMENT_HEADER_LEN, end)` visible to readers: for a last
    /// segment opened by an offline tool, whose torn tail must stay hidden.
    pub(crate) fn read_only_until(self, end: usize, records: u64) -> Result<Segment> {
        let file = File::open(&self.path).map_err(io_err("open segment", &self.path))?;
        let map = Mapping::new_read_only(&file, self.map.len(), end).map_err(io_err("map segment", &self.path))?;
        let seg = Segment { map: Arc::new(map), positions: Default::default(), ..self };
        seg.set_tail(end, records);
        Ok(seg)
    }

    /// Makes sure the sparse index is built: loaded from its file, or rebuilt from the frames
    /// (and the file written again, best effort).
    pub(crate) fn ensure_index(&self, dir: &Path) {
        if self.index.is_built() {
            return;
        }
        let path = crate::index::file_path(dir, self.base);
        if let Some(entries) = fs::read(&path).ok().and_then(|b| crate::index::decode(&b, self.base, self.map.len())) {
            self.index.set(entries);
            return;
        }
        let entries =
            crate::index::build(self.format, self.map.published().from(SEGMENT_HEADER_LEN), self.base).entries;
        if self.map.is_writable() || fs::metadata(dir.join(crate::index::INDEX_DIR)).is_ok() {
            crate::index::save(dir, self.base, &entries);
        }
        self.index.set(entries);
    }

    /// The dense position index, built on first use by a walk over the frame headers.
    pub(crate) fn positions(&self) -> Arc<crate::index::DenseIndex> {
        let positions = {
            let mut slot = self.positions.lock().unwrap_or_else(|e| e.into_inner());
            Arc::clone(slot.get_or_insert_with(|| Arc::new(crate::index::DenseIndex::new(self.map.len(), self.format))))
        };
        positions.build_once(self.format, self.map.published().from(SEGMENT_HEADER_LEN));
        positions
    }

    /// The dense position index if it is built already (the active segment's always is; a
    /// sealed one's after its first random read): for lookups that have a cheaper way without.
    pub(crate) fn positions_if_built(&self) -> Option<Arc<crate::index::DenseIndex>> {
        let slot = self.positions.lock().unwrap_or_else(|e| e.into_inner());
        slot.as_ref().filter(|p| p.is_built()).map(Arc::clone)
    }

    /// Position of record `offset`, from the dense index.
    pub(crate) fn position_of(&self, offset: u64) -> Option<usize> {
        self.positions().get(offset.checked_sub(self.base)? as usize)
    }

    /// Timestamp of record `offset`, if it is in this segment.
    pub(crate) fn timestamp_of(&self, offset: u64) -> Option<u64> {
        self.timestamp_in(&self.positions(), offset)
    }

    /// Timestamp of record `offset` through `positions` (this segment's dense index), if the
    /// index holds it among the published records.
    pub(crate) fn timestamp_in(&self, positions: &crate::index::DenseIndex, offset: u64) -> Option<u64> {
        let published = self.map.published();
        let pos = positions.get(offset.checked_sub(self.base)? as usize).filter(|&p| p < published.end())?;
        let own = frame::own_timestamp(self.format, published.from(pos));
        Some(own.unwrap_or_else(|| self.time_before(positions, offset)))
    }

    /// The timestamp that record `offset`'s frame takes when it holds none (format 3 on): that of
    /// the nearest frame before it in this segment that holds one, which `positions` (this
    /// segment's dense index) knows or marks. 0 for the segment's first record (whose frame
    /// always holds its own) and in earlier formats.
    pub(crate) fn time_before(&self, positions: &crate::index::DenseIndex, offset: u64) -> u64 {
        self.time_before_from(positions.time_of((offset - self.base) as usize), offset)
    }

    /// `time_before`, from what the dense index said of record `offset` (`DenseIndex::time_of`,
    /// asked earlier: `Reader::get_many` asks while the frame is still on its way to the cache).
    pub(crate) fn time_before_from(&self, indexed: crate::index::TimeOf, offset: u64) -> u64 {
        if !self.format.inherits_time() {
            return 0;
        }
        let published = self.map.published();
        match indexed {
            crate::index::TimeOf::Known(time) => return time,
            crate::index::TimeOf::HeldAt(pos) => {
                if let Some(time) = frame::own_timestamp(self.format, published.from(pos)) {
                    return time;
                }
            }
            crate::index::TimeOf::Unknown => {}
        }
        // Not found through the dense index (it marks every published frame that holds a time,
        // so only a frame damaged since it was checked gets here): a walk from the segment's
        // first frame.
        let data = published.from(SEGMENT_HEADER_LEN);
        let (mut at, mut time) = (0, 0);
        for _ in self.base..offset {
            let bytes = &data[at..];
            match (frame::peek_len(self.format, bytes), frame::peek_timestamp(self.format, bytes, time)) {
                (Some(len), Some(t)) => (at, time) = (at + len, t),
                _ => break,
            }
        }
        time
    }

    /// Reserves this segment's disk blocks up to `end` (rounded up to a page, at most the
    /// segment's length), so the writer may write below it. A full disk is an error here, never
    /// a fault on a write.
    pub(crate) fn allocate(&self, end: usize) -> Result<()> {
        let end = end.next_multiple_of(PAGE).min(self.map.len());
        let from = self.map.allocated();
        if end <= from {
            return Ok(());
        }
        let allocation_error =
            |e: io::Error| Error::SegmentAllocation { path: self.path.clone(), size: end as u64, source: e };
        // The file is not kept open (see `Segment`): a reservation is one open per
        // `ALLOCATION_STEP` or so of records.
        let file = OpenOptions::new().write(true).open(&self.path).map_err(allocation_error)?;
        rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), from as u64, (end - from) as u64)
            .map_err(|e| allocation_error(e.into()))?;
        self.map.set_allocated(end);
        Ok(())
    }

    /// The first hole of the file at or after file position `from`: a range that holds no data
    /// and reads as zeros, which recovery then need not read (`recovery::scan_with_hole`).
    /// Empty when there is none, or when the file system does not say.
    pub(crate) fn hole_after(&self, from: usize) -> std::ops::Range<usize> {
        use rustix::fs::{SeekFrom, seek};
        let len = self.map.len();
        let Ok(file) = File::open(&self.path) else { return 0..0 };
        let Ok(start) = seek(&file, SeekFrom::Hole(from as u64)) else { return 0..0 };
        let start = (start as usize).min(len);
        let end = match seek(&file, SeekFrom::Data(start as u64)) {
            Ok(end) => (end as usize).min(len),
            // A hole to the end of the file.
            Err(rustix::io::Errno::NXIO) => len,
            Err(_) => return 0..0,
        };
        start..end
    }

    /// Gives the disk blocks reserved past `end` back (the writer has stopped writes there:
    /// `DataWriter::unallocate_from`), so a closed log takes the disk its records take. Best
    /// effort: blocks that stay are only space.
    pub(crate) fn release_unwritten(&self, end: usize) {
        use std::os::unix::fs::MetadataExt;
        let end = end.next_multiple_of(PAGE).min(self.map.len());
        // No blocks past `end` (the file's 512-byte units take no more than the bytes before
        // it): nothing to give back, and a punch would still change the file's times.
        if fs::metadata(&self.path).is_ok_and(|m| m.blocks() * 512 <= end as u64) {
            return;
        }
        if let Ok(file) = OpenOptions::new().write(true).open(&self.path) {
            let flags = rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE;
            let _ = rustix::fs::fallocate(&file, flags, end as u64, (self.map.len() - end) as u64);
        }
    }

    /// Gives back what a sealed segment holds in memory: its resident pages and its indexes
    /// (all rebuilt or reloaded on the next use).
    pub(crate) fn release(&self) {
        self.map.release_pages();
        *self.positions.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.index.unload();
    }

    /// The published end position and the number of records before it.
    pub(crate) fn tail(&self) -> (usize, u64) {
        let t = self.tail.load(Ordering::Acquire);
        ((t >> 32) as usize, t & 0xFFFF_FFFF)
    }

    pub(crate) fn set_tail(&self, pos: usize, records: u64) {
        self.tail.store(pack(pos, records), Ordering::Release);
    }

    /// Makes everything written to the segment so far durable. A segment mapped read-only (a
    /// sealed one found at open, whose pages a session under `none` may have left dirty) is
    /// synced through a descriptor: Linux makes a mapping of a file opened without write access
    /// private to the kernel's syncing, and `msync` on it syncs nothing.
    pub(crate) fn sync(&self) -> io::Result<()> {
        match self.map.is_writable() {
            true => self.map.sync(),
            false => match File::open(&self.path) {
                Ok(file) => file.sync_data(),
                // Deleted meanwhile (retention): nothing of it is kept, nothing to make durable.
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(e),
            },
        }
    }

    /// Its header as the mapping holds it now (open refused one of an unsupported format).
    pub(crate) fn header(&self) -> Result<SegmentHeader, String> {
        SegmentHeader::decode_for(&self.map.read_header(), self.base).map_err(|e| e.to_string())
    }

    /// Its header, or, if that is damaged, the one its frames and file name imply.
    pub(crate) fn header_or_stand_in(&self) -> SegmentHeader {
        self.header().unwrap_or(SegmentHeader {
            format: self.format,
            base_offset: self.base,
            len: self.map.len() as u64,
            created: 0,
            checkpoint_pos: 0,
            checkpoint_offset: self.base,
        })
    }

    /// Makes an empty segment of an earlier format one of the current format: its header says so
    /// from now on (synced with `durable`, before any frame of the new format can be).
    pub(crate) fn adopt_current_format(&mut self, durable: bool) -> io::Result<()> {
        let mut header = self.header_or_stand_in();
        header.format = Format::CURRENT;
        self.map.write_header(&header.encode());
        self.format = Format::CURRENT;
        *self.positions.get_mut().unwrap_or_else(|e| e.into_inner()) = None;
        if durable { self.sync() } else { Ok(()) }
    }

    /// Records that frames before `pos` (where record `offset` starts) are durable. The header
    /// itself becomes durable with the next sync.
    pub(crate) fn write_checkpoint(&self, pos: u64, offset: u64) {
        let mut header = self.header_or_stand_in();
        header.checkpoint_pos = pos;
        header.checkpoint_offset = offset;
        self.map.write_header(&header.encode());
    }
}

fn pack(pos: usize, records: u64) -> u64 {
    debug_assert!(pos <= u32::MAX as usize && records <= u32::MAX as u64);
    (pos as u64) << 32 | records
}

/// A segment's header as `read` gives it, read up to `rereads` more times, 1 ms apart, while it
/// does not decode as segment `base`'s (a read torn by a writer rewriting it): the last read is
/// what is judged.
fn read_header(
    mut read: impl FnMut(&mut [u8]) -> io::Result<()>,
    base: u64,
    rereads: usize,
) -> io::Result<[u8; SEGMENT_HEADER_LEN]> {
    let mut header = [0u8; SEGMENT_HEADER_LEN];
    read(&mut header)?;
    for _ in 0..rereads {
        if SegmentHeader::decode_for(&header, base).is_ok() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
        read(&mut header)?;
    }
    Ok(header)
}

/// Renames `tmp` to `path`, never over a file already there: with `no_replace` (renameat2's
/// `RENAME_NOREPLACE`), or, on a file system without it (NFS, some FUSE ones), by looking first
/// (nothing else writes in a log's directory meanwhile).
fn rename_new(tmp: &Path, path: &Path, no_replace: impl FnOnce(&Path, &Path) -> rustix::io::Result<()>) -> Result<()> {
    match no_replace(tmp, path) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOSYS | rustix::io::Errno::OPNOTSUPP) => {
            if path.exists() {
                return Err(io_err("rename segment", path)(io::ErrorKind::AlreadyExists.into()));
            }
            fs::rename(tmp, path).map_err(io_err("rename segment", path))
        }
        Err(e) => Err(io_err("rename segment", path)(e.into())),
    }
}

pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    let d = File::open(dir).map_err(io_err("open directory", dir))?;
    d.sync_all().map_err(io_err("sync directory", dir))
}

fn read_exact_at(file: &File, buf: &mut [u8], at: u64) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    file.read_exact_at(buf, at)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_torn_header_is_read_again_and_a_damaged_one_is_given_up_on() {
        let good = SegmentHeader {
            format: Format::CURRENT,
            base_offset: 7,
            len: 1 << 20,
            created: 1,
            checkpoint_pos: 64,
            checkpoint_offset: 7,
        }
        .encode();
        let mut torn = good;
        torn[40..48].fill(0xff); // the checkpoint half rewritten: its CRC no longer holds
        // Torn twice, then whole: read until it decodes.
        let mut reads = 0;
        let read = read_header(
            |buf| {
                reads += 1;
                buf.copy_from_slice(if reads <= 2 { &torn } else { &good });
                Ok(())
            },
            7,
            HEADER_REREADS,
        )
        .unwrap();
        assert_eq!((read, reads), (good, 3));
        // Damaged for good: given up on after the rereads, the last read returned to be judged.
        let mut reads = 0;
        let read = read_header(
            |buf| {
                reads += 1;
                buf.copy_from_slice(&torn);
                Ok(())
            },
            7,
            HEADER_REREADS,
        )
        .unwrap();
        assert_eq!((read, reads), (torn, 1 + HEADER_REREADS));
        // A writable open (no writer beside it) reads once.
        let mut reads = 0;
        read_header(
            |_| {
                reads += 1;
                Ok(())
            },
            7,
            0,
        )
        .unwrap();
        assert_eq!(reads, 1);
    }

    #[test]
    fn a_new_segment_never_replaces_a_file_with_or_without_renameat2_noreplace() {
        let dir = tempfile::tempdir().unwrap();
        let (tmp, path) = (dir.path().join("a.log.tmp"), dir.path().join("a.log"));
        let without = |_: &Path, _: &Path| Err(rustix::io::Errno::INVAL);
        for (which, no_replace) in [("renameat2", None), ("a file system without it", Some(without))] {
            let rename = |tmp: &Path, path: &Path| match no_replace {
                Some(f) => rename_new(tmp, path, f),
                None => rename_new(tmp, path, |from, to| {
                    use rustix::fs::{CWD, RenameFlags, renameat_with};
                    renameat_with(CWD, from, CWD, to, RenameFlags::NOREPLACE)
                }),
            };
            let _ = fs::remove_file(&path);
            fs::write(&tmp, b"new").unwrap();
            rename(&tmp, &path).unwrap();
            assert_eq!(fs::read(&path).unwrap(), b"new", "{which}");
            assert!(!tmp.exists(), "{which}");
            fs::write(&tmp, b"newer").unwrap();
            let err = rename(&tmp, &path).unwrap_err();
            assert!(err.to_string().contains("rename segment"), "{which}: {err}");
            assert_eq!(fs::read(&path).unwrap(), b"new", "{which}: replaced");
        }
        // Any other error is reported as it is, nothing renamed.
        let err = rename_new(&tmp, &dir.path().join("b.log"), |_, _| Err(rustix::io::Errno::ACCESS)).unwrap_err();
        assert!(err.to_string().contains("rename segment"), "{err}");
        assert!(tmp.exists() && !dir.path().join("b.log").exists());
    }

    #[test]
    fn names_round_trip() {
        assert_eq!(file_name(42), "00000000000000000042.log");
        assert_eq!(parse_name(&file_name(u64::MAX)), Some(u64::MAX));
        assert_eq!(parse_name("42.log"), None);
        assert_eq!(parse_name("0000000000000000004x.log"), None);
        assert_eq!(parse_name("00000000000000000042.log.tmp"), None);
        assert!(is_leftover_tmp("00000000000000000042.log.tmp"));
        assert!(!is_leftover_tmp("notes.log.tmp"), "only a segment being made");
    }

    #[test]
    fn header_round_trips_and_rejects_damage() {
        let h = SegmentHeader {
            format: Format::V2,
            base_offset: 7,
            len: 65536,
            created: 1,
            checkpoint_pos: 128,
            checkpoint_offset: 9,
        };
        let b = h.encode();
        assert_eq!(SegmentHeader::decode(&b), Ok(h));
        for i in 0..SEGMENT_HEADER_LEN {
            let mut bad = b;
            bad[i] ^= 0x10;
            assert!(matches!(SegmentHeader::decode(&bad), Err(HeaderError::Damaged(_))), "byte {i}");
        }
        assert!(matches!(SegmentHeader::decode_for(&b, 8), Err(HeaderError::Damaged(_))), "another base");
        // Intact, but of a format or a header length this build does not know.
        for (at, value, what) in [(8, 6u32, "format version 6"), (12, 128, "header length 128")] {
            let mut newer = b;
            newer[at..at + 4].copy_from_slice(&value.to_le_bytes());
            let crc = crate::checksum::crc32c(&newer[0..60]);
            newer[60..64].copy_from_slice(&crc.to_le_bytes());
            assert_eq!(SegmentHeader::decode(&newer), Err(HeaderError::Unsupported(what.into())));
        }
    }
}
