//! Size variants: a template at another vCPU count and memory.
//!
//! A fork keeps its source's vCPUs and memory (they are in its RAM file and
//! device state), so a template serves creates of its own size only. A
//! create of template `T` at another size uses `T`'s **variant** of that
//! size: `T`'s disk cold-booted at that size, with `T`'s start commands run
//! again until their ready checks pass, snapshotted and published like any
//! template. It is built once per (template, vCPUs, memory) — on the first
//! create of that size, or ahead (`POST /v1/templates/{id}/variants`,
//! `strata template build --sizes`, a `[pools]` entry with a size) — and
//! every later create of that size is a fork of it.
//!
//! How a variant is built, in the background, by the template's owner:
//! 1. builder 1 forks `T` at `T`'s size and is hibernated without memory
//!    (file systems synced and frozen: the disk alone is consistent);
//! 2. builder 2 cold-boots that disk at the new size (a disk-only state may
//!    boot at any size) and runs `T`'s start commands, base first, each
//!    until its ready check passes; its build log is the variant's
//!    (`GET /v1/templates/{variant}/logs`);
//! 3. builder 2's state is published as the variant (its own template id,
//!    `variant_of = T`, not listed); both builders are deleted.
//!
//! What a variant does not carry: what `T`'s guest had in memory besides
//! its start commands (a process a recipe step left running, the page
//! cache, a kernel's loaded imports beyond what its start command loads
//! again) — it is a fresh boot of the same disk. A recipe template
//! published before start commands were kept has no variants (rebuild it).
//! Variant builds run two at a time per daemon; a template has at most
//! [`MAX_VARIANTS_PER_TEMPLATE`] (a new size past that deletes the oldest
//! built one); deleting a template deletes its variants.

use sha2::{Digest, Sha256};

use super::build::{builder_spec, stranded_builder, BuildLog};
use super::prelude::*;

/// Size variants one template may have at once.
pub const MAX_VARIANTS_PER_TEMPLATE: usize = 8;

/// Variant builds running at once; more wait their turn.
const CONCURRENT_VARIANT_BUILDS: usize = 2;

/// Cold boots a variant build tries before it fails (the first one that
/// never reaches its agent is retried on a fresh builder).
const COLD_BOOT_ATTEMPTS: u32 = 2;

/// A failed variant is built again on a create after this long (before: the
/// failure is the answer).
const RETRY_FAILED_AFTER: chrono::TimeDelta = chrono::TimeDelta::seconds(60);

/// The daemon's variant builds: one decision at a time on whether to start
/// one, and a bound on how many run.
pub(crate) struct VariantBuilds {
    start: tokio::sync::Mutex<()>,
    running: Arc<tokio::sync::Semaphore>,
}

impl Default for VariantBuilds {
    fn default() -> Self {
        VariantBuilds {
            start: tokio::sync::Mutex::new(()),
            running: Arc::new(tokio::sync::Semaphore::new(CONCURRENT_VARIANT_BUILDS)),
        }
    }
}

/// A template's variant of one size.
#[derive(Debug, Clone)]
pub enum Variant {
    /// Built: creates of its size fork it.
    Ready(TemplateRecord),
    /// Being built (this call may have started it): its progress.
    Building(TemplateView),
}

/// Whether `size` needs a variant of a template of `tpl` size.
pub(crate) fn needs_variant(tpl: SandboxSize, size: SandboxSize) -> bool {
    tpl.vcpus != size.vcpus || tpl.memory_mib != size.memory_mib
}

