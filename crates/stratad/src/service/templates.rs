//! Templates: the default one, builds, lookups, deletion; platform scope.

use super::prelude::*;

impl Service {
    /// The template a create starts from: the one named, or the newest ready
    /// one. A template still being built (the default one on a first start)
    /// is waited for, up to `template_wait`.
    pub(super) async fn resolve_template(
        &self,
        caller: &Caller,
        id: Option<&TemplateId>,
    ) -> ServiceResult<TemplateRecord> {
        let deadline = Instant::now() + self.config.template_wait;
        loop {
            let tpl = match id {
                Some(id) => self.get_template(caller, id).await?.record,
                None => {
                    let all = self.db(|s| s.list_templates(PLATFORM_SCOPE)).await?;
                    let ready = all.iter().rev().find(|t| t.status == TemplateStatus::Ready);
                    let building = all
                        .iter()
                        .rev()
                        .find(|t| t.status == TemplateStatus::Building);
                    match (ready, building) {
                        (Some(t), _) | (None, Some(t)) => t.clone(),
                        (None, None) => {
                            let failed = all
                                .iter()
                                .rev()
                                .find(|t| t.status == TemplateStatus::Failed)
                                .map(|t| {
                                    format!(
                                        " (template {} failed: {})",
                                        t.id,
                                        t.status_reason.as_deref().unwrap_or("unknown reason")
                                    )
                                })
                                .unwrap_or_default();
                            return Err(ServiceError::InvalidStateOther(format!(
                                "no template given and none is ready{failed}: build one with POST /v1/templates"
                            )));
                        }
                    }
                }
            };
            match tpl.status {
                TemplateStatus::Ready => return Ok(tpl),
                TemplateStatus::Building if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                TemplateStatus::Building => {
                    let step = self
                        .template_view(tpl.clone())
                        .progress
                        .map(|p| format!(" (now: {})", p.step))
                        .unwrap_or_default();
                    return Err(ServiceError::InvalidStateOther(format!(
                        "template {} is still being built{step}; retry later",
                        tpl.id
                    )));
                }
                other => {
                    return Err(ServiceError::InvalidStateOther(format!(
                        "template {} is {}{}",
                        tpl.id,
                        other.as_str(),
                        tpl.status_reason
                            .as_deref()
                            .map(|r| format!(": {r}"))
                            .unwrap_or_default()
                    )))
                }
            }
        }
    }

    /// `GET /v1/templates/{id}/stream`: template `id` (one the caller may
    /// use, ready, in this host's pool) as a `btrfs send` stream for
    /// another host of the cluster, incremental against template `parent`
    /// when the caller may use it too and this host holds it under the
    /// identity given (else full). Returns the stream and the parent
    /// identity used.
    pub async fn stream_template(
        &self,
        caller: &Caller,
        id: &TemplateId,
        parent: Option<(TemplateId, String)>,
    ) -> ServiceResult<(crate::engine::ByteStream, Option<String>)> {
        let tpl = self.get_template(caller, id).await?.record;
        if tpl.status != TemplateStatus::Ready {
            return Err(ServiceError::InvalidStateOther(format!(
                "template {id} is {}, not ready",
                tpl.status.as_str()
            )));
        }
        if !self.engine.has_template(id).await? {
            return Err(not_found("template", id));
        }
        let parent = match parent {
            Some((p, ident)) if self.get_template(caller, &p).await.is_ok() => Some((p, ident)),
            _ => None,
        };
        let (stream, used) = self.engine.send_template(id, parent).await?;
        info!(template = %id, parent = ?used, "template stream started");
        Ok((stream, used))
    }

    /// `POST /v1/templates/{id}/replicate {"host"}`: template `id` (one the
    /// caller may use, ready) copied into `host`'s pool: here when `host`
    /// is this host ([`crate::cluster::Cluster::ensure_template`]), else
    /// the call is sent to that host with the caller's credentials and its
    /// answer returned. `409 invalid_state` outside a cluster.
    pub async fn replicate_template(
        &self,
        caller: &Caller,
        id: &TemplateId,
        host: &str,
    ) -> ServiceResult<axum::response::Response> {
        use axum::response::IntoResponse;
        let tpl = self.get_template(caller, id).await?.record;
        if tpl.status != TemplateStatus::Ready {
            return Err(ServiceError::InvalidStateOther(format!(
                "template {id} is {}, not ready",
                tpl.status.as_str()
            )));
        }
        let Some(cluster) = self.cluster() else {
            return Err(ServiceError::InvalidStateOther(
                "this daemon is not a cluster host: its one pool holds every template".into(),
            ));
        };
        if host == cluster.host_id() {
            let fetched = cluster.ensure_template(self, &tpl).await?;
            let f = fetched.map(|f| {
                serde_json::json!({
                    "from": f.from,
                    "bytes": f.bytes,
                    "ms": f.ms as u64,
                    "parent": f.parent,
                })
            });
            return Ok(axum::Json(serde_json::json!({
                "template": id,
                "host": host,
                "fetched": f,
            }))
            .into_response());
        }
        cluster.replicate_on(id, host).await
    }

