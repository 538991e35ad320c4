//! Unit tests of parsing, limits, planning and hashing (pack and the
//! Dockerfile subset have their own files).

use super::*;
use crate::limits::*;

const TOML: &str = r#"
base = "default"

[[step]]
apt = ["jq"]

[[step]]
pip = ["requests==2.32.3", "uvicorn[standard]>=0.30,<1"]

[[step]]
env = { GREETING = "hi there", APP_ENV = "prod" }

[[step]]
user = "user"

[[step]]
workdir = "/srv/app"

[[step]]
copy = { src = "site", dest = "www/", sha256 = "1111111111111111111111111111111111111111111111111111111111111111", mode = 0o755 }

[[step]]
run = "echo $GREETING > index.html"

[start]
cmd = "python3 -m http.server 8000"

[ready]
port = 8000
timeout_secs = 30
"#;

fn recipe() -> Recipe {
    Recipe::from_toml(TOML).expect("the example parses")
}

#[test]
fn toml_parses_into_the_expected_recipe() {
    let r = recipe();
    assert_eq!(r.base, "default");
    assert_eq!(r.steps.len(), 7);
    assert_eq!(r.steps[0], Step::Apt(vec!["jq".into()]));
    assert_eq!(r.steps[3], Step::User("user".into()));
    match &r.steps[5] {
        Step::Copy(c) => {
            assert_eq!(c.src, "site");
            assert_eq!(c.dest, "www/");
            assert_eq!(c.mode, Some(0o755));
            assert_eq!(c.owner, None);
        }
        s => panic!("step 6 is {s:?}"),
    }
    assert_eq!(
        r.start,
        Some(Start {
            cmd: "python3 -m http.server 8000".into()
        })
    );
    assert_eq!(
        r.ready,
        Some(Ready::Port {
            port: 8000,
            timeout_secs: 30
        })
    );
}

#[test]
fn json_has_the_same_shape_and_accepts_steps_as_well_as_step() {
    let r = recipe();
    let json = r.to_json();
    assert_eq!(Recipe::from_json(&json).expect("own JSON parses"), r);
    let alias = json.replacen("\"step\":", "\"steps\":", 1);
    assert_ne!(alias, json);
    assert_eq!(Recipe::from_json(&alias).expect("\"steps\" parses"), r);
    let j = r#"{"steps": [{"run": "true"}, {"copy": {"src": "a", "dest": "/b", "mode": "0640"}}],
               "ready": {"http": {"port": 80}}}"#;
    let r = Recipe::from_json(j).expect("parses");
    assert_eq!(r.base, DEFAULT_BASE);
    let Step::Copy(c) = &r.steps[1] else {
        panic!("not a copy")
    };
    assert_eq!(c.mode, Some(0o640));
    assert_eq!(
        r.ready,
        Some(Ready::Http {
            port: 80,
            path: "/".into(),
            timeout_secs: DEFAULT_READY_TIMEOUT_SECS
        })
    );
}

#[test]
fn unknown_fields_and_shapes_are_refused() {
    for (name, bad) in [
        ("top-level field", "bsae = \"x\"\n"),
        ("step kind", "[[step]]\nexec = \"x\"\n"),
        (
            "two kinds in one step",
            "[[step]]\nrun = \"x\"\nuser = \"u\"\n",
        ),
        (
            "copy field",
            "[[step]]\ncopy = { src = \"a\", dest = \"/b\", chmod = 1 }\n",
        ),
        ("start field", "[start]\ncmd = \"x\"\nuser = \"root\"\n"),
        (
            "ready with two checks",
            "[ready]\nport = 1\ncmd = \"true\"\n",
        ),
        ("ready with none", "[ready]\ntimeout_secs = 3\n"),
        ("ready field", "[ready]\nport = 1\ninterval = 3\n"),
        ("port out of range", "[ready]\nport = 70000\n"),
        (
            "mode not octal",
            "[[step]]\ncopy = { src = \"a\", dest = \"/b\", mode = \"rwx\" }\n",
        ),
    ] {
        let e = Recipe::from_toml(bad).expect_err(name);
        assert_eq!(e.code(), "invalid_recipe", "{name}: {e}");
        assert_eq!(e.status(), 400);
    }
    let e = Recipe::from_json("{\"steps\": [{\"run\": 1}]}").expect_err("wrong type");
    assert_eq!(e.code(), "invalid_recipe");
}