impl Service {
    /// The id of `tpl`'s variant of `size` (its vCPUs and memory): derived,
    /// so concurrent creates find the same build; the template's creation
    /// time is part of it, so a template replaced under the same id never
    /// meets its predecessor's variants.
    fn variant_id(tpl: &TemplateRecord, size: SandboxSize) -> ServiceResult<TemplateId> {
        let mut h = Sha256::new();
        h.update(b"strata-variant/1\0");
        h.update(tpl.id.as_str().as_bytes());
        h.update([0u8]);
        h.update(tpl.created_at.timestamp_millis().to_le_bytes());
        h.update(size.vcpus.to_le_bytes());
        h.update(size.memory_mib.to_le_bytes());
        let hx = hex::encode(h.finalize());
        format!("tpl-v{}", &hx[..40])
            .parse()
            .map_err(|e: strata_core::id::IdError| ServiceError::InvalidRequest(e.to_string()))
    }

    /// The variants of `tpl` not deleted, any status.
    pub(super) async fn variants_of(&self, tpl: &TemplateId) -> ServiceResult<Vec<TemplateRecord>> {
        let id = tpl.clone();
        let all = self.db(|s| s.all_templates()).await?;
        Ok(all
            .into_iter()
            .filter(|t| t.variant_of.as_ref() == Some(&id))
            .collect())
    }

