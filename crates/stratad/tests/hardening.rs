//! A real `stratad` hardened as it starts (docs/hardening.md,
//! docs/listener.md): its files are its own user's only, looser modes of an
//! existing install are tightened, and the API is served over TLS with a
//! configured certificate, reached by `reqwest` and by the `strata` CLI.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use common::Daemon;
use strata_testkit::{run_strata, strata_bin, tokio_rt};

/// Every file and directory under `root` (not following symlinks, not
/// crossing into other file systems but the pool's), with its mode.
fn modes_under(root: &Path, out: &mut Vec<(PathBuf, u32)>) {
    let meta = std::fs::symlink_metadata(root).unwrap();
    out.push((root.to_path_buf(), meta.permissions().mode() & 0o7777));
    if meta.is_dir() {
        for e in std::fs::read_dir(root).unwrap() {
            let p = e.unwrap().path();
            if std::fs::symlink_metadata(&p)
                .unwrap()
                .file_type()
                .is_symlink()
            {
                continue;
            }
            modes_under(&p, out);
        }
    }
}

fn open_to_others(d: &Daemon) -> Vec<String> {
    let mut all = Vec::new();
    modes_under(&d.root.join("data"), &mut all);
    modes_under(&d.run_dir, &mut all);
    all.into_iter()
        .filter(|(_, m)| m & 0o077 != 0)
        .map(|(p, m)| format!("{} {m:04o}", p.display()))
        .collect()
}

fn chmod(p: &Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

#[test]
fn the_daemons_files_are_its_own_users_only_and_looser_ones_are_tightened() {
    let d = Daemon::start("default_template = false\n");
    // Something audited, so the audit log and the database's WAL exist.
    tokio_rt().block_on(async {
        let (status, body) = d
            .call(
                "POST",
                "/v1/tokens",
                Some(serde_json::json!({"name": "t", "role": "viewer"})),
            )
            .await;
        assert!((200..300).contains(&status), "{status} {body}");
    });
    let data = d.root.join("data");
    for f in [
        "strata.db",
        "strata.db-wal",
        "audit.jsonl",
        "pool.img",
        "pool/sandboxes",
    ] {
        assert!(data.join(f).exists(), "{f} missing");
    }
    let open = open_to_others(&d);
    assert!(
        open.is_empty(),
        "reachable by other users:\n{}",
        open.join("\n")
    );
    assert_eq!(mode(&data), 0o700);
    assert_eq!(mode(&data.join("pool")), 0o700, "the pool's mount point");
    assert_eq!(mode(&data.join("pool.img")), 0o600);

    // An install made before: modes as a 022 umask left them.
    d.stop();
    let loose = [
        (data.clone(), 0o755),
        (data.join("pool"), 0o755),
        (data.join("pool.img"), 0o644),
        (data.join("strata.db"), 0o644),
        (data.join("audit.jsonl"), 0o644),
        (d.run_dir.clone(), 0o755),
    ];
    for (p, m) in &loose {
        chmod(p, *m);
    }
    d.start_again();
    let open = open_to_others(&d);
    assert!(
        open.is_empty(),
        "left open after a restart:\n{}",
        open.join("\n")
    );
    let logs = d.logs();
    for (p, _) in &loose {
        assert!(
            logs.lines()
                .any(|l| l.contains("tightened") && l.contains(&*p.to_string_lossy())),
            "no log line for {}:\n{logs}",
            p.display()
        );
    }
    d.shutdown();
}

/// A CA and a leaf for `localhost` and `127.0.0.1` signed by it, as PEM
/// files in `dir`: (ca.pem, cert.pem, key.pem).
fn make_certs(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
        .unwrap()
        .signed_by(&key, &ca, &ca_key)
        .unwrap();
    let paths = (
        dir.join("ca.pem"),
        dir.join("cert.pem"),
        dir.join("key.pem"),
    );
    std::fs::write(&paths.0, ca.pem()).unwrap();
    std::fs::write(&paths.1, leaf.pem()).unwrap();
    std::fs::write(&paths.2, key.serialize_pem()).unwrap();
    (paths.0, paths.1, paths.2)
}

#[test]
fn the_api_is_served_over_tls_and_the_cli_talks_to_it() {
    let certs = tempfile::tempdir().unwrap();
    let (ca, cert, key) = make_certs(certs.path());
    let port = strata_testkit::free_port();
    let d = Daemon::start(&format!(
        "default_template = false\ntls_listen = \"127.0.0.1:{port}\"\ntls_cert = \"{}\"\ntls_key = \"{}\"\n",
        cert.display(),
        key.display()
    ));
    let token = d.token().expect("admin token");
    let url = format!("https://localhost:{port}");
    tokio_rt().block_on(async {
        let pem = std::fs::read(&ca).unwrap();
        let trusting = reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .add_root_certificate(reqwest::Certificate::from_pem(&pem).unwrap())
            .build()
            .unwrap();
        let r = trusting.get(format!("{url}/healthz")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let me: serde_json::Value = trusting
            .get(format!("{url}/v1/whoami"))
            .bearer_auth(&token)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(me["role"], "admin", "{me}");
        // By address too (no SNI: the configured certificate all the same).
        let r = trusting
            .get(format!("https://127.0.0.1:{port}/healthz"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        // Without the CA the handshake fails; plain HTTP gets no answer.
        let strict = reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .build()
            .unwrap();
        assert!(strict.get(format!("{url}/healthz")).send().await.is_err());
        let plain = reqwest::get(format!("http://127.0.0.1:{port}/healthz")).await;
        assert!(plain.is_err(), "{plain:?}");
    });

    let bin = strata_bin();
    let ca_arg = ca.to_string_lossy().into_owned();
    let out = run_strata(
        &bin,
        &url,
        Some(&token),
        &["--ca-bundle", &ca_arg, "--json", "whoami"],
    );
    assert!(out.status.success());
    let me: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(me["role"], "admin", "{me}");
    // STRATA_CA_BUNDLE does the same.
    let out = std::process::Command::new(&bin)
        .env("STRATA_URL", &url)
        .env("STRATA_TOKEN", &token)
        .env("STRATA_CA_BUNDLE", &ca)
        .env("STRATA_DATA_DIR", "/nonexistent/strata-testkit")
        .args(["--json", "whoami"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The system's roots do not know this CA: refused, and said why.
    let out = run_strata(&bin, &url, Some(&token), &["whoami"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr).to_lowercase();
    assert!(
        err.contains("certificate") || err.contains("issuer"),
        "{err}"
    );
    d.shutdown();
}
