//! Templates across the hosts of a cluster (docs/cluster.md, "Templates
//! across hosts"): which hosts hold which template (PostgreSQL's
//! `template_holders`, [`HostStore::template_holders`]), and the fetch of a
//! template a create needs from a live host that holds it.
//!
//! Contract:
//! - Every renewal round, a host records the templates its pool holds and
//!   forgets those it no longer holds ([`Cluster::sync_held`]): one write
//!   per change, none when nothing changed. A copy whose template was
//!   deleted (through any host: the shared record says `deleted`) is
//!   removed from the pool in the same round, so a delete reaches every
//!   host that fetched the template within a renewal period or two, not at
//!   their next restart. Sandboxes made from it run on (a fork shares
//!   extents, not the subvolume).
//! - A create placed on a host that does not hold its template fetches it
//!   first ([`Cluster::ensure_template`]): from a live holder, over that
//!   host's `GET /v1/templates/{id}/stream` with the caller's own
//!   credentials (the holder authenticates and authorizes the caller again,
//!   and answers only for a template the caller may use), incremental
//!   against the template's parent (its variant's template, else the
//!   default template) when this host received that parent before, else in
//!   full. The stream goes through the hostile-stream receive of a move
//!   (`strata_storage::send`, `Runtime::receive_template`) and the template
//!   is kept only if restorable here and signed with the cluster's key.
//!   Concurrent creates of one template fetch it once (a per-template lock;
//!   the others find it held).
//! - No live holder, or every holder failed: `503 template_unavailable`
//!   naming the template ([`ServiceError::TemplateUnavailable`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use futures::TryStreamExt;
use strata_core::TemplateId;
use tracing::{info, warn};

use super::Cluster;
use crate::engine::RuntimeError;
use crate::service::{Service, ServiceError, ServiceResult, MAX_SNAPSHOT_STREAM_BYTES};
use crate::store::TemplateRecord;

/// The answer header of `GET /v1/templates/{id}/stream` naming the parent
/// identity the stream is relative to (absent: a full stream).
pub const STREAM_PARENT_HEADER: &str = "x-strata-stream-parent";

/// What the fetch of one template did (logged; tests read the log line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetched {
    /// The host it came from.
    pub from: String,
    /// Stream bytes received.
    pub bytes: u64,
    /// Whole fetch, ms (request to published).
    pub ms: u128,
    /// The parent template it was incremental against, if any.
    pub parent: Option<TemplateId>,
}

/// The per-host state of template replication.
#[derive(Debug, Default)]
pub(super) struct TemplateHolding {
    /// Templates this host recorded as held (so a round writes changes only).
    recorded: std::sync::Mutex<HashSet<TemplateId>>,
    /// One fetch per template at a time.
    locks: std::sync::Mutex<HashMap<TemplateId, Arc<tokio::sync::Mutex<()>>>>,
}

impl TemplateHolding {
    fn lock_of(&self, tpl: &TemplateId) -> Arc<tokio::sync::Mutex<()>> {
        self.locks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(tpl.clone())
            .or_default()
            .clone()
    }