    /// `tpl`'s variant of `size`: ready, or being built — started here if
    /// there is none yet (or its last build failed over a minute ago).
    pub(crate) async fn variant(
        self: &Arc<Self>,
        tpl: &TemplateRecord,
        size: SandboxSize,
    ) -> ServiceResult<Variant> {
        if tpl.variant_of.is_some() {
            return Err(ServiceError::InvalidRequest(format!(
                "template {} is a size variant; create from the template it varies",
                tpl.id
            )));
        }
        if tpl.status != TemplateStatus::Ready {
            return Err(ServiceError::InvalidStateOther(format!(
                "template {} is {}",
                tpl.id,
                tpl.status.as_str()
            )));
        }
        size.validate()?;
        let id = Self::variant_id(tpl, size)?;
        let _g = self.variants.start.lock().await;
        let id2 = id.clone();
        let existing = self.db(move |s| s.get_template(&id2)).await?;
        match &existing {
            Some(r) if r.status == TemplateStatus::Ready => return Ok(Variant::Ready(r.clone())),
            Some(r) if r.status == TemplateStatus::Building => {
                return Ok(Variant::Building(self.template_view(r.clone())))
            }
            Some(r)
                if r.status == TemplateStatus::Failed
                    && self.now() - r.updated_at < RETRY_FAILED_AFTER =>
            {
                return Err(ServiceError::InvalidStateOther(format!(
                    "the {} vCPU / {} MiB variant of template {} failed: {}; it is built again from a minute after the failure (log: GET /v1/templates/{}/logs)",
                    size.vcpus,
                    size.memory_mib,
                    tpl.id,
                    r.status_reason.as_deref().unwrap_or("unknown reason"),
                    r.id
                )));
            }
            _ => {}
        }
        let origin = self.engine.template_starts(&tpl.id).await?;
        if origin.effective().is_none() {
            return Err(ServiceError::InvalidStateOther(format!(
                "template {} was built before templates kept their start commands, so it has no size variants: build it again to create it at other sizes",
                tpl.id
            )));
        }
        let mut others: Vec<TemplateRecord> = self
            .variants_of(&tpl.id)
            .await?
            .into_iter()
            .filter(|v| v.id != id)
            .collect();
        if others.len() >= MAX_VARIANTS_PER_TEMPLATE {
            // Full: the oldest built (or failed) variant goes (sandboxes made
            // from it are independent of it), so no caller can hold a
            // shared template's sizes for good; all of them being built is
            // a refusal.
            others.retain(|v| v.status != TemplateStatus::Building);
            let Some(oldest) = others
                .into_iter()
                .min_by_key(|v| (v.created_at, v.id.clone()))
            else {
                return Err(ServiceError::QuotaExceeded(format!(
                    "template {} has {MAX_VARIANTS_PER_TEMPLATE} size variants being built; retry when one is done",
                    tpl.id
                )));
            };
            info!(template = %tpl.id, variant = %oldest.id, "evicting the oldest size variant");
            self.metrics.count("template_variant_evicted");
            self.end_variant(oldest).await;
        }
        if existing.is_some() {
            // A failed or deleted build may have left parts; start clean.
            let _ = self.engine.delete_template(&id).await;
        }
        let now = self.now();
        let rec = TemplateRecord {
            id: id.clone(),
            tenant: tpl.tenant.clone(),
            name: Some(format!(
                "{} ({} vCPU, {} MiB)",
                tpl.name.as_deref().unwrap_or(tpl.id.as_str()),
                size.vcpus,
                size.memory_mib
            )),
            size: SandboxSize {
                disk_gib: tpl.size.disk_gib,
                ..size
            },
            status: TemplateStatus::Building,
            status_reason: None,
            accel: None,
            created_at: now,
            updated_at: now,
            variant_of: Some(tpl.id.clone()),
        };
        let r = rec.clone();
        self.db(move |s| s.put_template(&r)).await?;
        self.set_progress(&id, "queued", None);
        self.metrics.count("template_variant_started");
        info!(template = %tpl.id, variant = %id, vcpus = size.vcpus, memory_mib = size.memory_mib, "building a size variant");
        let this = self.clone();
        let tpl = tpl.clone();
        let mut done = rec.clone();
        tokio::spawn(
            async move {
                let t0 = Instant::now();
                let mut result = this.run_variant(&tpl, &done, origin).await;
                if result.is_ok() && this.template_record(&tpl.id).await.is_err() {
                    // Its template was deleted meanwhile: so is the variant.
                    result = Err(ServiceError::InvalidStateOther(format!(
                        "template {} was deleted during the build",
                        tpl.id
                    )));
                }
                match result {
                    Ok(accel) => {
                        done.status = TemplateStatus::Ready;
                        done.accel = Some(accel);
                        this.metrics.count("template_variant_ready");
                        info!(
                            build_ms = t0.elapsed().as_millis() as u64,
                            "size variant ready"
                        );
                    }
                    Err(e) => {
                        warn!(error = %e.message(), "size variant build failed");
                        this.metrics.count("template_variant_failed");
                        done.status = if this.template_record(&tpl.id).await.is_err() {
                            TemplateStatus::Deleted
                        } else {
                            TemplateStatus::Failed
                        };
                        done.status_reason = Some(e.message());
                        let _ = this.engine.delete_template(&done.id).await;
                    }
                }
                done.updated_at = this.now();
                this.progress
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&done.id);
                let r = done.clone();
                if let Err(e) = this.db(move |s| s.put_template(&r)).await {
                    warn!(error = %e.message(), "recording the size variant failed");
                }
                this.warm.wake.notify_one();
            }
            .instrument(tracing::info_span!("variant", variant = %id)),
        );
        Ok(Variant::Building(self.template_view(rec)))
    }

    /// Waits for variant `id` to be built, until `deadline`.
    pub(crate) async fn wait_variant(
        &self,
        id: &TemplateId,
        deadline: Instant,
    ) -> ServiceResult<TemplateRecord> {
        loop {
            let rec = self.template_record(id).await?;
            match rec.status {
                TemplateStatus::Ready => return Ok(rec),
                TemplateStatus::Building if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(250)).await
                }
                TemplateStatus::Building => {
                    return Err(ServiceError::InvalidStateOther(format!(
                        "size variant {id} is still being built; retry later"
                    )))
                }
                other => {
                    return Err(ServiceError::InvalidStateOther(format!(
                        "size variant {id} is {}{}",
                        other.as_str(),
                        rec.status_reason
                            .as_deref()
                            .map(|r| format!(": {r}"))
                            .unwrap_or_default()
                    )))
                }
            }
        }
    }

    /// `POST /v1/templates/{id}/variants`: builds (or finds) the caller's
    /// template's variant of `size` ahead of the creates that will use it.
    pub async fn build_variant(
        self: &Arc<Self>,
        caller: &Caller,
        id: &TemplateId,
        size: SizeSpec,
        opts: &GateOptions,
    ) -> ServiceResult<TemplateView> {
        let tpl = self.get_template(caller, id).await?.record;
        self.authorize(caller, None, lifecycle("create"), opts)
            .await?;
        let size = size.over(tpl.size);
        size.validate()?;
        if !needs_variant(tpl.size, size) {
            return Ok(self.template_view(tpl));
        }
        Ok(match self.variant(&tpl, size).await? {
            Variant::Ready(r) => self.template_view(r),
            Variant::Building(v) => v,
        })
    }

    /// `GET /v1/templates/{id}/variants`: the variants of a template the
    /// caller may use.
    pub async fn list_variants(
        &self,
        caller: &Caller,
        id: &TemplateId,
    ) -> ServiceResult<Vec<TemplateView>> {
        let tpl = self.get_template(caller, id).await?.record;
        Ok(self
            .variants_of(&tpl.id)
            .await?
            .into_iter()
            .map(|r| self.template_view(r))
            .collect())
    }

    /// `tpl`'s variant of `size` as recorded, without starting a build
    /// (the warm-pool filler: a failed variant is not retried for a pool).
    pub(super) async fn variant_record(
        &self,
        tpl: &TemplateRecord,
        size: SandboxSize,
    ) -> ServiceResult<Option<TemplateRecord>> {
        let id = Self::variant_id(tpl, size)?;
        Ok(self
            .db(move |s| s.get_template(&id))
            .await?
            .filter(|r| r.status != TemplateStatus::Deleted))
    }

    /// Deletes every variant of `tpl` (its template is being deleted).
    pub(super) async fn delete_variants(&self, tpl: &TemplateId) {
        let Ok(all) = self.variants_of(tpl).await else {
            return;
        };
        for v in all {
            if v.status == TemplateStatus::Building {
                // Its build ends on its own: finding its template gone, it
                // removes what it published and records the variant deleted.
                continue;
            }
            self.end_variant(v).await;
        }
    }

    /// Removes a variant's state and records it deleted.
    async fn end_variant(&self, mut v: TemplateRecord) {
        let _ = self.engine.delete_template(&v.id).await;
        v.status = TemplateStatus::Deleted;
        v.updated_at = self.now();
        let _ = self.db(move |s| s.put_template(&v)).await;
    }

    /// Builds variant `var` of `tpl` (module docs); returns the accelerator.
    async fn run_variant(
        self: &Arc<Self>,
        tpl: &TemplateRecord,
        var: &TemplateRecord,
        origin: crate::engine::TemplateStarts,
    ) -> ServiceResult<String> {
        // `variant` refused a template without recorded start commands.
        let starts = origin.effective().unwrap_or_default();
        let _turn = self
            .variants
            .running
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ServiceError::InvalidStateOther("the daemon is stopping".into()))?;
        let t0 = Instant::now();
        let mut log = BuildLog::create(
            self.build_log_path(&var.id),
            self.config.templates.log_max_bytes,
        )
        .await;
        log.line(&format!(
            "strata: building {} ({} vCPU, {} MiB) from template {}'s disk ({} start command(s))",
            var.id,
            var.size.vcpus,
            var.size.memory_mib,
            tpl.id,
            starts.len()
        ))
        .await;
        let owner = tpl.tenant.clone();
        let system = Caller::system(crate::caller::SystemReason::Platform);
        let spec = builder_spec(&var.id);
        let mut builders: Vec<SandboxId> = Vec::new();
        let outcome = async {
            self.set_progress(&var.id, "forking the template", Some(0.1));
            let mut first = self.new_record(&owner, &spec, tpl.size)?;
            first.template = Some(tpl.id.clone());
            builders.push(first.id.clone());
            let first = self
                .spawn_new(first, Source::Template(tpl.id.clone()), step::SPAWN)
                .await?;
            self.keep_lifecycle(&first, stranded_builder(), None).await;
            self.set_progress(&var.id, "syncing and freezing its disk", Some(0.2));
            let g = self
                .acquire(&first.id, Op::Hibernate, Who::Background)
                .await?;
            self.hibernate_locked(&first.id, g, false).await?;
            let fid = first.id.clone();
            let disk = self
                .db(move |s| s.latest_ready_snapshot(&fid))
                .await?
                .ok_or_else(|| {
                    ServiceError::InvalidStateOther("the disk snapshot is missing".into())
                })?;
            log.line(&format!(
                "strata: {}'s disk synced and frozen as {} ({:.1} s)",
                tpl.id,
                disk.id,
                t0.elapsed().as_secs_f64()
            ))
            .await;
            self.set_progress(
                &var.id,
                &format!(
                    "booting the disk with {} vCPU(s) and {} MiB",
                    var.size.vcpus, var.size.memory_mib
                ),
                Some(0.3),
            );
            let t_boot = Instant::now();
            // A cold boot is the one step here that depends on the guest
            // kernel alone; one that never reaches its agent (a stall seen
            // once in CI under TCG with 2 vCPUs; the runtime logs the
            // console's tail) is tried once more on a fresh builder before
            // the variant fails.
            let mut attempt = 0;
            let second = loop {
                attempt += 1;
                let mut second = self.new_record(&owner, &spec, var.size)?;
                second.template = Some(tpl.id.clone());
                builders.push(second.id.clone());
                match self
                    .spawn_new(second, Source::Snapshot(disk.id.clone()), step::SPAWN)
                    .await
                {
                    Ok(s) => break s,
                    Err(ServiceError::Engine(e @ RuntimeError::AgentTimeout { .. }))
                        if attempt < COLD_BOOT_ATTEMPTS =>
                    {
                        warn!(variant = %var.id, attempt, error = %e, "the variant's cold boot did not reach its agent; booting again");
                        log.line(&format!("strata: the boot did not answer ({e}); booting again"))
                            .await;
                    }
                    Err(e) => return Err(e),
                }
            };
            self.keep_lifecycle(&second, stranded_builder(), None).await;
            log.line(&format!(
                "strata: booted in {:.1} s",
                t_boot.elapsed().as_secs_f64()
            ))
            .await;
            for s in &starts {
                self.run_start(&system, &var.id, &second.id, s, &BTreeMap::new(), &mut log)
                    .await?;
            }
            self.set_progress(
                &var.id,
                "snapshotting the ready guest as the variant",
                Some(0.9),
            );
            let recipe = origin.recipe.map(|r| {
                // Its own content identity: a recipe on this variant must
                // not resume from steps cached on another size.
                format!("{r}@{}x{}", var.size.vcpus, var.size.memory_mib)
            });
            let snap = SnapshotId::generate();
            self.engine.snapshot(&second.id, &snap).await?;
            let published = self
                .engine
                .template_from_snapshot(&snap, &var.id, recipe, origin.starts)
                .await;
            let _ = self.engine.delete_snapshot(&snap).await;
            published?;
            Ok::<String, ServiceError>(second.accel.clone().unwrap_or_default())
        }
        .await;
        for b in builders {
            match self.delete(&system, &b, &GateOptions::default()).await {
                Ok(_) | Err(ServiceError::NotFound { .. }) => {}
                Err(e) => {
                    warn!(sandbox = %b, error = %e.message(), "removing a variant builder failed")
                }
            }
        }
        match &outcome {
            Ok(_) => {
                log.line(&format!(
                    "strata: variant {} ready in {:.1} s",
                    var.id,
                    t0.elapsed().as_secs_f64()
                ))
                .await
            }
            Err(e) => {
                log.line(&format!("strata: variant build failed: {}", e.message()))
                    .await
            }
        }
        outcome
    }
}
