//! Environment variables an exec call sets: the built-in list of names that
//! change what a program runs, and the policies' `allow_env` exceptions.

use std::sync::OnceLock;

use globset::GlobSet;

use super::matchers::{glob_set, ExecReading, GlobMode};
use super::{Decision, Effect, PolicySet};

/// Variable names (globs) that make a shell, the dynamic linker or an
/// interpreter run code the argv does not show (`BASH_FUNC_true%%` gives
/// bash a function `true`, `LD_PRELOAD` loads a library into any program,
/// `BASH_ENV` runs a file before a script …). An exec call that sets one is
/// denied (rule `dangerous-env`) unless a layer's `allow_env` names it.
pub const DANGEROUS_ENV: &[&str] = &[
    "BASH_FUNC_*",
    "BASH_ENV",
    "ENV",
    "SHELLOPTS",
    "BASHOPTS",
    "PS4",
    "PROMPT_COMMAND",
    "LD_*",
    "DYLD_*",
    "GCONV_PATH",
    "PYTHON*",
    "PERL5*",
    "PERLLIB",
    "RUBYOPT",
    "RUBYLIB",
    "NODE_OPTIONS",
    "JAVA_TOOL_OPTIONS",
    "_JAVA_OPTIONS",
    "JDK_JAVA_OPTIONS",
    "GIT_SSH",
    "GIT_SSH_COMMAND",
    "GIT_EXEC_PATH",
    "GIT_CONFIG*",
    "GIT_ASKPASS",
    "GIT_EDITOR",
    "GIT_PAGER",
    "GIT_PROXY_COMMAND",
    "GIT_EXTERNAL_DIFF",
    "GIT_TEMPLATE_DIR",
    "SSH_ASKPASS",
    "LESSOPEN",
    "LESSCLOSE",
];

/// Names the list above covers that only tune output or hashing: allowed
/// without an `allow_env`.
pub const HARMLESS_ENV: &[&str] = &[
    "PYTHONUNBUFFERED",
    "PYTHONDONTWRITEBYTECODE",
    "PYTHONIOENCODING",
    "PYTHONHASHSEED",
    "PYTHONUTF8",
];

/// The compiled [`DANGEROUS_ENV`]; `None` if it failed to compile (then
/// every name counts as dangerous: fail closed).
fn dangerous() -> Option<&'static GlobSet> {
    static SET: OnceLock<Option<GlobSet>> = OnceLock::new();
    SET.get_or_init(|| {
        let pats: Vec<String> = DANGEROUS_ENV.iter().map(|s| s.to_string()).collect();
        glob_set(&pats, GlobMode::Text).ok()
    })
    .as_ref()
}

/// Is `name` on the built-in list (and not a harmless exception)?
pub fn is_dangerous_env(name: &str) -> bool {
    !HARMLESS_ENV.contains(&name) && dangerous().is_none_or(|s| s.is_match(name))
}

impl PolicySet {
    /// The built-in refusal of an exec call that sets a dangerous variable
    /// no layer's `allow_env` names.
    pub(super) fn env_refusal(&self, reading: &ExecReading) -> Option<Decision> {
        let bad: Vec<&str> = reading
            .env
            .iter()
            .map(String::as_str)
            .filter(|n| is_dangerous_env(n))
            .filter(|n| {
                !self
                    .layers
                    .iter()
                    .any(|l| l.policy.allow_env.as_ref().is_some_and(|s| s.is_match(n)))
            })
            .collect();
        if bad.is_empty() {
            return None;
        }
        let names = bad
            .iter()
            .map(|n| format!("`{n}`"))
            .collect::<Vec<_>>()
            .join(", ");
        Some(Decision {
            effect: Effect::Deny,
            layer: None,
            rule_id: "dangerous-env".into(),
            rule_index: None,
            hard: true,
            reason: format!(
                "environment variable {names} can make the program run code its argv does not show \
                 (built-in list: BASH_FUNC_*, BASH_ENV, ENV, LD_*, PYTHON*, PERL5*, NODE_OPTIONS, GIT_SSH_COMMAND …); \
                 a policy's `allow_env` can allow it"
            ),
        })
    }
}

/// `d` with a note when the call cannot be read and a deny/approve rule
/// decided: the rule may have matched only because of that.
pub(super) fn note_unreadable(d: Decision, r: &ExecReading) -> Decision {
    match &r.unreadable {
        Some(why) if d.effect != Effect::Allow && d.rule_index.is_some() => Decision {
            reason: format!(
                "{} (the command cannot be read reliably: {why}; every exec deny/approve rule applies to it)",
                d.reason
            ),
            ..d
        },
        _ => d,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_built_in_list_compiles_and_matches_names_exactly() {
        assert!(dangerous().is_some());
        for n in [
            "BASH_FUNC_true%%",
            "LD_PRELOAD",
            "BASH_ENV",
            "ENV",
            "PYTHONPATH",
            "PERL5OPT",
            "NODE_OPTIONS",
            "GIT_CONFIG_COUNT",
        ] {
            assert!(is_dangerous_env(n), "{n}");
        }
        for n in [
            "PATH",
            "HOME",
            "ENVIRONMENT",
            "MY_LD_PRELOAD",
            "ld_preload",
            "PYTHONUNBUFFERED",
            "GIT_AUTHOR_NAME",
        ] {
            assert!(!is_dangerous_env(n), "{n}");
        }
    }
}
