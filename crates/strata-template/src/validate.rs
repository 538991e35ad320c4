//! [`crate::Recipe::validate`]: every limit and every value's shape.

use crate::limits::*;
use crate::plan::{resolve_path, BASE_WORKDIR};
use crate::{shell, Copy, Ready, Recipe, RecipeError, Step};

/// The text limit, checked before any parser runs.
pub(crate) fn check_text_size(s: &str) -> Result<(), RecipeError> {
    if s.len() > MAX_RECIPE_BYTES {
        return Err(RecipeError::too_large(
            None,
            "the recipe text",
            s.len(),
            MAX_RECIPE_BYTES,
        ));
    }
    Ok(())
}

/// `[a-z_][a-z0-9_-]{0,31}` (Debian's `NAME_REGEX` without `$`).
pub(crate) fn is_user_name(u: &str) -> bool {
    let b = u.as_bytes();
    !b.is_empty()
        && b.len() <= 32
        && (b[0].is_ascii_lowercase() || b[0] == b'_')
        && b[1..]
            .iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'_' || *c == b'-')
}

/// A user or group for `chown`: a name ([`is_user_name`]) or a numeric id.
fn is_owner_part(p: &str) -> bool {
    is_user_name(p) || (!p.is_empty() && p.len() <= 10 && p.bytes().all(|c| c.is_ascii_digit()))
}

/// `[A-Za-z_][A-Za-z0-9_]*`.
pub(crate) fn is_env_key(k: &str) -> bool {
    let b = k.as_bytes();
    !b.is_empty()
        && (b[0].is_ascii_alphabetic() || b[0] == b'_')
        && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'_')
}

fn no_nul(step: Option<usize>, what: &str, s: &str) -> Result<(), RecipeError> {
    if s.contains('\0') {
        return Err(RecipeError::invalid(
            step,
            format!("{what} contains a NUL byte"),
        ));
    }
    Ok(())
}

fn command(step: Option<usize>, what: &'static str, s: &str) -> Result<(), RecipeError> {
    if s.trim().is_empty() {
        return Err(RecipeError::invalid(step, format!("{what} is empty")));
    }
    if s.len() > MAX_COMMAND_BYTES {
        return Err(RecipeError::too_large(
            step,
            what,
            s.len(),
            MAX_COMMAND_BYTES,
        ));
    }
    no_nul(step, what, s)
}

fn path(step: Option<usize>, what: &'static str, s: &str) -> Result<(), RecipeError> {
    if s.is_empty() {
        return Err(RecipeError::invalid(step, format!("{what} is empty")));
    }
    if s.len() > MAX_PATH_BYTES {
        return Err(RecipeError::too_large(step, what, s.len(), MAX_PATH_BYTES));
    }
    no_nul(step, what, s)
}

pub(crate) fn check_owner(step: Option<usize>, o: &str) -> Result<(), RecipeError> {
    let mut parts = o.splitn(2, ':');
    let user = parts.next().unwrap_or("");
    let ok = is_owner_part(user) && parts.next().is_none_or(is_owner_part);
    if !ok {
        return Err(RecipeError::invalid(
            step,
            format!(
                "owner {:?} is not user[:group] (names [a-z_][a-z0-9_-]{{0,31}} or numeric ids)",
                o.escape_debug().to_string()
            ),
        ));
    }
    Ok(())
}

fn check_user(step: Option<usize>, u: &str) -> Result<(), RecipeError> {
    if !is_user_name(u) {
        return Err(RecipeError::invalid(
            step,
            format!(
                "user {:?} is not a user name ([a-z_][a-z0-9_-]{{0,31}})",
                u.escape_debug().to_string()
            ),
        ));
    }
    Ok(())
}

