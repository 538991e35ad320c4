//! Template recipes: how a strata template is built, as data.
//!
//! A [`Recipe`] names a base template and lists steps (`run`, `copy`, `env`,
//! `workdir`, `user`, `apt`, `pip`, `npm`), a `start` command left running in
//! the template and a `ready` check. It is read from TOML, JSON (same shape)
//! or a Dockerfile subset ([`Recipe::from_file_text`]), checked against the
//! limits of [`limits`] ([`Recipe::validate`], called by every `from_*`),
//! and turned into a [`Plan`]: one [`PlannedStep`] per step with the build
//! state (user, working directory, environment) folded in and a chain hash
//! that keys the step's snapshot, so a rebuild resumes at the first changed
//! step.
//!
//! `copy` sources live on the client: [`pack`] turns one into a
//! deterministic tar whose sha256 goes into the recipe ([`pack_all`]), the
//! client uploads the blobs, and the daemon installs them with
//! [`copy_install_script`].
//!
//! This crate does no I/O beyond reading copy sources in [`pack`]; the build
//! itself (booting a builder sandbox, running the plan, snapshotting) is the
//! daemon's.
//!
//! The format is described in `docs/templates.md` ("Recipe format").
//!
//! ```
//! use strata_template::{Action, Recipe};
//!
//! let recipe = Recipe::from_file_text(
//!     "strata.toml",
//!     r#"
//!     [[step]]
//!     pip = ["requests==2.32.3"]
//!     [[step]]
//!     user = "user"
//!     [[step]]
//!     workdir = "/home/user/site"
//!     [[step]]
//!     run = "echo hello > index.html"
//!     [start]
//!     cmd = "python3 -m http.server 8000"
//!     [ready]
//!     port = 8000
//!     "#,
//! )?;
//! let plan = recipe.plan("base-template-id@build-stamp")?;
//! assert_eq!(plan.steps[3].describe, "4/4 echo hello > index.html");
//! let Action::Exec(run) = &plan.steps[3].action else { unreachable!() };
//! assert_eq!((run.user.as_str(), run.cwd.as_str()), ("user", "/home/user/site"));
//! let Action::Exec(pip) = &plan.steps[0].action else { unreachable!() };
//! assert_eq!(pip.user, "root");
//! // Keys: each step's snapshot, and the finished template.
//! assert_ne!(plan.steps[3].hash, plan.final_hash);
//! # Ok::<(), strata_template::RecipeError>(())
//! ```

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

mod dockerfile;
mod error;
mod ignore;
pub mod limits;
mod pack;
mod plan;
pub mod shell;
mod validate;

pub use error::{Location, RecipeError};
pub use pack::{copy_install_script, dir_mode, pack, pack_all};
pub use plan::{Action, BuildState, ExecPlan, Plan, PlannedStep, BASE_USER, BASE_WORKDIR};

/// The base a recipe builds on when it names none.
pub const DEFAULT_BASE: &str = "default";

fn default_base() -> String {
    DEFAULT_BASE.to_string()
}

/// A template recipe (TOML or JSON, same shape; or a Dockerfile subset).
///
/// TOML:
/// ```toml
/// base = "default"
/// [[step]]
/// pip = ["requests==2.32.3"]
/// [[step]]
/// run = "mkdir -p /srv && echo hi > /srv/index.html"
/// [start]
/// cmd = "python3 -m http.server 8000 --directory /srv"
/// [ready]
/// port = 8000
/// ```
/// JSON accepts `"steps"` as well as `"step"` for the list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// Template id or name to build on; default `"default"`. The daemon maps
    /// it (and E2B names such as `e2bdev/base`) to a template.
    #[serde(default = "default_base")]
    pub base: String,
    /// The steps, in order (TOML `[[step]]`; JSON `"step"` or `"steps"`).
    #[serde(default, rename = "step", alias = "steps")]
    pub steps: Vec<Step>,
    /// The command left running in the template, with the final user,
    /// working directory and environment.
    #[serde(default)]
    pub start: Option<Start>,
    /// When the started template counts as ready to snapshot.
    #[serde(default)]
    pub ready: Option<Ready>,
}

