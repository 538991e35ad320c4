//! Precompiled matchers used by rules and connectors.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use globset::{GlobBuilder, GlobSet, GlobSetBuilder};

/// A host name pattern: an exact name (`api.slack.com`) or a suffix wildcard
/// (`*.salesforce.com`, which matches any depth of sub-domain but not
/// `salesforce.com` itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostPattern {
    /// Exactly this host.
    Exact(String),
    /// Any host ending in `.<suffix>`; holds the suffix with its leading dot.
    Suffix(String),
}

impl HostPattern {
    /// Parse a host pattern, lower-casing it. IP literals are refused: egress
    /// is granted to names only.
    pub fn parse(s: &str) -> Result<HostPattern, String> {
        let s = s.trim_end_matches('.').to_ascii_lowercase();
        let (wild, name) = match s.strip_prefix("*.") {
            Some(rest) => (true, rest.to_string()),
            None => (false, s.clone()),
        };
        if !is_host_name(&name) {
            return Err(format!("`{s}` is not a host name or `*.domain` pattern"));
        }
        if looks_like_ip(&name) {
            return Err(format!("`{s}` is an IP literal; connectors name hosts"));
        }
        Ok(if wild {
            HostPattern::Suffix(format!(".{name}"))
        } else {
            HostPattern::Exact(name)
        })
    }

    /// Does this pattern match `host` (already lower case, no trailing dot)?
    pub fn matches(&self, host: &str) -> bool {
        match self {
            HostPattern::Exact(h) => h == host,
            HostPattern::Suffix(sfx) => host.len() > sfx.len() && host.ends_with(sfx.as_str()),
        }
    }

    /// Is this an exact pattern?
    pub fn is_exact(&self) -> bool {
        matches!(self, HostPattern::Exact(_))
    }
}

/// An IP network in CIDR notation (`203.0.113.0/24`, `2001:db8::/32`; a
/// bare address is a `/32` or `/128`). The address is stored with its host
/// bits cleared; IPv4-mapped IPv6 (`::ffff:a.b.c.d`) is read as IPv4.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpNet {
    addr: IpAddr,
    prefix: u8,
}

impl IpNet {
    /// Parse `a.b.c.d[/n]` or `x:y::z[/n]`. Only canonical dotted quads are
    /// IPv4 (`127.1`, `0x7f.0.0.1` and leading zeros are refused).
    pub fn parse(s: &str) -> Result<IpNet, String> {
        let s = s.trim();
        let (a, p) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let a = a
            .strip_prefix('[')
            .and_then(|x| x.strip_suffix(']'))
            .unwrap_or(a);
        let addr: IpAddr = a
            .parse()
            .map_err(|_| format!("`{s}` is not an IP address or CIDR block"))?;
        let addr = canonical_ip(addr);
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match p {
            None => max,
            Some(p) => match p.parse::<u8>() {
                Ok(n) if n <= max && !p.starts_with('+') => n,
                _ => return Err(format!("`{s}`: the prefix length must be 0-{max}")),
            },
        };
        Ok(IpNet {
            addr: mask(addr, prefix),
            prefix,
        })
    }

    /// The network address (host bits cleared).
    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    /// The prefix length.
    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// Does this network contain `ip` (IPv4-mapped IPv6 read as IPv4)?
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = canonical_ip(ip);
        ip.is_ipv4() == self.addr.is_ipv4() && mask(ip, self.prefix) == self.addr
    }

    /// Does this network lie entirely inside `other`?
    pub fn within(&self, other: &IpNet) -> bool {
        self.prefix >= other.prefix && other.contains(self.addr)
    }
}

impl std::fmt::Display for IpNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// `ip` with IPv4-mapped IPv6 (`::ffff:a.b.c.d`) read as IPv4.
pub fn canonical_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map(IpAddr::V4)
            .unwrap_or(IpAddr::V6(v6)),
        v4 => v4,
    }
}

fn mask(ip: IpAddr, prefix: u8) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => {
            let bits = u32::from(v4);
            let m = if prefix == 0 {
                0
            } else {
                u32::MAX << (32 - u32::from(prefix))
            };
            IpAddr::V4(Ipv4Addr::from(bits & m))
        }
        IpAddr::V6(v6) => {
            let bits = u128::from(v6);
            let m = if prefix == 0 {
                0
            } else {
                u128::MAX << (128 - u32::from(prefix))
            };
            IpAddr::V6(Ipv6Addr::from(bits & m))
        }
    }
}