/// A copy source: relative, inside the context (no `..`), not empty.
pub(crate) fn check_src(step: Option<usize>, src: &str) -> Result<(), RecipeError> {
    if src.is_empty() {
        return Err(RecipeError::invalid(step, "copy src is empty"));
    }
    if src.len() > MAX_SRC_BYTES {
        return Err(RecipeError::too_large(
            step,
            "a copy src",
            src.len(),
            MAX_SRC_BYTES,
        ));
    }
    no_nul(step, "copy src", src)?;
    if src.starts_with('/') {
        return Err(RecipeError::invalid(
            step,
            format!("copy src {src:?} is absolute (sources are relative to the context directory)"),
        ));
    }
    if src.split('/').any(|c| c == "..") {
        return Err(RecipeError::invalid(
            step,
            format!("copy src {src:?} leaves the context directory (`..`)"),
        ));
    }
    Ok(())
}

fn check_copy(i: usize, c: &Copy) -> Result<(), RecipeError> {
    let step = Some(i);
    check_src(step, &c.src)?;
    path(step, "copy dest", &c.dest)?;
    if let Some(h) = &c.sha256 {
        if h.len() != 64
            || !h
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(RecipeError::invalid(
                step,
                "copy sha256 is not 64 lowercase hex digits",
            ));
        }
    }
    if let Some(o) = &c.owner {
        check_owner(step, o)?;
    }
    if let Some(m) = c.mode {
        if m > 0o7777 {
            return Err(RecipeError::invalid(
                step,
                format!("copy mode {m:o} is more than 7777"),
            ));
        }
    }
    Ok(())
}

fn check_packages(i: usize, list: &[String]) -> Result<(), RecipeError> {
    let step = Some(i);
    if list.is_empty() {
        return Err(RecipeError::invalid(step, "the package list is empty"));
    }
    if list.len() > MAX_PACKAGES {
        return Err(RecipeError::too_large(
            step,
            "the package list",
            list.len(),
            MAX_PACKAGES,
        ));
    }
    for p in list {
        if p.len() > MAX_PACKAGE_BYTES {
            return Err(RecipeError::too_large(
                step,
                "a package name",
                p.len(),
                MAX_PACKAGE_BYTES,
            ));
        }
        shell::check_package(p).map_err(|m| RecipeError::invalid(step, m))?;
    }
    Ok(())
}

fn check_ready(r: &Ready) -> Result<(), RecipeError> {
    let t = r.timeout_secs();
    if t == 0 || t > MAX_READY_TIMEOUT_SECS {
        return Err(RecipeError::invalid(
            None,
            format!("ready timeout_secs {t} is not within 1..={MAX_READY_TIMEOUT_SECS}"),
        ));
    }
    match r {
        Ready::Port { port, .. } | Ready::Http { port, .. } if *port == 0 => {
            Err(RecipeError::invalid(None, "ready port 0 is not a port"))
        }
        Ready::Port { .. } => Ok(()),
        Ready::Http { path, .. } => {
            if path.len() > MAX_READY_PATH_BYTES {
                return Err(RecipeError::too_large(
                    None,
                    "the ready http path",
                    path.len(),
                    MAX_READY_PATH_BYTES,
                ));
            }
            if !path.starts_with('/') || path.chars().any(|c| c.is_control() || c.is_whitespace()) {
                return Err(RecipeError::invalid(
                    None,
                    format!(
                        "ready http path {:?} must start with '/' and have no spaces or control characters",
                        path.escape_debug().to_string()
                    ),
                ));
            }
            Ok(())
        }
        Ready::Command { cmd, .. } => command(None, "the ready command", cmd),
    }
}

/// Bytes of every string in the recipe, so a recipe deserialized from a
/// request body (no text limit applied) is bounded the same way.
fn string_bytes(r: &Recipe) -> usize {
    let mut n = r.base.len();
    for s in &r.steps {
        n += match s {
            Step::Run(c) | Step::Workdir(c) | Step::User(c) => c.len(),
            Step::Copy(c) => {
                c.src.len()
                    + c.dest.len()
                    + c.sha256.as_ref().map_or(0, String::len)
                    + c.owner.as_ref().map_or(0, String::len)
            }
            Step::Env(m) => m.iter().map(|(k, v)| k.len() + v.len()).sum(),
            Step::Apt(l) | Step::Pip(l) | Step::Npm(l) => l.iter().map(String::len).sum(),
        };
    }
    n += r.start.as_ref().map_or(0, |s| s.cmd.len());
    n += match &r.ready {
        Some(Ready::Http { path, .. }) => path.len(),
        Some(Ready::Command { cmd, .. }) => cmd.len(),
        _ => 0,
    };
    n
}

