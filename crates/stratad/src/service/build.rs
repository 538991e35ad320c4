//! Recipe builds: a template made from a base template and steps
//! (`strata-template`'s [`Recipe`]), in a builder sandbox, with a cache of
//! every step's state.
//!
//! How a build runs ([`Service::build_template`] with a recipe):
//! 1. **At the request** ([`Service::check_recipe`]): the base is a
//!    template the caller may use (or an alias of the default one); the
//!    recipe is planned on the base's identity (limits, user/cwd/env state,
//!    chain hashes); every `copy` archive was uploaded by the caller's tenant
//!    (`PUT /v1/template-files/{sha256}`); a CA bundle is PEM. Anything
//!    wrong is a `400 invalid_recipe` (or `404` for the base) and nothing
//!    is created.
//! 2. **In the background**: the deepest step whose state the owner has
//!    cached (a template record of status `step`, id derived from the owner
//!    and the step's chain hash) is the starting point; a builder sandbox
//!    (label `strata.build=<template>`) forks from it. Only a builder's
//!    policy knows the connector `strata-build-registries` (the hosts of
//!    `[templates] build_egress`, ports 80/443, in its platform layer); its
//!    sandbox layer allows that connector and denies every other egress
//!    (the platform's and tenant's hard rules still decide first). No other
//!    sandbox can reach the registries through this.
//! 3. Each remaining step runs through [`Service::exec`] as the template's
//!    owner (so the tool-call policy gates and audits it like any exec): a
//!    command as the step's user, in its cwd, with its env; a `copy` as a
//!    root script that unpacks the uploaded archive. Output goes to the
//!    build log (`GET /v1/templates/{id}/logs`, bounded); a non-zero exit
//!    fails the build with the log's tail, and no template is created.
//!    After each step that ran something the builder's state (RAM, disk,
//!    devices) is cached as a `step` template.
//! 4. The start command is left running (`setsid`, output in
//!    `/tmp/strata-start.log` in the guest), the ready check polled until
//!    it passes; the builder's state is published as the template, carrying
//!    its recipe hash (a recipe naming it as base chains on that), and the
//!    builder is deleted. Every fork of the template begins with the start
//!    process running.
//!
//! What it does not do: it does not isolate a build from the owner's own
//! sandboxes any more than any sandbox is isolated; cached steps are per
//! owner (a tenant never resumes from another's), and a cached step is
//! reused on the hash of what the recipe says, not on what a command
//! fetched (as Docker's layer cache: `pip install x` is cached whatever
//! version the registry serves tomorrow).

use std::path::PathBuf;

use sha2::{Digest, Sha256};
use strata_template::{Action, ExecPlan, Plan, Recipe};

use super::prelude::*;

/// Label a builder sandbox carries: the template it builds.
pub const BUILD_LABEL: &str = "strata.build";

/// Where a builder's start command writes its output, in the guest.
pub const START_LOG: &str = "/tmp/strata-start.log";

/// Where a CA bundle given to a build goes in the guest (and stays: the
/// template trusts it; it is also appended to the system bundle).
pub const BUILD_CA_PATH: &str = "/usr/local/share/ca-certificates/strata-build-ca.crt";

/// The guest's system CA bundle, which a build's CA bundle is appended to
/// (the runtime's constant: plain template builds append to it too).
pub use strata_runtime::SYSTEM_CA_BUNDLE;

/// Largest CA bundle a build accepts, in bytes.
const MAX_CA_BUNDLE: usize = 1 << 20;

/// Base names that mean the platform's default template (E2B's names too).
const DEFAULT_ALIASES: &[&str] = &["default", "base", "e2bdev/base", "e2bdev/base:latest"];

/// What a build request carries besides the recipe's plan.
#[derive(Debug, Clone)]
pub(super) struct RecipeJob {
    pub base: TemplateRecord,
    pub plan: Plan,
    pub ca_bundle: Option<String>,
    pub recipe: Recipe,
}

/// The build log of one template: a file of at most `cap` bytes, and the
/// last bytes written (for a failure's reason).
pub(super) struct BuildLog {
    file: Option<tokio::fs::File>,
    written: u64,
    cap: u64,
    tail: std::collections::VecDeque<u8>,
}

/// Bytes of output a failed step's reason quotes.
const TAIL_BYTES: usize = 2048;

impl BuildLog {
    pub(super) async fn create(path: PathBuf, cap: u64) -> Self {
        if let Some(dir) = path.parent() {
            let _ = tokio::fs::create_dir_all(dir).await;
        }
        let file = tokio::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(&path)
            .await
            .map_err(|e| warn!(path = %path.display(), error = %e, "cannot write the build log"))
            .ok();
        BuildLog {
            file,
            written: 0,
            cap,
            tail: std::collections::VecDeque::with_capacity(TAIL_BYTES),
        }
    }

