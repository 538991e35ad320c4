//! The one route table of the daemon's HTTP door: every route's method,
//! path (axum syntax), [`Action`], who may call it and whether a call is a
//! tool call (gated by policy and audited). The router
//! ([`super::router`]), the role check of the security layer, the metrics
//! labels, the OpenAPI test and the security matrix tests all come from
//! [`ROUTES`]; nothing else lists routes. (The web console's static files
//! under `/console/`, [`crate::console`], are not API routes: public, no
//! data, no role, merged beside this door.)

use crate::security::auth::Role;

/// What a route does (one per route).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum Action {
    Healthz,
    Livez,
    Metrics,
    OpenApi,
    Ca,
    Stats,
    CreateSandbox,
    ListSandboxes,
    GetSandbox,
    PatchSandbox,
    DeleteSandbox,
    Exec,
    TerminalTicket,
    Terminal,
    RunCode,
    Pause,
    Resume,
    Hibernate,
    Fork,
    Rewind,
    Events,
    SandboxMetrics,
    SandboxLogs,
    Port,
    TakeSnapshot,
    ListSnapshots,
    ReadFile,
    WriteFile,
    RemoveFile,
    ListDir,
    StatFile,
    MakeDir,
    GetSnapshot,
    DeleteSnapshot,
    ForkSnapshot,
    BuildTemplate,
    TemplateLogs,
    PutTemplateFile,
    GetTemplateFile,
    ListTemplates,
    GetTemplate,
    DeleteTemplate,
    BuildVariant,
    ListVariants,
    StreamTemplate,
    ReplicateTemplate,
    Whoami,
    CreateToken,
    ListTokens,
    RevokeToken,
    GetPolicy,
    PutPolicy,
    TestPolicy,
    GetSandboxPolicy,
    PutSandboxPolicy,
    Egress,
    ListApprovals,
    GetApproval,
    Approve,
    Deny,
    ExportAudit,
    VerifyAudit,
    EventStream,
    CreateWebhook,
    ListWebhooks,
    DeleteWebhook,
    WebhookDeliveries,
    SetSecret,
    ListSecrets,
    DeleteSecret,
    ListConnectors,
    Push,
    ImportOffer,
    ImportSnapshot,
    ImportRegister,
    Pull,
    Export,
    ExportSnapshot,
    Move,
    ImportAdopt,
    ReplicaOffer,
    ReplicaSnapshot,
    GetSettings,
    PutSettings,
}

impl Action {
    /// Whether the route needs a host's machines (a VM, the pool, the
    /// template builder, this host's sampler or logs): an API-only process
    /// (`[cluster] role = "api"`) forwards such a call on a sandbox or
    /// snapshot to its owner and refuses the rest (`api::forward`). The
    /// others are answered from the shared store by any process.
    pub fn runs_on_host(self) -> bool {
        use Action::*;
        !matches!(
            self,
            Healthz
                | Livez
                | Metrics
                | OpenApi
                | Ca
                | Stats
                | CreateSandbox
                | ListSandboxes
                | GetSandbox
                | Events
                | ListSnapshots
                | GetSnapshot
                | ListTemplates
                | GetTemplate
                | DeleteTemplate
                | ListVariants
                | ReplicateTemplate
                | Whoami
                | CreateToken
                | ListTokens
                | RevokeToken
                | GetPolicy
                | PutPolicy
                | TestPolicy
                | GetSandboxPolicy
                | PutSandboxPolicy
                | ListApprovals
                | GetApproval
                | Approve
                | Deny
                | ExportAudit
                | VerifyAudit
                | EventStream
                | CreateWebhook
                | ListWebhooks
                | DeleteWebhook
                | WebhookDeliveries
                | SetSecret
                | ListSecrets
                | DeleteSecret
                | ListConnectors
                | GetSettings
                | PutSettings
        )
    }
}