/// One build step. Externally tagged: JSON `{"run": "..."}`, TOML
/// `[[step]]` `run = "..."`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", deny_unknown_fields)]
pub enum Step {
    /// A shell command (`sh -c`), as the current user in the current
    /// directory with the accumulated environment.
    Run(String),
    /// Files from the client's build context.
    Copy(Copy),
    /// Variables added to (or replacing in) the environment of later steps
    /// and of the start command.
    Env(BTreeMap<String, String>),
    /// The working directory of later steps (relative paths resolve against
    /// the current one); the build creates it.
    Workdir(String),
    /// The user later `run` steps, copies without an owner, and the start
    /// command run as.
    User(String),
    /// Debian packages (`apt-get install`, as root).
    Apt(Vec<String>),
    /// Python packages (`pip install` into the system Python, as root).
    Pip(Vec<String>),
    /// Node packages (`npm install -g`, as root).
    Npm(Vec<String>),
}

/// A `copy` step: `src` (file or directory, relative to the client's
/// context directory) installed at `dest`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Copy {
    /// Source path relative to the context directory (client side only: not
    /// part of the step's hash).
    pub src: String,
    /// Destination in the guest; relative paths resolve against the working
    /// directory. A directory source's contents go under `dest`; a file
    /// source is written at `dest`, or into it when `dest` ends with `/`.
    pub dest: String,
    /// Hex sha256 of the packed source ([`pack`]); filled by the client
    /// ([`pack_all`]) before the recipe is sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// `user[:group]` owning the copied files; default the current user (a
    /// Dockerfile `COPY` without `--chown` sets `root`, as Docker does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// Permission bits (e.g. TOML `0o755`, JSON `493` or `"0755"`) for
    /// every copied file; directories get them plus `x` wherever they grant
    /// read ([`dir_mode`]); default: kept from the source.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "mode::deserialize"
    )]
    pub mode: Option<u32>,
}

/// The start command: left running in the template with the final user,
/// working directory and environment, so every fork begins with it warm.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Start {
    /// Shell command (`sh -c`).
    pub cmd: String,
}

/// Seconds a ready check waits when the recipe says nothing.
pub const DEFAULT_READY_TIMEOUT_SECS: u64 = 60;

/// When a started template is ready to snapshot. TOML: `[ready]` with one
/// of `port = 8000`, `http = { port = 8000, path = "/" }`, `cmd = "..."`,
/// and optionally `timeout_secs` (default 60, at most 600).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "ReadyRaw", into = "ReadyRaw")]
pub enum Ready {
    /// A TCP port is listening in the guest.
    Port {
        /// The port.
        port: u16,
        /// How long to wait, seconds.
        timeout_secs: u64,
    },
    /// An HTTP GET on `127.0.0.1:port` + `path` answers 2xx or 3xx.
    Http {
        /// The port.
        port: u16,
        /// The path (starts with `/`).
        path: String,
        /// How long to wait, seconds.
        timeout_secs: u64,
    },
    /// A shell command exits 0 (retried until the timeout).
    Command {
        /// Shell command (`sh -c`), run as the final user.
        cmd: String,
        /// How long to wait, seconds.
        timeout_secs: u64,
    },
}

impl Step {
    /// The step's kind as written in a recipe: `run`, `copy`, `env`,
    /// `workdir`, `user`, `apt`, `pip`, `npm`.
    pub fn kind(&self) -> &'static str {
        match self {
            Step::Run(_) => "run",
            Step::Copy(_) => "copy",
            Step::Env(_) => "env",
            Step::Workdir(_) => "workdir",
            Step::User(_) => "user",
            Step::Apt(_) => "apt",
            Step::Pip(_) => "pip",
            Step::Npm(_) => "npm",
        }
    }
}

