//! The guest's end of the agent port, as QMP reports it.
//!
//! QEMU sends `VSERPORT_CHANGE {id, open}` when the guest opens or closes a
//! named virtio-serial port, and once more right after an incoming
//! migration's VM runs again (its post-load step replays the port's state).
//! The watcher counts the openings of the agent's port ([`AGENT_PORT_ID`])
//! on a `watch` channel, which the host's agent client takes as the cue to
//! send its Hello at once instead of at its next timed resend.
//!
//! Contract: the watcher subscribes before the VM's vCPUs first run, so no
//! opening is missed; it ends with the QMP connection (or the handle).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde_json::Value;
use tokio::sync::{broadcast, watch};

use crate::cmdline::AGENT_PORT_ID;
use crate::qmp::QmpEvent;

/// Openings of the agent port seen so far, and when the last one arrived.
#[derive(Debug, Default)]
pub(super) struct PortOpens {
    pub(super) last: Mutex<Option<Instant>>,
}

/// Whether `ev` says the guest's end of the agent port is open now.
pub(crate) fn agent_port_opened(ev: &QmpEvent) -> bool {
    agent_port_is(ev, true)
}

/// Whether `ev` says the guest closed its end of the agent port (the
/// agent exited, or the guest is shutting down).
pub(crate) fn agent_port_closed(ev: &QmpEvent) -> bool {
    agent_port_is(ev, false)
}

fn agent_port_is(ev: &QmpEvent, open: bool) -> bool {
    ev.event == "VSERPORT_CHANGE"
        && ev.data.get("id").and_then(Value::as_str) == Some(AGENT_PORT_ID)
        && ev.data.get("open").and_then(Value::as_bool) == Some(open)
}

/// Counts the agent port's openings from `events` into `tx` (and its
/// closings into `closes`) until the QMP connection ends.
pub(super) async fn watch_agent_port(
    mut events: broadcast::Receiver<QmpEvent>,
    tx: watch::Sender<u64>,
    closes: watch::Sender<u64>,
    opens: Arc<PortOpens>,
) {
    loop {
        let ev = match events.recv().await {
            Ok(ev) => ev,
            // Events were dropped (a burst of 256): the port may have opened
            // among them; a spurious Hello is harmless, a missed one costs a
            // resend interval.
            Err(broadcast::error::RecvError::Lagged(_)) => {
                tx.send_modify(|n| *n += 1);
                continue;
            }
            Err(broadcast::error::RecvError::Closed) => return,
        };
        if agent_port_opened(&ev) {
            *opens.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
            tracing::debug!("guest opened the agent port (VSERPORT_CHANGE)");
            tx.send_modify(|n| *n += 1);
        } else if agent_port_closed(&ev) {
            tracing::debug!("guest closed the agent port (VSERPORT_CHANGE)");
            closes.send_modify(|n| *n += 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn ev(name: &str, data: Value) -> QmpEvent {
        QmpEvent {
            event: name.into(),
            data,
        }
    }

    #[test]
    fn only_the_agent_port_opening_counts() {
        assert!(agent_port_opened(&ev(
            "VSERPORT_CHANGE",
            json!({"id": "agentport", "open": true})
        )));
        assert!(!agent_port_opened(&ev(
            "VSERPORT_CHANGE",
            json!({"id": "agentport", "open": false})
        )));
        assert!(!agent_port_opened(&ev(
            "VSERPORT_CHANGE",
            json!({"id": "other", "open": true})
        )));
        assert!(!agent_port_opened(&ev("RESUME", json!({}))));
        assert!(!agent_port_opened(&ev("VSERPORT_CHANGE", Value::Null)));
    }

    #[tokio::test]
    async fn openings_and_closings_are_counted_and_timed() {
        let (etx, erx) = broadcast::channel(8);
        let (tx, mut rx) = watch::channel(0u64);
        let (ctx, crx) = watch::channel(0u64);
        let opens = Arc::new(PortOpens::default());
        let task = tokio::spawn(watch_agent_port(erx, tx, ctx, opens.clone()));
        etx.send(ev("RESUME", json!({}))).unwrap();
        etx.send(ev(
            "VSERPORT_CHANGE",
            json!({"id": "agentport", "open": false}),
        ))
        .unwrap();
        etx.send(ev(
            "VSERPORT_CHANGE",
            json!({"id": "agentport", "open": true}),
        ))
        .unwrap();
        rx.changed().await.unwrap();
        assert_eq!(*rx.borrow_and_update(), 1);
        // The closing came first: counted by the time the opening is.
        assert_eq!(*crx.borrow(), 1);
        assert!(opens.last.lock().unwrap().is_some());
        // The QMP connection ends: so does the watcher, and the channel closes.
        drop(etx);
        task.await.unwrap();
        assert!(rx.changed().await.is_err());
    }
}
