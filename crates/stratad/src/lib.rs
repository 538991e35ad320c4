//! stratad: the strata daemon (HTTP API, metadata store, rolling snapshots,
//! retention, recovery).
//!
//! Layout: [`store`] (records, SQLite), [`retention`] (pure policy),
//! [`scheduler`] (rolling snapshots, idle hibernation, GC), [`service`]
//! (typed commands, operation locks, transitions), [`api`] (axum routes),
//! [`recovery`] (start-up reconciliation), [`engine`] (the runtime
//! boundary). [`App`] ties them together; [`daemon::run`] runs it over the
//! real runtime; [`cli`] is the daemon's command line. The `stratad` binary
//! is crate `strata-daemon` (it links this library and the E2B door).

pub mod api;
pub mod at_rest;
pub mod caller;
pub mod cli;
pub mod clock;
pub mod cluster;
pub mod config;
pub mod console;
pub mod daemon;
pub mod duration;
pub mod engine;
pub mod events;
pub mod host;
pub mod listener;
pub mod metrics;
pub mod recovery;
pub mod retention;
pub mod scheduler;
pub mod security;
pub mod service;
pub mod store;
pub mod tls;

use std::sync::Arc;

use tokio::sync::watch;

use crate::clock::{Clock, SystemClock};
use crate::config::Config;
use crate::engine::Engine;
use crate::service::Service;
use crate::store::{SqliteStore, Store, StoreError};

pub use crate::daemon::run;

/// A daemon assembled from its parts: a service over a store and an engine,
/// its HTTP router and its background tasks.
#[derive(Debug)]
pub struct App {
    service: Arc<Service>,
    shutdown: watch::Sender<bool>,
    security: Result<Arc<security::Security>, String>,
    /// `[cluster]`: this daemon as one host of several (PostgreSQL only).
    cluster: Option<Arc<cluster::Cluster>>,
}

impl App {
    /// Assembles a daemon over `store` and `engine` (nothing runs yet).
    pub fn new(
        config: Config,
        store: Arc<dyn Store>,
        engine: Arc<dyn Engine>,
        clock: Arc<dyn Clock>,
    ) -> Self {
        let metrics = Arc::new(metrics::Metrics::new());
        // Fails closed: without it every /v1 request answers 500.
        let security = security::Security::open(&config).map_err(|e| {
            let mut m = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(c) = src {
                m.push_str(": ");
                m.push_str(&c.to_string());
                src = c.source();
            }
            tracing::error!(error = %m, "security subsystem failed to open");
            m
        });
        let gate: Arc<dyn security::gate::ToolGate> = match &security {
            Ok(sec) => Arc::new(security::gate::SecurityGate(sec.clone())),
            Err(m) => Arc::new(security::gate::ClosedGate(m.clone())),
        };
        if let Ok(sec) = &security {
            sec.set_journal(Arc::new(events::JournalSink::new(
                store.clone(),
                &config.events,
            )));
        }
        store.set_delivery_limit(config.webhooks.max_queued_per_tenant);
        let service = Service::new(store, engine, Arc::new(config), clock, metrics, gate);
        App {
            service,
            shutdown: watch::channel(false).0,
            security,
            cluster: None,
        }
    }

    /// Assembles a daemon over the store `[store] url` names (SQLite in
    /// `config.data_dir` by default; docs/store.md).
    pub fn open(config: Config, engine: Arc<dyn Engine>) -> Result<Self, StoreError> {
        std::fs::create_dir_all(&config.data_dir).map_err(|e| {
            StoreError::Task(format!("cannot create {}: {e}", config.data_dir.display()))
        })?;
        let location = config
            .store_location()
            .map_err(|e| StoreError::Task(e.to_string()))?;
        // With PostgreSQL the security tables are there too
        // (`security::store::PgSecurity`): no SQLite file is opened.
        let mut cluster = None;
        let store: Arc<dyn Store> = match location {
            config::StoreLocation::Sqlite(path) => {
                Arc::new(SqliteStore::open(&path, config.db_readers)?)
            }
            config::StoreLocation::Postgres(url) => {
                let pg = Arc::new(store::PgStore::open(&store::PgOptions {
                    url,
                    schema: config.store.schema.clone(),
                    pool_size: config.store.pool_size,
                    timeout: config.store.timeout,
                })?);
                if config.cluster.enabled {
                    // Every sandbox write fenced by this host's leases.
                    let (c, fenced) = cluster::Cluster::new(&config, pg);
                    cluster = Some(c);
                    fenced
                } else {
                    pg
                }
            }
        };
        let mut app = Self::new(config, store, engine, Arc::new(SystemClock));
        if let Some(c) = &cluster {
            app.service.set_cluster(c.clone());
        }
        app.cluster = cluster;
        if let Err(e) = &app.security {
            return Err(StoreError::Task(format!("security: {e}")));
        }
        Ok(app)
    }

    /// The service (for tests and embedding).
    pub fn service(&self) -> &Arc<Service> {
        &self.service
    }

