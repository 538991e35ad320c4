//! The Dockerfile subset: `FROM`, `RUN`, `COPY`, `ENV`, `ARG`, `WORKDIR`,
//! `USER`, `CMD`/`ENTRYPOINT` (→ start), `HEALTHCHECK CMD` (→ ready); `EXPOSE`, `LABEL`
//! and `MAINTAINER` are accepted and have no effect; anything else is
//! refused naming its line.

use std::collections::BTreeMap;

use crate::error::Location;
use crate::{shell, Copy, Ready, Recipe, RecipeError, Start, Step, DEFAULT_READY_TIMEOUT_SECS};

/// The variables a Dockerfile's `$VAR` sees before any `ENV`/`ARG`: the
/// environment strata's agent gives every command.
const BASE_VARS: &[(&str, &str)] = &[
    (
        "PATH",
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    ),
    ("LANG", "C.UTF-8"),
];

/// One instruction: 1-based line of its first physical line, the keyword
/// upper-cased, and the rest (continuations joined).
struct Instr {
    line: usize,
    keyword: String,
    args: String,
}

fn invalid(line: usize, message: impl Into<String>) -> RecipeError {
    RecipeError::Invalid {
        at: Location {
            step: None,
            line: Some(line),
        },
        message: message.into(),
    }
}

fn unsupported(line: usize, instruction: &str, message: impl Into<String>) -> RecipeError {
    RecipeError::Unsupported {
        line,
        instruction: instruction.to_string(),
        message: message.into(),
    }
}

/// Whether the first instruction of `s` is `FROM` or `ARG`.
pub(crate) fn looks_like_dockerfile(s: &str) -> bool {
    s.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .and_then(|l| l.split_whitespace().next())
        .is_some_and(|w| w.eq_ignore_ascii_case("FROM") || w.eq_ignore_ascii_case("ARG"))
}

/// Splits the text into instructions: comments and blank lines dropped
/// (inside continuations too, as Docker does), `\` at the end of a line
/// joins the next.
fn instructions(s: &str) -> Result<Vec<Instr>, RecipeError> {
    let mut out = Vec::new();
    let mut cur: Option<(usize, String)> = None;
    let mut directives_open = true;
    for (i, raw) in s.lines().enumerate() {
        let n = i + 1;
        let t = raw.trim();
        if let Some(d) = t.strip_prefix('#') {
            if directives_open && cur.is_none() {
                if let Some((k, v)) = d.trim().split_once('=') {
                    if k.trim().eq_ignore_ascii_case("escape") && v.trim() != "\\" {
                        return Err(unsupported(
                            n,
                            "# escape",
                            "only the default escape character \\ is supported",
                        ));
                    }
                    continue;
                }
            }
            directives_open = false;
            continue;
        }
        directives_open = false;
        if t.is_empty() {
            continue;
        }
        let trimmed_end = raw.trim_end();
        let (body, cont) = match trimmed_end.strip_suffix('\\') {
            Some(b) => (b, true),
            None => (trimmed_end, false),
        };
        match &mut cur {
            Some((_, acc)) => acc.push_str(body),
            None => cur = Some((n, body.trim_start().to_string())),
        }
        if !cont {
            if let Some((line, text)) = cur.take() {
                out.push(split_instr(line, &text));
            }
        }
    }
    if let Some((line, text)) = cur.take() {
        out.push(split_instr(line, &text));
    }
    Ok(out)
}

fn split_instr(line: usize, text: &str) -> Instr {
    let text = text.trim();
    let (kw, rest) = match text.find(char::is_whitespace) {
        Some(p) => (&text[..p], text[p..].trim()),
        None => (text, ""),
    };
    Instr {
        line,
        keyword: kw.to_ascii_uppercase(),
        args: rest.to_string(),
    }
}

