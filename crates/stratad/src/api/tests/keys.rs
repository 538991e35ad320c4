//! A sandbox's stored environment variables are sealed by the key store
//! (`security::keys`): the database holds no value in the clear, a
//! restarted daemon with the same key dir reads them back, one with another
//! key reads none, and a row from before sealing is sealed in place. Real
//! store, service and key store; the engine is the test double.

use std::collections::BTreeMap;

use super::*;
use crate::caller::{Caller, SystemReason};

fn app(data: &std::path::Path, keys: &std::path::Path) -> App {
    let mut cfg = Config {
        data_dir: data.to_owned(),
        key_dir: keys.to_owned(),
        ..Config::default()
    };
    cfg.capacity.vcpus = 4;
    cfg.capacity.cpu_overcommit = 1.0;
    cfg.capacity.memory_mib = 8192;
    cfg.security.auth = false;
    let store = store_with_base_template(&cfg);
    App::new(
        cfg,
        store,
        Arc::new(Double::default()),
        Arc::new(SystemClock),
    )
}

fn raw_rows(data: &std::path::Path) -> Vec<(String, String)> {
    let conn = rusqlite::Connection::open(data.join("strata.db")).unwrap();
    let mut stmt = conn
        .prepare("SELECT sandbox_id, env FROM sandbox_env ORDER BY sandbox_id")
        .unwrap();
    let rows = stmt
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    rows
}

#[tokio::test]
async fn stored_env_is_sealed_survives_a_restart_and_needs_the_key() {
    let data = tempfile::tempdir().unwrap();
    let keys = tempfile::tempdir().unwrap();
    let key_dir = keys.path().join("keys");
    let sys = Caller::system(SystemReason::Embedder);
    let env = BTreeMap::from([
        (
            "OPENAI_API_KEY".to_string(),
            "sk-very-secret-value".to_string(),
        ),
        ("MODE".to_string(), "prod".to_string()),
    ]);
    let (a, b) = {
        let h = Harness {
            app: app(data.path(), &key_dir),
            engine: Arc::new(Double::default()),
            _dir: tempfile::tempdir().unwrap(),
        };
        let a: SandboxId = create(&h).await.parse().unwrap();
        let b: SandboxId = create(&h).await.parse().unwrap();
        let svc = h.app.service();
        svc.set_sandbox_env(&sys, &a, env.clone()).await.unwrap();
        svc.set_sandbox_env(&sys, &b, env.clone()).await.unwrap();
        (a, b)
    };
    // The database file holds neither a name's value nor the JSON.
    let db = std::fs::read(data.path().join("strata.db")).unwrap();
    let hay = String::from_utf8_lossy(&db);
    assert!(!hay.contains("sk-very-secret-value"));
    let rows = raw_rows(data.path());
    assert_eq!(rows.len(), 2);
    for (_, v) in &rows {
        assert!(v.starts_with("sealed:v1:"), "{v}");
        assert!(!v.contains("prod"));
    }
    // The key is private and outside the data dir.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(key_dir.join("master.key"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    assert!(!data.path().join("keys").exists());

    // A restart with the same key dir reads both back.
    let again = app(data.path(), &key_dir);
    let mut got = again.service().stored_envs().unwrap();
    got.sort();
    let mut want = vec![(a.clone(), env.clone()), (b.clone(), env.clone())];
    want.sort();
    assert_eq!(got, want);

    // A row moved onto another sandbox does not open there (bound to its id).
    let conn = rusqlite::Connection::open(data.path().join("strata.db")).unwrap();
    let a_row = &rows.iter().find(|(id, _)| id == a.as_str()).unwrap().1;
    conn.execute(
        "UPDATE sandbox_env SET env = ?1 WHERE sandbox_id = ?2",
        rusqlite::params![a_row, b.as_str()],
    )
    .unwrap();
    let got = app(data.path(), &key_dir).service().stored_envs().unwrap();
    assert_eq!(got, vec![(a.clone(), env.clone())]);

    // The data dir with another deployment's key opens nothing.
    let other = keys.path().join("other");
    assert!(app(data.path(), &other)
        .service()
        .stored_envs()
        .unwrap()
        .is_empty());
}

#[tokio::test]
async fn a_plain_row_from_before_sealing_is_read_and_sealed_in_place() {
    let data = tempfile::tempdir().unwrap();
    let keys = tempfile::tempdir().unwrap();
    let key_dir = keys.path().join("keys");
    let h = Harness {
        app: app(data.path(), &key_dir),
        engine: Arc::new(Double::default()),
        _dir: tempfile::tempdir().unwrap(),
    };
    let id: SandboxId = create(&h).await.parse().unwrap();
    // What store schema 7 wrote before the key store existed.
    let conn = rusqlite::Connection::open(data.path().join("strata.db")).unwrap();
    conn.execute(
        "INSERT INTO sandbox_env (sandbox_id, env, updated_at) VALUES (?1, ?2, 0)",
        rusqlite::params![id.as_str(), r#"{"TOKEN":"plain-old-secret"}"#],
    )
    .unwrap();
    let got = h.app.service().stored_envs().unwrap();
    assert_eq!(
        got,
        vec![(
            id.clone(),
            BTreeMap::from([("TOKEN".to_string(), "plain-old-secret".to_string())])
        )]
    );
    let rows = raw_rows(data.path());
    assert!(rows[0].1.starts_with("sealed:v1:"), "{rows:?}");
    assert!(!rows[0].1.contains("plain-old-secret"));
    // And it still reads back after that.
    assert_eq!(
        app(data.path(), &key_dir).service().stored_envs().unwrap(),
        got
    );
}

#[tokio::test]
async fn without_a_usable_key_store_nothing_is_stored() {
    let data = tempfile::tempdir().unwrap();
    let keys = tempfile::tempdir().unwrap();
    // A key dir others can write to is refused.
    let key_dir = keys.path().join("open");
    std::fs::create_dir(&key_dir).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&key_dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let h = Harness {
        app: app(data.path(), &key_dir),
        engine: Arc::new(Double::default()),
        _dir: tempfile::tempdir().unwrap(),
    };
    let id: SandboxId = create(&h).await.parse().unwrap();
    let err = h
        .app
        .service()
        .set_sandbox_env(
            &Caller::system(SystemReason::Embedder),
            &id,
            BTreeMap::from([("K".to_string(), "v".to_string())]),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, crate::service::ServiceError::Keys(_)),
        "{err}"
    );
    assert!(raw_rows(data.path()).is_empty());
    assert!(!key_dir.join("master.key").exists());
}
