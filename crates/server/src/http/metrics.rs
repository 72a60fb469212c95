//! `/metrics`: every figure read at the scrape into a fresh recorder (not a second set of
//! counters to keep in step, and a removed queue's series go with it), rendered in the
//! Prometheus text format by `metrics-exporter-prometheus`. Latency histograms cannot be read
//! back that way: they are recorded as things happen into `Events`, a recorder that lives as
//! long as the server, and its text follows the scrape's.

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use std::time::Duration;

use metrics::{Key, KeyName, Label, Metadata, Recorder};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};
use metrics_util::MetricKindMask;
use petrel_broker::CallObserver;
use petrel_broker::security::{Action, Kind, Principal};
use petrel_log::SyncObserver;

use super::Ctxt;
use crate::Ctx;
use crate::stats::get as read;

/// Which queues, topics and functions a scrape names in its series' labels.
pub(super) enum Names {
    /// Every one (`http_open_metrics`: a scraper on a trusted network).
    All,
    /// Those the user has a right on, as the admin API lists them (all, without users).
    SeenBy(Option<Principal>),
}

impl Names {
    fn shows(&self, ctx: &Ctx, kind: Kind, name: &str) -> bool {
        let rights: &[Action] = match kind {
            Kind::Queue => super::api::ANY_QUEUE_RIGHT,
            Kind::Topic => super::api::ANY_TOPIC_RIGHT,
            Kind::Function => super::api::ANY_FUNCTION_RIGHT,
        };
        match self {
            Names::All => true,
            Names::SeenBy(who) => ctx.broker.may(who.as_ref(), kind, name, rights),
        }
    }
}

/// Scrapes that build their text at once, at most: each holds ~140,000 series and their text at
/// 10,000 queues (tens of MB); more wait their turn.
pub(super) const SCRAPES_AT_ONCE: usize = 2;