/// Is `s` a syntactically valid DNS host name (letters, digits, `-`, dots)?
pub fn is_host_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// Does `host` look like an IP address literal? Catches dotted quads, IPv6 in
/// brackets or bare, and every name whose last label is numeric (`127.1`,
/// `0x7f.1`, `2130706433`), which URL parsers and resolvers read as IPv4.
pub fn looks_like_ip(host: &str) -> bool {
    if host.contains(':') || host.starts_with('[') {
        return true;
    }
    let last = host.trim_end_matches('.').rsplit('.').next().unwrap_or("");
    if last.is_empty() {
        return false;
    }
    let lower = last.to_ascii_lowercase();
    if lower.bytes().all(|b| b.is_ascii_digit()) {
        return true;
    }
    if let Some(hex) = lower.strip_prefix("0x") {
        return hex.bytes().all(|b| b.is_ascii_hexdigit());
    }
    false
}

/// Which glob dialect a field uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GlobMode {
    /// `*` does not cross `/`; `**` does (paths).
    Path,
    /// `*` matches anything, `/` included (programs, arguments, command lines).
    Text,
}

/// Compile a set of globs; returns the index of the first bad pattern on error.
pub fn glob_set(patterns: &[String], mode: GlobMode) -> Result<GlobSet, (usize, String)> {
    let mut b = GlobSetBuilder::new();
    for (i, p) in patterns.iter().enumerate() {
        b.add(one_glob(p, mode).map_err(|e| (i, e))?);
    }
    b.build().map_err(|e| (0, e.to_string()))
}

/// Compile one glob.
pub fn one_glob(p: &str, mode: GlobMode) -> Result<globset::Glob, String> {
    GlobBuilder::new(p)
        .literal_separator(mode == GlobMode::Path)
        .backslash_escape(true)
        .empty_alternates(true)
        .build()
        .map_err(|e| format!("bad glob `{p}`: {}", e.kind()))
}

/// Positional argument patterns: `args[i]` must match `argv[i+1]`; a final
/// `...` lets any further arguments follow, otherwise the counts must agree.
#[derive(Debug, Clone)]
pub struct ArgsMatcher {
    /// One compiled matcher per position.
    pub positions: Vec<globset::GlobMatcher>,
    /// Whether more arguments may follow.
    pub rest: bool,
}

/// One way to read an exec call's command: the literal argv, or a derived
/// reading (wrapper stripped, shell sub-command, paths normalised).
#[derive(Debug, Clone)]
pub struct ExecView {
    /// Program and arguments.
    pub argv: Vec<String>,
    /// `argv` joined by single spaces (or the raw script for a shell reading).
    pub line: String,
    /// True for the literal argv; false for derived readings, which only
    /// deny/approve rules look at.
    pub literal: bool,
}

impl ExecView {
    /// The program's basename (`/usr/bin/rm` → `rm`).
    pub fn program_base(&self) -> &str {
        let p = self.argv.first().map(String::as_str).unwrap_or("");
        basename(p)
    }

    fn derived(argv: Vec<String>) -> ExecView {
        ExecView {
            line: argv.join(" "),
            argv,
            literal: false,
        }
    }
}

/// Every reading of one exec call.
#[derive(Debug, Clone, Default)]
pub struct ExecReading {
    /// The literal argv first, then the derived readings.
    pub views: Vec<ExecView>,
    /// Why the command cannot be read reliably (a shell that reads its
    /// commands from stdin, an unknown wrapper option, too many readings,
    /// shells nested too deep). Such a call matches every deny/approve rule
    /// of the exec kind: it fails closed.
    pub unreadable: Option<String>,
    /// Names of the environment variables the call sets.
    pub env: Vec<String>,
}

/// Most readings one exec call gets; a call that needs more is unreadable.
pub const MAX_VIEWS: usize = 256;
/// Deepest nesting of shells (and `eval`) that is read; deeper is unreadable.
pub const MAX_DEPTH: usize = 4;
/// Most wrappers unwrapped in a row (`sudo env nice …`); more is unreadable.
const MAX_WRAPPERS: usize = 16;

const SHELLS: &[&str] = &[
    "sh", "bash", "dash", "zsh", "ash", "ksh", "mksh", "hush", "rbash",
];

fn basename(p: &str) -> &str {
    p.rsplit('/').next().unwrap_or(p)
}

/// Build the readings of an exec call. The first view is always the literal
/// argv; further views strip wrappers (`sudo -u root`, `env -u X A=1`,
/// `timeout -s KILL 5`, `busybox` …, with their options' values), split
/// shell scripts (`sh -c '…'`, `eval …`) into simple commands, and resolve
/// `.`, `..` and `//` in absolute paths. `stdin_fed`: the call gives the
/// command a stdin (a shell without `-c` would read its commands there).
pub fn exec_reading(argv: &[String], shell: Option<&str>, stdin_fed: bool) -> ExecReading {
    let literal: Vec<String> = match shell {
        Some(script) => vec!["sh".into(), "-c".into(), script.to_string()],
        None => argv.to_vec(),
    };
    let mut r = Reader::default();
    r.views.push(ExecView {
        line: literal.join(" "),
        argv: literal.clone(),
        literal: true,
    });
    r.derive(&literal, 0, stdin_fed);
    ExecReading {
        views: r.views,
        unreadable: r.unreadable,
        env: Vec::new(),
    }
}