    /// The security subsystem (tokens, policy, approvals, audit, egress),
    /// unless it failed to open.
    pub fn security(&self) -> Option<&Arc<security::Security>> {
        self.security.as_ref().ok()
    }

    /// The HTTP API, behind the security layer (`api::security`), and the
    /// web console's static files at `/console/` ([`console`]: public, they
    /// hold no data; the pages call the API with the user's token).
    pub fn router(&self) -> axum::Router {
        api::security::wrap(
            api::router(self.service.clone()),
            self.service.clone(),
            self.security.clone(),
        )
        .merge(console::router())
    }

    /// Adopts the states made before snapshot signing (once,
    /// [`service::signing`]), runs recovery, then starts the scheduler and
    /// the exit watcher.
    ///
    /// An API-only process (`[cluster] role = "api"`) starts none of a
    /// host's work: no signing adoption, no registration, no recovery, no
    /// scheduler, exit watcher, sampler, pressure monitor, warm pools or
    /// webhook worker (the hosts deliver webhooks); only the metrics' upkeep.
    pub async fn start(&self) -> service::ServiceResult<recovery::RecoveryReport> {
        if self.cluster.as_ref().is_some_and(|c| c.is_api()) {
            self.service
                .metrics()
                .spawn_upkeep(self.shutdown.subscribe());
            tracing::info!(
                id = self.cluster.as_ref().map(|c| c.host_id()).unwrap_or_default(),
                "API-only process: no pool, no VMs, not registered as a host; VM operations are forwarded to their hosts"
            );
            return Ok(recovery::RecoveryReport::default());
        }
        // Before recovery restores anything: the states made before
        // snapshot signing get their signature (once).
        self.service.adopt_unsigned_states().await?;
        // A cluster host registers and takes its leases first: recovery
        // then sees only the sandboxes it owns.
        if let Some(c) = &self.cluster {
            c.start(&self.service).await.map_err(|e| {
                service::ServiceError::Store(StoreError::Unavailable(format!(
                    "{e}: {}",
                    error_chain(&e)
                )))
            })?;
        }
        let report = recovery::reconcile(&self.service).await?;
        if let Some(c) = &self.cluster {
            c.spawn(self.service.clone(), self.shutdown.subscribe());
        }
        // The exit watcher stops with the other background tasks: after
        // `stop` a VM that dies (killed by whoever stopped the daemon) must
        // not be restored by a daemon that is going away.
        let watcher = self.service.spawn_exit_watcher();
        let mut stopped = self.shutdown.subscribe();
        tokio::spawn(async move {
            while !*stopped.borrow() {
                if stopped.changed().await.is_err() {
                    break;
                }
            }
            watcher.abort();
        });
        // Histogram samples folded into their summaries whether or not
        // anyone scrapes /metrics (else they queue for ever).
        self.service
            .metrics()
            .spawn_upkeep(self.shutdown.subscribe());
        // The per-sandbox usage sampler (`[metrics]`), stopped with the rest.
        self.service.spawn_sampler(self.shutdown.subscribe());
        // Webhook deliveries (`[webhooks]`), resumed from the store.
        self.service.spawn_webhook_worker(self.shutdown.subscribe());
        // Pressure-driven hibernation (`[pressure]`), stopped with the rest.
        self.service.spawn_pressure(self.shutdown.subscribe());
        // Warm pools (`[pools]`): filled in the background; their guests end
        // with the daemon (`stop`), they are no one's sandboxes.
        self.service.spawn_warm_filler(self.shutdown.subscribe());
        let cfg = self.service.config();
        let driver = scheduler::DriverConfig {
            max_concurrent: cfg.max_concurrent_tasks,
            sweep_interval: cfg.gc_sweep_interval,
        };
        tokio::spawn(scheduler::run(
            self.service.scheduler().clone(),
            Arc::new(service::ScheduledActions(self.service.clone())),
            self.service.clock(),
            driver,
            self.shutdown.subscribe(),
        ));
        Ok(report)
    }

    /// Stops the background tasks: scheduler and exit watcher (VMs keep running).
    pub fn stop(&self) {
        let _ = self.shutdown.send(true);
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut m = String::new();
    let mut src = e.source();
    while let Some(c) = src {
        if !m.is_empty() {
            m.push_str(": ");
        }
        m.push_str(&c.to_string());
        src = c.source();
    }
    m
}

impl App {
    /// This daemon as a cluster host, when `[cluster] enabled`.
    pub fn cluster(&self) -> Option<&Arc<cluster::Cluster>> {
        self.cluster.as_ref()
    }
}

/// Serves the API on `listener` (bounded by `[listener]`,
/// [`listener::serve`]) until `shutdown` completes, then stops the
/// background tasks. VMs keep running; the next start adopts them.
pub async fn serve(
    app: &App,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let result = listener::serve(
        listener,
        None,
        app.router(),
        app.service().config().listener.clone(),
        Some(app.service().metrics().clone()),
        shutdown,
    )
    .await;
    app.stop();
    result
}
