//! Connections to guest TCP ports over the agent channel (no guest network
//! needed): [`Runtime::connect_port`].

use strata_core::SandboxId;
use strata_proto::client::{PortError, PortStream};

use super::Runtime;
use crate::error::RuntimeError;

/// Why [`Runtime::connect_port`] gave no stream: the sandbox or its agent
/// channel failed, or the port tunnel was refused.
#[derive(Debug, thiserror::Error)]
pub enum PortOpenError {
    /// No live VM, or its agent did not answer.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// The agent refused or failed the port tunnel.
    #[error(transparent)]
    Port(#[from] PortError),
}

impl Runtime {
    /// Opens a byte stream to `127.0.0.1:<port>` inside the live sandbox
    /// `id` (running: a paused guest cannot answer until resumed). At most
    /// [`strata_proto::client::PORT_TUNNELS_MAX`] are open per sandbox.
    pub async fn connect_port(
        &self,
        id: &SandboxId,
        port: u16,
    ) -> Result<PortStream, PortOpenError> {
        let agent = self.agent(id).await?;
        Ok(agent.connect_port(port).await?)
    }
}