    async fn write(&mut self, b: &[u8]) {
        use tokio::io::AsyncWriteExt;
        for &c in b
            .iter()
            .rev()
            .take(TAIL_BYTES)
            .collect::<Vec<_>>()
            .iter()
            .rev()
        {
            if self.tail.len() == TAIL_BYTES {
                self.tail.pop_front();
            }
            self.tail.push_back(*c);
        }
        let Some(f) = self.file.as_mut() else { return };
        if self.written >= self.cap {
            return;
        }
        let room = (self.cap - self.written) as usize;
        let (part, cut) = if b.len() > room {
            (&b[..room], true)
        } else {
            (b, false)
        };
        let _ = f.write_all(part).await;
        self.written += part.len() as u64;
        if cut {
            let _ = f.write_all(b"\n[strata: build log truncated]\n").await;
            self.written = self.cap;
        }
        let _ = f.flush().await;
    }

    pub(super) async fn line(&mut self, s: &str) {
        self.write(format!("{s}\n").as_bytes()).await;
    }

    fn tail(&self) -> String {
        let v: Vec<u8> = self.tail.iter().copied().collect();
        String::from_utf8_lossy(&v).trim_end().to_owned()
    }
}

/// The spec of a builder sandbox of template `tpl` (a recipe build's or a
/// size variant's): labelled `strata.build=<tpl>`, no rolling snapshots, an
/// idle timeout no build reaches.
pub(super) fn builder_spec(tpl: &TemplateId) -> SandboxSpec {
    let mut labels = BTreeMap::new();
    labels.insert(BUILD_LABEL.to_owned(), tpl.to_string());
    SandboxSpec {
        labels,
        idle_timeout: Some("6h".into()),
        snapshot_interval: Some("0s".into()),
        ..SandboxSpec::default()
    }
}

/// A builder's lifecycle: one a restart strands is deleted when it idles
/// out.
pub(super) fn stranded_builder() -> Option<LifecyclePolicy> {
    Some(LifecyclePolicy {
        on_timeout: OnTimeout::Delete,
        ..LifecyclePolicy::default()
    })
}

/// A recipe's start command and ready probe as a template keeps them.
fn own_start(plan: &Plan) -> strata_runtime::StartCommand {
    strata_runtime::StartCommand {
        start: plan.start.as_ref().map(guest_command),
        ready: plan.ready_probe.as_ref().map(guest_command),
        ready_timeout_secs: plan.ready.as_ref().map(|r| r.timeout_secs()).unwrap_or(0),
    }
}

fn guest_command(e: &ExecPlan) -> strata_runtime::GuestCommand {
    strata_runtime::GuestCommand {
        shell: e.shell.clone(),
        user: e.user.clone(),
        cwd: e.cwd.clone(),
        env: e.env.clone(),
    }
}

fn exec_plan(c: &strata_runtime::GuestCommand) -> ExecPlan {
    ExecPlan {
        shell: c.shell.clone(),
        user: c.user.clone(),
        cwd: c.cwd.clone(),
        env: c.env.clone(),
    }
}

/// Is `s` a lowercase hex sha256?
pub(crate) fn is_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// [`is_sha256`], as the template-file routes refuse a name (`400`).
fn check_sha256(s: &str) -> ServiceResult<()> {
    if is_sha256(s) {
        Ok(())
    } else {
        Err(ServiceError::InvalidRequest(format!(
            "{s:?} is not a lowercase hex sha256"
        )))
    }
}

/// The request of one build command: `sh -c` as the plan's user, in its
/// cwd, with its env; `extra` (the build's own, e.g. the CA for npm) where
/// the recipe set nothing of that name.
fn exec_request(e: &ExecPlan, extra: &BTreeMap<String, String>, timeout: Duration) -> ExecRequest {
    let mut req = ExecRequest::shell(e.shell.clone());
    req.user = Some(e.user.clone());
    req.cwd = Some(e.cwd.clone());
    req.env = e.env.clone();
    for (k, v) in extra {
        req.env.entry(k.clone()).or_insert_with(|| v.clone());
    }
    req.timeout = Some(timeout);
    req
}

impl Service {
    /// Directory of the `copy` archives tenant `owner` uploaded.
    fn template_files_dir(&self, owner: &str) -> PathBuf {
        let h = hex::encode(Sha256::digest(owner.as_bytes()));
        self.config.data_dir.join("template-files").join(&h[..32])
    }

    /// The build log of template `id`.
    pub(super) fn build_log_path(&self, id: &TemplateId) -> PathBuf {
        self.config
            .data_dir
            .join("build-logs")
            .join(format!("{id}.log"))
    }