/// Who may call a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Anyone, without a token (`/healthz`, `/livez`).
    Open,
    /// A `metrics` token or an admin of the platform tenant (`/metrics`:
    /// every tenant's figures).
    HostMetrics,
    /// A token with one of these roles.
    Roles(&'static [Role]),
    /// No bearer (a browser's WebSocket cannot send one): a single-use
    /// ticket issued to a token with one of these roles, checked by the
    /// handler (`api::terminal`).
    Ticket(&'static [Role]),
    /// Another host of the cluster, not a user: the handler checks the
    /// host credential (`cluster::replicas`); no token's role applies.
    Host,
}

use Role::{Admin, Approver, Developer, Metrics as MetricsRole, Viewer};

/// Every role that reads records.
const READ: Access = Access::Roles(&[Admin, Developer, Approver, Viewer]);
/// Developers (and admins): sandboxes, guest files, templates.
const DEV: Access = Access::Roles(&[Admin, Developer]);
/// Approvers (and admins): answers to held calls.
const APPROVE: Access = Access::Roles(&[Admin, Approver]);
/// Admins of the tenant.
const ADMIN: Access = Access::Roles(&[Admin]);
/// Every token.
const ANY: Access = Access::Roles(&[Admin, Developer, Approver, Viewer, MetricsRole]);

/// One route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    /// HTTP method (`HEAD` is served and decided as `GET`).
    pub method: &'static str,
    /// Path in axum syntax (`:id`).
    pub path: &'static str,
    /// What it does.
    pub action: Action,
    /// Who may call it.
    pub access: Access,
    /// Whether a call is a tool call: decided by the policy gate (and
    /// audited) by the service command it runs.
    pub tool_call: bool,
}

const fn r(method: &'static str, path: &'static str, action: Action, access: Access) -> Route {
    Route {
        method,
        path,
        action,
        access,
        tool_call: false,
    }
}

const fn tool(method: &'static str, path: &'static str, action: Action, access: Access) -> Route {
    Route {
        tool_call: true,
        ..r(method, path, action, access)
    }
}

