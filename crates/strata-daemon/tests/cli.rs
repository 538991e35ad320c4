//! The two binaries' command lines, without a VM: help, the default
//! configuration, and the E2B door's secret checked before anything starts.

use std::process::{Command, Output};

fn run(bin: &str, args: &[&str]) -> Output {
    Command::new(bin)
        .args(args)
        .env_remove("STRATAD_CONFIG")
        .env_remove("STRATA_E2B_API_KEYS")
        .output()
        .expect("run the binary")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

const STRATAD: &str = env!("CARGO_BIN_EXE_stratad");
const SERVER: &str = env!("CARGO_BIN_EXE_strata-server");

#[test]
fn stratad_has_the_e2b_switch() {
    let o = run(STRATAD, &["--help"]);
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    assert!(t.contains("Usage: stratad"), "{t}");
    let flags: Vec<&str> = t
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    for flag in [
        "--e2b",
        "--e2b-api-key",
        "--e2b-token-secret-file",
        "--listen",
    ] {
        assert!(flags.contains(&flag), "{flag} missing from:\n{t}");
    }
}

#[test]
fn strata_server_is_a_deprecated_alias() {
    let o = run(SERVER, &["--help"]);
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    assert!(t.contains("Usage: strata-server"), "{t}");
    assert!(t.contains("stratad --e2b"), "{t}");
    assert!(t.contains("--e2b-api-key"), "{t}");
}

#[test]
fn the_default_configuration_has_an_e2b_section() {
    for bin in [STRATAD, SERVER] {
        let o = run(bin, &["--print-default-config"]);
        assert!(o.status.success(), "{}", text(&o));
        let t = String::from_utf8_lossy(&o.stdout);
        assert!(t.contains("[e2b]\nenabled = false"), "{t}");
    }
}

/// A secret file that is too short stops the daemon before it opens the
/// runtime, with `--e2b`, with `[e2b] enabled` and with the alias; without
/// the door the secret is not read.
#[test]
fn the_e2b_door_reads_its_secret_first() {
    let d = tempfile::tempdir().expect("tempdir");
    let secret = d.path().join("e2b.secret");
    std::fs::write(&secret, "short\n").expect("write");
    let conf = d.path().join("stratad.toml");
    std::fs::write(&conf, "[e2b]\nenabled = true\n").expect("write");
    let data = d.path().join("data");
    let data = data.to_str().expect("utf-8");
    let secret = secret.to_str().expect("utf-8");
    let conf = conf.to_str().expect("utf-8");
    let common = ["--data-dir", data, "--e2b-token-secret-file", secret];
    for (bin, extra) in [
        (STRATAD, vec!["--e2b"]),
        (STRATAD, vec!["--config", conf]),
        (SERVER, vec![]),
    ] {
        let args: Vec<&str> = common.iter().copied().chain(extra).collect();
        let o = run(bin, &args);
        assert!(!o.status.success(), "{bin} {args:?}: {}", text(&o));
        assert!(
            text(&o).contains("holds a secret that is too short"),
            "{bin} {args:?}: {}",
            text(&o)
        );
    }
}