#[derive(Default)]
struct Reader {
    views: Vec<ExecView>,
    unreadable: Option<String>,
}

impl Reader {
    fn fail(&mut self, why: String) {
        if self.unreadable.is_none() {
            self.unreadable = Some(why);
        }
    }

    /// Adds a view; false (and unreadable) once the budget is spent.
    fn push(&mut self, v: ExecView) -> bool {
        if self.views.len() >= MAX_VIEWS {
            self.fail(format!("it has more than {MAX_VIEWS} readings"));
            return false;
        }
        self.views.push(v);
        true
    }

    fn push_normalised(&mut self, argv: &[String]) -> bool {
        match normalised_paths(argv) {
            Some(n) => self.push(ExecView::derived(n)),
            None => true,
        }
    }

    /// Readings of `argv` (already pushed by the caller).
    fn derive(&mut self, argv: &[String], depth: usize, stdin_fed: bool) {
        if self.unreadable.is_some() {
            return; // it matches every deny/approve rule already
        }
        if depth > MAX_DEPTH {
            self.fail(format!("shells nest more than {MAX_DEPTH} deep"));
            return;
        }
        if !self.push_normalised(argv) {
            return;
        }
        let mut cur = argv.to_vec();
        let mut steps = 0;
        loop {
            match unwrap_once(&cur) {
                Unwrap::No => break,
                Unwrap::Unreadable(why) => return self.fail(why),
                Unwrap::Inner(next) => {
                    steps += 1;
                    if steps > MAX_WRAPPERS {
                        return self.fail(format!("more than {MAX_WRAPPERS} wrappers in a row"));
                    }
                    if next.is_empty() {
                        return; // a wrapper with no command runs nothing
                    }
                    cur = next;
                    if !self.push(ExecView::derived(cur.clone())) || !self.push_normalised(&cur) {
                        return;
                    }
                }
            }
        }
        let prog = cur.first().map(|p| basename(p)).unwrap_or("");
        let (prog, args) = match cur.get(1) {
            Some(applet) if prog == "busybox" => (basename(applet), &cur[2..]),
            _ => (prog, cur.get(1..).unwrap_or(&[])),
        };
        if SHELLS.contains(&prog) {
            match shell_input(prog, args) {
                ShellInput::Script(s) => self.script(&s, &cur, depth),
                ShellInput::Stdin if stdin_fed => {
                    self.fail(format!("`{prog}` reads its commands from stdin"))
                }
                ShellInput::Stdin | ShellInput::File => {}
                ShellInput::Unreadable(why) => self.fail(why),
            }
        } else if prog == "eval" {
            let script = args.join(" ");
            self.script(&script, &cur, depth);
        }
    }

    fn script(&mut self, script: &str, argv: &[String], depth: usize) {
        if !self.push(ExecView {
            line: script.to_string(),
            argv: argv.to_vec(),
            literal: false,
        }) {
            return;
        }
        for cmd in split_script(script) {
            // `A=1 rm …`: assignments before the command are not the program.
            let skip = cmd.iter().take_while(|w| is_assignment(w)).count();
            let cmd = cmd[skip..].to_vec();
            if cmd.is_empty() {
                continue;
            }
            if !self.push(ExecView::derived(cmd.clone())) {
                return;
            }
            // Inside a script a command's stdin may be a pipe: a bare `sh`
            // there reads whatever the pipe carries.
            self.derive(&cmd, depth + 1, true);
            if self.unreadable.is_some() {
                return;
            }
        }
    }
}

/// `NAME=value` with a shell variable name.
fn is_assignment(w: &str) -> bool {
    match w.split_once('=') {
        Some((name, _)) => {
            let mut b = name.bytes();
            b.next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == b'_')
                && b.all(|c| c.is_ascii_alphanumeric() || c == b'_')
        }
        None => false,
    }
}

/// `argv` with `.`, `..` and repeated `/` resolved in every absolute path
/// (`//` and `/.` are `/`; `..` at the root stays there, as in the kernel),
/// when that changes something.
fn normalised_paths(argv: &[String]) -> Option<Vec<String>> {
    let mut changed = false;
    let out = argv
        .iter()
        .map(|a| {
            if !a.starts_with('/') {
                return a.clone();
            }
            let mut parts: Vec<&str> = Vec::new();
            for c in a.split('/') {
                match c {
                    "" | "." => {}
                    ".." => {
                        parts.pop();
                    }
                    c => parts.push(c),
                }
            }
            let n = format!("/{}", parts.join("/"));
            changed |= n != *a;
            n
        })
        .collect();
    changed.then_some(out)
}