    /// `PUT /v1/template-files/{sha256}`: stores a `copy` archive for the
    /// caller's tenant, checking that its content has that sha256 (else
    /// `400`, nothing kept) and is at most `max_upload_bytes` (`413`).
    /// Returns the bytes stored. Idempotent.
    pub async fn put_template_file(
        &self,
        caller: &Caller,
        sha256: &str,
        mut body: ByteStream,
        opts: &GateOptions,
    ) -> ServiceResult<u64> {
        check_sha256(sha256)?;
        self.authorize(caller, None, lifecycle("build_template"), opts)
            .await?;
        let io = |e: std::io::Error| {
            ServiceError::Engine(RuntimeError::Other(format!("template files: {e}")))
        };
        let dir = self.template_files_dir(caller.owner());
        tokio::fs::create_dir_all(&dir).await.map_err(io)?;
        let path = dir.join(sha256);
        if let Ok(m) = tokio::fs::metadata(&path).await {
            // Already here: drain nothing, keep what was checked.
            return Ok(m.len());
        }
        let tmp = dir.join(format!(".{sha256}.{}", rand::random::<u64>()));
        let result = async {
            use tokio::io::AsyncWriteExt;
            let mut f = tokio::fs::File::create(&tmp).await.map_err(io)?;
            let mut h = Sha256::new();
            let mut n = 0u64;
            while let Some(chunk) = body.next().await {
                let chunk = chunk?;
                n += chunk.len() as u64;
                if n > self.config.max_upload_bytes {
                    return Err(ServiceError::TooLarge(format!(
                        "a template file may be at most {} bytes (max_upload_bytes)",
                        self.config.max_upload_bytes
                    )));
                }
                h.update(&chunk);
                f.write_all(&chunk).await.map_err(io)?;
            }
            f.sync_all().await.map_err(io)?;
            let got = hex::encode(h.finalize());
            if got != sha256 {
                return Err(ServiceError::InvalidRequest(format!(
                    "the uploaded content's sha256 is {got}, not {sha256}"
                )));
            }
            tokio::fs::rename(&tmp, &path).await.map_err(io)?;
            Ok(n)
        }
        .await;
        if result.is_err() {
            let _ = tokio::fs::remove_file(&tmp).await;
        }
        result
    }

    /// `HEAD /v1/template-files/{sha256}`: whether the caller's tenant
    /// uploaded that archive.
    pub async fn has_template_file(&self, caller: &Caller, sha256: &str) -> ServiceResult<bool> {
        check_sha256(sha256)?;
        Ok(
            tokio::fs::metadata(self.template_files_dir(caller.owner()).join(sha256))
                .await
                .is_ok(),
        )
    }

    /// `GET /v1/templates/{id}/logs?offset=N`: the build log from byte
    /// `offset` (at most 256 KiB), the offset to ask next, and whether the
    /// build is over (the log will not grow).
    pub async fn template_log(
        &self,
        caller: &Caller,
        id: &TemplateId,
        offset: u64,
    ) -> ServiceResult<(Vec<u8>, u64, bool)> {
        use tokio::io::{AsyncReadExt, AsyncSeekExt};
        let v = self.get_template(caller, id).await?;
        let done = v.record.status != TemplateStatus::Building;
        let path = self.build_log_path(id);
        let Ok(mut f) = tokio::fs::File::open(&path).await else {
            return Ok((Vec::new(), offset, done));
        };
        let len = f.metadata().await.map(|m| m.len()).unwrap_or(0);
        if offset >= len {
            return Ok((Vec::new(), offset, done));
        }
        let io = |e: std::io::Error| {
            ServiceError::Engine(RuntimeError::Other(format!("build log: {e}")))
        };
        f.seek(std::io::SeekFrom::Start(offset)).await.map_err(io)?;
        let want = (len - offset).min(256 * 1024) as usize;
        let mut buf = vec![0u8; want];
        f.read_exact(&mut buf).await.map_err(io)?;
        let next = offset + want as u64;
        Ok((buf, next, done && next >= len))
    }