pub(crate) fn validate(r: &Recipe) -> Result<(), RecipeError> {
    if r.steps.len() > MAX_STEPS {
        return Err(RecipeError::too_large(
            None,
            "the step list",
            r.steps.len(),
            MAX_STEPS,
        ));
    }
    let total = string_bytes(r);
    if total > MAX_RECIPE_BYTES {
        return Err(RecipeError::too_large(
            None,
            "the recipe",
            total,
            MAX_RECIPE_BYTES,
        ));
    }
    if r.base.is_empty() || r.base.len() > MAX_BASE_BYTES || r.base.chars().any(char::is_control) {
        return Err(RecipeError::invalid(
            None,
            format!("base must be 1..={MAX_BASE_BYTES} bytes with no control characters"),
        ));
    }
    // The state walk, as the plan does it: resolved paths and the
    // accumulated environment stay bounded.
    let mut cwd = BASE_WORKDIR.to_string();
    let mut env: std::collections::BTreeMap<&str, &str> = Default::default();
    let mut env_bytes = 0usize;
    for (i, s) in r.steps.iter().enumerate() {
        let step = Some(i);
        match s {
            Step::Run(c) => command(step, "a run command", c)?,
            Step::Copy(c) => {
                check_copy(i, c)?;
                resolve_path(step, &cwd, &c.dest)?;
            }
            Step::Env(m) => {
                if m.is_empty() {
                    return Err(RecipeError::invalid(step, "env sets no variable"));
                }
                if m.len() > MAX_ENV_VARS_PER_STEP {
                    return Err(RecipeError::too_large(
                        step,
                        "the env step",
                        m.len(),
                        MAX_ENV_VARS_PER_STEP,
                    ));
                }
                for (k, v) in m {
                    if k.len() > MAX_ENV_KEY_BYTES {
                        return Err(RecipeError::too_large(
                            step,
                            "an env name",
                            k.len(),
                            MAX_ENV_KEY_BYTES,
                        ));
                    }
                    if !is_env_key(k) {
                        return Err(RecipeError::invalid(
                            step,
                            format!(
                                "env name {:?} is not [A-Za-z_][A-Za-z0-9_]*",
                                k.escape_debug().to_string()
                            ),
                        ));
                    }
                    if v.len() > MAX_ENV_VALUE_BYTES {
                        return Err(RecipeError::too_large(
                            step,
                            "an env value",
                            v.len(),
                            MAX_ENV_VALUE_BYTES,
                        ));
                    }
                    no_nul(step, "an env value", v)?;
                    if let Some(old) = env.insert(k, v) {
                        env_bytes -= k.len() + old.len();
                    }
                    env_bytes += k.len() + v.len();
                }
                if env_bytes > MAX_ENV_TOTAL_BYTES {
                    return Err(RecipeError::too_large(
                        step,
                        "the accumulated environment",
                        env_bytes,
                        MAX_ENV_TOTAL_BYTES,
                    ));
                }
            }
            Step::Workdir(w) => {
                path(step, "workdir", w)?;
                cwd = resolve_path(step, &cwd, w)?;
            }
            Step::User(u) => check_user(step, u)?,
            Step::Apt(l) | Step::Pip(l) | Step::Npm(l) => check_packages(i, l)?,
        }
    }
    if let Some(s) = &r.start {
        command(None, "the start command", &s.cmd)?;
    }
    if let Some(rd) = &r.ready {
        check_ready(rd)?;
    }
    Ok(())
}