/// `/metrics` (the router asks for a user first, unless `http_open_metrics`).
/// Off the runtime's workers: a scrape of 10,000 queues takes ~0.2 s (docs/benchmarks.md).
pub(super) async fn scrape(State(ctx): Ctxt, names: Names) -> Response {
    // Held by the build itself: a scrape given up (its client gone) keeps its turn until its
    // build ends, so that builds never pile up past the limit.
    let scrapes = std::sync::Arc::clone(&ctx.http_probes.scrapes);
    let turn = scrapes.acquire_owned().await.expect("the scrapes' semaphore is never closed");
    let rendered = tokio::task::spawn_blocking(move || {
        let _turn = turn;
        let scrape = Scrape::new();
        scrape.collect(&ctx, &names);
        let mut text = scrape.recorder.handle().render();
        text.push_str(&ctx.events.render(|function| names.shows(&ctx, Kind::Function, function)));
        text
    })
    .await;
    match rendered {
        Ok(text) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response(),
        Err(e) => super::refusal(axum::http::StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

const FSYNC_SECONDS: &str = "petrel_fsync_duration_seconds";
const CALL_SECONDS: &str = "petrel_function_duration_seconds";

/// Histograms recorded as things happen: data syncs of durable logs, answered function calls.
/// A histogram's samples wait in the recorder until its upkeep folds them into the buckets
/// (every few seconds, from the sampler), so they take bounded memory between scrapes; a
/// function's series go after ten minutes without calls.
pub(crate) struct Events {
    recorder: PrometheusRecorder,
}

impl Events {
    pub fn new() -> Events {
        let buckets = |matcher: &str, values: &[f64], b: PrometheusBuilder| {
            b.set_buckets_for_metric(Matcher::Full(matcher.to_owned()), values).expect("buckets are not empty")
        };
        let sync = [0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.1, 1.0];
        let call = [0.000_1, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];
        let builder = buckets(FSYNC_SECONDS, &sync, PrometheusBuilder::new());
        let builder = buckets(CALL_SECONDS, &call, builder)
            .idle_timeout(MetricKindMask::HISTOGRAM, Some(Duration::from_secs(600)));
        let recorder = builder.build_recorder();
        recorder.describe_histogram(
            KeyName::from_const_str(FSYNC_SECONDS),
            Some(metrics::Unit::Seconds),
            "Data syncs (fdatasync) of durable logs.".into(),
        );
        recorder.describe_histogram(
            KeyName::from_const_str(CALL_SECONDS),
            Some(metrics::Unit::Seconds),
            "Function calls, from routing to the reply.".into(),
        );
        Events { recorder }
    }

    /// What the broker's logs tell each sync's duration.
    pub fn sync_observer(self: &std::sync::Arc<Self>) -> SyncObserver {
        let events = std::sync::Arc::clone(self);
        SyncObserver::new(move |took| {
            let key = Key::from_static_name(FSYNC_SECONDS);
            events.recorder.register_histogram(&key, &METADATA).record(took.as_secs_f64());
        })
    }

    /// What the broker tells each answered call's duration.
    pub fn call_observer(self: &std::sync::Arc<Self>) -> CallObserver {
        let events = std::sync::Arc::clone(self);
        CallObserver::new(move |function, took| {
            let key = Key::from_parts(CALL_SECONDS, vec![Label::new("function", function.to_owned())]);
            events.recorder.register_histogram(&key, &METADATA).record(took.as_secs_f64());
        })
    }

    /// Folds the samples recorded since into the histograms' buckets.
    pub fn upkeep(&self) {
        self.recorder.handle().run_upkeep();
    }

    /// The text of every series, those of functions `shows` refuses left out.
    fn render(&self, shows: impl Fn(&str) -> bool) -> String {
        let text = self.recorder.handle().render();
        // Asked once per function, not per line (a histogram has a line per bucket).
        let mut shows_function = std::collections::HashMap::<&str, bool>::new();
        let mut shown = String::with_capacity(text.len());
        for line in text.lines() {
            // (Function names are plain characters, `check_name`'s: no escapes to undo.)
            let function = line.find("function=\"").and_then(|at| {
                let value = &line[at + "function=\"".len()..];
                value.find('"').map(|end| &value[..end])
            });
            if let Some(name) = function
                && !*shows_function.entry(name).or_insert_with(|| shows(name))
            {
                continue;
            }
            shown.push_str(line);
            shown.push('\n');
        }
        shown
    }
}

/// One scrape: every figure read now into a recorder of its own.
struct Scrape {
    recorder: PrometheusRecorder,
}

static METADATA: Metadata<'static> = Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

impl Scrape {
    fn new() -> Scrape {
        Scrape { recorder: PrometheusBuilder::new().build_recorder() }
    }

    fn gauge(&self, name: &'static str, help: &'static str, labels: Vec<Label>, value: u64) {
        self.recorder.describe_gauge(KeyName::from_const_str(name), None, help.into());
        self.recorder.register_gauge(&Key::from_parts(name, labels), &METADATA).set(value as f64);
    }

    fn counter(&self, name: &'static str, help: &'static str, labels: Vec<Label>, value: u64) {
        self.recorder.describe_counter(KeyName::from_const_str(name), None, help.into());
        self.recorder.register_counter(&Key::from_parts(name, labels), &METADATA).absolute(value);
    }

    fn collect(&self, ctx: &Ctx, names: &Names) {
        let s = &ctx.stats;
        let broker = &ctx.broker;
        let none = Vec::new;
        self.gauge("petrel_connections", "Open client connections.", none(), read(&s.curr_connections));
        self.counter("petrel_connections_accepted_total", "Connections accepted.", none(), read(&s.total_connections));
        let refused = read(&s.connections_refused);
        self.counter("petrel_connections_refused_total", "Connections refused at a limit.", none(), refused);
        self.counter("petrel_idle_closed_total", "Connections closed as idle.", none(), read(&s.idle_closed));
        self.counter("petrel_received_bytes_total", "Bytes read from clients.", none(), read(&s.bytes_read));
        self.counter("petrel_sent_bytes_total", "Bytes written to clients.", none(), read(&s.bytes_written));
        self.counter("petrel_auth_failures_total", "Failed authentications.", none(), read(&s.auth_failures));
        let help = "Logins refused unchecked: their address (an IPv6 /64) was past auth_attempts_per_minute.";
        self.counter("petrel_auth_rate_limited_total", help, none(), read(&s.auth_rate_limited));
        self.counter("petrel_tls_connections_total", "TLS handshakes completed.", none(), read(&s.tls_connections));
        let help = "Connections refused for TLS: a failed handshake, or plain text where require_tls.";
        self.counter("petrel_tls_refused_total", help, none(), read(&s.tls_refused));
        let reloads = ctx.reload.lock().unwrap_or_else(|e| e.into_inner()).status.failures;
        let help = "Reloads of the configuration file that changed nothing because it could not be applied (see /api/v1/server's reload.outcome).";
        self.counter("petrel_reload_failures_total", help, none(), reloads);
        self.counter("petrel_acl_denials_total", "Requests an ACL refused.", none(), broker.denials());
        let help = "Queues not served because their files could not be opened (see /api/v1/server and the log).";
        self.gauge("petrel_queues_damaged", help, none(), broker.damaged_queues().len() as u64);
        let help = "Durable topics not served because their logs could not be opened (see /api/v1/server and the log).";
        self.gauge("petrel_topics_damaged", help, none(), broker.damaged_topics().len() as u64);
        let help = "Requests that failed in the server (storage errors such as a full disk), each answered SERVER_ERROR and logged.";
        for (protocol, n) in crate::stats::FAILURE_PROTOCOLS.iter().zip(crate::stats::request_failures()) {
            self.counter("petrel_request_failures_total", help, vec![Label::new("protocol", *protocol)], n);
        }
        let (memory_used, memory_max) = broker.memory();
        self.gauge("petrel_memory_queued_bytes", "Bytes held against max_memory_bytes.", none(), memory_used);
        self.gauge("petrel_memory_budget_bytes", "max_memory_bytes (0: no limit).", none(), memory_max);
        let (resident, releases) = broker.resident_pages();
        let help = "Mapped segment bytes counted against max_resident_bytes.";
        self.gauge("petrel_resident_counted_bytes", help, none(), resident);
        self.counter("petrel_resident_releases_total", "Segments that gave their pages back.", none(), releases);
        let help = "Bytes of segment files deleted between segment rolls: emptied by queues' consumers, a drained queue's active segment, a durable topic's past its age cap.";
        self.counter("petrel_given_back_bytes_total", help, none(), broker.given_back_bytes());
        if let Ok(fs) = rustix::fs::statvfs(&ctx.config.data) {
            self.gauge(
                "petrel_disk_free_bytes",
                "Free bytes for the data directory.",
                none(),
                fs.f_bavail * fs.f_frsize,
            );
            let total = fs.f_blocks * fs.f_frsize;
            self.gauge("petrel_disk_total_bytes", "Size of the data directory's file system.", none(), total);
        }
        for (i, (_, command)) in crate::stats::NATIVE_COMMANDS.iter().enumerate() {
            let labels = vec![Label::new("protocol", "native"), Label::new("command", *command)];
            self.counter("petrel_requests_total", "Requests read, by command.", labels, read(&s.native_requests[i]));
        }
        let labels = vec![Label::new("protocol", "native"), Label::new("command", "unknown")];
        let unknown = read(&s.native_requests[crate::stats::NATIVE_COMMANDS.len()]);
        self.counter("petrel_requests_total", "Requests read, by command.", labels, unknown);
        for (i, command) in crate::stats::MEMCACHE_COMMANDS.iter().enumerate() {
            let labels = vec![Label::new("protocol", "memcache"), Label::new("command", *command)];
            self.counter("petrel_requests_total", "Requests read, by command.", labels, read(&s.memcache_requests[i]));
        }
        for f in broker.functions().into_iter().filter(|f| names.shows(ctx, Kind::Function, &f.name)) {
            let labels = || vec![Label::new("function", f.name.clone())];
            self.gauge(
                "petrel_function_servers",
                "Connections serving the function.",
                labels(),
                f.servers.len() as u64,
            );
            self.counter("petrel_function_calls_total", "Calls routed to a server.", labels(), f.stats.calls);
            let help = "Calls answered with an error, failed by their server leaving, or refused as busy.";
            self.counter("petrel_function_errors_total", help, labels(), f.stats.errors);
            let help = "Calls without a reply before their deadline.";
            self.counter("petrel_function_timeouts_total", help, labels(), f.stats.timeouts);
        }
        let topics = broker.topic_names();
        self.gauge("petrel_topics", "Topics.", none(), topics.len() as u64);
        let queues = broker.queue_names();
        self.gauge("petrel_queues", "Queues.", none(), queues.len() as u64);
        if !ctx.config.metrics_per_queue {
            return;
        }
        for topic in topics.iter().filter(|t| names.shows(ctx, Kind::Topic, t)) {
            let Some(t) = broker.topic(topic) else { continue };
            for g in t.groups() {
                let labels = vec![Label::new("topic", topic.clone()), Label::new("group", g.name)];
                let help = "Messages of the topic the consumer group has not acknowledged.";
                self.gauge("petrel_group_lag_messages", help, labels, g.lag);
            }
        }
        for name in queues.iter().filter(|q| names.shows(ctx, Kind::Queue, q)) {
            let Some(q) = broker.queue(name).map(|q| q.counters()) else { continue };
            let labels = || vec![Label::new("queue", name.clone())];
            self.gauge("petrel_queue_messages", "Messages waiting (not taken).", labels(), q.items);
            self.gauge("petrel_queue_bytes", "Bytes of messages waiting, delayed and in flight.", labels(), q.bytes);
            let help = "Messages taken tentatively, not yet acknowledged.";
            self.gauge("petrel_queue_open_reads", help, labels(), q.in_flight);
            self.gauge("petrel_queue_waiters", "Consumers waiting for a message.", labels(), q.waiters);
            self.counter("petrel_queue_offered_total", "Messages offered.", labels(), q.total_offered);
            self.counter("petrel_queue_delivered_total", "Messages taken by consumers.", labels(), q.total_polled);
            self.counter("petrel_queue_expired_total", "Messages that expired.", labels(), q.expired);
            self.counter("petrel_queue_acked_total", "Tentative reads acknowledged.", labels(), q.acked);
            let help = "Tentative reads returned to the queue (abort, visibility timeout, disconnect).";
            self.counter("petrel_queue_returned_total", help, labels(), q.aborted);
            let help = "Messages moved to the dead-letter queue at max_deliveries.";
            self.counter("petrel_queue_dead_lettered_total", help, labels(), q.dead_lettered);
            let help =
                "Expired or over max_deliveries, and not taken by the dead-letter queue (full, or failing): lost.";
            self.counter("petrel_queue_dead_letters_lost_total", help, labels(), q.dead_letters_lost);
            let help = "Offered messages not stored: their idempotency key was remembered (repeats).";
            self.counter("petrel_queue_deduplicated_total", help, labels(), q.deduplicated);
            let help = "Idempotency keys the queue remembers now (its dedup window).";
            self.gauge("petrel_queue_dedup_keys", help, labels(), q.dedup_keys);
            let help =
                "Messages stored but not yet due (delayed offers and redeliveries), not in petrel_queue_messages.";
            self.gauge("petrel_queue_delayed", help, labels(), q.delayed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scrape_leaves_out_the_call_histograms_of_functions_its_user_may_not_name() {
        let events = Events::new();
        for function in ["billing.charge", "secret.rotate"] {
            let key = Key::from_parts(CALL_SECONDS, vec![Label::new("function", function)]);
            events.recorder.register_histogram(&key, &METADATA).record(0.001);
        }
        events.upkeep();
        assert!(events.render(|_| true).contains("function=\"secret.rotate\""));
        let text = events.render(|function| function != "secret.rotate");
        assert!(text.contains("function=\"billing.charge\""), "{text}");
        assert!(!text.contains("secret"), "{text}");
    }
}