#[test]
fn toml_errors_name_the_line() {
    let e = Recipe::from_toml("base = \"x\"\n\n[[step]]\nrunn = \"x\"\n").expect_err("bad");
    assert_eq!(e.line(), Some(4), "{e}");
}

fn run_steps(n: usize) -> Recipe {
    Recipe {
        base: "default".into(),
        steps: (0..n).map(|i| Step::Run(format!("echo {i}"))).collect(),
        start: None,
        ready: None,
    }
}

fn one(step: Step) -> Recipe {
    Recipe {
        base: "default".into(),
        steps: vec![Step::Run("true".into()), step],
        start: None,
        ready: None,
    }
}

#[test]
fn limits_are_enforced_with_codes_and_step_numbers() {
    assert!(run_steps(MAX_STEPS).validate().is_ok());
    let e = run_steps(MAX_STEPS + 1)
        .validate()
        .expect_err("too many steps");
    assert_eq!((e.code(), e.status()), ("recipe_too_large", 413));

    let big = "x".repeat(MAX_COMMAND_BYTES + 1);
    let e = one(Step::Run(big)).validate().expect_err("long run");
    assert_eq!(e.code(), "recipe_too_large");
    assert_eq!(e.step(), Some(1));
    assert!(e.to_string().starts_with("step 2: "), "{e}");
    assert!(one(Step::Run("x".repeat(MAX_COMMAND_BYTES)))
        .validate()
        .is_ok());

    let pk = |n: usize, len: usize| Step::Pip((0..n).map(|i| format!("{i:0>len$}")).collect());
    assert!(one(pk(MAX_PACKAGES, MAX_PACKAGE_BYTES)).validate().is_ok());
    assert_eq!(
        one(pk(MAX_PACKAGES + 1, 3))
            .validate()
            .expect_err("n")
            .code(),
        "recipe_too_large"
    );
    assert_eq!(
        one(pk(1, MAX_PACKAGE_BYTES + 1))
            .validate()
            .expect_err("len")
            .code(),
        "recipe_too_large"
    );

    let env = |k: &str, v: String| Step::Env([(k.to_string(), v)].into());
    assert!(one(env("A", "v".repeat(MAX_ENV_VALUE_BYTES)))
        .validate()
        .is_ok());
    assert_eq!(
        one(env("A", "v".repeat(MAX_ENV_VALUE_BYTES + 1)))
            .validate()
            .expect_err("v")
            .code(),
        "recipe_too_large"
    );
    // Many steps each under the per-value limit: the accumulated total is bounded.
    let many = Recipe {
        steps: (0..8)
            .map(|i| env(&format!("K{i}"), "v".repeat(MAX_ENV_VALUE_BYTES)))
            .collect(),
        ..run_steps(0)
    };
    let e = many.validate().expect_err("env total");
    assert_eq!(e.code(), "recipe_too_large");
    assert!(e.to_string().contains("accumulated environment"), "{e}");
    // Replacing a variable does not count twice.
    let same = Recipe {
        steps: (0..8)
            .map(|_| env("K", "v".repeat(MAX_ENV_VALUE_BYTES)))
            .collect(),
        ..run_steps(0)
    };
    assert!(same.validate().is_ok());

    let text = format!("base = \"default\"\n# {}\n", "x".repeat(MAX_RECIPE_BYTES));
    assert_eq!(
        Recipe::from_toml(&text).expect_err("text").code(),
        "recipe_too_large"
    );
    assert_eq!(
        Recipe::from_json(&text).expect_err("text").code(),
        "recipe_too_large"
    );
    assert_eq!(
        Recipe::from_dockerfile(&text).expect_err("text").code(),
        "recipe_too_large"
    );

    let deep = Recipe {
        steps: (0..3).map(|_| Step::Workdir("d".repeat(2000))).collect(),
        ..run_steps(0)
    };
    assert_eq!(
        deep.validate().expect_err("resolved path").code(),
        "recipe_too_large"
    );
}