    fn recorded(&self) -> std::sync::MutexGuard<'_, HashSet<TemplateId>> {
        self.recorded.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The template an incremental stream of `tpl` is best made against: its
/// variant's template, else the default template.
fn parent_of(tpl: &TemplateRecord) -> Option<TemplateId> {
    if let Some(v) = &tpl.variant_of {
        return Some(v.clone());
    }
    let default: TemplateId = crate::service::DEFAULT_TEMPLATE.parse().ok()?;
    (default != tpl.id).then_some(default)
}

impl Cluster {
    /// Records the templates this host's pool holds and forgets those it
    /// no longer holds (a write per change).
    pub(crate) async fn sync_held(&self, svc: &Service) {
        let Ok(subs) = svc.engine().subvolumes().await else {
            return;
        };
        let mut now: HashSet<TemplateId> = subs.templates.into_iter().collect();
        // Copies of templates deleted in the shared store (one point read
        // each: a host holds tens of templates, not thousands).
        let held: Vec<TemplateId> = now.iter().cloned().collect();
        let raw = self.raw.clone();
        let deleted: Vec<TemplateId> = tokio::task::spawn_blocking(move || {
            held.into_iter()
                .filter(|t| {
                    matches!(
                        raw.get_template(t),
                        Ok(Some(r)) if r.status == crate::store::TemplateStatus::Deleted
                    )
                })
                .collect()
        })
        .await
        .unwrap_or_default();
        for t in deleted {
            match svc.engine().delete_template(&t).await {
                Ok(()) => {
                    info!(template = %t, "template deleted in the cluster: this host's copy removed");
                    now.remove(&t);
                }
                Err(e) => {
                    warn!(template = %t, error = %e.message(), "removing the copy of a deleted template failed; the next round retries")
                }
            }
        }
        let (new, gone): (Vec<TemplateId>, Vec<TemplateId>) = {
            let rec = self.templates.recorded();
            (
                now.difference(&rec).cloned().collect(),
                rec.difference(&now).cloned().collect(),
            )
        };
        for t in new {
            let (me, t2) = (self.info.id.clone(), t.clone());
            match self
                .blocking(move |h| h.add_template_holder(t2.as_str(), &me))
                .await
            {
                Ok(()) => {
                    self.templates.recorded().insert(t);
                }
                Err(e) => {
                    warn!(template = %t, error = %e, "cannot record a template this host holds")
                }
            }
        }
        for t in gone {
            let (me, t2) = (self.info.id.clone(), t.clone());
            match self
                .blocking(move |h| h.remove_template_holder(t2.as_str(), &me))
                .await
            {
                Ok(()) => {
                    self.templates.recorded().remove(&t);
                }
                Err(e) => {
                    warn!(template = %t, error = %e, "cannot forget a template this host deleted")
                }
            }
        }
    }

    /// The hosts that hold template `tpl` (alive or not).
    pub async fn template_holders(&self, tpl: &TemplateId) -> ServiceResult<Vec<String>> {
        let t = tpl.clone();
        self.blocking(move |h| h.template_holders(t.as_str()))
            .await
            .map_err(super::host_to_service)
    }

    /// Makes sure template `tpl` is in this host's pool, fetching it from a
    /// live holder when it is not (see the module docs). `None`: it was
    /// here already (or another create fetched it meanwhile).
    pub async fn ensure_template(
        &self,
        svc: &Service,
        tpl: &TemplateRecord,
    ) -> ServiceResult<Option<Fetched>> {
        let engine = svc.engine();
        if engine.has_template(&tpl.id).await? {
            return Ok(None);
        }
        let lock = self.templates.lock_of(&tpl.id);
        let _one = lock.lock().await;
        if engine.has_template(&tpl.id).await? {
            return Ok(None);
        }
        let unavailable = |why: String| ServiceError::TemplateUnavailable {
            template: tpl.id.to_string(),
            why,
        };
        let holders = self.template_holders(&tpl.id).await?;
        let hosts = self.hosts_view().await?;
        let live: Vec<(String, String)> = hosts
            .iter()
            .filter(|h| h.alive && h.info.id != self.info.id && holders.contains(&h.info.id))
            .map(|h| (h.info.id.clone(), h.info.address.clone()))
            .collect();
        if live.is_empty() {
            return Err(unavailable(if holders.is_empty() {
                "no host holds it".into()
            } else {
                format!("no live host holds it (held by {})", holders.join(", "))
            }));
        }
        let parent = match parent_of(tpl) {
            Some(p) => engine
                .received_template_identity(&p)
                .await?
                .map(|ident| (p, ident)),
            None => None,
        };
        let mut failures = Vec::new();
        for (host, addr) in &live {
            match self.fetch_from(svc, tpl, host, addr, parent.clone()).await {
                Ok(f) => {
                    info!(
                        template = %tpl.id,
                        from = %f.from,
                        bytes = f.bytes,
                        ms = f.ms as u64,
                        parent = ?f.parent,
                        "template fetched"
                    );
                    let (me, t) = (self.info.id.clone(), tpl.id.clone());
                    self.blocking(move |h| h.add_template_holder(t.as_str(), &me))
                        .await
                        .map_err(super::host_to_service)?;
                    self.templates.recorded().insert(tpl.id.clone());
                    return Ok(Some(f));
                }
                Err(e) => {
                    warn!(template = %tpl.id, from = %host, error = %e, "template fetch failed");
                    failures.push(format!("{host}: {e}"));
                }
            }
        }
        Err(unavailable(format!(
            "fetching it failed: {}",
            failures.join("; ")
        )))
    }