enum ShellInput {
    /// `-c SCRIPT`.
    Script(String),
    /// Commands come from stdin (no `-c`, no script file, or `-s`).
    Stdin,
    /// A script file, which no rule reads.
    File,
    Unreadable(String),
}

/// Single-letter shell options without a value (any of the shells above).
const SHELL_FLAGS: &str = "abefhiklmnprstuvxBCDEHILPTV";
const SHELL_LONG_FLAGS: &[&str] = &[
    "login",
    "noprofile",
    "norc",
    "posix",
    "verbose",
    "restricted",
    "noediting",
    "debugger",
    "dump-strings",
    "dump-po-strings",
    "wordexp",
    "pretty-print",
    "protected",
    "help",
    "version",
];
const SHELL_LONG_VALUED: &[&str] = &["rcfile", "init-file", "emulate"];

/// What a shell invocation (`args` after the program) runs: POSIX `sh
/// [-abCefimnuvx] [-o opt]… [-c] [--] operand…`, with bash's `-O shopt`
/// and long options. The script of `-c` is the first operand, wherever `-c`
/// stands (`sh -c -e 'rm …'`, `sh -c -- 'rm …'`).
fn shell_input(prog: &str, args: &[String]) -> ShellInput {
    let bash = prog == "bash" || prog == "rbash";
    let (mut c, mut s) = (false, false);
    let mut i = 0;
    while i < args.len() {
        let a = args[i].as_str();
        if a == "--" || a == "-" {
            i += 1;
            break;
        }
        if let Some(long) = a.strip_prefix("--") {
            let (name, has_value) = match long.split_once('=') {
                Some((n, _)) => (n, true),
                None => (long, false),
            };
            if SHELL_LONG_VALUED.contains(&name) {
                i += if has_value { 1 } else { 2 };
                continue;
            }
            if SHELL_LONG_FLAGS.contains(&name) && !has_value {
                i += 1;
                continue;
            }
            return ShellInput::Unreadable(format!("unknown option `{a}` of `{prog}`"));
        }
        let Some(cluster) = a.strip_prefix('-').or_else(|| a.strip_prefix('+')) else {
            break; // the first operand
        };
        let mut values = 0;
        for ch in cluster.chars() {
            match ch {
                'c' => c = true,
                's' => s = true,
                'o' => values += 1,
                'O' if bash => values += 1,
                ch if SHELL_FLAGS.contains(ch) => {}
                ch => return ShellInput::Unreadable(format!("unknown option `-{ch}` of `{prog}`")),
            }
        }
        i += 1 + values;
    }
    let operands = args.get(i..).unwrap_or(&[]);
    if c {
        return match operands.first() {
            Some(script) => ShellInput::Script(script.clone()),
            None => ShellInput::File, // `sh -c` without a script runs nothing
        };
    }
    if s || operands.is_empty() {
        ShellInput::Stdin
    } else {
        ShellInput::File
    }
}

/// The option grammar of a program that runs another one.
struct Wrapper {
    name: &'static str,
    /// Single-letter options without a value.
    flags: &'static str,
    /// Single-letter options with a value (attached or the next word).
    valued: &'static str,
    /// Single-letter options whose value is optional and only attached (`xargs -i{}`).
    optional: &'static str,
    long_flags: &'static [&'static str],
    /// `--name VALUE` or `--name=VALUE`.
    long_valued: &'static [&'static str],
    /// `--name` or `--name=VALUE`.
    long_optional: &'static [&'static str],
    /// `NAME=value` words may follow the options (`env`, `sudo`).
    assignments: bool,
    /// Words before the command (the duration of `timeout`).
    operands: usize,
    /// `-N` is an option (`nice -10`).
    numeric: bool,
}

const HELP: &[&str] = &["help", "version"];

