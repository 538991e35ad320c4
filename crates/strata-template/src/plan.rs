//! [`crate::Recipe::plan`]: the steps as the builder executes them, with the
//! build state folded in and the chain hashes that key their snapshots.

use std::collections::BTreeMap;

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::limits::MAX_PATH_BYTES;
use crate::shell::quote;
use crate::{Ready, Recipe, RecipeError, Step};

/// The user steps run as until a `user` step (Docker's rule).
pub const BASE_USER: &str = "root";
/// The working directory steps run in until a `workdir` step (Docker's rule).
pub const BASE_WORKDIR: &str = "/";

/// Version tag of the chain hash; bump it when the planned form of a step
/// changes, so old step snapshots are not reused for a different command.
const HASH_DOMAIN: &str = "strata-recipe/1\0";

/// The executable plan of a recipe ([`crate::Recipe::plan`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Plan {
    /// One entry per recipe step, in order.
    pub steps: Vec<PlannedStep>,
    /// The start command with the final user, cwd and environment.
    pub start: Option<ExecPlan>,
    /// The ready check, as the recipe gave it.
    pub ready: Option<Ready>,
    /// [`Ready::probe_shell`] as an exec in the final state (user, cwd,
    /// environment): run it until it exits 0 or the ready timeout ends.
    pub ready_probe: Option<ExecPlan>,
    /// The user, working directory and environment after the last step:
    /// what the start command runs with, and what a daemon may keep as the
    /// template's defaults for commands in its sandboxes (E2B persists the
    /// last user and workdir that way).
    pub final_state: BuildState,
    /// `h_base`: the chain's start, from the base identity alone.
    pub base_hash: String,
    /// Hash of everything, start and ready included: the template's cache
    /// key (it chains one more record after the last step, so it differs
    /// from every step hash even without start or ready).
    pub final_hash: String,
}

impl Plan {
    /// Where a rebuild resumes: given which step snapshots exist (by
    /// [`PlannedStep::hash`]), the number of leading steps already done —
    /// the index after the last step with a snapshot, since a step's hash
    /// covers every step before it. `0`: build from the base; `steps.len()`:
    /// only start/ready are left.
    pub fn resume_at(&self, has_snapshot: impl Fn(&str) -> bool) -> usize {
        self.steps
            .iter()
            .rposition(|s| has_snapshot(&s.hash))
            .map_or(0, |i| i + 1)
    }
}

/// The build state a step runs in: starts as [`BASE_USER`] in
/// [`BASE_WORKDIR`] with no recipe environment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BuildState {
    /// User name.
    pub user: String,
    /// Absolute working directory.
    pub cwd: String,
    /// Environment variables set by the recipe.
    pub env: BTreeMap<String, String>,
}

/// One step as the builder runs it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlannedStep {
    /// 0-based index in the recipe.
    pub index: usize,
    /// Hex sha256 chain over the base identity and steps `0..=index` as
    /// planned: the key of the snapshot taken after this step.
    pub hash: String,
    /// What to do.
    pub action: Action,
    /// One line for progress: `"3/7 pip install requests"`.
    pub describe: String,
}

/// What a planned step does in the builder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Run a command (`run`, `apt`, `pip`, `npm`, and the directory
    /// creation of a `workdir`).
    Exec(ExecPlan),
    /// Install the uploaded archive with this sha256 at `dest`
    /// ([`crate::copy_install_script`] does it in the guest, as root).
    Copy {
        /// Hex sha256 of the archive ([`crate::pack`]).
        sha256: String,
        /// Absolute destination; ending with `/` means "into this
        /// directory" for a file source.
        dest: String,
        /// `user[:group]` the copied files get.
        owner: String,
        /// Permission bits for every copied file ([`crate::dir_mode`] of
        /// them for directories), or keep the archive's.
        mode: Option<u32>,
    },
    /// Nothing to run: `env` and `user` only change the state of later
    /// steps (which their hashes include).
    None,
}

/// A command for the builder: `sh -c shell` as `user` in `cwd` with `env`
/// added to the agent's default environment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ExecPlan {
    /// Passed to `sh -c`.
    pub shell: String,
    /// User name to run as.
    pub user: String,
    /// Absolute working directory.
    pub cwd: String,
    /// Environment variables set by the recipe so far.
    pub env: BTreeMap<String, String>,
}

/// Resolves `p` against `cwd` lexically (`.` and `..` folded, `..` at `/`
/// stays at `/`) into an absolute path without a trailing `/` (except `/`).
pub(crate) fn resolve_path(step: Option<usize>, cwd: &str, p: &str) -> Result<String, RecipeError> {
    let mut parts: Vec<&str> = Vec::new();
    let rel = if p.starts_with('/') {
        p
    } else {
        parts.extend(cwd.split('/').filter(|c| !c.is_empty()));
        p
    };
    for c in rel.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    let out = format!("/{}", parts.join("/"));
    if out.len() > MAX_PATH_BYTES {
        return Err(RecipeError::too_large(
            step,
            "a resolved path",
            out.len(),
            MAX_PATH_BYTES,
        ));
    }
    Ok(out)
}