/// Docker's word rules with `$VAR` substitution: whitespace separates words
/// (when `split`), `'…'` is literal, `"…"` substitutes and honours `\"`,
/// `\\`, `\$`; outside quotes `\` escapes the next character. `$NAME`,
/// `${NAME}`, `${NAME:-word}`, `${NAME:+word}`; unset expands to nothing.
fn lex(s: &str, vars: &BTreeMap<String, String>, split: bool) -> Result<Vec<String>, String> {
    let chars: Vec<char> = s.chars().collect();
    let mut words = Vec::new();
    let mut w = String::new();
    let mut in_word = false;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            c if split && c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut w));
                    in_word = false;
                }
                i += 1;
            }
            '\\' => {
                in_word = true;
                if let Some(n) = chars.get(i + 1) {
                    w.push(*n);
                    i += 2;
                } else {
                    w.push('\\');
                    i += 1;
                }
            }
            '\'' => {
                in_word = true;
                let end = chars[i + 1..]
                    .iter()
                    .position(|c| *c == '\'')
                    .ok_or("unterminated single quote")?;
                w.extend(&chars[i + 1..i + 1 + end]);
                i += end + 2;
            }
            '"' => {
                in_word = true;
                i += 1;
                loop {
                    match chars.get(i) {
                        None => return Err("unterminated double quote".into()),
                        Some('"') => {
                            i += 1;
                            break;
                        }
                        Some('\\') if matches!(chars.get(i + 1), Some('"' | '\\' | '$')) => {
                            w.push(chars[i + 1]);
                            i += 2;
                        }
                        Some('$') => i = expand(&chars, i, vars, &mut w)?,
                        Some(c) => {
                            w.push(*c);
                            i += 1;
                        }
                    }
                }
            }
            '$' => {
                in_word = true;
                i = expand(&chars, i, vars, &mut w)?;
            }
            c => {
                in_word = true;
                w.push(c);
                i += 1;
            }
        }
    }
    if in_word || !split {
        words.push(w);
    }
    Ok(words)
}

/// Expands the `$…` at `chars[i]` into `out`; returns the index after it.
fn expand(
    chars: &[char],
    i: usize,
    vars: &BTreeMap<String, String>,
    out: &mut String,
) -> Result<usize, String> {
    let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_';
    match chars.get(i + 1) {
        Some('{') => {
            let close = chars[i + 2..]
                .iter()
                .position(|c| *c == '}')
                .ok_or("unterminated ${")?;
            let inner: String = chars[i + 2..i + 2 + close].iter().collect();
            let name_len = inner.chars().take_while(|c| is_name(*c)).count();
            let (name, op) = inner.split_at(name_len);
            if name.is_empty() {
                return Err(format!("bad substitution ${{{inner}}}"));
            }
            let val = vars.get(name).map(String::as_str).unwrap_or("");
            if op.is_empty() {
                out.push_str(val);
            } else if let Some(word) = op.strip_prefix(":-") {
                out.push_str(if val.is_empty() { word } else { val });
            } else if let Some(word) = op.strip_prefix(":+") {
                out.push_str(if val.is_empty() { "" } else { word });
            } else {
                return Err(format!("unsupported substitution ${{{inner}}} (use $X, ${{X}}, ${{X:-w}} or ${{X:+w}})"));
            }
            Ok(i + 3 + close)
        }
        Some(c) if c.is_ascii_alphabetic() || *c == '_' => {
            let len = chars[i + 1..].iter().take_while(|c| is_name(**c)).count();
            let name: String = chars[i + 1..i + 1 + len].iter().collect();
            out.push_str(vars.get(&name).map(String::as_str).unwrap_or(""));
            Ok(i + 1 + len)
        }
        _ => {
            out.push('$');
            Ok(i + 1)
        }
    }
}

/// The exec form `["a", "b"]`, if `args` is one (a JSON array of strings).
fn exec_form(args: &str) -> Option<Vec<String>> {
    if !args.starts_with('[') {
        return None;
    }
    serde_json::from_str::<Vec<String>>(args).ok()
}

/// A shell command from a shell-form or exec-form argument.
fn command_of(args: &str) -> String {
    match exec_form(args) {
        Some(words) => shell::join(&words),
        None => args.to_string(),
    }
}

/// A `CMD`/`ENTRYPOINT` argument: exec form (words) or shell form.
enum Form {
    Exec(Vec<String>),
    Shell(String),
}

