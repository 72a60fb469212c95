//! `/metrics`: every figure read at the scrape into a fresh recorder (not a second set of
//! counters to keep in step, and a removed queue's series go with it), rendered in the
//! Prometheus text format by `metrics-exporter-prometheus`.

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use metrics::{Key, KeyName, Label, Metadata, Recorder};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusRecorder};

use super::Ctxt;
use crate::Ctx;
use crate::stats::get as read;

/// `/metrics` (the router asks for a user first, unless `http_open_metrics`).
/// Off the runtime's workers: a scrape of 10,000 queues takes ~0.2 s (docs/benchmarks.md).
pub(super) async fn scrape(State(ctx): Ctxt) -> Response {
    let rendered = tokio::task::spawn_blocking(move || {
        let scrape = Scrape::new();
        scrape.collect(&ctx);
        scrape.recorder.handle().render()
    })
    .await;
    match rendered {
        Ok(text) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response(),
        Err(e) => super::refusal(axum::http::StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
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

    fn collect(&self, ctx: &Ctx) {
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
        self.counter("petrel_acl_denials_total", "Requests an ACL refused.", none(), broker.denials());
        let (memory_used, memory_max) = broker.memory();
        self.gauge("petrel_memory_queued_bytes", "Bytes held against max_memory_bytes.", none(), memory_used);
        self.gauge("petrel_memory_budget_bytes", "max_memory_bytes (0: no limit).", none(), memory_max);
        let (resident, releases) = broker.resident_pages();
        let help = "Mapped segment bytes counted against max_resident_bytes.";
        self.gauge("petrel_resident_counted_bytes", help, none(), resident);
        self.counter("petrel_resident_releases_total", "Segments that gave their pages back.", none(), releases);
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
        let names = broker.queue_names();
        self.gauge("petrel_queues", "Queues.", none(), names.len() as u64);
        if !ctx.config.metrics_per_queue {
            return;
        }
        for name in &names {
            let Some(q) = broker.queue(name).map(|q| q.stats()) else { continue };
            let labels = || vec![Label::new("queue", name.clone())];
            self.gauge("petrel_queue_messages", "Messages waiting (not taken).", labels(), q.items);
            self.gauge("petrel_queue_bytes", "Bytes of messages waiting and in flight.", labels(), q.bytes);
            let help = "Messages taken tentatively, not yet acknowledged.";
            self.gauge("petrel_queue_open_reads", help, labels(), q.in_flight);
            self.gauge("petrel_queue_waiters", "Consumers waiting for a message.", labels(), q.waiters);
            self.counter("petrel_queue_offered_total", "Messages offered.", labels(), q.total_offered);
            self.counter("petrel_queue_delivered_total", "Messages taken by consumers.", labels(), q.total_polled);
            self.counter("petrel_queue_expired_total", "Messages that expired.", labels(), q.expired);
        }
    }
}
