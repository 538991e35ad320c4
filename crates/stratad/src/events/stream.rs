//! The event stream (`text/event-stream`): the journal of one tenant (or
//! one of its sandboxes) after a cursor, then live.
//!
//! Each message is `id: <seq>`, `event: <kind>`, `data: <one-line JSON>`
//! ([`crate::store::JournalEntry::message`]); a comment line is sent every
//! `[events] heartbeat` on an idle stream. A producer task reads the store
//! by seq (woken by the store after each commit) and hands messages to the
//! response through a channel of `[events] buffer` messages: a consumer
//! that leaves it full for `[events] slow_consumer_timeout` is
//! disconnected (it resumes with `Last-Event-ID`); nothing is buffered
//! beyond that.

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use tokio::sync::mpsc;

use super::StreamSlot;
use crate::service::Service;

/// Entries read from the store at once.
const PAGE: usize = 256;

/// The stream of `tenant`'s journal (of `sandbox` only, when given) after
/// `after`, holding `slot` while it is open; `follow: false` ends it after
/// the backlog.
pub fn respond(
    svc: Arc<Service>,
    slot: StreamSlot,
    tenant: String,
    sandbox: Option<String>,
    after: i64,
    follow: bool,
) -> Response {
    let cfg = svc.config().events.clone();
    let (tx, mut rx) = mpsc::channel::<SseEvent>(cfg.buffer.max(1));
    tokio::spawn(produce(svc, slot, tenant, sandbox, after, follow, tx));
    let body =
        futures::stream::poll_fn(move |cx| rx.poll_recv(cx).map(|o| o.map(Ok::<_, Infallible>)));
    let mut resp = Sse::new(body)
        .keep_alive(KeepAlive::new().interval(cfg.heartbeat).text("heartbeat"))
        .into_response();
    // Proxies must not hold the stream back.
    resp.headers_mut().insert(
        "x-accel-buffering",
        axum::http::HeaderValue::from_static("no"),
    );
    resp
}

async fn produce(
    svc: Arc<Service>,
    slot: StreamSlot,
    tenant: String,
    sandbox: Option<String>,
    mut cursor: i64,
    follow: bool,
    tx: mpsc::Sender<SseEvent>,
) {
    let _slot = slot;
    let cfg = svc.config().events.clone();
    // Subscribed before the first read: a commit after it wakes us.
    let mut changes = svc.journal_changes();
    loop {
        changes.borrow_and_update();
        let (t, sb) = (tenant.clone(), sandbox.clone());
        let batch = match svc
            .db(move |s| s.journal_after(&t, sb.as_deref(), cursor, PAGE))
            .await
        {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e.message(), "event stream: reading the journal failed");
                return;
            }
        };
        if batch.is_empty() {
            if !follow {
                return;
            }
            tokio::select! {
                r = changes.changed() => if r.is_err() { return },
                _ = tx.closed() => return,
            }
            continue;
        }
        for e in batch {
            let msg = SseEvent::default()
                .id(e.seq.to_string())
                .event(e.kind.as_str())
                .data(e.message().to_string());
            match tokio::time::timeout(cfg.slow_consumer_timeout, tx.send(msg)).await {
                Ok(Ok(())) => cursor = e.seq,
                Ok(Err(_)) => return,
                Err(_) => {
                    svc.metrics().count("event_stream_slow_consumer");
                    tracing::info!(tenant = %tenant, seq = e.seq, "event stream: consumer too slow, disconnected");
                    return;
                }
            }
        }
    }
}