const WRAPPERS: &[Wrapper] = &[
    Wrapper {
        name: "sudo",
        flags: "ABbEeHiKklNnPSsVv",
        valued: "aCcDgpRrTtUu",
        optional: "h",
        long_flags: &[
            "askpass",
            "background",
            "bell",
            "edit",
            "help",
            "set-home",
            "login",
            "remove-timestamp",
            "reset-timestamp",
            "list",
            "non-interactive",
            "preserve-groups",
            "stdin",
            "shell",
            "version",
            "validate",
            "no-update",
        ],
        long_valued: &[
            "close-from",
            "login-class",
            "chdir",
            "group",
            "host",
            "prompt",
            "chroot",
            "role",
            "type",
            "command-timeout",
            "other-user",
            "user",
        ],
        long_optional: &["preserve-env"],
        assignments: true,
        operands: 0,
        numeric: false,
    },
    Wrapper {
        name: "doas",
        flags: "Lns",
        valued: "Cu",
        optional: "",
        long_flags: &[],
        long_valued: &[],
        long_optional: &[],
        assignments: false,
        operands: 0,
        numeric: false,
    },
    Wrapper {
        name: "env",
        flags: "i0v",
        valued: "uCS",
        optional: "",
        long_flags: &[
            "ignore-environment",
            "null",
            "debug",
            "list-signal-handling",
            "help",
            "version",
        ],
        long_valued: &["unset", "chdir", "split-string"],
        long_optional: &["block-signal", "default-signal", "ignore-signal"],
        assignments: true,
        operands: 0,
        numeric: false,
    },
    Wrapper {
        name: "nice",
        flags: "",
        valued: "n",
        optional: "",
        long_flags: HELP,
        long_valued: &["adjustment"],
        long_optional: &[],
        assignments: false,
        operands: 0,
        numeric: true,
    },
    Wrapper {
        name: "nohup",
        flags: "",
        valued: "",
        optional: "",
        long_flags: HELP,
        long_valued: &[],
        long_optional: &[],
        assignments: false,
        operands: 0,
        numeric: false,
    },
    Wrapper {
        name: "exec",
        flags: "cl",
        valued: "a",
        optional: "",
        long_flags: &[],
        long_valued: &[],
        long_optional: &[],
        assignments: false,
        operands: 0,
        numeric: false,
    },
    Wrapper {
        name: "command",
        flags: "pVv",
        valued: "",
        optional: "",
        long_flags: &[],
        long_valued: &[],
        long_optional: &[],
        assignments: false,
        operands: 0,
        numeric: false,
    },
    Wrapper {
        name: "builtin",
        flags: "",
        valued: "",
        optional: "",
        long_flags: &[],
        long_valued: &[],
        long_optional: &[],
        assignments: false,
        operands: 0,
        numeric: false,
    },
    Wrapper {
        name: "time",
        flags: "apqvV",
        valued: "fo",
        optional: "",
        long_flags: &[
            "append",
            "portability",
            "verbose",
            "quiet",
            "help",
            "version",
        ],
        long_valued: &["format", "output"],
        long_optional: &[],
        assignments: false,
        operands: 0,
        numeric: false,
    },
    Wrapper {
        name: "timeout",
        flags: "v",
        valued: "ks",
        optional: "",
        long_flags: &[
            "foreground",
            "preserve-status",
            "verbose",
            "help",
            "version",
        ],
        long_valued: &["kill-after", "signal"],
        long_optional: &[],
        assignments: false,
        operands: 1,
        numeric: false,
    },
    Wrapper {
        name: "stdbuf",
        flags: "",
        valued: "ioe",
        optional: "",
        long_flags: HELP,
        long_valued: &["input", "output", "error"],
        long_optional: &[],
        assignments: false,
        operands: 0,
        numeric: false,
    },
    Wrapper {
        name: "xargs",
        flags: "0oprtx",
        valued: "adEILnPs",
        optional: "eil",
        long_flags: &[
            "null",
            "no-run-if-empty",
            "verbose",
            "interactive",
            "exit",
            "open-tty",
            "show-limits",
            "help",
            "version",
        ],
        long_valued: &[
            "arg-file",
            "delimiter",
            "max-args",
            "max-procs",
            "max-chars",
            "process-slot-var",
        ],
        long_optional: &["replace", "eof", "max-lines"],
        assignments: false,
        operands: 0,
        numeric: false,
    },
    Wrapper {
        name: "setsid",
        flags: "cfw",
        valued: "",
        optional: "",
        long_flags: &["ctty", "fork", "wait", "help", "version"],
        long_valued: &[],
        long_optional: &[],
        assignments: false,
        operands: 0,
        numeric: false,
    },
];

enum Unwrap {
    /// Not a wrapper (or `busybox` running a shell).
    No,
    /// The command the wrapper runs (empty: none).
    Inner(Vec<String>),
    Unreadable(String),
}