impl Ready {
    /// How long the check may take, seconds.
    pub fn timeout_secs(&self) -> u64 {
        match self {
            Ready::Port { timeout_secs, .. }
            | Ready::Http { timeout_secs, .. }
            | Ready::Command { timeout_secs, .. } => *timeout_secs,
        }
    }

    /// A shell command (for `sh -c` in the guest) that exits 0 once the
    /// check passes; run it repeatedly until it does or the timeout ends.
    /// Port: `ss` (iproute2, in strata's base image) lists a listener;
    /// HTTP: `curl -f` gets a 2xx/3xx; command: itself.
    pub fn probe_shell(&self) -> String {
        match self {
            Ready::Port { port, .. } => {
                format!("[ -n \"$(ss -Htln 'sport = :{port}')\" ]")
            }
            Ready::Http { port, path, .. } => format!(
                "curl -fsS -o /dev/null --max-time 5 {}",
                shell::quote(&format!("http://127.0.0.1:{port}{path}"))
            ),
            Ready::Command { cmd, .. } => cmd.clone(),
        }
    }
}

/// The serde shape of [`Ready`]: exactly one of `port`, `http`, `cmd`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReadyRaw {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    port: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    http: Option<HttpRaw>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cmd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    timeout_secs: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct HttpRaw {
    port: u16,
    #[serde(default = "default_path")]
    path: String,
}

fn default_path() -> String {
    "/".to_string()
}

impl TryFrom<ReadyRaw> for Ready {
    type Error = String;
    fn try_from(r: ReadyRaw) -> Result<Ready, String> {
        let timeout_secs = r.timeout_secs.unwrap_or(DEFAULT_READY_TIMEOUT_SECS);
        match (r.port, r.http, r.cmd) {
            (Some(port), None, None) => Ok(Ready::Port { port, timeout_secs }),
            (None, Some(h), None) => Ok(Ready::Http {
                port: h.port,
                path: h.path,
                timeout_secs,
            }),
            (None, None, Some(cmd)) => Ok(Ready::Command { cmd, timeout_secs }),
            _ => Err("ready needs exactly one of `port`, `http` or `cmd`".to_string()),
        }
    }
}

impl From<Ready> for ReadyRaw {
    fn from(r: Ready) -> ReadyRaw {
        let mut raw = ReadyRaw {
            port: None,
            http: None,
            cmd: None,
            timeout_secs: Some(r.timeout_secs()),
        };
        match r {
            Ready::Port { port, .. } => raw.port = Some(port),
            Ready::Http { port, path, .. } => raw.http = Some(HttpRaw { port, path }),
            Ready::Command { cmd, .. } => raw.cmd = Some(cmd),
        }
        raw
    }
}

/// `mode` accepts a number (TOML `0o755`, JSON `493`) or an octal string
/// (`"0755"`, `"755"`, `"0o755"`).
mod mode {
    use serde::{Deserialize, Deserializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Num(u32),
        Str(String),
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
        match Option::<Raw>::deserialize(d)? {
            None => Ok(None),
            Some(Raw::Num(n)) => Ok(Some(n)),
            Some(Raw::Str(s)) => {
                let digits = s.strip_prefix("0o").unwrap_or(&s);
                u32::from_str_radix(digits, 8).map(Some).map_err(|_| {
                    serde::de::Error::custom(format!("mode {s:?} is not an octal number"))
                })
            }
        }
    }
}

impl Recipe {
    /// Parses a TOML recipe and validates it.
    pub fn from_toml(s: &str) -> Result<Recipe, RecipeError> {
        validate::check_text_size(s)?;
        let s = strip_bom(s);
        let r: Recipe = toml::from_str(s).map_err(|e| RecipeError::Invalid {
            at: Location {
                step: None,
                line: e.span().map(|sp| line_of_offset(s, sp.start)),
            },
            message: format!("TOML: {}", e.message()),
        })?;
        r.validate()?;
        Ok(r)
    }

