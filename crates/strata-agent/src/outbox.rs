//! Sending frames to the host, tagged with the session they belong to.

use bytes::{Bytes, BytesMut};
use strata_proto::frame::{Frame, FrameKind, SYNC_MAGIC};
use strata_proto::Response;
use tokio::sync::mpsc;

use crate::error::Fail;
use crate::transport::Outgoing;

/// Cheap handle that sends frames for one session epoch.
#[derive(Clone)]
pub struct Outbox {
    tx: mpsc::Sender<Outgoing>,
    epoch: Option<u64>,
}

impl Outbox {
    /// Frames tagged with `epoch` (`None`: always sent).
    pub fn new(tx: mpsc::Sender<Outgoing>, epoch: Option<u64>) -> Self {
        Self { tx, epoch }
    }

    async fn push(&self, data: Bytes) {
        // The writer thread only goes away when the agent exits.
        let _ = self
            .tx
            .send(Outgoing {
                epoch: self.epoch,
                data,
            })
            .await;
    }

    /// Sends a control message.
    pub async fn msg(&self, id: u32, r: &Response) {
        match Frame::control(id, r).and_then(|f| f.encode()) {
            Ok(b) => self.push(b).await,
            Err(e) => tracing::error!(error = %e, "cannot encode reply"),
        }
    }

    /// Sends the sync marker followed by a control message.
    pub async fn sync_msg(&self, id: u32, r: &Response) {
        let mut b = BytesMut::new();
        b.extend_from_slice(&SYNC_MAGIC);
        match Frame::control(id, r).and_then(|f| f.encode_into(&mut b)) {
            Ok(()) => self.push(b.freeze()).await,
            Err(e) => tracing::error!(error = %e, "cannot encode reply"),
        }
    }

    /// Sends a data frame.
    pub async fn data(&self, kind: FrameKind, id: u32, payload: Bytes) {
        match Frame::data(kind, id, payload).encode() {
            Ok(b) => self.push(b).await,
            Err(e) => tracing::error!(error = %e, "cannot encode data frame"),
        }
    }

    /// Sends an error reply.
    pub async fn error(&self, id: u32, f: Fail) {
        self.msg(
            id,
            &Response::Error {
                kind: f.kind,
                message: f.message,
            },
        )
        .await;
    }
}