/// Strip one wrapper off `argv`, with its options, their values, its
/// assignments and operands.
fn unwrap_once(argv: &[String]) -> Unwrap {
    let Some(first) = argv.first() else {
        return Unwrap::No;
    };
    let base = basename(first);
    if base == "busybox" {
        return match argv.get(1) {
            Some(applet) if SHELLS.contains(&basename(applet)) => Unwrap::No,
            Some(_) => Unwrap::Inner(argv[1..].to_vec()),
            None => Unwrap::Inner(Vec::new()),
        };
    }
    let Some(w) = WRAPPERS.iter().find(|w| w.name == base) else {
        return Unwrap::No;
    };
    let mut args: Vec<String> = argv[1..].to_vec();
    let mut splits = 0;
    let mut i = 0;
    let unknown = |opt: &str| Unwrap::Unreadable(format!("unknown option `{opt}` of `{}`", w.name));
    'opts: while i < args.len() {
        let a = args[i].clone();
        if a == "--" {
            i += 1;
            break;
        }
        if a == "-" && w.name == "env" {
            i += 1; // `env -` is `env -i`
            continue;
        }
        if let Some(long) = a.strip_prefix("--") {
            let (name, value) = match long.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (long, None),
            };
            let matches = |list: &[&str]| list.contains(&name);
            if matches(w.long_valued) {
                let value = match value {
                    Some(v) => v,
                    None => {
                        i += 1;
                        match args.get(i) {
                            Some(v) => v.clone(),
                            None => return Unwrap::Inner(Vec::new()),
                        }
                    }
                };
                i += 1;
                if w.name == "env"
                    && name == "split-string"
                    && !split_into(&mut args, &mut i, &value, &mut splits)
                {
                    return Unwrap::Unreadable(
                        "`env -S` with variables or more than 8 strings".into(),
                    );
                }
                continue;
            }
            if (matches(w.long_flags) && value.is_none()) || matches(w.long_optional) {
                i += 1;
                continue;
            }
            if w.numeric && long.bytes().all(|b| b.is_ascii_digit()) && !long.is_empty() {
                i += 1;
                continue;
            }
            return unknown(&a);
        }
        let Some(cluster) = a.strip_prefix('-').filter(|c| !c.is_empty()) else {
            break; // the first operand or assignment
        };
        if w.numeric && cluster.bytes().all(|b| b.is_ascii_digit() || b == b'+') {
            i += 1; // `nice -10`
            continue;
        }
        for (at, ch) in cluster.char_indices() {
            if w.flags.contains(ch) {
                continue;
            }
            let rest = &cluster[at + ch.len_utf8()..];
            if w.optional.contains(ch) {
                i += 1;
                continue 'opts;
            }
            if w.valued.contains(ch) {
                let value = if rest.is_empty() {
                    i += 1;
                    match args.get(i) {
                        Some(v) => v.clone(),
                        None => return Unwrap::Inner(Vec::new()),
                    }
                } else {
                    rest.to_string()
                };
                i += 1;
                if w.name == "env"
                    && ch == 'S'
                    && !split_into(&mut args, &mut i, &value, &mut splits)
                {
                    return Unwrap::Unreadable(
                        "`env -S` with variables or more than 8 strings".into(),
                    );
                }
                continue 'opts;
            }
            return unknown(&format!("-{ch}"));
        }
        i += 1;
    }
    if w.assignments {
        while args.get(i).is_some_and(|a| a.contains('=')) {
            i += 1;
        }
    }
    i += w.operands;
    Unwrap::Inner(args.get(i..).unwrap_or(&[]).to_vec())
}

/// `env -S STRING`: the words of STRING take the place of the option at `i`
/// and are parsed as env's own arguments. False when it cannot be read
/// (`${VAR}` expansions) or strings nest too often.
fn split_into(args: &mut Vec<String>, i: &mut usize, value: &str, splits: &mut usize) -> bool {
    *splits += 1;
    if *splits > 8 || value.contains("${") {
        return false;
    }
    let words = split_words(value);
    let tail = args.split_off(*i);
    args.extend(words);
    args.extend(tail);
    true
}

/// Appends to `word` the rest of a run quoted by `q` (`'` or `"`), up to
/// its closing quote, quotes removed; inside `"…"` a `\` escapes the next
/// character. Shared by [`split_words`] and [`split_script`].
fn take_quoted(q: char, chars: &mut impl Iterator<Item = char>, word: &mut String) {
    while let Some(d) = chars.next() {
        match d {
            d if d == q => break,
            '\\' if q == '"' => {
                if let Some(e) = chars.next() {
                    word.push(e);
                }
            }
            _ => word.push(d),
        }
    }
}

/// Split a string into words the way `env -S` does, best effort: white
/// space separates, `'…'` and `"…"` quote, `\` escapes, `#` at the start of
/// a word begins a comment.
pub fn split_words(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            '#' if !in_word => break,
            q @ ('\'' | '"') => {
                in_word = true;
                take_quoted(q, &mut chars, &mut word);
            }
            '\\' => {
                in_word = true;
                match chars.next() {
                    Some('_') => word.push(' '),
                    Some(e) => word.push(e),
                    None => {}
                }
            }
            c if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            c => {
                in_word = true;
                word.push(c);
            }
        }
    }
    if in_word {
        out.push(word);
    }
    out
}