    /// Sends `POST /v1/templates/{tpl}/replicate` to live host `host`
    /// with the caller's credentials and returns its answer.
    pub async fn replicate_on(
        &self,
        tpl: &TemplateId,
        host: &str,
    ) -> ServiceResult<axum::response::Response> {
        if crate::api::forward::is_forwarded() {
            return Err(ServiceError::Conflict(format!(
                "a replication for host {host} arrived forwarded at host {}",
                self.info.id
            )));
        }
        let hosts = self.hosts_view().await?;
        let Some(h) = hosts.iter().find(|h| h.info.id == host && h.alive) else {
            return Err(ServiceError::InvalidRequest(format!(
                "host {host}: no live host of this cluster has this id"
            )));
        };
        let url = format!(
            "{}/v1/templates/{tpl}/replicate",
            h.info.address.trim_end_matches('/')
        );
        let mut req = crate::api::forward::client()
            .post(&url)
            .header(crate::api::forward::FORWARDED_HEADER, self.info.id.as_str())
            .json(&serde_json::json!({ "host": host }));
        if let Some(auth) = crate::api::forward::caller_authorization() {
            req = req.header(axum::http::header::AUTHORIZATION, auth);
        }
        let resp = req
            .send()
            .await
            .map_err(|e| ServiceError::TemplateUnavailable {
                template: tpl.to_string(),
                why: format!("host {host} cannot be reached: {e}"),
            })?;
        let status = axum::http::StatusCode::from_u16(resp.status().as_u16())
            .unwrap_or(axum::http::StatusCode::BAD_GATEWAY);
        let body = resp
            .bytes()
            .await
            .map_err(|e| ServiceError::TemplateUnavailable {
                template: tpl.to_string(),
                why: format!("host {host}'s answer: {e}"),
            })?;
        let mut r = axum::response::Response::new(axum::body::Body::from(body));
        *r.status_mut() = status;
        r.headers_mut().insert(
            axum::http::header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static("application/json"),
        );
        if let Ok(v) = host.parse() {
            r.headers_mut().insert(crate::api::forward::HOST_HEADER, v);
        }
        Ok(r)
    }

    async fn fetch_from(
        &self,
        svc: &Service,
        tpl: &TemplateRecord,
        host: &str,
        addr: &str,
        parent: Option<(TemplateId, String)>,
    ) -> Result<Fetched, String> {
        let t0 = Instant::now();
        let mut url = format!(
            "{}/v1/templates/{}/stream",
            addr.trim_end_matches('/'),
            tpl.id
        );
        if let Some((p, ident)) = &parent {
            url.push_str(&format!("?parent={p}&identity={ident}"));
        }
        let mut req = crate::api::forward::client()
            .get(&url)
            .header(crate::api::forward::FORWARDED_HEADER, self.info.id.as_str());
        if let Some(auth) = crate::api::forward::caller_authorization() {
            req = req.header(axum::http::header::AUTHORIZATION, auth);
        }
        let resp = req.send().await.map_err(|e| format!("request: {e}"))?;
        let status = resp.status();
        if !status.is_success() {
            let body = resp.text().await.unwrap_or_default();
            return Err(format!(
                "answered {}: {}",
                status.as_u16(),
                body.chars().take(300).collect::<String>()
            ));
        }
        let used = resp
            .headers()
            .get(STREAM_PARENT_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let from = host.to_owned();
        let body = resp
            .bytes_stream()
            .map_err(move |e| RuntimeError::Invalid(format!("template stream from {from}: {e}")));
        let bytes = svc
            .engine()
            .receive_template(
                &tpl.id,
                used.clone(),
                MAX_SNAPSHOT_STREAM_BYTES,
                Box::pin(body),
            )
            .await
            .map_err(|e| e.to_string())?;
        Ok(Fetched {
            from: host.to_owned(),
            bytes,
            ms: t0.elapsed().as_millis(),
            parent: used.and(parent.map(|p| p.0)),
        })
    }
}