    /// The base a recipe names: a template id, a name of one of the
    /// caller's (or the platform's) ready templates, or an alias of the
    /// default template (`default`, `base`, `e2bdev/base`). A container
    /// image reference is refused with the list of what is supported.
    pub(super) async fn recipe_base(
        &self,
        caller: &Caller,
        base: &str,
    ) -> ServiceResult<TemplateRecord> {
        if let Ok(id) = base.parse::<TemplateId>() {
            return Ok(self.get_template(caller, &id).await?.record);
        }
        let all = self.list_templates(caller).await?;
        let ready = |name: &str| {
            all.iter()
                .rev()
                .find(|t| {
                    t.record.status == TemplateStatus::Ready
                        && t.record.name.as_deref() == Some(name)
                })
                .map(|t| t.record.clone())
        };
        if DEFAULT_ALIASES.contains(&base) {
            return match ready("default") {
                Some(t) => Ok(t),
                None => self.resolve_template(caller, None).await,
            };
        }
        let alias = match base {
            "e2bdev/code-interpreter" | "e2bdev/code-interpreter:latest" => "code-interpreter",
            other => other,
        };
        if let Some(t) = ready(alias) {
            return Ok(t);
        }
        Err(ServiceError::Recipe(strata_template::RecipeError::Invalid {
            at: strata_template::Location::default(),
            message: format!(
                "base {base:?} is not a template you can use: give a template id or name, or one of {} (other container images are not supported)",
                DEFAULT_ALIASES
                    .iter()
                    .chain(["e2bdev/code-interpreter"].iter())
                    .map(|a| format!("{a:?}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }))
    }

    /// Everything a recipe build checks before it is accepted (module docs,
    /// step 1).
    pub(super) async fn check_recipe(
        &self,
        caller: &Caller,
        recipe: &Recipe,
        ca_bundle: Option<String>,
    ) -> ServiceResult<RecipeJob> {
        recipe.validate()?;
        if let Some(ca) = &ca_bundle {
            if ca.len() > MAX_CA_BUNDLE
                || !ca.contains("-----BEGIN CERTIFICATE-----")
                || ca.contains('\0')
            {
                return Err(ServiceError::InvalidRequest(format!(
                    "ca_bundle: PEM certificates (-----BEGIN CERTIFICATE-----), at most {MAX_CA_BUNDLE} bytes"
                )));
            }
        }
        let ca_bundle = self.with_intercept_ca(ca_bundle)?;
        let base = self.recipe_base(caller, &recipe.base).await?;
        if base.status != TemplateStatus::Ready {
            return Err(ServiceError::InvalidStateOther(format!(
                "base template {} is {}",
                base.id,
                base.status.as_str()
            )));
        }
        let plan = self.plan_on(recipe, &base, ca_bundle.as_deref()).await?;
        let dir = self.template_files_dir(caller.owner());
        for s in &plan.steps {
            if let Action::Copy { sha256, .. } = &s.action {
                if tokio::fs::metadata(dir.join(sha256)).await.is_err() {
                    return Err(ServiceError::Recipe(strata_template::RecipeError::Invalid {
                        at: strata_template::Location {
                            step: Some(s.index),
                            line: None,
                        },
                        message: format!(
                            "copy archive {sha256} was not uploaded: PUT /v1/template-files/{sha256} first (`strata template build` does)"
                        ),
                    }));
                }
            }
        }
        Ok(RecipeJob {
            base,
            plan,
            ca_bundle,
            recipe: recipe.clone(),
        })
    }

    /// `ca_bundle` with the deployment's TLS interception CA appended when
    /// `[security] egress_tls_intercept` is on (docs/tls-interception.md):
    /// a recipe's template then trusts the proxy's leaves for connector
    /// hosts, its start command's processes included, and its cached steps
    /// are keyed on the CA (the bundle's hash is part of the plan's
    /// identity), so a step built under one deployment's CA is never
    /// resumed under another's.
    pub(super) fn with_intercept_ca(
        &self,
        ca_bundle: Option<String>,
    ) -> ServiceResult<Option<String>> {
        if !self.config.security.egress_tls_intercept {
            return Ok(ca_bundle);
        }
        let pem = crate::security::intercept::open_ca(&self.config.key_dir)
            .map_err(|e| ServiceError::Keys(e.to_string()))?
            .pem()
            .to_owned();
        Ok(Some(match ca_bundle {
            Some(mut c) => {
                if !c.ends_with('\n') {
                    c.push('\n');
                }
                c.push_str(&pem);
                c
            }
            None => pem,
        }))
    }

    /// `recipe` planned on `base`'s content identity (and the CA bundle's).
    async fn plan_on(
        &self,
        recipe: &Recipe,
        base: &TemplateRecord,
        ca_bundle: Option<&str>,
    ) -> ServiceResult<Plan> {
        let mut identity = self.engine.template_identity(&base.id).await?;
        if let Some(ca) = ca_bundle {
            identity.push_str(&format!(
                "+ca:{}",
                hex::encode(Sha256::digest(ca.as_bytes()))
            ));
        }
        Ok(recipe.plan(&identity)?)
    }

    /// A recipe build at another vCPU count or memory than its base's: its
    /// base becomes the base's size variant (built first, waited for), and
    /// the recipe is planned again on it.
    pub(super) async fn rebase_on_variant(
        self: &Arc<Self>,
        mut job: RecipeJob,
        size: SandboxSize,
    ) -> ServiceResult<RecipeJob> {
        if !super::variants::needs_variant(job.base.size, size) {
            return Ok(job);
        }
        let v = match self.variant(&job.base, size).await? {
            super::variants::Variant::Ready(v) => v,
            super::variants::Variant::Building(v) => {
                let deadline = Instant::now() + self.config.templates.variant_wait;
                self.wait_variant(&v.record.id, deadline).await?
            }
        };
        job.plan = self
            .plan_on(&job.recipe, &v, job.ca_bundle.as_deref())
            .await?;
        job.base = v;
        Ok(job)
    }

    /// The id of the cached state of step `hash` of `owner`'s builds.
    fn step_template_id(owner: &str, hash: &str) -> ServiceResult<TemplateId> {
        let mut h = Sha256::new();
        h.update(owner.as_bytes());
        h.update([0u8]);
        h.update(hash.as_bytes());
        let hx = hex::encode(h.finalize());
        format!("tpl-s{}", &hx[..40])
            .parse()
            .map_err(|e: strata_core::id::IdError| ServiceError::InvalidRequest(e.to_string()))
    }

    /// A cached step of `owner`, if one is recorded.
    async fn cached_step(&self, owner: &str, hash: &str) -> ServiceResult<Option<TemplateRecord>> {
        let id = Self::step_template_id(owner, hash)?;
        let rec = self.db(move |s| s.get_template(&id)).await?;
        Ok(rec.filter(|r| r.status == TemplateStatus::Step && r.tenant == owner))
    }

    /// Runs a recipe build to the end (module docs, steps 2–4). On success
    /// the template `tpl` exists in the engine; the caller records it.
    pub(super) async fn run_recipe(
        self: &Arc<Self>,
        caller: &Caller,
        tpl: &TemplateRecord,
        job: RecipeJob,
    ) -> ServiceResult<f64> {
        let t0 = Instant::now();
        let mut log = BuildLog::create(
            self.build_log_path(&tpl.id),
            self.config.templates.log_max_bytes,
        )
        .await;
        let owner = caller.owner().to_owned();
        let plan = &job.plan;
        let n = plan.steps.len();
        // The host's cache of built templates (other daemons' builds too).
        let cached = self.host_cache_entry(&owner, &plan.final_hash);
        if let Some(entry) = cached.as_ref().filter(|e| e.is_dir()) {
            self.set_progress(&tpl.id, "importing from the host's template cache", None);
            // The entry's content record is checked by the import; what it
            // holds must also be this recipe's template (its name is only
            // a hash of owner and recipe). The import signs it with this
            // deployment's key (docs/keys.md).
            let imported = match self.engine.import_template(entry, &tpl.id).await {
                Ok(()) => match self.engine.template_starts(&tpl.id).await {
                    Ok(s) if s.recipe.as_deref() == Some(plan.final_hash.as_str()) => Ok(()),
                    Ok(s) => Err(RuntimeError::SnapshotUnusable {
                        id: tpl.id.to_string(),
                        reason: format!(
                            "cached template is of recipe {:?}, not {}",
                            s.recipe, plan.final_hash
                        ),
                    }),
                    Err(e) => Err(e),
                },
                Err(e) => Err(e),
            };
            match imported {
                Ok(()) => {
                    // Touch: the least recently used entries go first.
                    let _ = std::fs::File::open(entry.join("meta.json"))
                        .and_then(|f| f.set_modified(std::time::SystemTime::now()));
                    log.line(&format!(
                        "strata: {} imported from the host's template cache ({}) in {:.1} s",
                        tpl.id,
                        entry.display(),
                        t0.elapsed().as_secs_f64()
                    ))
                    .await;
                    return Ok(t0.elapsed().as_secs_f64() * 1000.0);
                }
                Err(e) => {
                    log.line(&format!(
                        "strata: the host's cached copy is unusable here ({}); building",
                        e.message()
                    ))
                    .await;
                    let _ = self.engine.delete_template(&tpl.id).await;
                }
            }
        }
        // The final state (start running, ready) is cached too: the same
        // recipe again publishes at once.
        let mut from = Source::Template(job.base.id.clone());
        let mut first = 0;
        let mut resumed_final = false;
        if let Some(rec) = self.cached_step(&owner, &plan.final_hash).await? {
            from = Source::Template(rec.id.clone());
            first = n;
            resumed_final = true;
        } else {
            for s in plan.steps.iter().rev() {
                if let Some(rec) = self.cached_step(&owner, &s.hash).await? {
                    from = Source::Template(rec.id.clone());
                    first = s.index + 1;
                    break;
                }
            }
        }
        let from_name = match &from {
            Source::Template(t) => t.to_string(),
            Source::Snapshot(s) => s.to_string(),
        };
        log.line(&format!(
            "strata: building {} from {} ({} step(s); {} cached)",
            tpl.id, job.base.id, n, first
        ))
        .await;
        self.set_progress(&tpl.id, "starting the builder sandbox", Some(0.0));
        // The builder: a sandbox of the owner, labelled, that never idles
        // out during a build but goes if a restart strands it.
        let spec = builder_spec(&tpl.id);
        let mut rec = self.new_record(&owner, &spec, tpl.size)?;
        rec.template = Some(job.base.id.clone());
        let builder = rec.id.clone();
        self.gate
            .make_builder(
                &owner,
                builder.as_str(),
                &self.config.templates.build_egress,
            )
            .await
            .map_err(|m| ServiceError::InvalidStateOther(format!("build egress policy: {m}")))?;
        let rec = match self.spawn_new(rec, from, step::SPAWN).await {
            Ok(r) => r,
            Err(e) => {
                self.gate.end_builder(builder.as_str());
                return Err(e);
            }
        };
        self.keep_lifecycle(&rec, stranded_builder(), None).await;
        log.line(&format!(
            "strata: builder {builder} forked from {from_name}"
        ))
        .await;
        let outcome = self
            .run_steps(caller, tpl, &job, &builder, first, resumed_final, &mut log)
            .await;
        self.gate.end_builder(builder.as_str());
        let system = Caller::system(crate::caller::SystemReason::Platform);
        if let Err(e) = self
            .delete(&system, &builder, &GateOptions::default())
            .await
        {
            warn!(sandbox = %builder, error = %e.message(), "removing the builder failed");
        }
        match &outcome {
            Ok(()) => {
                log.line(&format!(
                    "strata: template {} ready in {:.1} s",
                    tpl.id,
                    t0.elapsed().as_secs_f64()
                ))
                .await
            }
            Err(e) => {
                log.line(&format!("strata: build failed: {}", e.message()))
                    .await
            }
        }
        self.evict_steps(&owner).await;
        if let (Ok(()), Some(entry)) = (&outcome, cached) {
            self.export_to_host_cache(&tpl.id, &entry, &mut log).await;
        }
        outcome.map(|()| t0.elapsed().as_secs_f64() * 1000.0)
    }

    #[allow(clippy::too_many_arguments)]
    async fn run_steps(
        self: &Arc<Self>,
        caller: &Caller,
        tpl: &TemplateRecord,
        job: &RecipeJob,
        builder: &SandboxId,
        first: usize,
        resumed_final: bool,
        log: &mut BuildLog,
    ) -> ServiceResult<()> {
        let plan = &job.plan;
        let n = plan.steps.len();
        let owner = caller.owner().to_owned();
        let mut extra_env = BTreeMap::new();
        if let Some(ca) = &job.ca_bundle {
            extra_env.insert("NODE_EXTRA_CA_CERTS".to_owned(), BUILD_CA_PATH.to_owned());
            // Python `requests` reads certifi's bundle unless told: the
            // system bundle (with the CA appended below) for both it and
            // OpenSSL-based clients that honour SSL_CERT_FILE.
            for k in ["SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"] {
                extra_env.insert(k.to_owned(), SYSTEM_CA_BUNDLE.to_owned());
            }
            if first == 0 && !resumed_final {
                self.set_progress(&tpl.id, "installing the build's CA bundle", Some(0.0));
                log.line("strata: installing the CA bundle given to the build")
                    .await;
                let bytes = bytes::Bytes::from(ca.clone().into_bytes());
                let body: ByteStream = futures::stream::iter([Ok(bytes)]).boxed();
                self.engine
                    .write_file(builder, BUILD_CA_PATH, 0o644, body)
                    .await?;
                // Appended to the system bundle (what curl, pip, git and
                // Python's ssl read), not rehashed: `update-ca-certificates`
                // takes minutes under TCG on a whole bundle.
                let root = ExecPlan {
                    shell: format!("cat {BUILD_CA_PATH} >> {SYSTEM_CA_BUNDLE}"),
                    user: "root".into(),
                    cwd: "/".into(),
                    env: BTreeMap::new(),
                };
                self.run_exec(caller, builder, &root, &BTreeMap::new(), log, "CA bundle")
                    .await?;
            }
        }
        if !resumed_final {
            for s in plan.steps.iter().skip(first) {
                let what = format!("step {}", s.describe);
                self.set_progress(&tpl.id, &what, Some(s.index as f32 / (n as f32 + 1.0)));
                log.line(&format!("strata: {what}")).await;
                let t = Instant::now();
                match &s.action {
                    Action::None => continue,
                    Action::Exec(e) => {
                        self.run_exec(caller, builder, e, &extra_env, log, &what)
                            .await?
                    }
                    Action::Copy {
                        sha256,
                        dest,
                        owner: who,
                        mode,
                    } => {
                        let archive = format!("/tmp/strata-copy-{sha256}.tar");
                        let path = self.template_files_dir(&owner).join(sha256);
                        let f = tokio::fs::File::open(&path).await.map_err(|e| {
                            ServiceError::Engine(RuntimeError::Other(format!(
                                "copy archive {sha256}: {e}"
                            )))
                        })?;
                        let body: ByteStream =
                            tokio_util::io::ReaderStream::with_capacity(f, 256 * 1024)
                                .map(|r| {
                                    r.map_err(|e| RuntimeError::Other(format!("copy archive: {e}")))
                                })
                                .boxed();
                        self.engine
                            .write_file(builder, &archive, 0o600, body)
                            .await?;
                        let script = format!(
                            "{}; rm -f {}",
                            strata_template::copy_install_script(&archive, dest, who, *mode),
                            strata_template::shell::quote(&archive)
                        );
                        let root = ExecPlan {
                            shell: script,
                            user: "root".into(),
                            cwd: "/".into(),
                            env: BTreeMap::new(),
                        };
                        self.run_exec(caller, builder, &root, &BTreeMap::new(), log, &what)
                            .await?;
                    }
                }
                log.line(&format!(
                    "strata: {what}: done in {:.1} s",
                    t.elapsed().as_secs_f64()
                ))
                .await;
                self.cache_step(&owner, builder, &s.hash, tpl, &what, log)
                    .await;
            }
            let own = own_start(plan);
            self.run_start(caller, &tpl.id, builder, &own, &extra_env, log)
                .await?;
            if plan.start.is_some() || plan.ready.is_some() {
                self.cache_step(&owner, builder, &plan.final_hash, tpl, "ready", log)
                    .await;
            }
        }
        self.set_progress(
            &tpl.id,
            "snapshotting the ready guest as the template",
            None,
        );
        // What the template's guest has started: its base's, then its own
        // (a size variant boots its disk and runs them again).
        let starts = self.starts_of(&job.base.id).await?.map(|mut v| {
            let own = own_start(plan);
            if own.start.is_some() || own.ready.is_some() {
                v.push(own);
            }
            v
        });
        let snap = SnapshotId::generate();
        self.engine.snapshot(builder, &snap).await?;
        let published = self
            .engine
            .template_from_snapshot(&snap, &tpl.id, Some(plan.final_hash.clone()), starts)
            .await;
        let _ = self.engine.delete_snapshot(&snap).await;
        published?;
        Ok(())
    }

    /// What template `id`'s guest had started when it was published, base
    /// first ([`crate::engine::TemplateStarts`]): nothing for an
    /// image-booted template, `None` for a recipe template published before
    /// they were kept.
    pub(super) async fn starts_of(
        &self,
        id: &TemplateId,
    ) -> ServiceResult<Option<Vec<strata_runtime::StartCommand>>> {
        Ok(self.engine.template_starts(id).await?.effective())
    }

    /// Runs a start command (left running in the background, its output in
    /// [`START_LOG`]) and polls its ready check until it passes or its
    /// timeout ends (the build's failure, quoting the start's output).
    pub(super) async fn run_start(
        self: &Arc<Self>,
        caller: &Caller,
        tpl: &TemplateId,
        builder: &SandboxId,
        s: &strata_runtime::StartCommand,
        extra_env: &BTreeMap<String, String>,
        log: &mut BuildLog,
    ) -> ServiceResult<()> {
        if let Some(start) = &s.start {
            let start = exec_plan(start);
            self.set_progress(tpl, "starting the start command", None);
            log.line(&format!("strata: start: {}", start.shell)).await;
            let bg = ExecPlan {
                shell: format!(
                    "setsid sh -c {} </dev/null >{START_LOG} 2>&1 &",
                    strata_template::shell::quote(&start.shell)
                ),
                ..start.clone()
            };
            self.run_exec(caller, builder, &bg, extra_env, log, "start")
                .await?;
        }
        if let Some(probe) = &s.ready {
            let probe = exec_plan(probe);
            let secs = s.ready_timeout_secs;
            self.set_progress(tpl, &format!("waiting for ready ({secs} s at most)"), None);
            log.line(&format!("strata: ready check: {}", probe.shell))
                .await;
            // A recipe's timeout of centuries waits "forever", it does not
            // overflow the clock.
            let deadline = Instant::now()
                .checked_add(Duration::from_secs(secs))
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(100 * 365 * 86_400));
            loop {
                if self.probe(builder, &probe, extra_env).await? {
                    break;
                }
                if Instant::now() >= deadline {
                    let start_log = self.start_log_tail(builder).await;
                    log.line(&format!("strata: start command output:\n{start_log}"))
                        .await;
                    return Err(ServiceError::InvalidStateOther(format!(
                        "the ready check did not pass within {secs} s; start command output: {start_log}"
                    )));
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            log.line("strata: ready").await;
        }
        Ok(())
    }

    /// Runs one command of a build through [`Service::exec`] (gated and
    /// audited as the owner's), its output into the log; a non-zero exit is
    /// the build's failure, quoting the output's tail.
    pub(super) async fn run_exec(
        self: &Arc<Self>,
        caller: &Caller,
        builder: &SandboxId,
        e: &ExecPlan,
        extra_env: &BTreeMap<String, String>,
        log: &mut BuildLog,
        what: &str,
    ) -> ServiceResult<()> {
        let req = exec_request(e, extra_env, self.config.templates.step_timeout);
        let mut stream = self
            .exec(caller, builder, req, &GateOptions::default())
            .await?;
        while let Some(ev) = stream.next().await {
            match ev? {
                ExecEvent::Stdout(b) | ExecEvent::Stderr(b) => log.write(&b).await,
                ExecEvent::Started { .. } => {}
                ExecEvent::Exit(st) => {
                    if st.success() {
                        return Ok(());
                    }
                    let how = if st.timed_out {
                        format!("timed out after {:?}", self.config.templates.step_timeout)
                    } else if let Some(c) = st.code {
                        format!("exited {c}")
                    } else {
                        format!("was killed by signal {}", st.signal.unwrap_or(0))
                    };
                    return Err(ServiceError::InvalidStateOther(format!(
                        "{what} {how}; output ends: {}",
                        log.tail()
                    )));
                }
            }
        }
        Err(ServiceError::InvalidStateOther(format!(
            "{what}: the command's stream ended without an exit status"
        )))
    }

    /// Runs a ready probe once: whether it exited 0.
    async fn probe(
        self: &Arc<Self>,
        builder: &SandboxId,
        e: &ExecPlan,
        extra_env: &BTreeMap<String, String>,
    ) -> ServiceResult<bool> {
        let req = exec_request(e, extra_env, Duration::from_secs(10));
        let mut stream = self.engine.exec(builder, req).await?;
        while let Some(ev) = stream.next().await {
            if let ExecEvent::Exit(st) = ev? {
                return Ok(st.success());
            }
        }
        Ok(false)
    }

    async fn start_log_tail(&self, builder: &SandboxId) -> String {
        let req = ExecRequest::shell(format!("tail -c 2000 {START_LOG} 2>/dev/null"));
        let Ok(mut stream) = self.engine.exec(builder, req).await else {
            return String::new();
        };
        let mut out = Vec::new();
        while let Some(Ok(ev)) = stream.next().await {
            if let ExecEvent::Stdout(b) = ev {
                out.extend_from_slice(&b);
            }
        }
        String::from_utf8_lossy(&out).trim_end().to_owned()
    }

    /// Caches the builder's state after a step as `owner`'s `step`
    /// template of `hash` (already cached: nothing). A failure only costs
    /// the cache entry.
    async fn cache_step(
        self: &Arc<Self>,
        owner: &str,
        builder: &SandboxId,
        hash: &str,
        tpl: &TemplateRecord,
        what: &str,
        log: &mut BuildLog,
    ) {
        let id = match Self::step_template_id(owner, hash) {
            Ok(i) => i,
            Err(_) => return,
        };
        if let Ok(Some(_)) = self.cached_step(owner, hash).await {
            return;
        }
        let t = Instant::now();
        let snap = SnapshotId::generate();
        let r = async {
            self.engine.snapshot(builder, &snap).await?;
            let published = self
                .engine
                .template_from_snapshot(&snap, &id, None, None)
                .await;
            let _ = self.engine.delete_snapshot(&snap).await;
            published?;
            let now = self.now();
            let rec = TemplateRecord {
                id: id.clone(),
                tenant: owner.to_owned(),
                name: Some(format!("{}: {what}", tpl.id)),
                size: tpl.size,
                status: TemplateStatus::Step,
                status_reason: None,
                accel: None,
                created_at: now,
                updated_at: now,
                variant_of: None,
            };
            self.db(move |s| s.put_template(&rec)).await?;
            Ok::<(), ServiceError>(())
        }
        .await;
        match r {
            Ok(()) => {
                log.line(&format!(
                    "strata: cached as {id} ({:.0} ms)",
                    t.elapsed().as_secs_f64() * 1000.0
                ))
                .await
            }
            // Publishing is whole or nothing, and a step another build of
            // the same recipe published first ("already exists") is theirs:
            // nothing to remove (a record that failed to land leaves a
            // subvolume recovery removes as an orphan).
            Err(e) => warn!(error = %e.message(), "caching a build step failed"),
        }
    }

    /// The host-level cache entry of `owner`'s recipe `final_hash`, when a
    /// cache is configured.
    fn host_cache_entry(&self, owner: &str, final_hash: &str) -> Option<PathBuf> {
        let dir = self.config.templates.cache_dir.as_ref()?;
        let mut h = Sha256::new();
        h.update(b"strata-template-cache/1\0");
        h.update(owner.as_bytes());
        h.update([0u8]);
        h.update(final_hash.as_bytes());
        Some(dir.join(&hex::encode(h.finalize())[..40]))
    }

    /// Copies a freshly built template into the host's cache (best effort)
    /// and keeps the cache within `cache_max_entries`.
    async fn export_to_host_cache(
        &self,
        tpl: &TemplateId,
        entry: &std::path::Path,
        log: &mut BuildLog,
    ) {
        let Some(dir) = self.config.templates.cache_dir.clone() else {
            return;
        };
        if let Err(e) = std::fs::create_dir_all(&dir).and_then(|()| {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
        }) {
            warn!(dir = %dir.display(), error = %e, "template cache unusable");
            log.line(&format!(
                "strata: the host's template cache {} is unusable: {e}",
                dir.display()
            ))
            .await;
            return;
        }
        let t = Instant::now();
        match self.engine.export_template(tpl, entry).await {
            Ok(()) => {
                log.line(&format!(
                    "strata: copied to the host's template cache ({}) in {:.1} s",
                    entry.display(),
                    t.elapsed().as_secs_f64()
                ))
                .await
            }
            Err(e) => {
                warn!(error = %e.message(), "copying the template to the host cache failed");
                log.line(&format!(
                    "strata: copying to the host's template cache failed: {}",
                    e.message()
                ))
                .await
            }
        }
        let keep = self.config.templates.cache_max_entries;
        let _ = tokio::task::spawn_blocking(move || evict_host_cache(&dir, keep)).await;
    }

    /// Keeps at most `[templates] step_cache_per_owner` cached steps of
    /// `owner`, the newest.
    async fn evict_steps(&self, owner: &str) {
        let keep = self.config.templates.step_cache_per_owner;
        let o = owner.to_owned();
        let Ok(all) = self.db(move |s| s.list_templates(&o)).await else {
            return;
        };
        let mut steps: Vec<TemplateRecord> = all
            .into_iter()
            .filter(|t| t.status == TemplateStatus::Step)
            .collect();
        if steps.len() <= keep {
            return;
        }
        steps.sort_by_key(|t| std::cmp::Reverse(t.updated_at));
        for mut t in steps.into_iter().skip(keep) {
            let _ = self.engine.delete_template(&t.id).await;
            t.status = TemplateStatus::Deleted;
            t.updated_at = self.now();
            let _ = self.db(move |s| s.put_template(&t)).await;
        }
    }

    pub(super) fn set_progress(&self, id: &TemplateId, step: &str, fraction: Option<f32>) {
        self.progress
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                id.clone(),
                BuildProgress {
                    step: step.to_owned(),
                    fraction,
                },
            );
    }
}

/// Removes the least recently used entries of the host's template cache
/// beyond `keep` (an entry's `meta.json` mtime is its last use).
fn evict_host_cache(dir: &std::path::Path, keep: usize) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<(std::time::SystemTime, PathBuf)> = rd
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .map(|e| {
            let used = std::fs::metadata(e.path().join("meta.json"))
                .and_then(|m| m.modified())
                .unwrap_or(std::time::UNIX_EPOCH);
            (used, e.path())
        })
        .collect();
    if entries.len() <= keep {
        return;
    }
    entries.sort_by_key(|e| std::cmp::Reverse(e.0));
    for (_, p) in entries.into_iter().skip(keep) {
        let _ = std::fs::remove_dir_all(p);
    }
}