impl Form {
    fn of(args: &str) -> Form {
        match exec_form(args) {
            Some(words) => Form::Exec(words),
            None => Form::Shell(args.to_string()),
        }
    }
}

/// The start command from the last `ENTRYPOINT` and `CMD`, as Docker
/// combines them: an exec-form entrypoint takes the `CMD` as its arguments
/// (a shell-form `CMD` as `/bin/sh -c cmd`); a shell-form entrypoint
/// ignores `CMD`; without an entrypoint the `CMD` is the command. Empty:
/// no start command.
fn start_command(entrypoint: Option<Form>, cmd: Option<Form>) -> Option<String> {
    let words = match (entrypoint, cmd) {
        (Some(Form::Shell(e)), _) => return Some(e).filter(|e| !e.trim().is_empty()),
        (Some(Form::Exec(mut e)), c) => {
            match c {
                Some(Form::Exec(c)) => e.extend(c),
                Some(Form::Shell(c)) if !c.trim().is_empty() => {
                    e.extend(["/bin/sh".to_string(), "-c".to_string(), c])
                }
                _ => {}
            }
            e
        }
        (None, Some(Form::Exec(c))) => c,
        (None, Some(Form::Shell(c))) => return Some(c).filter(|c| !c.trim().is_empty()),
        (None, None) => return None,
    };
    Some(shell::join(&words)).filter(|_| !words.is_empty())
}

/// Leading `--flag[=value]` words of an instruction, and the rest.
fn flags(args: &str) -> (Vec<&str>, &str) {
    let mut rest = args.trim_start();
    let mut out = Vec::new();
    while rest.starts_with("--") {
        let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
        out.push(&rest[..end]);
        rest = rest[end..].trim_start();
    }
    (out, rest)
}

/// Whether a `RUN` shell command uses a heredoc (`<<EOF`, `<<-'EOF'`).
fn has_heredoc(cmd: &str) -> bool {
    let b = cmd.as_bytes();
    let mut i = 0;
    while i + 2 < b.len() {
        if b[i] == b'<' && b[i + 1] == b'<' && (i == 0 || b[i - 1] != b'<') {
            let mut j = i + 2;
            if b.get(j) == Some(&b'-') {
                j += 1;
            }
            while b.get(j).is_some_and(|c| *c == b' ' || *c == b'\t') {
                j += 1;
            }
            if matches!(b.get(j), Some(b'"' | b'\'')) {
                j += 1;
            }
            if b.get(j)
                .is_some_and(|c| c.is_ascii_alphabetic() || *c == b'_')
            {
                return true;
            }
        }
        i += 1;
    }
    false
}