/// Split a shell script into simple commands (words, quotes removed), best
/// effort: separators `; & | && || newline`, `$(`, backquotes and parentheses.
pub fn split_script(script: &str) -> Vec<Vec<String>> {
    let mut cmds = Vec::new();
    let mut cur: Vec<String> = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = script.chars().peekable();
    let flush_word = |word: &mut String, in_word: &mut bool, cur: &mut Vec<String>| {
        if *in_word {
            cur.push(std::mem::take(word));
            *in_word = false;
        }
    };
    while let Some(c) = chars.next() {
        match c {
            q @ ('\'' | '"') => {
                in_word = true;
                take_quoted(q, &mut chars, &mut word);
            }
            '\\' => {
                in_word = true;
                if let Some(e) = chars.next() {
                    word.push(e);
                }
            }
            ';' | '&' | '|' | '\n' | '`' | '(' | ')' | '{' | '}' => {
                flush_word(&mut word, &mut in_word, &mut cur);
                if !cur.is_empty() {
                    cmds.push(std::mem::take(&mut cur));
                }
            }
            '$' if chars.peek() == Some(&'(') => {
                flush_word(&mut word, &mut in_word, &mut cur);
                if !cur.is_empty() {
                    cmds.push(std::mem::take(&mut cur));
                }
            }
            c if c.is_whitespace() => flush_word(&mut word, &mut in_word, &mut cur),
            c => {
                in_word = true;
                word.push(c);
            }
        }
    }
    flush_word(&mut word, &mut in_word, &mut cur);
    if !cur.is_empty() {
        cmds.push(cur);
    }
    cmds
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_patterns() {
        let p = HostPattern::parse("*.Salesforce.com.").unwrap_or_else(|e| panic!("{e}"));
        assert!(p.matches("na1.salesforce.com"));
        assert!(p.matches("a.b.salesforce.com"));
        assert!(!p.matches("salesforce.com"));
        assert!(!p.matches("evilsalesforce.com"));
        assert!(!p.matches("salesforce.com.evil.org"));
        let e = HostPattern::parse("api.slack.com").unwrap_or_else(|e| panic!("{e}"));
        assert!(e.matches("api.slack.com") && !e.matches("x.api.slack.com"));
        for bad in [
            "10.0.0.1",
            "*.10.0.0.1",
            "[::1]",
            "::1",
            "a..b",
            "",
            "*",
            "a_b.com",
            "127.1",
            "0x7f",
        ] {
            assert!(HostPattern::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn ip_nets() {
        let n = IpNet::parse("10.77.3.9/16").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(n.to_string(), "10.77.0.0/16");
        assert!(n.contains("10.77.200.1".parse().unwrap_or_else(|e| panic!("{e}"))));
        assert!(n.contains("::ffff:10.77.0.1".parse().unwrap_or_else(|e| panic!("{e}"))));
        assert!(!n.contains("10.78.0.1".parse().unwrap_or_else(|e| panic!("{e}"))));
        assert!(!n.contains("::1".parse().unwrap_or_else(|e| panic!("{e}"))));
        let one = IpNet::parse("1.2.3.4").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(one.to_string(), "1.2.3.4/32");
        let all = IpNet::parse("0.0.0.0/0").unwrap_or_else(|e| panic!("{e}"));
        assert!(all.contains("255.1.2.3".parse().unwrap_or_else(|e| panic!("{e}"))));
        assert!(n.within(&IpNet::parse("10.0.0.0/8").unwrap_or_else(|e| panic!("{e}"))));
        assert!(!all.within(&IpNet::parse("10.0.0.0/8").unwrap_or_else(|e| panic!("{e}"))));
        let v6 = IpNet::parse("[2001:db8::1]/32").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(v6.to_string(), "2001:db8::/32");
        for bad in [
            "10.0.0.0/33",
            "::/129",
            "127.1",
            "0x7f.0.0.1",
            "010.0.0.1",
            "a.b",
            "1.2.3.4/",
            "1.2.3.4/+8",
            "",
        ] {
            assert!(IpNet::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn ip_literals() {
        for ip in [
            "127.0.0.1",
            "127.1",
            "2130706433",
            "0x7f.0.0.1",
            "1.2.3.0x4",
            "[::1]",
            "fe80::1",
        ] {
            assert!(looks_like_ip(ip), "{ip}");
        }
        for name in ["api.salesforce.com", "1password.com", "a1.b2", "x.0xz"] {
            assert!(!looks_like_ip(name), "{name}");
        }
    }

    #[test]
    fn script_splitting() {
        let s = split_script("ls -l; rm -rf / && echo 'a b' | tee \"x y\" $(whoami) `id`");
        assert_eq!(
            s,
            vec![
                vec!["ls", "-l"],
                vec!["rm", "-rf", "/"],
                vec!["echo", "a b"],
                vec!["tee", "x y"],
                vec!["whoami"],
                vec!["id"],
            ]
        );
    }

    #[test]
    fn views_see_through_wrappers_and_shells() {
        let v = |a: &[&str]| {
            exec_reading(
                &a.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
                None,
                false,
            )
            .views
        };
        let views = v(&["sudo", "-n", "env", "A=1", "/bin/rm", "-rf", "/"]);
        assert!(views
            .iter()
            .any(|w| w.argv == ["/bin/rm", "-rf", "/"] && !w.literal));
        let views = v(&["bash", "-lc", "cd /tmp && sh -c 'rm -rf /'"]);
        assert!(
            views.iter().any(|w| w.argv == ["rm", "-rf", "/"]),
            "{views:?}"
        );
        let views = exec_reading(&[], Some("busybox rm -fr /"), false).views;
        assert_eq!(views[0].argv, ["sh", "-c", "busybox rm -fr /"]);
        assert!(
            views.iter().any(|w| w.argv == ["rm", "-fr", "/"]),
            "{views:?}"
        );
        let views = v(&["timeout", "5", "rm", "x"]);
        assert!(views.iter().any(|w| w.argv == ["rm", "x"]));
    }

    #[test]
    fn wrapper_option_values_are_not_the_program() {
        let inner =
            |a: &[&str]| match unwrap_once(&a.iter().map(|s| s.to_string()).collect::<Vec<_>>()) {
                Unwrap::Inner(v) => v,
                Unwrap::No => panic!("{a:?}: not a wrapper"),
                Unwrap::Unreadable(why) => panic!("{a:?}: {why}"),
            };
        assert_eq!(inner(&["sudo", "-u", "root", "rm", "x"]), ["rm", "x"]);
        assert_eq!(inner(&["sudo", "-nu", "root", "--", "rm"]), ["rm"]);
        assert_eq!(inner(&["sudo", "--user=root", "A=1", "rm"]), ["rm"]);
        assert_eq!(inner(&["env", "-u", "X", "-C", "/", "A=1", "rm"]), ["rm"]);
        assert_eq!(
            inner(&["env", "-S", "rm -rf '/x y'", "z"]),
            ["rm", "-rf", "/x y", "z"]
        );
        assert_eq!(inner(&["env", "-S-i A=1 rm"]), ["rm"]);
        assert_eq!(inner(&["timeout", "-s", "KILL", "-k5", "5", "rm"]), ["rm"]);
        assert_eq!(inner(&["timeout", "--signal", "KILL", "1m", "rm"]), ["rm"]);
        assert_eq!(inner(&["nice", "-n", "5", "rm"]), ["rm"]);
        assert_eq!(inner(&["nice", "-10", "rm"]), ["rm"]);
        assert_eq!(
            inner(&["xargs", "-I{}", "-n", "1", "rm", "{}"]),
            ["rm", "{}"]
        );
        assert_eq!(inner(&["xargs", "-I", "{}", "rm", "{}"]), ["rm", "{}"]);
        assert_eq!(inner(&["stdbuf", "-o0", "-e", "L", "rm"]), ["rm"]);
        assert_eq!(inner(&["time", "-f", "%e", "rm"]), ["rm"]);
        assert_eq!(inner(&["nohup", "rm"]), ["rm"]);
        assert_eq!(inner(&["busybox", "rm"]), ["rm"]);
        assert!(matches!(
            unwrap_once(&["sudo".to_string(), "--frobnicate".into(), "rm".into()]),
            Unwrap::Unreadable(_)
        ));
    }

    #[test]
    fn shell_scripts_are_the_first_operand_after_the_options() {
        let s = |a: &[&str]| match shell_input(
            "bash",
            &a.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        ) {
            ShellInput::Script(s) => s,
            _ => panic!("{a:?}: no script"),
        };
        assert_eq!(s(&["-c", "--", "rm x"]), "rm x");
        assert_eq!(s(&["-c", "-e", "rm x"]), "rm x");
        assert_eq!(s(&["-e", "-o", "pipefail", "-c", "rm x", "name"]), "rm x");
        assert_eq!(s(&["-O", "extglob", "-lc", "rm x"]), "rm x");
        assert_eq!(s(&["--norc", "--rcfile", "f", "-c", "rm x"]), "rm x");
        assert!(matches!(shell_input("sh", &[]), ShellInput::Stdin));
        assert!(matches!(
            shell_input("sh", &["-s".into(), "a".into()]),
            ShellInput::Stdin
        ));
        assert!(matches!(
            shell_input("sh", &["f.sh".into()]),
            ShellInput::File
        ));
        assert!(matches!(
            shell_input("zsh", &["-O".into(), "x".into()]),
            ShellInput::Unreadable(_)
        ));
    }

    #[test]
    fn paths_are_normalised_in_a_derived_reading() {
        let n = |a: &[&str]| normalised_paths(&a.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(
            n(&["rm", "-rf", "//"]),
            Some(vec!["rm".into(), "-rf".into(), "/".into()])
        );
        assert_eq!(n(&["rm", "/."]).map(|v| v[1].clone()), Some("/".into()));
        assert_eq!(
            n(&["rm", "/tmp/../.."]).map(|v| v[1].clone()),
            Some("/".into())
        );
        assert_eq!(n(&["rm", "/./*"]).map(|v| v[1].clone()), Some("/*".into()));
        assert_eq!(n(&["rm", "-rf", "/"]), None);
    }
}