#[test]
fn values_are_checked() {
    let bad = [
        ("NUL in run", Step::Run("a\0b".into())),
        ("empty run", Step::Run("  ".into())),
        (
            "NUL in env",
            Step::Env([("A".to_string(), "a\0".to_string())].into()),
        ),
        (
            "env key",
            Step::Env([("1A".to_string(), "x".to_string())].into()),
        ),
        (
            "env key dash",
            Step::Env([("A-B".to_string(), "x".to_string())].into()),
        ),
        ("empty env", Step::Env(BTreeMap::new())),
        ("user upper", Step::User("Root".into())),
        ("user long", Step::User("a".repeat(33))),
        ("user shell", Step::User("u;id".into())),
        ("workdir NUL", Step::Workdir("/a\0".into())),
        ("apt metachar", Step::Apt(vec!["curl;id".into()])),
        (
            "npm option",
            Step::Npm(vec!["--registry=http://evil".into()]),
        ),
        ("pip empty", Step::Pip(vec![])),
        (
            "copy abs src",
            Step::Copy(Copy {
                src: "/etc/passwd".into(),
                dest: "/x".into(),
                sha256: None,
                owner: None,
                mode: None,
            }),
        ),
        (
            "copy .. src",
            Step::Copy(Copy {
                src: "a/../../x".into(),
                dest: "/x".into(),
                sha256: None,
                owner: None,
                mode: None,
            }),
        ),
        (
            "copy owner",
            Step::Copy(Copy {
                src: "a".into(),
                dest: "/x".into(),
                sha256: None,
                owner: Some("u:g:x".into()),
                mode: None,
            }),
        ),
        (
            "copy mode",
            Step::Copy(Copy {
                src: "a".into(),
                dest: "/x".into(),
                sha256: None,
                owner: None,
                mode: Some(0o10000),
            }),
        ),
        (
            "copy sha",
            Step::Copy(Copy {
                src: "a".into(),
                dest: "/x".into(),
                sha256: Some("ABC".into()),
                owner: None,
                mode: None,
            }),
        ),
    ];
    for (name, step) in bad {
        let e = one(step).validate().expect_err(name);
        assert_eq!(e.code(), "invalid_recipe", "{name}: {e}");
        assert_eq!(e.step(), Some(1), "{name}");
    }
    for ok in ["user", "_apt", "www-data", "u1"] {
        assert!(one(Step::User(ok.into())).validate().is_ok(), "{ok}");
    }
    for owner in ["user", "user:staff", "1000:1000", "root"] {
        let c = Copy {
            src: "a".into(),
            dest: "/x".into(),
            sha256: None,
            owner: Some(owner.into()),
            mode: None,
        };
        assert!(one(Step::Copy(c)).validate().is_ok(), "{owner}");
    }
    let ready = |r: Ready| {
        Recipe {
            ready: Some(r),
            ..run_steps(1)
        }
        .validate()
    };
    assert!(ready(Ready::Port {
        port: 1,
        timeout_secs: MAX_READY_TIMEOUT_SECS
    })
    .is_ok());
    assert!(ready(Ready::Port {
        port: 1,
        timeout_secs: MAX_READY_TIMEOUT_SECS + 1
    })
    .is_err());
    assert!(ready(Ready::Port {
        port: 1,
        timeout_secs: 0
    })
    .is_err());
    assert!(ready(Ready::Port {
        port: 0,
        timeout_secs: 5
    })
    .is_err());
    assert!(ready(Ready::Http {
        port: 80,
        path: "health".into(),
        timeout_secs: 5
    })
    .is_err());
    assert!(ready(Ready::Http {
        port: 80,
        path: "/a b".into(),
        timeout_secs: 5
    })
    .is_err());
    assert!(ready(Ready::Command {
        cmd: "".into(),
        timeout_secs: 5
    })
    .is_err());
    let e = Recipe {
        start: Some(Start { cmd: "x\0".into() }),
        ..run_steps(1)
    }
    .validate();
    assert_eq!(e.expect_err("NUL start").code(), "invalid_recipe");
    let e = Recipe {
        base: "a\nb".into(),
        ..run_steps(1)
    }
    .validate();
    assert_eq!(e.expect_err("base").code(), "invalid_recipe");
}

