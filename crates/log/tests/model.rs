//! Property test: random appends, batch appends, reads, syncs, reopens and segment rolls,
//! checked against a plain in-memory vector of records.

use petrel_log::{Durability, Input, Log, MIN_SEGMENT_BYTES, Options};
use proptest::prelude::*;

#[derive(Clone, Debug, PartialEq)]
struct Rec {
    key: Option<Vec<u8>>,
    headers: Vec<(String, Vec<u8>)>,
    payload: Vec<u8>,
}

#[derive(Clone, Debug)]
enum Op {
    Append(Rec),
    Batch(Vec<Vec<u8>>),
    Get(usize),
    Scan {
        from: usize,
        max: usize,
    },
    /// Lookups by offset in one `get_many`, some past the end.
    GetMany(Vec<usize>),
    Sync,
    Reopen,
}

fn payload() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        8 => prop::collection::vec(any::<u8>(), 0..200),
        2 => prop::collection::vec(any::<u8>(), 200..5000),
        // Larger than a whole segment: gets a segment of its own.
        1 => (70_000usize..90_000).prop_map(|n| vec![0x5a; n]),
    ]
}

fn rec() -> impl Strategy<Value = Rec> {
    (
        prop::option::of(prop::collection::vec(any::<u8>(), 0..40)),
        prop::collection::vec(("[a-z]{0,6}", prop::collection::vec(any::<u8>(), 0..20)), 0..3),
        payload(),
    )
        .prop_map(|(key, headers, payload)| Rec { key, headers, payload })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => rec().prop_map(Op::Append),
        3 => prop::collection::vec(payload(), 0..20).prop_map(Op::Batch),
        4 => any::<usize>().prop_map(Op::Get),
        2 => prop::collection::vec(any::<usize>(), 0..40).prop_map(Op::GetMany),
        2 => (any::<usize>(), 1usize..300).prop_map(|(from, max)| Op::Scan { from, max }),
        1 => Just(Op::Sync),
        2 => Just(Op::Reopen),
    ]
}

fn options() -> Options {
    Options { segment_bytes: MIN_SEGMENT_BYTES, durability: Durability::None, ..Options::default() }
}

fn same(record: &petrel_log::Record<'_>, expected: &Rec) -> bool {
    record.key == expected.key.as_deref()
        && record.payload == expected.payload
        && record.headers.iter().map(|(n, v)| (n.to_owned(), v.to_vec())).collect::<Vec<_>>() == expected.headers
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn the_log_behaves_like_a_vector(ops in prop::collection::vec(op(), 1..60)) {
        let dir = tempfile::tempdir().unwrap();
        let mut log = Log::open(dir.path(), options()).unwrap();
        let mut model: Vec<Rec> = Vec::new();
        for op in ops {
            match op {
                Op::Append(r) => {
                    let headers: Vec<(&str, &[u8])> = r.headers.iter().map(|(n, v)| (n.as_str(), v.as_slice())).collect();
                    let input = Input { key: r.key.as_deref(), headers: &headers, payload: &r.payload, timestamp: None };
                    prop_assert_eq!(log.append_with(&input).unwrap(), model.len() as u64);
                    model.push(r);
                }
                Op::Batch(payloads) => {
                    let range = log.append_batch(&payloads).unwrap();
                    prop_assert_eq!(range, model.len() as u64..(model.len() + payloads.len()) as u64);
                    model.extend(payloads.into_iter().map(|payload| Rec { key: None, headers: vec![], payload }));
                }
                Op::Get(i) => {
                    let mut reader = log.reader();
                    let offset = if model.is_empty() { i as u64 % 4 } else { (i % (model.len() + 1)) as u64 };
                    match reader.get(offset).unwrap() {
                        Some(r) => {
                            prop_assert_eq!(r.offset, offset);
                            prop_assert!(same(&r, &model[offset as usize]));
                        }
                        None => prop_assert!(offset as usize >= model.len()),
                    }
                }
                Op::GetMany(picks) => {
                    let mut reader = log.reader();
                    let offsets: Vec<u64> = picks.iter().map(|i| (i % (model.len() + 2)) as u64).collect();
                    let mut got = Vec::new();
                    reader.get_many(&offsets, |i, r| got.push((i, r.offset, same(&r, &model[r.offset as usize])))).unwrap();
                    let expected: Vec<(usize, u64, bool)> = offsets
                        .iter()
                        .enumerate()
                        .filter(|(_, o)| (**o as usize) < model.len())
                        .map(|(i, o)| (i, *o, true))
                        .collect();
                    prop_assert_eq!(got, expected);
                }
                Op::Scan { from, max } => {
                    let mut reader = log.reader();
                    let from = from % (model.len() + 1);
                    reader.seek(from as u64);
                    let mut at = from;
                    while at < (from + max).min(model.len()) {
                        let batch = reader.read_batch(from + max - at).unwrap();
                        prop_assert!(!batch.is_empty());
                        for r in batch {
                            prop_assert_eq!(r.offset, at as u64);
                            prop_assert!(same(&r, &model[at]));
                            at += 1;
                        }
                    }
                }
                Op::Sync => log.sync().unwrap(),
                Op::Reopen => {
                    drop(log);
                    log = Log::open(dir.path(), options()).unwrap();
                    prop_assert_eq!(log.next_offset(), model.len() as u64);
                    prop_assert_eq!(log.recovery_report().torn_at, None);
                }
            }
        }
        let mut reader = log.reader();
        let mut n = 0;
        while let Some(r) = reader.read_next().unwrap() {
            prop_assert!(same(&r, &model[n]));
            n += 1;
        }
        prop_assert_eq!(n, model.len());
        drop(log);
        let report = petrel_log::verify::verify(dir.path(), |_, _| {}).unwrap();
        prop_assert!(report.problems.is_empty(), "{:?}", report.problems);
        prop_assert_eq!(report.records, model.len() as u64);
    }
}
