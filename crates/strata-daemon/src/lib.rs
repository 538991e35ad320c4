//! The strata daemon binary, on top of both front doors: the `stratad`
//! library (the `/v1` API, the store, the scheduler) and `strata-e2b` (the
//! E2B-compatible control plane and envd), which itself depends on
//! `stratad`, so the binary that links both lives one floor above them.
//!
//! Binaries: `stratad` ([`main`]) and `strata-server`, the deprecated alias
//! of `stratad --e2b` kept for one release. The E2B door is on with `--e2b`
//! or `[e2b] enabled = true`; its settings are `[e2b]` of the configuration
//! ([`stratad::config::E2bSettings`]) and the `--e2b-*` flags.
//!
//! Point the E2B SDK at a daemon serving the door with
//! `E2B_API_URL=http://HOST:PORT`, `E2B_SANDBOX_URL=http://HOST:PORT` and
//! `E2B_API_KEY=KEY`.

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;

use anyhow::Context as _;
use stratad::cli::Args;
use stratad::config::Config;
use stratad::daemon::Mount;

/// Runs the daemon as `stratad` does: the configuration the arguments
/// describe, with the E2B door mounted when it is enabled.
pub async fn main(args: Args) -> anyhow::Result<()> {
    stratad::cli::main_with_doors(args, e2b_door).await
}

/// The E2B door the configuration asks for: `None` when `[e2b]` is not
/// enabled. Reads (or creates) the envd token secret first, so a bad secret
/// file stops the daemon before it starts.
pub fn e2b_door(cfg: &Config) -> anyhow::Result<Option<Mount>> {
    let s = &cfg.e2b;
    if !s.enabled {
        if !s.api_keys.is_empty() || s.token_secret_file.is_some() {
            tracing::warn!(
                "E2B settings given, but the E2B door is off: add --e2b (or [e2b] enabled = true)"
            );
        }
        return Ok(None);
    }
    let api_keys = strata_e2b::auth::ApiKey::parse_all(&s.api_keys)
        .context("[e2b] api_keys / --e2b-api-key (KEY, KEY=TENANT or KEY=TENANT:ACTOR)")?;
    let secret_path = s.token_secret_path(&cfg.data_dir);
    if cfg.cluster.enabled && !secret_path.exists() {
        // A new random secret: another host's or API process's envd tokens
        // (and this one's for them) would not check (docs/cluster.md).
        tracing::warn!(
            secret = %secret_path.display(),
            "E2B door on a cluster with no envd token secret yet: a new one is made, which no other host or API process shares; give every one the same file ([e2b] token_secret_file)"
        );
    }
    let door = strata_e2b::E2bConfig {
        api_keys,
        token_secret: token_secret(&secret_path)?,
        home_dir: s.home_dir.clone(),
        client_id: s.client_id.clone(),
        default_timeout_s: s.default_timeout.as_secs(),
        max_request_bytes: usize::try_from(s.max_request_bytes).unwrap_or(usize::MAX),
        rate_limit_per_second: s.rate_limit_per_second,
        rate_limit_burst: s.rate_limit_burst,
        auth_failures_per_minute: s.auth_failures_per_minute,
        // get_host(port) = <port>-<id>.localhost:<port> reaches this listener
        // (the TLS one when [e2b] tls_listen is set: the SDKs use https).
        domain: Some(s.domain.clone().unwrap_or_else(|| {
            let port = s.tls_listen.map_or(cfg.listen.port(), |a| a.port());
            format!("localhost:{port}")
        })),
        public_ports: s.public_ports,
        template_ca_bundle: s.template_ca_bundle.clone(),
    };
    for k in &door.api_keys {
        tracing::info!(
            key = k.id(),
            tenant = k.tenant(),
            actor = k.actor(),
            "E2B API key"
        );
    }
    tracing::info!(secret = %secret_path.display(), keys = door.api_keys.len(), "E2B door on");
    Ok(Some(Box::new(move |svc, sec, api| {
        let auth = sec.as_ref().is_some_and(|s| s.config().auth);
        if door.api_keys.is_empty() && !auth {
            tracing::warn!(
                "no E2B API key and no strata authentication: the E2B control plane accepts any key"
            );
        }
        strata_e2b::router_with_api(api, svc, sec, door)
    })))
}

/// Reads the envd token secret, creating it (32 random bytes, hex, mode
/// 0600) if absent.
pub fn token_secret(path: &Path) -> anyhow::Result<Vec<u8>> {
    if let Ok(text) = std::fs::read_to_string(path) {
        let s = text.trim();
        anyhow::ensure!(
            s.len() >= 32,
            "{} holds a secret that is too short",
            path.display()
        );
        return Ok(s.as_bytes().to_vec());
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    let secret = hex::encode(rand::random::<[u8; 32]>());
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("create {}", path.display()))?;
    f.write_all(secret.as_bytes())?;
    f.sync_all()?;
    Ok(secret.into_bytes())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    #[test]
    fn the_secret_is_created_once_and_kept() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("sub/e2b.secret");
        let first = token_secret(&path).unwrap();
        assert_eq!(first.len(), 64);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(token_secret(&path).unwrap(), first);
        std::fs::write(&path, "short\n").unwrap();
        assert!(token_secret(&path).is_err());
    }

    #[test]
    fn the_door_follows_the_configuration() {
        let d = tempfile::tempdir().unwrap();
        let mut cfg = Config {
            data_dir: d.path().to_owned(),
            ..Config::default()
        };
        assert!(e2b_door(&cfg).unwrap().is_none());
        assert!(!d.path().join("e2b.secret").exists());
        cfg.e2b.enabled = true;
        assert!(e2b_door(&cfg).unwrap().is_some());
        assert!(d.path().join("e2b.secret").is_file());
        // Keys with tenants; a bad entry stops the daemon.
        cfg.e2b.api_keys = vec!["bare".into(), "k=acme:ci-bot".into()];
        assert!(e2b_door(&cfg).unwrap().is_some());
        for bad in ["k=Acme", "=acme", "k=acme:a b"] {
            cfg.e2b.api_keys = vec![bad.into()];
            let e = e2b_door(&cfg).err().expect(bad);
            assert!(format!("{e:#}").contains("api_keys"), "{bad}: {e:#}");
        }
    }
}