    /// Parses a JSON recipe and validates it.
    pub fn from_json(s: &str) -> Result<Recipe, RecipeError> {
        validate::check_text_size(s)?;
        let s = strip_bom(s);
        let r: Recipe = serde_json::from_str(s).map_err(|e| RecipeError::Invalid {
            at: Location {
                step: None,
                line: Some(e.line()).filter(|l| *l > 0),
            },
            message: format!("JSON: {e}"),
        })?;
        r.validate()?;
        Ok(r)
    }

    /// Parses the Dockerfile subset (see `docs/templates.md`) and validates
    /// the result; errors name the Dockerfile line.
    pub fn from_dockerfile(s: &str) -> Result<Recipe, RecipeError> {
        validate::check_text_size(s)?;
        let s = strip_bom(s);
        let (r, lines) = dockerfile::parse(s)?;
        r.validate()
            .map_err(|e| e.at_line(|i| lines.get(i).copied()))?;
        Ok(r)
    }

    /// Parses by file name, then content: `*.toml` → TOML, `*.json` → JSON,
    /// `Dockerfile`, `*.Dockerfile`, `Dockerfile.*`, `Containerfile` →
    /// Dockerfile; any other name: JSON if the text starts with `{`, a
    /// Dockerfile if its first instruction is `FROM`/`ARG`, else TOML.
    pub fn from_file_text(name: &str, s: &str) -> Result<Recipe, RecipeError> {
        let file = name.rsplit(['/', '\\']).next().unwrap_or(name);
        let lower = file.to_ascii_lowercase();
        if lower.ends_with(".toml") {
            return Recipe::from_toml(s);
        }
        if lower.ends_with(".json") {
            return Recipe::from_json(s);
        }
        if lower == "dockerfile"
            || lower == "containerfile"
            || lower.ends_with(".dockerfile")
            || lower.starts_with("dockerfile.")
        {
            return Recipe::from_dockerfile(s);
        }
        if strip_bom(s).trim_start().starts_with('{') {
            return Recipe::from_json(s);
        }
        if dockerfile::looks_like_dockerfile(strip_bom(s)) {
            return Recipe::from_dockerfile(s);
        }
        Recipe::from_toml(s)
    }

    /// Checks every limit of [`limits`] and every value's shape (user names,
    /// environment keys, package names, paths, ready timeouts). Called by
    /// every `from_*`; call it yourself on a `Recipe` built or deserialized
    /// some other way (a request body) before planning it.
    pub fn validate(&self) -> Result<(), RecipeError> {
        validate::validate(self)
    }

    /// The executable plan: one [`PlannedStep`] per step, with the state
    /// (user, cwd, env) folded in and chain hashes. `base_identity` is an
    /// opaque string from the daemon (base template id + its build stamp),
    /// so a rebuilt base invalidates every step. Validates first; every
    /// `copy` must have its `sha256` ([`pack_all`]).
    pub fn plan(&self, base_identity: &str) -> Result<Plan, RecipeError> {
        self.validate()?;
        plan::plan(self, base_identity)
    }

    /// The recipe as canonical JSON (what a client sends to the daemon).
    pub fn to_json(&self) -> String {
        // A Recipe is strings, maps and integers: serialising cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// The text without a leading UTF-8 byte-order mark (editors on some
/// systems write one).
fn strip_bom(s: &str) -> &str {
    s.strip_prefix('\u{feff}').unwrap_or(s)
}

/// 1-based line of a byte offset.
fn line_of_offset(s: &str, offset: usize) -> usize {
    s.as_bytes()
        .iter()
        .take(offset)
        .filter(|b| **b == b'\n')
        .count()
        + 1
}

#[cfg(test)]
mod tests;
