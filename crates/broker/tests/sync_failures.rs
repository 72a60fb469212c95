//! A disk that fails a sync (`SharedLog::fail_next_sync`: the log is poisoned, as after a real
//! `fdatasync` error): what the broker answers, what it keeps handing out, and what a restart
//! finds. An offer is acknowledged only once it is on disk, so a failed sync must refuse the offer
//! waiting for it; and no message may be handed out twice or lost because a tick failed half way.

use std::path::Path;
use std::time::Duration;

use petrel_broker::{Broker, BrokerError, BrokerOptions, Delivery, Message, QueueConfig, TICK_RETRY_NS};

const SECOND: u64 = 1_000_000_000;

fn open(dir: &Path) -> Broker {
    Broker::open(dir, BrokerOptions { durability: petrel_log::Durability::Always, ..BrokerOptions::default() }).unwrap()
}

fn durable() -> QueueConfig {
    QueueConfig { durable: true, ..QueueConfig::default() }
}

fn texts(ds: &[Delivery]) -> Vec<String> {
    ds.iter().map(|d| String::from_utf8_lossy(&d.message.payload).into_owned()).collect()
}

fn take(b: &Broker, queue: &str, now_ns: u64) -> Result<Vec<String>, BrokerError> {
    b.poll(queue, 100, None, 1, now_ns).map(|ds| texts(&ds))
}

#[test]
fn a_failed_sync_refuses_its_offer_and_every_later_one_and_loses_nothing_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path());
    let jobs = b.create_queue("jobs", durable(), None).unwrap();
    b.create_queue("other", durable(), None).unwrap();
    b.offer("jobs", vec![Message::new(&b"kept"[..])], SECOND).unwrap();

    jobs.fail_next_syncs();
    let err = b.offer("jobs", vec![Message::new(&b"doomed"[..])], SECOND).unwrap_err();
    assert!(matches!(err, BrokerError::Storage(_)) && err.to_string().contains("injected failure"), "{err}");
    let err = b.offer("jobs", vec![Message::new(&b"later"[..])], SECOND).unwrap_err();
    assert!(matches!(err, BrokerError::Storage(_)), "the log stays refused: {err}");
    // What was never on disk is never handed out; what was may be, or the poll says why not.
    if let Ok(taken) = take(&b, "jobs", SECOND) {
        assert!(taken.iter().all(|t| t == "kept"), "{taken:?}");
    }
    // Another queue's log goes on.
    b.offer("other", vec![Message::new(&b"fine"[..])], SECOND).unwrap();
    assert_eq!(take(&b, "other", SECOND).unwrap(), ["fine"]);
    drop((jobs, b));

    // After a restart: the acknowledged message, first. The refused one may be there too (its
    // bytes reached the page cache; a producer retries a refused offer: at least once), the one
    // offered after the failure never is.
    let b = open(dir.path());
    let taken = take(&b, "jobs", SECOND).unwrap();
    assert_eq!(taken.first().map(String::as_str), Some("kept"), "{taken:?}");
    assert!(taken.iter().skip(1).all(|t| t == "doomed"), "{taken:?}");
    b.offer("jobs", vec![Message::new(&b"new"[..])], SECOND).unwrap();
    assert_eq!(take(&b, "jobs", SECOND).unwrap(), ["new"]);
}

/// A delayed message comes due and the tick copies it to its level's log (as it does when too
/// many released runs wait: `limit_ready_runs`); that log's sync fails. The tick says so and does
/// not spin, and the copy that half happened is not handed out. After a restart the message is
/// handed out once, neither lost nor doubled; acknowledged then, it stays so across the next.
#[test]
fn a_tick_whose_sync_fails_neither_loses_nor_doubles_a_delayed_message() {
    petrel_broker::limit_ready_runs(0);
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path());
    let jobs = b.create_queue("jobs", durable(), None).unwrap();
    let delayed = Message { delay_ms: 1, ..Message::new(&b"later"[..]) };
    b.offer("jobs", vec![delayed], SECOND).unwrap();
    assert!(take(&b, "jobs", SECOND).unwrap().is_empty(), "not due yet");

    jobs.fail_next_syncs();
    let due = SECOND + 2_000_000;
    b.tick(due);
    assert!(!jobs.is_due(due + TICK_RETRY_NS / 2), "the ticker does not spin on it");
    if let Ok(taken) = take(&b, "jobs", due) {
        assert!(taken.is_empty(), "a copy whose sync failed: {taken:?}");
    }
    drop((jobs, b));

    let b = open(dir.path());
    let later = due + SECOND;
    b.tick(later);
    let again = b.poll("jobs", 100, Some(Duration::from_secs(30)), 1, later).unwrap();
    assert_eq!(texts(&again), ["later"], "after the restart");
    b.tick(later + SECOND);
    assert!(take(&b, "jobs", later + SECOND).unwrap().is_empty(), "once");
    assert_eq!(b.ack("jobs", &[again[0].handle], 1).unwrap(), 1);
    drop(b);
    let b = open(dir.path());
    b.tick(later + 2 * SECOND);
    assert!(take(&b, "jobs", later + 2 * SECOND).unwrap().is_empty(), "acknowledged stays so");
}

/// A durable topic's publish whose sync fails is refused and reaches no subscriber; the
/// publishes after it are refused too (the log stays refused) and none waits for the failed one's
/// turn to hand its messages on; subscribing goes on.
#[test]
fn a_durable_topic_s_failed_sync_reaches_no_subscriber_and_holds_up_no_publish() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path());
    let topic = b.create_topic("news", true).unwrap();
    let mut sub = b.subscribe("news", 1, 100).unwrap();
    assert_eq!(b.publish("news", vec![Message::new(&b"kept"[..])], SECOND).unwrap(), 1);
    assert_eq!(sub.try_recv().map(|d| d.message.payload.clone()), Some(b"kept"[..].into()));
    topic.fail_next_syncs();
    let err = b.publish("news", vec![Message::new(&b"doomed"[..])], SECOND).unwrap_err();
    assert!(matches!(err, BrokerError::Storage(_)), "{err}");
    let err = b.publish("news", vec![Message::new(&b"later"[..])], SECOND).unwrap_err();
    assert!(matches!(err, BrokerError::Storage(_)), "{err}");
    assert!(sub.try_recv().is_none(), "nothing that was not on disk reaches a subscriber");
    let mut again = b.subscribe("news", 1, 100).unwrap();
    assert!(again.try_recv().is_none());
}