/// Parses the Dockerfile; returns the recipe and, per step, its line.
pub(crate) fn parse(s: &str) -> Result<(Recipe, Vec<usize>), RecipeError> {
    let mut vars: BTreeMap<String, String> = BASE_VARS
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let mut base: Option<String> = None;
    let mut steps = Vec::new();
    let mut lines = Vec::new();
    let mut cmd: Option<Form> = None;
    let mut entrypoint: Option<Form> = None;
    let mut ready: Option<Ready> = None;
    let mut push = |steps: &mut Vec<Step>, step: Step, line: usize| {
        steps.push(step);
        lines.push(line);
    };
    for ins in instructions(s)? {
        let line = ins.line;
        let kw = ins.keyword.as_str();
        let args = ins.args.as_str();
        let lexed = |a: &str, split: bool, vars: &BTreeMap<String, String>| {
            lex(a, vars, split).map_err(|m| invalid(line, format!("{kw}: {m}")))
        };
        if base.is_none() && !matches!(kw, "FROM" | "ARG") {
            return Err(invalid(
                line,
                format!("{kw} before FROM (a Dockerfile starts with FROM)"),
            ));
        }
        match kw {
            "FROM" => {
                if base.is_some() {
                    return Err(unsupported(line, "FROM", "multi-stage builds (a second FROM) are not supported"));
                }
                let (f, rest) = flags(args);
                if let Some(f) = f.first() {
                    return Err(unsupported(line, "FROM", format!("flag {f} is not supported")));
                }
                let words = lexed(rest, true, &vars)?;
                match words.as_slice() {
                    [image] => base = Some(image.clone()),
                    [image, as_, _name] if as_.eq_ignore_ascii_case("as") => base = Some(image.clone()),
                    [] => return Err(invalid(line, "FROM needs an image")),
                    _ => return Err(invalid(line, "FROM takes an image and optionally `AS name`")),
                }
            }
            "RUN" => {
                let (f, rest) = flags(args);
                if let Some(f) = f.first() {
                    return Err(unsupported(line, "RUN", format!("flag {f} is not supported")));
                }
                let cmd = command_of(rest);
                if exec_form(rest).is_none() && has_heredoc(rest) {
                    return Err(unsupported(line, "RUN", "heredocs (<<EOF) are not supported; use a COPY'd script or printf"));
                }
                if cmd.trim().is_empty() {
                    return Err(invalid(line, "RUN needs a command"));
                }
                push(&mut steps, Step::Run(cmd), line);
            }
            "COPY" => {
                let (f, rest) = flags(args);
                let mut owner = "root".to_string();
                let mut mode = None;
                for f in f {
                    let (name, val) = f.split_once('=').unwrap_or((f, ""));
                    match name {
                        "--chown" => owner = lexed(val, false, &vars)?.concat(),
                        "--chmod" => {
                            mode = Some(u32::from_str_radix(val, 8).map_err(|_| {
                                invalid(line, format!("COPY --chmod={val}: not an octal mode"))
                            })?)
                        }
                        _ => return Err(unsupported(line, &format!("COPY {name}"), "only --chown and --chmod are supported")),
                    }
                }
                let words = match exec_form(rest) {
                    Some(w) => w,
                    None => lexed(rest, true, &vars)?,
                };
                let Some((dest, srcs)) = words.split_last().filter(|(_, s)| !s.is_empty()) else {
                    return Err(invalid(line, "COPY needs a source and a destination"));
                };
                if srcs.len() > 1 && !dest.ends_with('/') {
                    return Err(invalid(line, "COPY with several sources needs a destination ending with /"));
                }
                for src in srcs {
                    if src.contains(['*', '?', '[']) {
                        return Err(unsupported(line, "COPY", format!("wildcards in sources ({src:?}) are not supported")));
                    }
                    let src = src.trim_start_matches("./");
                    let src = if src.is_empty() { "." } else { src };
                    let c = Copy {
                        src: src.to_string(),
                        dest: dest.clone(),
                        sha256: None,
                        owner: Some(owner.clone()),
                        mode,
                    };
                    push(&mut steps, Step::Copy(c), line);
                }
            }
            "ENV" | "ARG" => {
                let words = lexed(args, true, &vars)?;
                let mut set = BTreeMap::new();
                if kw == "ENV" && words.first().is_some_and(|w| !w.contains('=')) {
                    // Legacy `ENV key value with spaces`.
                    let (key, value) = args
                        .split_once(char::is_whitespace)
                        .ok_or_else(|| invalid(line, "ENV needs key=value or `key value`"))?;
                    let value = lexed(value.trim(), false, &vars)?.concat();
                    set.insert(key.to_string(), value);
                } else {
                    if words.is_empty() {
                        return Err(invalid(line, format!("{kw} needs a name")));
                    }
                    for w in words {
                        match w.split_once('=') {
                            Some((k, v)) => {
                                set.insert(k.to_string(), v.to_string());
                            }
                            // `ARG NAME`: declared, no value (there are no --build-args).
                            None if kw == "ARG" => {}
                            None => return Err(invalid(line, format!("ENV {w:?} is not key=value"))),
                        }
                    }
                }
                for (k, v) in &set {
                    vars.insert(k.clone(), v.clone());
                }
                // ARGs before FROM only parametrise FROM, as in Docker.
                if !set.is_empty() && base.is_some() {
                    push(&mut steps, Step::Env(set), line);
                }
            }
            "WORKDIR" => {
                let w = lexed(args, false, &vars)?.concat();
                if w.is_empty() {
                    return Err(invalid(line, "WORKDIR needs a path"));
                }
                push(&mut steps, Step::Workdir(w), line);
            }
            "USER" => {
                let u = lexed(args, false, &vars)?.concat();
                if u.contains(':') {
                    return Err(unsupported(line, "USER", "a group (user:group) is not supported; name the user only"));
                }
                push(&mut steps, Step::User(u), line);
            }
            "CMD" => cmd = Some(Form::of(args)),
            "ENTRYPOINT" => entrypoint = Some(Form::of(args)),
            "HEALTHCHECK" => {
                let (f, rest) = flags(args);
                for f in f {
                    let name = f.split_once('=').map_or(f, |(n, _)| n);
                    if !matches!(name, "--interval" | "--timeout" | "--start-period" | "--start-interval" | "--retries") {
                        return Err(unsupported(line, &format!("HEALTHCHECK {name}"), "unknown flag"));
                    }
                }
                let (word, cmd) = match rest.find(char::is_whitespace) {
                    Some(p) => (&rest[..p], rest[p..].trim()),
                    None => (rest, ""),
                };
                if word.eq_ignore_ascii_case("NONE") && cmd.is_empty() {
                    ready = None;
                } else if word.eq_ignore_ascii_case("CMD") && !cmd.is_empty() {
                    ready = Some(Ready::Command {
                        cmd: command_of(cmd),
                        timeout_secs: DEFAULT_READY_TIMEOUT_SECS,
                    });
                } else {
                    return Err(invalid(line, "HEALTHCHECK takes CMD <command> or NONE"));
                }
            }
            "EXPOSE" | "LABEL" | "MAINTAINER" => {}
            "ADD" => return Err(unsupported(line, "ADD", "use COPY (ADD's URLs and archive unpacking are not supported)")),
            other => {
                return Err(unsupported(
                    line,
                    other,
                    "supported: FROM, RUN, COPY, ENV, ARG, WORKDIR, USER, CMD, ENTRYPOINT, HEALTHCHECK; ignored: EXPOSE, LABEL, MAINTAINER",
                ))
            }
        }
    }
    let base = base.ok_or_else(|| invalid(1, "no FROM instruction"))?;
    let start = start_command(entrypoint, cmd).map(|cmd| Start { cmd });
    Ok((
        Recipe {
            base,
            steps,
            start,
            ready,
        },
        lines,
    ))
}