fn exec(a: &Action) -> &ExecPlan {
    match a {
        Action::Exec(e) => e,
        a => panic!("not an exec: {a:?}"),
    }
}

#[test]
fn plan_folds_user_cwd_and_env_docker_style() {
    let p = recipe().plan("tmpl-1@stamp").expect("plans");
    assert_eq!(p.steps.len(), 7);
    // apt and pip: root in /, the recipe env so far (none).
    let apt = exec(&p.steps[0].action);
    assert_eq!((apt.user.as_str(), apt.cwd.as_str()), ("root", "/"));
    assert!(
        apt.shell
            .contains("apt-get install -y --no-install-recommends 'jq'"),
        "{}",
        apt.shell
    );
    assert!(apt.shell.contains("DEBIAN_FRONTEND=noninteractive"));
    let pip = exec(&p.steps[1].action);
    assert!(pip
        .shell
        .starts_with("pip install --no-cache-dir --break-system-packages"));
    assert!(
        pip.shell
            .ends_with("'requests==2.32.3' 'uvicorn[standard]>=0.30,<1'"),
        "{}",
        pip.shell
    );
    assert_eq!(p.steps[2].action, Action::None);
    assert_eq!(p.steps[3].action, Action::None);
    // workdir: created as root, handed to the user.
    let wd = exec(&p.steps[4].action);
    assert_eq!(wd.user, "root");
    assert!(
        wd.shell.contains("mkdir -p -- '/srv/app'") && wd.shell.contains("chown -- 'user'"),
        "{}",
        wd.shell
    );
    // copy: dest resolved against the cwd, owner the current user.
    assert_eq!(
        p.steps[5].action,
        Action::Copy {
            sha256: "1".repeat(64),
            dest: "/srv/app/www/".into(),
            owner: "user".into(),
            mode: Some(0o755)
        }
    );
    let run = exec(&p.steps[6].action);
    assert_eq!((run.user.as_str(), run.cwd.as_str()), ("user", "/srv/app"));
    assert_eq!(
        run.env.get("GREETING").map(String::as_str),
        Some("hi there")
    );
    assert_eq!(run.env.len(), 2);
    assert_eq!(run.shell, "echo $GREETING > index.html");
    let start = p.start.as_ref().expect("start");
    assert_eq!(
        (start.user.as_str(), start.cwd.as_str()),
        ("user", "/srv/app")
    );
    assert_eq!(start.shell, "python3 -m http.server 8000");
    assert_eq!(start.env, run.env);
    assert_eq!(
        p.final_state,
        BuildState {
            user: "user".into(),
            cwd: "/srv/app".into(),
            env: run.env.clone()
        }
    );
    let probe = p.ready_probe.as_ref().expect("probe");
    assert!(probe.shell.contains("sport = :8000"), "{}", probe.shell);
    let d: Vec<&str> = p.steps.iter().map(|s| s.describe.as_str()).collect();
    assert_eq!(
        d[1],
        "2/7 pip install requests==2.32.3 uvicorn[standard]>=0.30,<1"
    );
    assert_eq!(d[4], "5/7 workdir /srv/app");
    assert_eq!(d[5], "6/7 copy site → /srv/app/www/");
    assert_eq!(d[6], "7/7 echo $GREETING > index.html");
}

