//! The daemon as one call: [`run`] opens the sandbox runtime described by the
//! configuration (pool, run dir, guest image, accelerator, QEMU), wraps it
//! in [`RuntimeEngine`], recovers, starts the background tasks, builds the
//! default template when none exists, and serves the API until shutdown.
//!
//! The `stratad` binary (crate `strata-daemon`) is a thin wrapper around it
//! that mounts the E2B door when `[e2b] enabled`; `strata serve` runs that
//! binary; embedders call [`run`] or [`run_with`] (or [`open_engine`] +
//! [`App`]) directly.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use strata_runtime::{PoolSetting, Runtime, RuntimeConfig};
use tokio::net::TcpListener;

use crate::caller::{Caller, SystemReason};
use crate::config::Config;
use crate::engine::runtime::RuntimeEngine;
use crate::store::StoreError;
use crate::App;

/// Why the daemon could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// No guest image was configured and none is in the image cache.
    #[error("no guest image in {cache}: run `strata image build` (or set image_dir)")]
    NoImage {
        /// The image cache searched.
        cache: PathBuf,
    },
    /// The data directory cannot be created.
    #[error("cannot create {path}")]
    DataDir {
        /// The directory.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The sandbox runtime (pool, QEMU) could not be opened.
    #[error("cannot open the sandbox runtime")]
    Runtime(#[source] strata_runtime::RuntimeError),
    /// The key store (`key_dir`) could not be opened: without the
    /// deployment's key no snapshot can be signed or checked.
    #[error("cannot open the key store")]
    Keys(#[source] crate::security::keys::KeyError),
    /// The metadata store could not be opened.
    #[error("cannot open the metadata store")]
    Store(#[source] StoreError),
    /// Start-up reconciliation failed.
    #[error("recovery failed: {0}")]
    Recovery(String),
    /// The listen address cannot be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address.
        addr: std::net::SocketAddr,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Serving failed.
    #[error("serving the API failed")]
    Serve(#[source] std::io::Error),
    /// The local CA or a TLS listener (`tls_listen`, `[e2b] tls_listen`)
    /// could not be set up.
    #[error("TLS listener")]
    Tls(#[source] crate::tls::TlsError),
}

/// Raises this process's `RLIMIT_NOFILE` soft limit to its hard limit
/// (the systemd default soft limit is 1024, far below what many sandboxes'
/// egress connections, VMs and API clients need). Returns `(soft, hard)` in
/// force afterwards.
pub fn raise_nofile() -> std::io::Result<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` into the valid, exclusively
    // borrowed `lim`; no other memory is touched.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if lim.rlim_cur < lim.rlim_max {
        let want = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit only reads the valid `want`; raising the soft
        // limit up to the hard limit needs no privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        lim = want;
    }
    Ok((lim.rlim_cur, lim.rlim_max))
}

/// This process's `RLIMIT_NOFILE` soft limit (`None`: unlimited or unknown).
pub fn nofile_limit() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` into the valid, exclusively
    // borrowed `lim`.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return None;
    }
    (lim.rlim_cur != libc::RLIM_INFINITY).then_some(lim.rlim_cur)
}

/// The newest guest image (by manifest modification time) in an image cache
/// laid out as `strata image build` leaves it: `<cache>/<hash>/manifest.json`.
pub fn newest_image(cache: &Path) -> Option<PathBuf> {
    let rd = std::fs::read_dir(cache).ok()?;
    rd.flatten()
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .filter_map(|e| {
            let dir = e.path();
            let m = dir.join(strata_image::MANIFEST_FILE).metadata().ok()?;
            Some((m.modified().ok()?, dir))
        })
        .max()
        .map(|(_, dir)| dir)
}

/// The guest image directory the daemon boots templates from.
pub fn image_dir(cfg: &Config) -> Result<PathBuf, DaemonError> {
    if let Some(d) = &cfg.image_dir {
        return Ok(d.clone());
    }
    let cache = strata_image::default_cache_dir();
    newest_image(&cache).ok_or(DaemonError::NoImage { cache })
}

/// The runtime configuration the daemon's configuration describes.
pub fn runtime_config(cfg: &Config) -> Result<RuntimeConfig, DaemonError> {
    let pool = match &cfg.pool_path {
        Some(p) => PoolSetting::Path(p.clone()),
        None => PoolSetting::Image {
            image: cfg.pool_image(),
            size_bytes: cfg.pool_size_gib.saturating_mul(1 << 30),
            mount_point: cfg.pool_mount(),
        },
    };
    Ok(RuntimeConfig {
        pool,
        run_dir: cfg.run_dir(),
        image_dir: image_dir(cfg)?,
        accel: cfg.accel,
        qemu_binary: cfg.qemu_binary.clone(),
        console_log_max_bytes: cfg.console_log_max_bytes,
        agent_timeout_ms: cfg.agent_timeout.as_millis() as u64,
        // A missing user is refused by `Runtime::open` unless `allow_root`.
        run_as: strata_vmm::lookup_user(&cfg.vm.user).map(|_| cfg.vm.user.clone()),
        allow_root: cfg.vm.allow_root,
        cgroups: true,
        cgroups_required: cfg.vm.require_cgroups,
        netns: (!cfg.vm.netns.is_empty()).then(|| cfg.vm.netns.clone()),
        disk_throttle: strata_vmm::DiskThrottle::new(cfg.vm.disk_iops, cfg.vm.disk_bps),
        egress_proxy: None,
        tcg_tb_size_mib: cfg.tcg_tb_size_mib,
        guest_disk_flush: cfg.vm.guest_disk_flush,
        // Set by [`open_engine`] from the key store.
        signing: None,
        max_concurrent_pauses: cfg.snapshots.max_concurrent_pauses,
    })
}

/// The deployment's signer of snapshots and templates: the Ed25519 seed of
/// [`Purpose::SnapshotSigning`](crate::security::keys::Purpose) from the
/// key store in `key_dir` (created on first use).
pub fn state_signer(cfg: &Config) -> Result<Arc<strata_runtime::StateSigner>, DaemonError> {
    use crate::security::keys::{KeyError, KeyStore, Purpose};
    let keys = KeyStore::open(&cfg.key_dir).map_err(DaemonError::Keys)?;
    let seed = keys
        .seed(Purpose::SnapshotSigning)
        .map_err(DaemonError::Keys)?;
    let signer = strata_runtime::StateSigner::from_seed(&seed)
        .map_err(|_| DaemonError::Keys(KeyError::Derive))?;
    tracing::info!(public_key = %signer.public_key(), "snapshots are signed with this deployment's key");
    Ok(Arc::new(signer))
}

/// Opens the runtime (creating and loop-mounting the pool image when needed)
/// and wraps it as the daemon's engine. States are signed with the
/// deployment's key ([`state_signer`]).
pub async fn open_engine(cfg: &Config) -> Result<Arc<RuntimeEngine>, DaemonError> {
    std::fs::create_dir_all(&cfg.data_dir).map_err(|source| DaemonError::DataDir {
        path: cfg.data_dir.clone(),
        source,
    })?;
    let mut rc = runtime_config(cfg)?;
    rc.signing = Some(state_signer(cfg)?);
    tracing::info!(
        pool = ?rc.pool,
        run_dir = %rc.run_dir.display(),
        image = %rc.image_dir.display(),
        accel = %cfg.accel,
        "opening the sandbox runtime"
    );
    let rt: Arc<Runtime> = Runtime::open(rc).await.map_err(DaemonError::Runtime)?;
    // `[quotas] reserve_bytes`: a fallocated reserve released when the pool runs low.
    rt.pool()
        .keep_reserve(cfg.quotas.reserve_bytes, cfg.quotas.reserve_low_water())
        .map_err(|e| DaemonError::Runtime(strata_runtime::RuntimeError::Storage(e)))?;
    Ok(Arc::new(RuntimeEngine::new(rt)))
}

/// Runs the daemon on the real runtime until `shutdown` completes: open the
/// engine and the store, recover (adopting VMs that survived), start the
/// scheduler, build the default template if none exists, serve the API on
/// `config.listen`. VMs keep running after it returns.
pub async fn run(
    config: Config,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), DaemonError> {
    run_with(config, shutdown, None).await
}

/// Extra routes served next to the API (e.g. the E2B front door), built from
/// the daemon's service and its security subsystem (tokens, policy,
/// approvals, audit; `None` when it failed to open) once they are open.
/// Given the API's router, it returns the router to serve: the API's with
/// its own routes merged (and any layer that must see every request, e.g.
/// the E2B door's routing of guest-port traffic by `Host`).
pub type Mount = Box<
    dyn FnOnce(
            Arc<crate::service::Service>,
            Option<Arc<crate::security::Security>>,
            axum::Router,
        ) -> axum::Router
        + Send,
>;

/// [`run`], with `mount`'s routes merged into the API router.
pub async fn run_with(
    config: Config,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    mount: Option<Mount>,
) -> Result<(), DaemonError> {
    let listen = config.listen;
    let config_tls = config
        .e2b
        .tls_listen
        .map(|a| (a, config.data_dir.clone(), config.e2b.domain.clone()));
    // Data at rest: owner-only from here on (docs/hardening.md).
    let old_umask = crate::at_rest::set_umask();
    tracing::info!(old = format!("{old_umask:03o}"), "umask 077");
    std::fs::create_dir_all(&config.data_dir).map_err(|source| DaemonError::DataDir {
        path: config.data_dir.clone(),
        source,
    })?;
    crate::at_rest::harden(&config);
    // `tls_listen`: the API over TLS with the configured certificate.
    let api_tls = match (&config.tls_listen, &config.tls_cert, &config.tls_key) {
        (Some(addr), Some(cert), Some(key)) => {
            let cfg = crate::tls::file_server_config(cert, key).map_err(DaemonError::Tls)?;
            Some((*addr, Arc::new(cfg)))
        }
        _ => None,
    };
    let hardened = config.clone();
    // Before anything opens descriptors; the egress caps are derived from it.
    match raise_nofile() {
        Ok((soft, hard)) => tracing::info!(
            soft,
            hard,
            reserve = config.egress.fd_reserve,
            "RLIMIT_NOFILE raised to the hard limit"
        ),
        Err(e) => tracing::warn!(error = %e, "cannot raise RLIMIT_NOFILE"),
    }
    if config.e2b.enabled && mount.is_none() {
        tracing::warn!(
            "[e2b] enabled = true, but nothing mounts the E2B door here: it is served by the `stratad` binary"
        );
    }
    // An API-only process (`[cluster] role = "api"`) opens no runtime: no
    // pool, no run dir, no QEMU, no /dev/kvm (docs/cluster.md, "API
    // processes"). Its engine refuses every VM operation; the API forwards
    // them to the sandboxes' hosts first.
    let api_only = config.cluster.enabled && config.cluster.role == crate::cluster::Role::Api;
    let runtime = if api_only {
        None
    } else {
        Some(open_engine(&config).await?)
    };
    let engine: Arc<dyn crate::engine::Engine> = match &runtime {
        Some(r) => r.clone(),
        None => Arc::new(crate::engine::api_only::ApiOnlyEngine),
    };
    let app = App::open(config, engine).map_err(DaemonError::Store)?;
    // Again now that the pool is mounted (its root comes from mkfs, 0755)
    // and the database and audit log exist.
    crate::at_rest::harden(&hardened);
    // Egress: each sandbox's guest traffic to 127.0.0.1:3128 is tunnelled over
    // its agent channel to that sandbox's policy proxy, served in-process on
    // the tunnel's stream (no listener), under the `[egress]` caps.
    if let (Some(sec), Some(runtime)) = (app.security(), &runtime) {
        let sec = sec.clone();
        let svc = app.service().clone();
        // A deleted sandbox's proxy goes, and its MCP stdio servers with it.
        let s2 = sec.clone();
        svc.on_deleted(Arc::new(move |id| s2.forget_egress_proxy(id.as_str())));
        let resolver: strata_runtime::EgressResolver = Arc::new(move |id| {
            let (sec, svc) = (sec.clone(), svc.clone());
            Box::pin(async move {
                let daemon = Caller::system(SystemReason::Egress);
                let rec = svc.get_sandbox(&daemon, &id).await.ok()?;
                let guest = Caller::Guest {
                    sandbox: rec.id,
                    tenant: rec.tenant,
                };
                // Egress is activity: a guest that talks out is not an
                // unchanged one (its rolling snapshots are taken).
                let note = svc.activity_note(&id);
                let note: crate::security::TunnelNote = Arc::new(move || note.note());
                match sec.tunnel_handler_noting(&guest, Some(note)) {
                    Ok(h) => Some(h),
                    Err(e) => {
                        tracing::warn!(sandbox = %id, error = %e, "egress proxy unavailable; egress stays closed");
                        None
                    }
                }
            })
        });
        runtime.runtime().set_egress_resolver(resolver);
    }
    let report = app
        .start()
        .await
        .map_err(|e| DaemonError::Recovery(e.message()))?;
    tracing::info!(
        report = %serde_json::to_string(&report).unwrap_or_default(),
        "recovered"
    );
    if app.service().config().default_template && !api_only {
        if let Err(e) = app.service().ensure_default_template().await {
            tracing::warn!(error = %e.message(), "cannot start the default template build");
        }
    }
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|source| DaemonError::Bind {
            addr: listen,
            source,
        })?;
    tracing::info!(%listen, "stratad listening");
    let mut tls_listeners = Vec::new();
    if let Some((addr, cfg)) = api_tls {
        let l = TcpListener::bind(addr)
            .await
            .map_err(|source| DaemonError::Bind { addr, source })?;
        tracing::info!(listen = %addr, "API TLS listening");
        tls_listeners.push((l, cfg));
    }
    match (config_tls, &mount) {
        (Some((addr, data_dir, domain)), Some(_)) => {
            let ca = crate::tls::LocalCa::open(&data_dir).map_err(DaemonError::Tls)?;
            let domains: Vec<String> = domain.into_iter().collect();
            let resolver = Arc::new(crate::tls::LeafResolver::new(Arc::new(ca), &domains));
            let cfg = crate::tls::server_config(resolver).map_err(DaemonError::Tls)?;
            let l = TcpListener::bind(addr)
                .await
                .map_err(|source| DaemonError::Bind { addr, source })?;
            tracing::info!(listen = %addr, ca = %crate::tls::ca_pem_path(&data_dir).display(), "TLS listening");
            tls_listeners.push((l, Arc::new(cfg)));
        }
        (Some(_), None) => {
            tracing::warn!("[e2b] tls_listen is set, but the E2B door is off: no TLS listener");
        }
        _ => {}
    }
    let router = match mount {
        None => app.router(),
        Some(mount) => mount(app.service().clone(), app.security().cloned(), app.router()),
    };
    let bounds = app.service().config().listener.clone();
    let metrics = Some(app.service().metrics().clone());
    // The TLS listeners (`tls_listen`, `[e2b] tls_listen`) serve the same
    // routes and stop when the plain listener does.
    let (tls_stop, _) = tokio::sync::watch::channel(false);
    let tls_tasks: Vec<_> = tls_listeners
        .into_iter()
        .map(|(l, cfg)| {
            let mut stopped = tls_stop.subscribe();
            tokio::spawn(crate::listener::serve(
                l,
                Some(cfg),
                router.clone(),
                bounds.clone(),
                metrics.clone(),
                async move {
                    let _ = stopped.wait_for(|s| *s).await;
                },
            ))
        })
        .collect();
    // Every request carries its peer (the E2B door limits failed logins
    // per address).
    let shutdown = async move {
        shutdown.await;
        let _ = tls_stop.send(true);
    };
    let result = crate::listener::serve(listener, None, router, bounds, metrics, shutdown).await;
    for t in tls_tasks {
        let _ = t.await;
    }
    app.stop();
    // Warm guests are no one's: they end with the daemon. The VMs of
    // sandboxes outlive it; the next start adopts them.
    app.service().drain_warm().await;
    if let Some(r) = &runtime {
        r.runtime().detach_all();
    }
    result.map_err(DaemonError::Serve)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nofile_is_raised_to_the_hard_limit() {
        let (soft, hard) = raise_nofile().unwrap();
        assert_eq!(soft, hard);
        if hard != libc::RLIM_INFINITY {
            assert_eq!(nofile_limit(), Some(soft));
        }
    }

    #[test]
    fn newest_image_picks_the_latest_manifest() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(newest_image(d.path()), None);
        for (name, age) in [("old", 100), ("new", 0)] {
            let dir = d.path().join(name);
            std::fs::create_dir(&dir).unwrap();
            let m = dir.join(strata_image::MANIFEST_FILE);
            std::fs::write(&m, "{}").unwrap();
            let t = std::time::SystemTime::now() - std::time::Duration::from_secs(age);
            std::fs::File::options()
                .write(true)
                .open(&m)
                .unwrap()
                .set_modified(t)
                .unwrap();
        }
        std::fs::create_dir(d.path().join("no-manifest")).unwrap();
        assert_eq!(newest_image(d.path()), Some(d.path().join("new")));
    }

    #[test]
    fn runtime_config_from_daemon_config() {
        let cfg = Config {
            data_dir: "/srv/strata".into(),
            image_dir: Some("/img".into()),
            pool_size_gib: 8,
            ..Config::default()
        };
        let rc = runtime_config(&cfg).unwrap();
        match rc.pool {
            PoolSetting::Image {
                image,
                size_bytes,
                mount_point,
            } => {
                assert_eq!(image, PathBuf::from("/srv/strata/pool.img"));
                assert_eq!(size_bytes, 8 << 30);
                assert_eq!(mount_point, PathBuf::from("/srv/strata/pool"));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(rc.run_dir, PathBuf::from("/run/strata"));
        assert_eq!(rc.agent_timeout_ms, 60_000);
        let cfg = Config {
            pool_path: Some("/mnt/b".into()),
            ..cfg
        };
        assert!(matches!(
            runtime_config(&cfg).unwrap().pool,
            PoolSetting::Path(p) if p == Path::new("/mnt/b")
        ));
    }
}
