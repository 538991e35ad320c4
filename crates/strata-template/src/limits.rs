//! The limits a recipe must stay within (the daemon treats recipes as
//! hostile input). Checked by [`crate::Recipe::validate`].

/// Bytes of recipe text (TOML, JSON or Dockerfile) accepted by the `from_*`
/// parsers, and of all the strings of a recipe together.
pub const MAX_RECIPE_BYTES: usize = 1024 * 1024;
/// Steps in a recipe.
pub const MAX_STEPS: usize = 256;
/// Bytes of one `run` command, the start command or a ready command.
pub const MAX_COMMAND_BYTES: usize = 64 * 1024;
/// Packages in one `apt`/`pip`/`npm` step.
pub const MAX_PACKAGES: usize = 256;
/// Bytes of one package name (npm's limit on a name).
pub const MAX_PACKAGE_BYTES: usize = 214;
/// Variables set by one `env` step.
pub const MAX_ENV_VARS_PER_STEP: usize = 256;
/// Bytes of one environment variable's name.
pub const MAX_ENV_KEY_BYTES: usize = 256;
/// Bytes of one environment variable's value.
pub const MAX_ENV_VALUE_BYTES: usize = 32 * 1024;
/// Bytes of the whole accumulated environment (names + values), which every
/// planned step carries and every exec passes to `execve`.
pub const MAX_ENV_TOTAL_BYTES: usize = 128 * 1024;
/// Bytes of a path (`copy` dest, `workdir`, resolved or not).
pub const MAX_PATH_BYTES: usize = 4096;
/// Bytes of a `copy` source path.
pub const MAX_SRC_BYTES: usize = 4096;
/// Bytes of the base name.
pub const MAX_BASE_BYTES: usize = 256;
/// Bytes of an HTTP ready path.
pub const MAX_READY_PATH_BYTES: usize = 2048;
/// Seconds a ready check may wait at most.
pub const MAX_READY_TIMEOUT_SECS: u64 = 600;