#[cfg(test)]
mod tests {
    use crate::{Copy, Ready, Recipe, Start, Step, DEFAULT_READY_TIMEOUT_SECS};

    const DF: &str = r#"# syntax=docker/dockerfile:1
# a comment
ARG PYVER=3.11
from e2bdev/base AS build
LABEL org.example=1
run apt-get update \
    # a comment inside a continuation
    && apt-get install -y jq

ENV APP_HOME=/srv/app GREETING="hello world" PATH=/opt/tool/bin:$PATH
ENV LEGACY some value with spaces
WORKDIR $APP_HOME
COPY --chown=user:user requirements.txt ./src/ /srv/app/
COPY ["site", "/var/www"]
USER user
RUN ["python3", "-c", "print('it''s')"]
EXPOSE 8000
RUN echo "py $PYVER"
HEALTHCHECK --interval=5s CMD curl -f http://localhost:8000/ || exit 1
CMD ["python3", "-m", "http.server", "8000"]
"#;

    #[test]
    fn the_subset_parses_into_the_expected_recipe() {
        let r = Recipe::from_dockerfile(DF).expect("parses");
        assert_eq!(r.base, "e2bdev/base");
        let env = |pairs: &[(&str, &str)]| {
            Step::Env(
                pairs
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            )
        };
        let copy = |src: &str, dest: &str, owner: &str| {
            Step::Copy(Copy {
                src: src.into(),
                dest: dest.into(),
                sha256: None,
                owner: Some(owner.into()),
                mode: None,
            })
        };
        let want = vec![
            Step::Run("apt-get update     && apt-get install -y jq".into()),
            env(&[
                ("APP_HOME", "/srv/app"),
                ("GREETING", "hello world"),
                (
                    "PATH",
                    "/opt/tool/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                ),
            ]),
            env(&[("LEGACY", "some value with spaces")]),
            Step::Workdir("/srv/app".into()),
            copy("requirements.txt", "/srv/app/", "user:user"),
            copy("src/", "/srv/app/", "user:user"),
            copy("site", "/var/www", "root"),
            Step::User("user".into()),
            Step::Run("'python3' '-c' 'print('\\''it'\\'''\\''s'\\'')'".into()),
            Step::Run("echo \"py $PYVER\"".into()),
        ];
        assert_eq!(r.steps, want);
        assert_eq!(
            r.start,
            Some(Start {
                cmd: "'python3' '-m' 'http.server' '8000'".into()
            })
        );
        assert_eq!(
            r.ready,
            Some(Ready::Command {
                cmd: "curl -f http://localhost:8000/ || exit 1".into(),
                timeout_secs: DEFAULT_READY_TIMEOUT_SECS
            })
        );
    }

    /// ARG before FROM parametrises FROM only; ARG after it is an ENV (no
    /// --build-args), so RUN sees it.
    #[test]
    fn args() {
        let r = Recipe::from_dockerfile("ARG B=base\nFROM $B\nARG V=1 W\nRUN echo $V\n")
            .expect("parses");
        assert_eq!(r.base, "base");
        assert_eq!(
            r.steps[0],
            Step::Env([("V".to_string(), "1".to_string())].into())
        );
    }

    #[test]
    fn variable_forms() {
        let r = Recipe::from_dockerfile(
            "FROM base\nENV A=1\nENV B=${A}x C=${UNSET:-d} D=${A:+set} E='$A' F=\"$A\" G=\\$A H=$A$A\n",
        )
        .expect("parses");
        let Step::Env(m) = &r.steps[1] else {
            panic!("not env")
        };
        let got: Vec<(&str, &str)> = m.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        assert_eq!(
            got,
            [
                ("B", "1x"),
                ("C", "d"),
                ("D", "set"),
                ("E", "$A"),
                ("F", "1"),
                ("G", "$A"),
                ("H", "11")
            ]
        );
        let e = Recipe::from_dockerfile("FROM base\nENV A=${B?err}\n").expect_err("bad subst");
        assert_eq!((e.code(), e.line()), ("invalid_recipe", Some(2)));
    }

    #[test]
    fn refusals_name_the_line_and_instruction() {
        for (text, line, instr, code) in [
            (
                "FROM base\nRUN true\nADD x.tar /x\n",
                3,
                "ADD",
                "unsupported_instruction",
            ),
            (
                "FROM base\n\n# c\nONBUILD RUN x\n",
                4,
                "ONBUILD",
                "unsupported_instruction",
            ),
            (
                "FROM base\nVOLUME /data\n",
                2,
                "VOLUME",
                "unsupported_instruction",
            ),
            (
                "FROM base\nSHELL [\"bash\"]\n",
                2,
                "SHELL",
                "unsupported_instruction",
            ),
            (
                "FROM base\nFROM other\n",
                2,
                "FROM",
                "unsupported_instruction",
            ),
            (
                "FROM --platform=linux/amd64 base\n",
                1,
                "FROM",
                "unsupported_instruction",
            ),
            (
                "FROM base\nRUN --mount=type=cache,target=/x true\n",
                2,
                "RUN",
                "unsupported_instruction",
            ),
            (
                "FROM base\nRUN cat <<EOF > /x\nhi\nEOF\n",
                2,
                "RUN",
                "unsupported_instruction",
            ),
            (
                "FROM base\nCOPY --from=build /a /b\n",
                2,
                "COPY --from",
                "unsupported_instruction",
            ),
            (
                "FROM base\nCOPY *.py /app/\n",
                2,
                "COPY",
                "unsupported_instruction",
            ),
            (
                "FROM base\nUSER user:staff\n",
                2,
                "USER",
                "unsupported_instruction",
            ),
            (
                "# escape=`\nFROM base\n",
                1,
                "# escape",
                "unsupported_instruction",
            ),
        ] {
            let e = Recipe::from_dockerfile(text).expect_err(text);
            assert_eq!(e.code(), code, "{text}: {e}");
            assert_eq!(e.line(), Some(line), "{text}: {e}");
            match &e {
                crate::RecipeError::Unsupported { instruction, .. } => {
                    assert_eq!(instruction, instr)
                }
                e => panic!("{e:?}"),
            }
            assert!(
                e.to_string().starts_with(&format!("line {line}: {instr} ")),
                "{e}"
            );
        }
        for (text, line) in [
            ("RUN true\nFROM base\n", 1),
            ("", 1),
            ("FROM base\nCOPY onlyone\n", 2),
            ("FROM base\nCOPY a b /notadir\n", 2),
            ("FROM base\nENV A\n", 2),
            ("FROM base\nRUN\n", 2),
            ("FROM base\nENV A=\"open\n", 2),
            ("FROM base\nHEALTHCHECK curl x\n", 2),
            ("FROM base\nCOPY --chmod=abc a /b\n", 2),
        ] {
            let e = Recipe::from_dockerfile(text).expect_err(text);
            assert_eq!(
                (e.code(), e.line()),
                ("invalid_recipe", Some(line)),
                "{text:?}: {e}"
            );
        }
    }

    /// Errors found by validate() on the parsed recipe name the Dockerfile line.
    #[test]
    fn validation_errors_name_the_dockerfile_line() {
        let e =
            Recipe::from_dockerfile("FROM base\nRUN true\n\nUSER Root\n").expect_err("bad user");
        assert_eq!(
            (e.code(), e.line(), e.step()),
            ("invalid_recipe", Some(4), Some(1))
        );
        assert!(e.to_string().starts_with("line 4 (step 2): "), "{e}");
        let e = Recipe::from_dockerfile("FROM base\nCOPY ../secret /x\n").expect_err("escape");
        assert_eq!(e.line(), Some(2));
        let e = Recipe::from_dockerfile("FROM base\nENV 1A=x\n").expect_err("key");
        assert_eq!(e.line(), Some(2));
    }

    /// ENTRYPOINT and CMD combine as in Docker.
    #[test]
    fn entrypoint_and_cmd() {
        let start = |df: &str| {
            Recipe::from_dockerfile(&format!("FROM base\n{df}"))
                .expect("parses")
                .start
                .map(|s| s.cmd)
        };
        assert_eq!(
            start("ENTRYPOINT [\"python3\", \"-m\"]\nCMD [\"http.server\"]\n").as_deref(),
            Some("'python3' '-m' 'http.server'")
        );
        assert_eq!(
            start("CMD [\"http.server\"]\nENTRYPOINT [\"python3\", \"-m\"]\n").as_deref(),
            Some("'python3' '-m' 'http.server'")
        );
        assert_eq!(
            start("ENTRYPOINT [\"env\"]\nCMD echo $HOME\n").as_deref(),
            Some("'env' '/bin/sh' '-c' 'echo $HOME'")
        );
        assert_eq!(
            start("ENTRYPOINT exec server --port 80\nCMD [\"ignored\"]\n").as_deref(),
            Some("exec server --port 80")
        );
        assert_eq!(
            start("ENTRYPOINT [\"server\"]\n").as_deref(),
            Some("'server'")
        );
        assert_eq!(start("ENTRYPOINT []\nCMD []\n"), None);
        assert_eq!(start("RUN true\n"), None);
        // The combined command runs under a real sh as the words it names.
        let cmd = start("ENTRYPOINT [\"printf\", \"%s|\"]\nCMD [\"a b\", \"it's\", \"$x\"]\n")
            .expect("start");
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(&cmd)
            .output()
            .expect("sh");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "a b|it's|$x|");
    }

    #[test]
    fn healthcheck_none_and_empty_cmd_and_last_wins() {
        let r = Recipe::from_dockerfile(
            "FROM base\nHEALTHCHECK CMD true\nHEALTHCHECK NONE\nCMD a\nCMD [\"b\"]\n",
        )
        .expect("parses");
        assert_eq!(r.ready, None);
        assert_eq!(r.start, Some(Start { cmd: "'b'".into() }));
        assert!(r.steps.is_empty());
        let r = Recipe::from_dockerfile("FROM base\nCMD []\n").expect("parses");
        assert_eq!(r.start, None);
    }
}