#[test]
fn paths_resolve_lexically() {
    let r = Recipe {
        steps: vec![
            Step::Workdir("app".into()),
            Step::Workdir("../srv/./x/..".into()),
            Step::Workdir("../../../..".into()),
            Step::Workdir("/opt//y/".into()),
            Step::Copy(Copy {
                src: "f".into(),
                dest: ".".into(),
                sha256: Some("a".repeat(64)),
                owner: Some("root".into()),
                mode: None,
            }),
            Step::Copy(Copy {
                src: "f".into(),
                dest: "../z".into(),
                sha256: Some("a".repeat(64)),
                owner: None,
                mode: None,
            }),
        ],
        ..run_steps(0)
    };
    let p = r.plan("b").expect("plans");
    let cwds: Vec<String> = p.steps[..4]
        .iter()
        .map(|s| exec(&s.action).shell.clone())
        .collect();
    assert_eq!(cwds[0], "mkdir -p -- '/app'");
    assert_eq!(cwds[1], "mkdir -p -- '/srv'");
    assert_eq!(cwds[2], "mkdir -p -- '/'");
    assert_eq!(cwds[3], "mkdir -p -- '/opt/y'");
    let dest = |i: usize| match &p.steps[i].action {
        Action::Copy { dest, owner, .. } => (dest.clone(), owner.clone()),
        a => panic!("{a:?}"),
    };
    assert_eq!(dest(4), ("/opt/y/".to_string(), "root".to_string()));
    assert_eq!(dest(5), ("/opt/z".to_string(), "root".to_string()));
}

#[test]
fn plan_needs_every_copy_packed() {
    let mut r = recipe();
    if let Step::Copy(c) = &mut r.steps[5] {
        c.sha256 = None;
    }
    let e = r.plan("b").expect_err("unpacked copy");
    assert_eq!(e.code(), "copy_not_packed");
    assert_eq!(e.step(), Some(5));
}

fn hashes(p: &Plan) -> Vec<String> {
    p.steps.iter().map(|s| s.hash.clone()).collect()
}