/// Every route of the door.
#[rustfmt::skip]
pub const ROUTES: &[Route] = &[
    r("GET", "/healthz", Action::Healthz, Access::Open),
    r("GET", "/livez", Action::Livez, Access::Open),
    r("GET", "/metrics", Action::Metrics, Access::HostMetrics),
    r("GET", "/v1/openapi.json", Action::OpenApi, ANY),
    r("GET", "/v1/stats", Action::Stats, READ),
    r("GET", "/v1/ca", Action::Ca, ANY),
    tool("POST", "/v1/sandboxes", Action::CreateSandbox, DEV),
    r("GET", "/v1/sandboxes", Action::ListSandboxes, READ),
    r("GET", "/v1/sandboxes/:id", Action::GetSandbox, READ),
    tool("PATCH", "/v1/sandboxes/:id", Action::PatchSandbox, DEV),
    tool("DELETE", "/v1/sandboxes/:id", Action::DeleteSandbox, DEV),
    tool("POST", "/v1/sandboxes/:id/exec", Action::Exec, DEV),
    // A terminal for the web console: a ticket (bearer), then the WebSocket
    // (the ticket and the daemon's own Origin; the exec is gated there).
    r("POST", "/v1/sandboxes/:id/terminal", Action::TerminalTicket, DEV),
    tool("GET", "/v1/sandboxes/:id/terminal", Action::Terminal, Access::Ticket(&[Admin, Developer])),
    // Code in the sandbox's code interpreter (guest port 49999, gated as that port).
    tool("POST", "/v1/sandboxes/:id/code", Action::RunCode, DEV),
    tool("POST", "/v1/sandboxes/:id/pause", Action::Pause, DEV),
    tool("POST", "/v1/sandboxes/:id/resume", Action::Resume, DEV),
    tool("POST", "/v1/sandboxes/:id/hibernate", Action::Hibernate, DEV),
    tool("POST", "/v1/sandboxes/:id/fork", Action::Fork, DEV),
    tool("POST", "/v1/sandboxes/:id/rewind", Action::Rewind, DEV),
    r("GET", "/v1/sandboxes/:id/events", Action::Events, READ),
    r("GET", "/v1/sandboxes/:id/metrics", Action::SandboxMetrics, READ),
    // What the guest's commands printed: guest data, like its files.
    r("GET", "/v1/sandboxes/:id/logs", Action::SandboxLogs, DEV),
    // A guest port, reverse-proxied (any of these methods; the rest of the
    // path and the query are the guest's).
    tool("GET", "/v1/sandboxes/:id/ports/:port", Action::Port, DEV),
    tool("POST", "/v1/sandboxes/:id/ports/:port", Action::Port, DEV),
    tool("PUT", "/v1/sandboxes/:id/ports/:port", Action::Port, DEV),
    tool("DELETE", "/v1/sandboxes/:id/ports/:port", Action::Port, DEV),
    tool("GET", "/v1/sandboxes/:id/ports/:port/*rest", Action::Port, DEV),
    tool("POST", "/v1/sandboxes/:id/ports/:port/*rest", Action::Port, DEV),
    tool("PUT", "/v1/sandboxes/:id/ports/:port/*rest", Action::Port, DEV),
    tool("DELETE", "/v1/sandboxes/:id/ports/:port/*rest", Action::Port, DEV),
    tool("POST", "/v1/sandboxes/:id/snapshots", Action::TakeSnapshot, DEV),
    r("GET", "/v1/sandboxes/:id/snapshots", Action::ListSnapshots, READ),
    tool("GET", "/v1/sandboxes/:id/files", Action::ReadFile, DEV),
    tool("PUT", "/v1/sandboxes/:id/files", Action::WriteFile, DEV),
    tool("DELETE", "/v1/sandboxes/:id/files", Action::RemoveFile, DEV),
    tool("GET", "/v1/sandboxes/:id/files/list", Action::ListDir, DEV),
    tool("GET", "/v1/sandboxes/:id/files/stat", Action::StatFile, DEV),
    tool("POST", "/v1/sandboxes/:id/files/mkdir", Action::MakeDir, DEV),
    r("GET", "/v1/snapshots/:id", Action::GetSnapshot, READ),
    tool("DELETE", "/v1/snapshots/:id", Action::DeleteSnapshot, DEV),
    tool("POST", "/v1/snapshots/:id/fork", Action::ForkSnapshot, DEV),
    tool("POST", "/v1/templates", Action::BuildTemplate, DEV),
    r("GET", "/v1/templates", Action::ListTemplates, READ),
    r("GET", "/v1/templates/:id", Action::GetTemplate, READ),
    tool("DELETE", "/v1/templates/:id", Action::DeleteTemplate, DEV),
    r("GET", "/v1/templates/:id/logs", Action::TemplateLogs, READ),
    tool("POST", "/v1/templates/:id/variants", Action::BuildVariant, DEV),
    r("GET", "/v1/templates/:id/variants", Action::ListVariants, READ),
    r("GET", "/v1/templates/:id/stream", Action::StreamTemplate, DEV),
    r("POST", "/v1/templates/:id/replicate", Action::ReplicateTemplate, DEV),
    tool("PUT", "/v1/template-files/:id", Action::PutTemplateFile, DEV),
    r("GET", "/v1/template-files/:id", Action::GetTemplateFile, DEV),
    r("GET", "/v1/whoami", Action::Whoami, ANY),
    // The tenant's defaults for new sandboxes (replication: docs/cluster.md).
    r("GET", "/v1/settings", Action::GetSettings, READ),
    r("PUT", "/v1/settings", Action::PutSettings, ADMIN),
    r("POST", "/v1/tokens", Action::CreateToken, ADMIN),
    r("GET", "/v1/tokens", Action::ListTokens, ADMIN),
    r("DELETE", "/v1/tokens/:id", Action::RevokeToken, ADMIN),
    r("GET", "/v1/policy", Action::GetPolicy, READ),
    r("PUT", "/v1/policy", Action::PutPolicy, ADMIN),
    // A dry evaluation changes nothing.
    r("POST", "/v1/policy/test", Action::TestPolicy, READ),
    r("GET", "/v1/sandboxes/:id/policy", Action::GetSandboxPolicy, READ),
    r("PUT", "/v1/sandboxes/:id/policy", Action::PutSandboxPolicy, ADMIN),
    // Starting an egress proxy is a developer's action even though it is a GET.
    r("GET", "/v1/sandboxes/:id/egress", Action::Egress, DEV),
    r("GET", "/v1/approvals", Action::ListApprovals, READ),
    r("GET", "/v1/approvals/:id", Action::GetApproval, READ),
    r("POST", "/v1/approvals/:id/approve", Action::Approve, APPROVE),
    r("POST", "/v1/approvals/:id/deny", Action::Deny, APPROVE),
    r("GET", "/v1/audit", Action::ExportAudit, READ),
    r("GET", "/v1/audit/verify", Action::VerifyAudit, ADMIN),
    // The tenant's journal as server-sent events (docs/events.md).
    r("GET", "/v1/events", Action::EventStream, READ),
    // Webhooks carry guest-written data to a URL the tenant's admin names.
    r("POST", "/v1/webhooks", Action::CreateWebhook, ADMIN),
    r("GET", "/v1/webhooks", Action::ListWebhooks, ADMIN),
    r("DELETE", "/v1/webhooks/:id", Action::DeleteWebhook, ADMIN),
    r("GET", "/v1/webhooks/:id/deliveries", Action::WebhookDeliveries, ADMIN),
    // Connector secrets the egress proxy injects (docs/secrets.md): values
    // are write-only.
    r("POST", "/v1/secrets", Action::SetSecret, ADMIN),
    r("GET", "/v1/secrets", Action::ListSecrets, ADMIN),
    r("DELETE", "/v1/secrets/:id", Action::DeleteSecret, ADMIN),
    r("GET", "/v1/connectors", Action::ListConnectors, READ),
    // Moving a sandbox to another deployment (docs/move.md): the sender's
    // push, the receiver's offer, snapshot stream and registration (the
    // registration is the gated tool call that makes the sandbox).
    tool("POST", "/v1/sandboxes/:id/push", Action::Push, DEV),
    r("POST", "/v1/imports/:id/offer", Action::ImportOffer, DEV),
    r("PUT", "/v1/imports/:id/snapshots", Action::ImportSnapshot, DEV),
    tool("POST", "/v1/imports/:id", Action::ImportRegister, DEV),
    // A pull (docs/move.md): the puller's call (the copy is the caller's
    // tenant's), and the owner's export: its manifest, then one snapshot
    // stream per call (a read, still a tool call: the data leaves).
    tool("POST", "/v1/pulls", Action::Pull, DEV),
    tool("POST", "/v1/sandboxes/:id/export", Action::Export, DEV),
    tool("GET", "/v1/sandboxes/:id/export", Action::ExportSnapshot, DEV),
    // A move between the hosts of one cluster (docs/move.md): the call
    // (answered by the owner), and the target's taking up of the lease the
    // owner handed over (the owner's last step; the caller's token again).
    tool("POST", "/v1/sandboxes/:id/move", Action::Move, DEV),
    r("POST", "/v1/imports/:id/adopt", Action::ImportAdopt, DEV),
    // Replicas of a sandbox's snapshots, pushed by its owner host (docs/
    // cluster.md "Replicas"): the host credential, checked by the handler.
    r("POST", "/v1/cluster/replicas/:id/offer", Action::ReplicaOffer, Access::Host),
    r("PUT", "/v1/cluster/replicas/:id/snapshots", Action::ReplicaSnapshot, Access::Host),
];

