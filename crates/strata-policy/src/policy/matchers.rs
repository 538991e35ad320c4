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
/// reading (wrapper stripped, shell sub-command).
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
        p.rsplit('/').next().unwrap_or(p)
    }
}

const SHELLS: &[&str] = &["sh", "bash", "dash", "zsh", "ash", "ksh", "busybox"];
const WRAPPERS: &[&str] = &[
    "sudo", "env", "nice", "nohup", "exec", "command", "time", "timeout", "stdbuf", "doas",
    "busybox", "xargs", "setsid",
];

/// Build the readings of an exec call. The first view is always the literal
/// argv; further views strip wrappers (`sudo`, `env X=1`, `busybox` …) and
/// split shell scripts (`sh -c '…'`) into simple commands, best effort.
pub fn exec_views(argv: &[String], shell: Option<&str>) -> Vec<ExecView> {
    let literal: Vec<String> = match shell {
        Some(script) => vec!["sh".into(), "-c".into(), script.to_string()],
        None => argv.to_vec(),
    };
    let mut views = vec![ExecView {
        line: literal.join(" "),
        argv: literal.clone(),
        literal: true,
    }];
    derive_views(&literal, 0, &mut views);
    views
}

fn derive_views(argv: &[String], depth: usize, out: &mut Vec<ExecView>) {
    if depth > 3 || out.len() > 64 {
        return;
    }
    let stripped = strip_wrappers(argv);
    if stripped.len() != argv.len() && !stripped.is_empty() {
        out.push(ExecView {
            line: stripped.join(" "),
            argv: stripped.clone(),
            literal: false,
        });
    }
    let base = stripped
        .first()
        .map(|p| p.rsplit('/').next().unwrap_or(p))
        .unwrap_or("");
    if SHELLS.contains(&base) {
        // sh [-opts] -c SCRIPT …
        let mut it = stripped.iter().skip(1);
        while let Some(a) = it.next() {
            if a.starts_with('-') && a.contains('c') && !a.starts_with("--") {
                if let Some(script) = it.next() {
                    out.push(ExecView {
                        line: script.clone(),
                        argv: stripped.clone(),
                        literal: false,
                    });
                    for cmd in split_script(script) {
                        out.push(ExecView {
                            line: cmd.join(" "),
                            argv: cmd.clone(),
                            literal: false,
                        });
                        derive_views(&cmd, depth + 1, out);
                    }
                }
                break;
            }
        }
    }
}

fn strip_wrappers(argv: &[String]) -> Vec<String> {
    let mut i = 0;
    while i < argv.len() {
        let a = argv[i].as_str();
        let base = a.rsplit('/').next().unwrap_or(a);
        if i > 0 && (a.starts_with('-') || (a.contains('=') && !a.starts_with('='))) {
            i += 1; // wrapper option or env assignment
            continue;
        }
        if WRAPPERS.contains(&base)
            && (base != "busybox" || argv.get(i + 1).is_some_and(|n| n != "sh"))
        {
            i += 1;
            continue;
        }
        if i > 0 && base.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
            i += 1; // e.g. `timeout 5 rm …`
            continue;
        }
        break;
    }
    argv[i.min(argv.len())..].to_vec()
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
            '\'' => {
                in_word = true;
                for d in chars.by_ref() {
                    if d == '\'' {
                        break;
                    }
                    word.push(d);
                }
            }
            '"' => {
                in_word = true;
                while let Some(d) = chars.next() {
                    match d {
                        '"' => break,
                        '\\' => {
                            if let Some(e) = chars.next() {
                                word.push(e);
                            }
                        }
                        _ => word.push(d),
                    }
                }
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
        let v = |a: &[&str]| exec_views(&a.iter().map(|s| s.to_string()).collect::<Vec<_>>(), None);
        let views = v(&["sudo", "-n", "env", "A=1", "/bin/rm", "-rf", "/"]);
        assert!(views
            .iter()
            .any(|w| w.argv == ["/bin/rm", "-rf", "/"] && !w.literal));
        let views = v(&["bash", "-lc", "cd /tmp && sh -c 'rm -rf /'"]);
        assert!(
            views.iter().any(|w| w.argv == ["rm", "-rf", "/"]),
            "{views:?}"
        );
        let views = exec_views(&[], Some("busybox rm -fr /"));
        assert_eq!(views[0].argv, ["sh", "-c", "busybox rm -fr /"]);
        assert!(
            views.iter().any(|w| w.argv == ["rm", "-fr", "/"]),
            "{views:?}"
        );
        let views = v(&["timeout", "5", "rm", "x"]);
        assert!(views.iter().any(|w| w.argv == ["rm", "x"]));
    }
}
