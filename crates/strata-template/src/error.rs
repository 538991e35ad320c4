//! The one error type of this crate, with a stable machine-readable code.

use thiserror::Error;

/// Where in a recipe an error is: the step (0-based index, printed 1-based
/// like the progress lines) and, for a Dockerfile, the line (1-based).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Location {
    /// 0-based index of the step in [`crate::Recipe::steps`], if the error is in a step.
    pub step: Option<usize>,
    /// 1-based line of the Dockerfile instruction, if the recipe came from a Dockerfile.
    pub line: Option<usize>,
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.line, self.step) {
            (Some(l), Some(s)) => write!(f, "line {l} (step {}): ", s + 1),
            (Some(l), None) => write!(f, "line {l}: "),
            (None, Some(s)) => write!(f, "step {}: ", s + 1),
            (None, None) => Ok(()),
        }
    }
}

/// Everything that can go wrong reading, checking, planning or packing a
/// recipe. Each variant has a stable [`RecipeError::code`] and an HTTP
/// status ([`RecipeError::status`]) for the daemon's API.
#[derive(Debug, Error)]
pub enum RecipeError {
    /// The text is not a recipe: TOML/JSON syntax, an unknown field, a wrong
    /// type, or a value out of its allowed set. Code `invalid_recipe`.
    #[error("{at}{message}")]
    Invalid {
        /// Where.
        at: Location,
        /// What is wrong, for a human.
        message: String,
    },
    /// A size or count limit was exceeded (text, steps, a command, a package
    /// list, the environment). Code `recipe_too_large`.
    #[error("{at}{what} is too large: {size} > {limit}")]
    TooLarge {
        /// Where.
        at: Location,
        /// What is too large ("the recipe text", "a run command", …).
        what: &'static str,
        /// Its size (bytes or count, as `limit`).
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// A Dockerfile instruction (or a flag of one) outside the supported
    /// subset. Code `unsupported_instruction`.
    #[error("line {line}: {instruction} is not supported: {message}")]
    Unsupported {
        /// 1-based line of the instruction.
        line: usize,
        /// The instruction as written, upper-cased (`ADD`, `COPY --from`, …).
        instruction: String,
        /// Why, and what to use instead.
        message: String,
    },
    /// [`crate::Recipe::plan`] met a `copy` step whose content hash was not
    /// filled in ([`crate::pack_all`] does it). Code `copy_not_packed`.
    #[error("step {}: copy {src:?} has no sha256 (its files were not packed and uploaded)", index + 1)]
    CopyNotPacked {
        /// 0-based step index.
        index: usize,
        /// The copy's source path.
        src: String,
    },
    /// A copy source that may not be packed: missing, outside the context
    /// directory, or a special file. Code `copy_source_invalid`.
    #[error("copy source {src:?}: {message}")]
    CopySource {
        /// The source as written in the recipe.
        src: String,
        /// What is wrong with it.
        message: String,
    },
    /// The packed archive of a copy source would exceed the byte limit.
    /// Code `copy_too_large`.
    #[error("copy source {src:?} packs to more than {limit} bytes")]
    CopyTooLarge {
        /// The source as written in the recipe.
        src: String,
        /// The limit in bytes.
        limit: u64,
    },
    /// Reading a copy source failed. Code `copy_io`.
    #[error("copy source {src:?}: cannot read {path}")]
    CopyIo {
        /// The source as written in the recipe.
        src: String,
        /// The file that could not be read.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

impl RecipeError {
    /// The stable machine-readable code (never renamed).
    pub fn code(&self) -> &'static str {
        match self {
            RecipeError::Invalid { .. } => "invalid_recipe",
            RecipeError::TooLarge { .. } => "recipe_too_large",
            RecipeError::Unsupported { .. } => "unsupported_instruction",
            RecipeError::CopyNotPacked { .. } => "copy_not_packed",
            RecipeError::CopySource { .. } => "copy_source_invalid",
            RecipeError::CopyTooLarge { .. } => "copy_too_large",
            RecipeError::CopyIo { .. } => "copy_io",
        }
    }

    /// The HTTP status an API answers this error with: 413 for the size
    /// limits, 500 for a local read failure, 400 otherwise.
    pub fn status(&self) -> u16 {
        match self {
            RecipeError::TooLarge { .. } | RecipeError::CopyTooLarge { .. } => 413,
            RecipeError::CopyIo { .. } => 500,
            _ => 400,
        }
    }

    /// The step index (0-based) the error is about, if any.
    pub fn step(&self) -> Option<usize> {
        match self {
            RecipeError::Invalid { at, .. } | RecipeError::TooLarge { at, .. } => at.step,
            RecipeError::CopyNotPacked { index, .. } => Some(*index),
            _ => None,
        }
    }

    /// The Dockerfile line (1-based) the error is about, if any.
    pub fn line(&self) -> Option<usize> {
        match self {
            RecipeError::Invalid { at, .. } | RecipeError::TooLarge { at, .. } => at.line,
            RecipeError::Unsupported { line, .. } => Some(*line),
            _ => None,
        }
    }

    pub(crate) fn invalid(step: Option<usize>, message: impl Into<String>) -> Self {
        RecipeError::Invalid {
            at: Location { step, line: None },
            message: message.into(),
        }
    }

    pub(crate) fn too_large(
        step: Option<usize>,
        what: &'static str,
        size: usize,
        limit: usize,
    ) -> Self {
        RecipeError::TooLarge {
            at: Location { step, line: None },
            what,
            size,
            limit,
        }
    }

    /// Attaches a Dockerfile line to an error located by step, so errors from
    /// [`crate::Recipe::validate`] on a parsed Dockerfile name the line.
    pub(crate) fn at_line(mut self, line_of_step: impl Fn(usize) -> Option<usize>) -> Self {
        if let RecipeError::Invalid { at, .. } | RecipeError::TooLarge { at, .. } = &mut self {
            if at.line.is_none() {
                at.line = at.step.and_then(&line_of_step);
            }
        }
        self
    }
}