    /// Starts the build of the default template (`tpl-default`, named
    /// `default`, of `default_size`) unless a template is ready or building.
    /// Returns the build started, if any.
    pub async fn ensure_default_template(self: &Arc<Self>) -> ServiceResult<Option<TemplateView>> {
        let all = self.db(|s| s.list_templates(PLATFORM_SCOPE)).await?;
        if all
            .iter()
            .any(|t| matches!(t.status, TemplateStatus::Ready | TemplateStatus::Building))
        {
            return Ok(None);
        }
        let id: TemplateId = DEFAULT_TEMPLATE
            .parse()
            .map_err(|e: strata_core::id::IdError| ServiceError::InvalidRequest(e.to_string()))?;
        info!(template = %id, "no template yet: building the default one in the background");
        let v = self
            .build_template(
                &Caller::system(crate::caller::SystemReason::Platform),
                BuildTemplate {
                    id: Some(id),
                    name: Some("default".into()),
                    size: SizeSpec::default(),
                    ..BuildTemplate::default()
                },
                &GateOptions::default(),
            )
            .await?;
        Ok(Some(v))
    }

    /// Starts a template build; returns at once with the `building` record.
    pub async fn build_template(
        self: &Arc<Self>,
        caller: &Caller,
        cmd: BuildTemplate,
        opts: &GateOptions,
    ) -> ServiceResult<TemplateView> {
        let mut size = cmd.size.over(self.config.default_size);
        size.validate()?;
        if !caller.is_system()
            && cmd
                .id
                .as_ref()
                .is_some_and(|i| i.as_str() == DEFAULT_TEMPLATE)
        {
            return Err(ServiceError::Forbidden(format!(
                "template id {DEFAULT_TEMPLATE} is reserved for the platform"
            )));
        }
        self.authorize(caller, None, lifecycle("build_template"), opts)
            .await?;
        // A recipe is checked whole before anything is recorded: its base,
        // its plan, its uploaded files (`service::build`). Its template has
        // the base's vCPUs and memory (a fork keeps them).
        let job = match &cmd.recipe {
            Some(r) => {
                let job = self.check_recipe(caller, r, cmd.ca_bundle.clone()).await?;
                // Another vCPU count or memory than the base's: built on
                // the base's size variant (`service::variants`).
                let asked = cmd.size.over(job.base.size);
                asked.validate()?;
                let at_base = SandboxSize {
                    disk_gib: asked.disk_gib,
                    ..job.base.size
                };
                check_source_size(
                    &format!("base template {}", job.base.id),
                    job.base.size,
                    at_base,
                )?;
                size = asked;
                Some(job)
            }
            None if cmd.ca_bundle.is_some() => {
                return Err(ServiceError::InvalidRequest(
                    "ca_bundle is for recipe builds (give a recipe)".into(),
                ))
            }
            None => None,
        };
        if cmd.sizes.len() > super::variants::MAX_VARIANTS_PER_TEMPLATE {
            return Err(ServiceError::InvalidRequest(format!(
                "sizes: at most {} variants",
                super::variants::MAX_VARIANTS_PER_TEMPLATE
            )));
        }
        let mut sizes = Vec::new();
        for s in &cmd.sizes {
            let v = s.over(size);
            v.validate()?;
            if super::variants::needs_variant(size, v) && !sizes.contains(&v) {
                sizes.push(v);
            }
        }
        let id = cmd.id.unwrap_or_else(TemplateId::generate);
        let id2 = id.clone();
        if let Some(t) = self.db(move |s| s.get_template(&id2)).await? {
            if t.tenant != caller.owner() {
                // Ids are global: one once used by another owner (the
                // platform's included) stays theirs, whatever its status.
                return Err(ServiceError::Conflict(format!("template id {id} is taken")));
            }
            if t.status == TemplateStatus::Failed {
                // A failed build may have left parts behind; a rebuild starts clean.
                let _ = self.engine.delete_template(&id).await;
            } else if t.status != TemplateStatus::Deleted {
                return Err(ServiceError::Conflict(format!(
                    "template {id} exists ({})",
                    t.status.as_str()
                )));
            }
        }
        // A plain build's guest trusts the deployment's TLS interception CA
        // while interception is on (a recipe build installs it as a step).
        let trust = match job {
            None => self.with_intercept_ca(None)?,
            Some(_) => None,
        };
        // Room for the builder VM, held until the build ends (a recipe's
        // builder is a sandbox: its create is admitted as any).
        let builder = match job {
            None => Some(self.admit_build(size).await?),
            Some(_) => None,
        };
        let now = self.now();
        let rec = TemplateRecord {
            id: id.clone(),
            tenant: caller.owner().to_owned(),
            name: cmd.name,
            size,
            status: TemplateStatus::Building,
            status_reason: None,
            accel: None,
            created_at: now,
            updated_at: now,
            variant_of: None,
        };
        let r = rec.clone();
        self.db(move |s| s.put_template(&r)).await?;
        self.set_progress(&id, "starting", None);
        let this = self.clone();
        let owner_caller = caller.clone();
        let mut rec2 = rec.clone();
        tokio::spawn(
            async move {
                let _builder = builder;
                let weak = Arc::downgrade(&this);
                let tid = rec2.id.clone();
                let sink: crate::engine::ProgressSink = Arc::new(move |step: &str| {
                    if let Some(s) = weak.upgrade() {
                        s.set_progress(&tid, step, None);
                    }
                });
                let result = match job {
                    Some(job) => {
                        async {
                            let job = this.rebase_on_variant(job, rec2.size).await?;
                            let accel = job.base.accel.clone().unwrap_or_default();
                            this.run_recipe(&owner_caller, &rec2, job)
                                .await
                                .map(|ms| (accel, ms))
                        }
                        .await
                    }
                    None => this
                        .engine
                        .build_template_trusting(&rec2.id, rec2.size, sink, trust)
                        .await
                        .map(|info| (info.accel, info.build_ms))
                        .map_err(ServiceError::from),
                };
                match result {
                    Ok((accel, build_ms)) => {
                        rec2.status = TemplateStatus::Ready;
                        rec2.accel = Some(accel);
                        info!(build_ms, "template ready");
                    }
                    Err(e) => {
                        warn!(error = %e.message(), "template build failed");
                        rec2.status = TemplateStatus::Failed;
                        rec2.status_reason = Some(e.message());
                    }
                }
                rec2.updated_at = this.now();
                this.progress
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&rec2.id);
                let r = rec2.clone();
                if let Err(e) = this.db(move |s| s.put_template(&r)).await {
                    warn!(error = %e.message(), "recording template failed");
                } else if rec2.status == TemplateStatus::Ready {
                    // Other hosts can fetch it from now on, not from the
                    // next renewal round.
                    if let Some(c) = this.cluster() {
                        c.sync_held(&this).await;
                    }
                    // `sizes`: its variants, built now (in the background).
                    for s in sizes {
                        if let Err(e) = this.variant(&rec2, s).await {
                            warn!(error = %e.message(), vcpus = s.vcpus, memory_mib = s.memory_mib, "starting a size variant failed");
                        }
                    }
                }
            }
            .instrument(tracing::info_span!("template", template = %id)),
        );
        Ok(self.template_view(rec))
    }

    pub(super) fn template_view(&self, record: TemplateRecord) -> TemplateView {
        let progress = self
            .progress
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&record.id)
            .cloned();
        TemplateView { record, progress }
    }

    /// Templates not deleted that the caller may use: the platform's and
    /// its tenant's (the daemon: all).
    pub async fn list_templates(&self, caller: &Caller) -> ServiceResult<Vec<TemplateView>> {
        let tenant = caller.tenant().map(str::to_owned);
        let v = self
            .db(move |s| match tenant {
                None => s.all_templates(),
                Some(t) => {
                    let mut v = s.list_templates(PLATFORM_SCOPE)?;
                    v.extend(s.list_templates(&t)?);
                    v.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
                    Ok(v)
                }
            })
            .await?;
        Ok(v.into_iter()
            .filter(|r| r.status != TemplateStatus::Step && r.variant_of.is_none())
            .map(|r| self.template_view(r))
            .collect())
    }

    /// One template the caller may use (another tenant's answers like an
    /// unknown id).
    pub async fn get_template(
        &self,
        caller: &Caller,
        id: &TemplateId,
    ) -> ServiceResult<TemplateView> {
        match self.template_record(id).await {
            Ok(r) if caller.sees_template(&r.tenant) && r.status != TemplateStatus::Step => {
                Ok(self.template_view(r))
            }
            Ok(_) => Err(not_found("template", id)),
            Err(e) => Err(e),
        }
    }

    /// Deletes one of the caller's templates (sandboxes made from it are
    /// independent). Platform templates are deleted by no tenant.
    pub async fn delete_template(
        &self,
        caller: &Caller,
        id: &TemplateId,
        opts: &GateOptions,
    ) -> ServiceResult<TemplateView> {
        let v = self.get_template(caller, id).await?;
        if v.record.tenant != caller.owner() {
            return Err(ServiceError::Forbidden(format!(
                "template {id} belongs to the platform; no tenant may delete it"
            )));
        }
        self.authorize(caller, None, lifecycle("delete_template"), opts)
            .await?;
        let mut v = self.get_template(caller, id).await?;
        if v.record.status == TemplateStatus::Building {
            return Err(ServiceError::Conflict(format!(
                "template {id} is being built"
            )));
        }
        v.record.status = TemplateStatus::Deleted;
        v.record.updated_at = self.now();
        let r = v.record.clone();
        self.db(move |s| s.put_template(&r)).await?;
        if let Err(e) = self.engine.delete_template(id).await {
            warn!(template = %id, error = %e.message(), "removing template failed; recovery will retry");
        }
        self.delete_variants(id).await;
        Ok(v)
    }
}