/// Whether a copy `dest` names a directory to copy into (Docker: a trailing
/// `/`, or `.`/`..` as the last component).
fn dest_is_dir(dest: &str) -> bool {
    dest.ends_with('/')
        || dest == "."
        || dest == ".."
        || dest.ends_with("/.")
        || dest.ends_with("/..")
}

fn hex(bytes: &[u8]) -> String {
    const D: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(D[(b >> 4) as usize] as char);
        s.push(D[(b & 15) as usize] as char);
    }
    s
}

/// `h_base = sha256("strata-recipe/1\0" + base_identity)`, hex.
fn base_hash(base_identity: &str) -> String {
    let mut h = Sha256::new();
    h.update(HASH_DOMAIN.as_bytes());
    h.update(base_identity.as_bytes());
    hex(&h.finalize())
}

/// `h_i = sha256(hex(h_{i-1}) + "\n" + record)`, hex.
fn chain(prev: &str, record: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(prev.as_bytes());
    h.update(b"\n");
    h.update(record);
    hex(&h.finalize())
}

/// The canonical record of a planned step: its action and the state after
/// it, as compact JSON (struct fields in declaration order). The
/// environment appears as its digest ([`env_digest`]), so a large
/// environment is hashed once per `env` step, not once per step. The copy's
/// `src` is not in it: only the content hash and where it goes.
#[derive(Serialize)]
struct StepRecord<'a> {
    action: ActionRecord<'a>,
    user: &'a str,
    cwd: &'a str,
    env: &'a str,
}

/// [`Action`] with the environment as its digest.
#[derive(Serialize)]
#[serde(rename_all = "snake_case")]
enum ActionRecord<'a> {
    Exec(ExecRecord<'a>),
    Copy {
        sha256: &'a str,
        dest: &'a str,
        owner: &'a str,
        mode: Option<u32>,
    },
    None,
}

/// [`ExecPlan`] with the environment as its digest.
#[derive(Serialize)]
struct ExecRecord<'a> {
    shell: &'a str,
    user: &'a str,
    cwd: &'a str,
    env: &'a str,
}

impl<'a> ExecRecord<'a> {
    fn new(e: &'a ExecPlan, env_digest: &'a str) -> Self {
        ExecRecord {
            shell: &e.shell,
            user: &e.user,
            cwd: &e.cwd,
            env: env_digest,
        }
    }
}

impl<'a> ActionRecord<'a> {
    fn new(a: &'a Action, env_digest: &'a str) -> Self {
        match a {
            Action::Exec(e) => ActionRecord::Exec(ExecRecord::new(e, env_digest)),
            Action::Copy {
                sha256,
                dest,
                owner,
                mode,
            } => ActionRecord::Copy {
                sha256,
                dest,
                owner,
                mode: *mode,
            },
            Action::None => ActionRecord::None,
        }
    }
}

#[derive(Serialize)]
struct FinalRecord<'a> {
    start: Option<ExecRecord<'a>>,
    ready: &'a Option<Ready>,
}

/// `sha256(JSON of the environment)`, hex: `{}` for none, keys sorted.
fn env_digest(env: &BTreeMap<String, String>) -> String {
    hex(&Sha256::digest(to_json(env)))
}

fn to_json<T: Serialize>(v: &T) -> Vec<u8> {
    // Strings, integers and sorted maps only: serialisation cannot fail.
    serde_json::to_vec(v).unwrap_or_default()
}

/// First line of `s`, at most `max` chars, with `…` if cut.
fn short(s: &str, max: usize) -> String {
    let first = s.trim().lines().next().unwrap_or("");
    let cut: String = first.chars().take(max).collect();
    if cut.len() < s.trim().len() {
        format!("{cut}…")
    } else {
        cut
    }
}

/// The `apt` step's command line.
pub(crate) fn apt_shell(pkgs: &[String]) -> String {
    format!(
        "export DEBIAN_FRONTEND=noninteractive; apt-get update && apt-get install -y --no-install-recommends {} && rm -rf /var/lib/apt/lists/*",
        crate::shell::join(pkgs)
    )
}

/// The `pip` step's command line (Debian 12's Python is "externally
/// managed": installing into it needs `--break-system-packages`).
pub(crate) fn pip_shell(pkgs: &[String]) -> String {
    format!(
        "pip install --no-cache-dir --break-system-packages --root-user-action=ignore {}",
        crate::shell::join(pkgs)
    )
}