#[test]
fn chain_hash_follows_the_documented_formula() {
    use sha2::{Digest, Sha256};
    let hexs = |d: &[u8]| d.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let r = Recipe {
        steps: vec![Step::Run("echo hi".into())],
        ..run_steps(0)
    };
    let p = r.plan("base-id").expect("plans");
    let h0 = hexs(&Sha256::digest(b"strata-recipe/1\0base-id"));
    assert_eq!(p.base_hash, h0);
    // The environment goes in as sha256 of its JSON: here `{}`.
    let env = hexs(&Sha256::digest(b"{}"));
    let record = format!(
        r#"{{"action":{{"exec":{{"shell":"echo hi","user":"root","cwd":"/","env":"{env}"}}}},"user":"root","cwd":"/","env":"{env}"}}"#
    );
    let mut h = Sha256::new();
    h.update(h0.as_bytes());
    h.update(b"\n");
    h.update(record.as_bytes());
    assert_eq!(p.steps[0].hash, hexs(&h.finalize()));
    let mut h = Sha256::new();
    h.update(p.steps[0].hash.as_bytes());
    h.update(b"\n");
    h.update(br#"{"start":null,"ready":null}"#);
    assert_eq!(p.final_hash, hexs(&h.finalize()));
}

#[test]
fn same_recipe_same_hashes_in_every_run() {
    // Parsed separately (TOML and its JSON form), planned separately: equal.
    let a = recipe().plan("tmpl@1").expect("plans");
    let b = Recipe::from_json(&recipe().to_json())
        .expect("json")
        .plan("tmpl@1")
        .expect("plans");
    assert_eq!(a, b);
    // Pinned: these hashes key snapshots kept across daemon upgrades and
    // machines. If this changes, the planned form changed: bump HASH_DOMAIN.
    assert_eq!(
        a.final_hash,
        "9346919e94a46348ea5e1e80a9efb4d0566e6483f47a478d5c5cce2046e76e31"
    );
}

#[test]
fn changing_step_k_changes_hashes_from_k_only() {
    let base = recipe();
    let p0 = base.plan("b").expect("plans");
    let h0 = hashes(&p0);
    for k in 0..base.steps.len() {
        let mut r = base.clone();
        r.steps[k] = match &r.steps[k] {
            Step::Run(c) => Step::Run(format!("{c} ")),
            Step::Apt(_) => Step::Apt(vec!["curl".into()]),
            Step::Pip(_) => Step::Pip(vec!["requests==2.32.4".into()]),
            Step::Env(m) => {
                let mut m = m.clone();
                m.insert("GREETING".into(), "hello".into());
                Step::Env(m)
            }
            Step::User(_) => Step::User("nobody".into()),
            Step::Workdir(_) => Step::Workdir("/srv/app2".into()),
            Step::Copy(c) => Step::Copy(Copy {
                sha256: Some("2".repeat(64)),
                ..c.clone()
            }),
            Step::Npm(_) => unreachable!(),
        };
        let p = r.plan("b").expect("plans");
        let h = hashes(&p);
        assert_eq!(h[..k], h0[..k], "step {k} changed earlier hashes");
        for i in k..h.len() {
            assert_ne!(h[i], h0[i], "changing step {k} left hash {i} alone");
        }
        assert_ne!(p.final_hash, p0.final_hash);
    }
    // Start/ready change only the final hash.
    let mut r = base.clone();
    r.start = Some(Start {
        cmd: "python3 -m http.server 8001".into(),
    });
    let p = r.plan("b").expect("plans");
    assert_eq!(hashes(&p), h0);
    assert_ne!(p.final_hash, p0.final_hash);
    let mut r = base.clone();
    r.ready = Some(Ready::Port {
        port: 8000,
        timeout_secs: 31,
    });
    assert_ne!(r.plan("b").expect("plans").final_hash, p0.final_hash);
    // A rebuilt base invalidates everything.
    let p = base.plan("b2").expect("plans");
    assert!(hashes(&p).iter().zip(&h0).all(|(a, b)| a != b));
    // The copy's client-side source path is not part of the hash.
    let mut r = base.clone();
    if let Step::Copy(c) = &mut r.steps[5] {
        c.src = "elsewhere/site".into();
    }
    assert_eq!(hashes(&r.plan("b").expect("plans")), h0);
    // Appending a step keeps every earlier hash (describe's "k/n" is not hashed).
    let mut r = base.clone();
    r.steps.push(Step::Run("true".into()));
    assert_eq!(hashes(&r.plan("b").expect("plans"))[..7], h0[..]);
}

#[test]
fn file_text_dispatch() {
    let toml = "[[step]]\nrun = \"true\"\n";
    let df = "FROM base\nRUN true\n";
    let json = "{\"steps\": [{\"run\": \"true\"}]}";
    for (name, text, base) in [
        ("strata.toml", toml, "default"),
        ("x/recipe.json", json, "default"),
        ("Dockerfile", df, "base"),
        ("build/app.Dockerfile", df, "base"),
        ("Dockerfile.dev", df, "base"),
        ("recipe", json, "default"),
        ("recipe", df, "base"),
        ("recipe", toml, "default"),
    ] {
        let r = Recipe::from_file_text(name, text).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(r.base, base, "{name}");
        assert_eq!(r.steps, vec![Step::Run("true".into())], "{name}");
    }
    assert!(Recipe::from_file_text("x.toml", df).is_err());
}

/// Runs a planned command under a real `sh` with `pip`/`npm`/`apt-get`/`rm`
/// replaced (first on PATH) by scripts that print their arguments one per
/// line: each package is exactly one argument, nothing in it reaches the
/// shell.
fn argv_under_sh(shell: &str) -> Vec<String> {
    use std::os::unix::fs::PermissionsExt;
    let bin = tempfile::tempdir().expect("tmp");
    for name in ["pip", "npm", "apt-get", "rm"] {
        let p = bin.path().join(name);
        let body = if name == "rm" {
            "#!/bin/sh\n".to_string()
        } else {
            format!("#!/bin/sh\nprintf '%s\\n' {name} \"$@\"\n")
        };
        std::fs::write(&p, body).expect("write");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    let path = format!(
        "{}:{}",
        bin.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(shell)
        .env("PATH", path)
        .output()
        .expect("sh");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(String::from)
        .collect()
}

#[test]
fn package_steps_pass_each_package_as_one_argument() {
    let pkgs: Vec<String> = ["uvicorn[standard]>=0.30,<1", "a>b", "numpy==1.*", "x<y"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let r = Recipe {
        steps: vec![
            Step::Pip(pkgs.clone()),
            Step::Npm(vec!["@scope/pkg@^1.2".into()]),
            Step::Apt(vec!["libssl3=3.0.15-1~deb12u1".into()]),
        ],
        ..run_steps(0)
    };
    let dir = tempfile::tempdir().expect("tmp");
    let p = r.plan("b").expect("plans");
    let run = |i: usize| {
        let e = exec(&p.steps[i].action);
        assert_eq!(e.user, "root");
        // Run in a scratch cwd so a mis-quoted `>` would leave a file there.
        argv_under_sh(&format!(
            "cd {} && {}",
            crate::shell::quote(&dir.path().display().to_string()),
            e.shell
        ))
    };
    let pip = run(0);
    assert_eq!(
        pip[..4],
        [
            "pip",
            "install",
            "--no-cache-dir",
            "--break-system-packages"
        ]
    );
    assert_eq!(pip[pip.len() - 4..], pkgs[..]);
    let npm = run(1);
    assert_eq!(
        npm,
        [
            "npm",
            "install",
            "-g",
            "--no-audit",
            "--no-fund",
            "@scope/pkg@^1.2"
        ]
    );
    let apt = run(2);
    assert_eq!(apt[..2], ["apt-get", "update"]);
    assert_eq!(
        apt[2..],
        [
            "apt-get",
            "install",
            "-y",
            "--no-install-recommends",
            "libssl3=3.0.15-1~deb12u1"
        ]
    );
    assert_eq!(
        std::fs::read_dir(dir.path()).expect("ls").count(),
        0,
        "no redirection happened"
    );
}

/// The workdir command, run for real as root: creates the directory and
/// gives a new one to the current user; an existing one keeps its owner.
#[test]
fn workdir_command_creates_and_hands_over_the_directory() {
    use std::os::unix::fs::MetadataExt;
    let me = std::process::Command::new("id")
        .arg("-u")
        .output()
        .expect("id");
    if String::from_utf8_lossy(&me.stdout).trim() != "0" {
        eprintln!("skipped: needs root to chown");
        return;
    }
    let dir = tempfile::tempdir().expect("tmp");
    let new = dir.path().join("a/b");
    let r = Recipe {
        steps: vec![
            Step::User("nobody".into()),
            Step::Workdir(new.display().to_string()),
            Step::Workdir(dir.path().display().to_string()),
        ],
        ..run_steps(0)
    };
    let p = r.plan("b").expect("plans");
    for s in &p.steps[1..] {
        let e = exec(&s.action);
        assert_eq!(e.user, "root");
        let st = std::process::Command::new("sh")
            .arg("-c")
            .arg(&e.shell)
            .status()
            .expect("sh");
        assert!(st.success(), "{}", e.shell);
    }
    let nobody = std::process::Command::new("id")
        .args(["-u", "nobody"])
        .output()
        .expect("id");
    let nobody: u32 = String::from_utf8_lossy(&nobody.stdout)
        .trim()
        .parse()
        .expect("uid");
    assert_eq!(std::fs::metadata(&new).expect("created").uid(), nobody);
    assert_eq!(
        std::fs::metadata(dir.path()).expect("exists").uid(),
        0,
        "existing dir untouched"
    );
}

#[test]
fn a_byte_order_mark_is_skipped() {
    let r = Recipe::from_file_text("recipe", "\u{feff}FROM base\nRUN true\n").expect("dockerfile");
    assert_eq!(r.base, "base");
    assert!(Recipe::from_json("\u{feff}{\"steps\": []}").is_ok());
    assert!(Recipe::from_toml("\u{feff}base = \"x\"\n").is_ok());
}

/// The same recipe as TOML and as a Dockerfile plans to the same steps and
/// hashes (no copy: a Dockerfile COPY's owner defaults to root, TOML's to
/// the current user).
#[test]
fn toml_and_dockerfile_spellings_plan_the_same() {
    let toml = r#"
base = "e2bdev/base"
[[step]]
run = "apt-get update"
[[step]]
env = { A = "1", B = "two words" }
[[step]]
workdir = "/app"
[[step]]
user = "user"
[[step]]
run = "echo $A > a.txt"
[start]
cmd = "python3 -m http.server 8000"
[ready]
cmd = "curl -f http://127.0.0.1:8000/"
"#;
    let df = "FROM e2bdev/base\nRUN apt-get update\nENV A=1 B=\"two words\"\nWORKDIR /app\nUSER user\n\
              RUN echo $A > a.txt\nHEALTHCHECK CMD curl -f http://127.0.0.1:8000/\nCMD python3 -m http.server 8000\n";
    let a = Recipe::from_toml(toml).expect("toml");
    let b = Recipe::from_dockerfile(df).expect("dockerfile");
    assert_eq!(a, b);
    assert_eq!(a.plan("x").expect("plans"), b.plan("x").expect("plans"));
}

/// Hostile text never panics a parser: every truncation of the examples,
/// and each of a set of awkward characters inserted at every position,
/// either parses or is a typed error.
#[test]
fn mangled_text_is_an_error_not_a_panic() {
    const DF: &str = "ARG B=base\nFROM ${B:-x} AS y\nENV A=\"q\\\"\" C='s' D=$A${A}${A:+z}\nCOPY --chown=u:g [\"a\", \"b/\"]\n\
                      RUN x \\\n  # c\n  y\nHEALTHCHECK --retries=3 CMD [\"t\"]\nCMD [\"s\"]\n";
    let json = recipe().to_json();
    let odd = [
        '\\', '"', '\'', '$', '{', '}', '[', ']', '\n', '\0', '=', '#', 'é', '\u{feff}', ' ',
    ];
    for text in [DF, TOML, json.as_str()] {
        let cuts = text.char_indices().map(|(i, _)| i);
        for i in cuts.chain([text.len()]) {
            let head = &text[..i];
            let _ = Recipe::from_file_text("recipe", head);
            let _ = Recipe::from_dockerfile(head);
            for c in odd {
                let mut s = head.to_string();
                s.push(c);
                s.push_str(&text[i..]);
                let _ = Recipe::from_dockerfile(&s);
                let _ = Recipe::from_toml(&s);
                let _ = Recipe::from_json(&s);
            }
        }
    }
}

#[test]
fn a_rebuild_resumes_after_the_last_unchanged_step() {
    let old = recipe().plan("b").expect("plans");
    let cached: std::collections::BTreeSet<String> = hashes(&old).into_iter().collect();
    let has = |h: &str| cached.contains(h);
    assert_eq!(
        old.resume_at(has),
        7,
        "nothing changed: only start/ready left"
    );
    let mut r = recipe();
    r.steps[6] = Step::Run("echo changed".into());
    assert_eq!(
        r.plan("b").expect("plans").resume_at(has),
        6,
        "the last step changed"
    );
    let mut r = recipe();
    r.steps[2] = Step::Env([("X".to_string(), "1".to_string())].into());
    assert_eq!(r.plan("b").expect("plans").resume_at(has), 2);
    assert_eq!(
        recipe().plan("b2").expect("plans").resume_at(has),
        0,
        "new base"
    );
    // The kinds, as written.
    let kinds: Vec<&str> = recipe().steps.iter().map(Step::kind).collect();
    assert_eq!(
        kinds,
        ["apt", "pip", "env", "user", "workdir", "copy", "run"]
    );
}