impl Route {
    /// Whether a token of `role` may call this route.
    pub fn allows(&self, role: Role) -> bool {
        match self.access {
            Access::Open => true,
            Access::Host => false,
            Access::HostMetrics => role == MetricsRole || role == Admin,
            Access::Roles(roles) | Access::Ticket(roles) => roles.contains(&role),
        }
    }

    /// The label of the route in metrics and `/v1/stats` (`METHOD /path`).
    pub fn label(&self) -> String {
        format!("{} {}", self.method, self.path)
    }
}

/// The route of `(method, matched path)`; `HEAD` finds the `GET` route.
pub fn find(method: &str, path: &str) -> Option<&'static Route> {
    let method = if method == "HEAD" { "GET" } else { method };
    ROUTES.iter().find(|r| r.method == method && r.path == path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_entry_per_method_and_path_and_per_action() {
        let mut seen = std::collections::HashSet::new();
        let mut actions = std::collections::HashSet::new();
        for r in ROUTES {
            assert!(
                seen.insert((r.method, r.path)),
                "{} {} twice",
                r.method,
                r.path
            );
            // A proxied guest port is one action over several methods.
            assert!(
                actions.insert(r.action) || r.action == Action::Port,
                "{:?} twice",
                r.action
            );
        }
    }

    #[test]
    fn roles_mean_what_they_say() {
        let get = |m, p| find(m, p).unwrap();
        for role in [Viewer, Approver, MetricsRole] {
            assert!(
                !get("GET", "/v1/sandboxes/:id/files").allows(role),
                "{role:?}"
            );
            assert!(!get("HEAD", "/v1/sandboxes/:id/files/stat").allows(role));
        }
        assert!(get("GET", "/v1/sandboxes/:id").allows(Viewer));
        assert!(!get("GET", "/v1/sandboxes").allows(MetricsRole));
        assert!(get("GET", "/v1/whoami").allows(MetricsRole));
        assert!(get("POST", "/v1/approvals/:id/approve").allows(Approver));
        assert!(!get("POST", "/v1/approvals/:id/approve").allows(Developer));
        assert!(!get("GET", "/v1/tokens").allows(Developer));
        for r in ROUTES.iter().filter(|r| {
            r.access != Access::Open && r.access != Access::HostMetrics && r.access != Access::Host
        }) {
            assert!(r.allows(Admin), "{} {}", r.method, r.path);
        }
    }
}