/// The `npm` step's command line.
pub(crate) fn npm_shell(pkgs: &[String]) -> String {
    format!(
        "npm install -g --no-audit --no-fund {}",
        crate::shell::join(pkgs)
    )
}

/// The `workdir` step's command: create the directory (as root); a
/// directory that did not exist is given to the current user when that is
/// not root, so `user` then `workdir` gives the user a place to write.
pub(crate) fn workdir_shell(dir: &str, user: &str) -> String {
    let q = quote(dir);
    if user == BASE_USER {
        format!("mkdir -p -- {q}")
    } else {
        format!(
            "[ -d {q} ] || {{ mkdir -p -- {q} && chown -- {} {q}; }}",
            quote(user)
        )
    }
}

pub(crate) fn plan(r: &Recipe, base_identity: &str) -> Result<Plan, RecipeError> {
    let n = r.steps.len();
    let mut user = BASE_USER.to_string();
    let mut cwd = BASE_WORKDIR.to_string();
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    let base = base_hash(base_identity);
    let mut prev = base.clone();
    let mut digest = env_digest(&env);
    let mut steps = Vec::with_capacity(n);
    for (i, s) in r.steps.iter().enumerate() {
        let exec = |shell: String, user: &str, cwd: &str, env: &BTreeMap<String, String>| {
            Action::Exec(ExecPlan {
                shell,
                user: user.to_string(),
                cwd: cwd.to_string(),
                env: env.clone(),
            })
        };
        let (action, what) = match s {
            Step::Run(c) => (exec(c.clone(), &user, &cwd, &env), short(c, 72)),
            Step::Copy(c) => {
                let sha256 = c.sha256.clone().ok_or_else(|| RecipeError::CopyNotPacked {
                    index: i,
                    src: c.src.clone(),
                })?;
                let mut dest = resolve_path(Some(i), &cwd, &c.dest)?;
                if dest_is_dir(&c.dest) && !dest.ends_with('/') {
                    dest.push('/');
                }
                let what = format!("copy {} → {dest}", short(&c.src, 60));
                let owner = c.owner.clone().unwrap_or_else(|| user.clone());
                (
                    Action::Copy {
                        sha256,
                        dest,
                        owner,
                        mode: c.mode,
                    },
                    what,
                )
            }
            Step::Env(m) => {
                for (k, v) in m {
                    env.insert(k.clone(), v.clone());
                }
                let keys: Vec<&str> = m.keys().map(String::as_str).collect();
                (Action::None, short(&format!("env {}", keys.join(" ")), 72))
            }
            Step::Workdir(w) => {
                cwd = resolve_path(Some(i), &cwd, w)?;
                let a = exec(workdir_shell(&cwd, &user), BASE_USER, BASE_WORKDIR, &env);
                (a, short(&format!("workdir {cwd}"), 72))
            }
            Step::User(u) => {
                user = u.clone();
                (Action::None, format!("user {u}"))
            }
            Step::Apt(p) => (
                exec(apt_shell(p), BASE_USER, &cwd, &env),
                short(&format!("apt install {}", p.join(" ")), 72),
            ),
            Step::Pip(p) => (
                exec(pip_shell(p), BASE_USER, &cwd, &env),
                short(&format!("pip install {}", p.join(" ")), 72),
            ),
            Step::Npm(p) => (
                exec(npm_shell(p), BASE_USER, &cwd, &env),
                short(&format!("npm install -g {}", p.join(" ")), 72),
            ),
        };
        if matches!(s, Step::Env(_)) {
            digest = env_digest(&env);
        }
        // Every exec runs with the current environment.
        debug_assert!(!matches!(&action, Action::Exec(e) if e.env != env));
        let record = StepRecord {
            action: ActionRecord::new(&action, &digest),
            user: &user,
            cwd: &cwd,
            env: &digest,
        };
        let hash = chain(&prev, &to_json(&record));
        prev.clone_from(&hash);
        steps.push(PlannedStep {
            index: i,
            hash,
            action,
            describe: format!("{}/{n} {what}", i + 1),
        });
    }
    let state_exec = |shell: String| ExecPlan {
        shell,
        user: user.clone(),
        cwd: cwd.clone(),
        env: env.clone(),
    };
    let start = r.start.as_ref().map(|s| state_exec(s.cmd.clone()));
    let ready = r.ready.clone();
    let ready_probe = ready.as_ref().map(|rd| state_exec(rd.probe_shell()));
    let final_hash = chain(
        &prev,
        &to_json(&FinalRecord {
            start: start.as_ref().map(|e| ExecRecord::new(e, &digest)),
            ready: &ready,
        }),
    );
    let final_state = BuildState { user, cwd, env };
    Ok(Plan {
        steps,
        start,
        ready,
        ready_probe,
        final_state,
        base_hash: base,
        final_hash,
    })
}
