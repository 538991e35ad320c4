//! The host side of each sandbox's guest agent: connecting (and
//! reconnecting after a restore), egress, and the sync a restored guest needs.
//!
//! Contract:
//! - One [`AgentClient`] per live VM, made on first use and made again when
//!   the channel has closed (every restore closes it).
//! - Every connection enables egress when the sandbox has a target (the
//!   [`EgressResolver`], else `RuntimeConfig::egress_proxy`), so a guest
//!   keeps its egress across restores; without a target it has none.
//! - A guest started from a state gets fresh entropy and the host clock;
//!   a new sandbox also a new hostname and machine-id ([`Identity::New`]).

use std::sync::Arc;
use std::time::Instant;

use rand::RngCore;
use strata_core::SandboxId;
use strata_proto::msg::RestoreSync;
use strata_proto::{AgentClient, HandshakeStats, Liveness, TunnelHandler};

use super::vms::Live;
use super::{ms, Result, Runtime};
use crate::error::agent_err;

/// Finds how one sandbox's tunnels are served (the daemon: its policy proxy,
/// in-process); `None` leaves its egress closed. Called whenever the host
/// (re)connects to a sandbox's agent, e.g. after every restore.
pub type EgressResolver = Arc<
    dyn Fn(
            SandboxId,
        )
            -> std::pin::Pin<Box<dyn std::future::Future<Output = Option<TunnelHandler>> + Send>>
        + Send
        + Sync,
>;

/// Whether a guest started from a state becomes someone new.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Identity {
    /// The same sandbox again (rewind, restore, wake): hostname and
    /// machine-id stay.
    Keep,
    /// A new sandbox (create, fork, first start of one created hibernated):
    /// its id as hostname and a random machine-id.
    New,
    /// The same sandbox cold-booted from its disk (a disk-only state): its
    /// hostname set again (the boot gave the image's); the machine-id is on
    /// its disk.
    Reboot,
}

impl Runtime {
    /// Sets the per-sandbox egress target lookup (it takes precedence over
    /// `RuntimeConfig::egress_proxy`). Applies from the next agent connection.
    pub fn set_egress_resolver(&self, resolver: EgressResolver) {
        *self.egress.write().unwrap_or_else(|p| p.into_inner()) = Some(resolver);
    }

    /// Whether the agent handshake re-sends Hello the moment QMP reports the
    /// guest's agent port open (`VSERPORT_CHANGE`), on top of its timed
    /// resend. On by default; off is how it was before (for A/B runs).
    pub fn set_hello_on_port_open(&self, on: bool) {
        self.hello_cue
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// The agent of a live sandbox, connecting (or reconnecting) if needed.
    /// Map the errors of its calls with [`crate::RuntimeError::from_agent`].
    pub async fn agent(&self, id: &SandboxId) -> Result<AgentClient> {
        let live = self.live(id)?;
        self.agent_of(id, &live).await
    }

    pub(super) async fn agent_of(&self, id: &SandboxId, live: &Live) -> Result<AgentClient> {
        let mut slot = live.agent.lock().await;
        if let Some(a) = slot.as_ref() {
            if !a.is_closed() {
                return Ok(a.clone());
            }
        }
        let t = self.agent_timeout();
        // With an egress target, the client enables egress in this agent
        // session (again after every reconnect, e.g. after a restore) and
        // serves the guest's tunnels with the handler (a TCP target when
        // only `RuntimeConfig::egress_proxy` is set).
        let egress = self.egress_target(id).await;
        // A guest that stops answering is noticed within 5 s: the connection
        // closes, calls in flight fail, and the next use reconnects here.
        // The guest closing the agent's port (the agent exited) closes the
        // connection at once; the agent's successor is greeted when it
        // opens the port again.
        let liveness =
            Liveness::new(Some(live.running.clone())).with_gone(live.vm.agent_port_closes());
        let socket = live.vm.agent_socket();
        // QEMU's report that the guest opened its end of the port cues an
        // immediate Hello (the timed resend stays as the fallback).
        let cue = if self.hello_cue.load(std::sync::atomic::Ordering::Relaxed) {
            live.vm.agent_port_opens()
        } else {
            None
        };
        let connect = AgentClient::connect_unix_cued(&socket, t, egress, Some(liveness), cue);
        // A VM that dies before its agent answers (a QEMU killed in the
        // middle of a start, restore or rewind) fails the connect now, not
        // after the whole agent timeout spent knocking on a dead socket.
        let client = tokio::select! {
            r = connect => r.map_err(|e| agent_err(id.as_str(), e, t))?,
            exit = live.vm.wait_exit() => {
                return Err(crate::RuntimeError::VmFailed {
                    id: id.to_string(),
                    reason: format!("the VM exited before its agent answered: {}", exit.reason),
                });
            }
        };
        *slot = Some(client.clone());
        Ok(client)
    }

    /// How sandbox `id`'s guest egress is served now: the resolver's
    /// answer, else `RuntimeConfig::egress_proxy`, else none.
    pub(super) async fn egress_target(&self, id: &SandboxId) -> Option<TunnelHandler> {
        let resolver = self
            .egress
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        match resolver {
            Some(r) => r(id.clone()).await,
            None => None,
        }
        .or_else(|| self.cfg.egress_proxy.map(TunnelHandler::tcp))
    }

    /// Fresh entropy, the host clock and (for a new identity) hostname + machine-id.
    pub(super) async fn sync_guest(
        &self,
        id: &SandboxId,
        live: &Live,
        identity: Identity,
    ) -> Result<Synced> {
        let t0 = Instant::now();
        let agent = self.agent_of(id, live).await?;
        let session = Instant::now();
        tracing::debug!(sandbox = %id, connect_ms = ms(t0), "agent connected");
        let mut entropy = vec![0u8; 256];
        rand::rngs::OsRng.fill_bytes(&mut entropy);
        let (hostname, machine_id) = match identity {
            Identity::New => {
                let mut mid = [0u8; 16];
                rand::rngs::OsRng.fill_bytes(&mut mid);
                (Some(id.to_string()), Some(hex::encode(mid)))
            }
            Identity::Keep => (None, None),
            Identity::Reboot => (Some(id.to_string()), None),
        };
        let unix_time_ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        agent
            .restore_sync(RestoreSync {
                entropy,
                unix_time_ns,
                hostname,
                machine_id,
            })
            .await
            .map_err(|e| agent_err(id.as_str(), e, self.agent_timeout()))?;
        Ok(Synced {
            handshake: agent.handshake_stats(),
            session,
            synced: Instant::now(),
        })
    }
}

/// When the steps of a guest sync ended.
#[derive(Debug, Clone, Copy)]
pub(super) struct Synced {
    /// The agent connection's handshake (of the connection used: made now,
    /// or earlier when one was open already).
    pub(super) handshake: HandshakeStats,
    /// The agent session was ready (handshake, output window, egress).
    pub(super) session: Instant,
    /// `restore_sync` was answered.
    pub(super) synced: Instant,
}
