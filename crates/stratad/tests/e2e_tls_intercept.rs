//! TLS interception of connector hosts from inside a real guest
//! (`docs/tls-interception.md`).
//!
//! A real `stratad` with `[security] egress_tls_intercept = true` and this
//! test's CA as `egress_upstream_ca_bundle`. Two small TLS servers on
//! 127.0.0.1 stand in for `api.salesforce.test` (a certificate of the test
//! CA) and `bad.salesforce.test` (a certificate of a CA nobody trusts);
//! both names are pinned to 127.0.0.1 (`egress_static_hosts`). Tenant
//! `default` declares the read-only connector `salesforce` in its own
//! policy; tenant `other` declares nothing. The default template was
//! built trusting the deployment's interception CA (its system bundle), so
//! Python `requests` needs nothing given; curl is also pointed at a copy
//! (`/tmp/ica.pem`, from `<key_dir>/intercept-ca.pem`) in some checks; a
//! template built from a recipe has it installed by the build.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::Daemon;
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
use rustls::pki_types::PrivateKeyDer;
use serde_json::{json, Value};

/// A certificate authority of this test.
struct Ca {
    key: KeyPair,
    cert: rcgen::Certificate,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let key = KeyPair::generate().expect("key");
        let mut p = CertificateParams::new(Vec::<String>::new()).expect("params");
        p.distinguished_name
            .push(rcgen::DnType::CommonName, name.to_string());
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let cert = p.self_signed(&key).expect("self-signed");
        Ca { key, cert }
    }
}

/// One request a stand-in server received.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
}

/// A TLS HTTP/1.1 server on 127.0.0.1 with a certificate for `host` from
/// `ca`: one request per connection, answers `hello <method> <path>`.
struct TlsUpstream {
    port: u16,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl TlsUpstream {
    fn start(ca: &Ca, host: &str) -> TlsUpstream {
        let key = KeyPair::generate().expect("key");
        let cert = CertificateParams::new(vec![host.to_string()])
            .expect("params")
            .signed_by(&key, &ca.cert, &ca.key)
            .expect("sign");
        let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .expect("cert");
        let cfg = Arc::new(cfg);
        let l = TcpListener::bind("127.0.0.1:0").expect("bind upstream");
        let port = l.local_addr().expect("addr").port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s2 = seen.clone();
        std::thread::spawn(move || {
            for conn in l.incoming() {
                let Ok(conn) = conn else { continue };
                let (s3, cfg) = (s2.clone(), cfg.clone());
                std::thread::spawn(move || serve(conn, cfg, &s3));
            }
        });
        TlsUpstream { port, seen }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("seen").clone()
    }
}

fn serve(conn: TcpStream, cfg: Arc<rustls::ServerConfig>, seen: &Mutex<Vec<Seen>>) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
    let Ok(tls) = rustls::ServerConnection::new(cfg) else {
        return;
    };
    let mut s = rustls::StreamOwned::new(tls, conn);
    let mut r = BufReader::new(&mut s);
    let mut line = String::new();
    if r.read_line(&mut line).is_err() {
        return;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or_default().to_owned();
    let path = parts.next().unwrap_or_default().to_owned();
    let mut len = 0usize;
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).is_err() || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.trim().eq_ignore_ascii_case("content-length") {
                len = v.trim().parse().unwrap_or(0);
            }
        }
    }
    let mut body = vec![0u8; len];
    let _ = r.read_exact(&mut body);
    let answer = format!("hello {method} {path}");
    seen.lock().expect("seen").push(Seen { method, path });
    let _ = write!(
        s,
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{answer}",
        answer.len()
    );
    let _ = s.flush();
    s.conn.send_close_notify();
    let _ = s.flush();
}

async fn audit(d: &Daemon, sandbox: &str) -> Vec<Value> {
    let (s, body) = d
        .raw("GET", &format!("/v1/audit?sandbox={sandbox}"), Vec::new())
        .await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&body));
    body.split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).expect("audit line"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_https_to_a_connector_is_intercepted_and_judged_per_request() {
    let test_ca = Ca::new("e2e upstream CA");
    let good = TlsUpstream::start(&test_ca, "api.salesforce.test");
    let bad = TlsUpstream::start(&Ca::new("untrusted CA"), "bad.salesforce.test");
    let (gp, bp) = (good.port, bad.port);
    let scratch = tempfile::Builder::new()
        .prefix("stratad-e2e-tls-")
        .tempdir_in("/tmp")
        .expect("scratch");
    let bundle = scratch.path().join("upstream-ca.pem");
    std::fs::write(&bundle, test_ca.cert.pem()).expect("bundle");
    let d = Daemon::start(&format!(
        r#"[security]
egress_tls_intercept = true
egress_upstream_ca_bundle = "{}"
secrets_allow_private = ["127.0.0.1"]
[security.egress_static_hosts]
"api.salesforce.test" = "127.0.0.1"
"bad.salesforce.test" = "127.0.0.1"
"bearer.crm.test" = "127.0.0.1"
"header.crm.test" = "127.0.0.1"
"basic.crm.test" = "127.0.0.1"
"query.crm.test" = "127.0.0.1"
"oauth.crm.test" = "127.0.0.1"
"login.crm.test" = "127.0.0.1"
"#,
        bundle.display()
    ));
    d.wait_template().await;
    // Tenant `default` (the admin's) names the connector in its policy.
    let tenant_policy = format!(
        r#"default = "allow"

[[connector]]
name = "salesforce"
hosts = ["api.salesforce.test", "bad.salesforce.test"]
ports = [{gp}, {bp}]
tls_ports = [{gp}, {bp}]
read_only = true
"#
    );
    let (s, body) = d.raw("PUT", "/v1/policy", tenant_policy.into_bytes()).await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&body));
    let ca_pem = std::fs::read_to_string(d.root.join("keys/intercept-ca.pem"))
        .expect("the deployment's interception CA");
    let sb = d.create(json!({})).await;
    let (s, body) = d
        .raw(
            "PUT",
            &format!("/v1/sandboxes/{sb}/files?path=/tmp/ica.pem"),
            ca_pem.clone().into_bytes(),
        )
        .await;
    assert!(
        s == 200 || s == 201,
        "{s} {}",
        String::from_utf8_lossy(&body)
    );

    // curl: a GET passes, through the proxy the agent sets (https_proxy).
    let url = format!("https://api.salesforce.test:{gp}");
    let e = d
        .exec(
            &sb,
            &[
                "curl",
                "-sS",
                "--cacert",
                "/tmp/ica.pem",
                &format!("{url}/accounts"),
            ],
        )
        .await;
    assert_eq!(
        e.code,
        Some(0),
        "{}\n{}",
        String::from_utf8_lossy(&e.stderr),
        d.logs()
    );
    assert_eq!(e.out(), "hello GET /accounts");
    // Writes are refused at the proxy and never reach the server.
    for m in ["POST", "PATCH", "DELETE"] {
        let e = d
            .exec(
                &sb,
                &[
                    "curl",
                    "-s",
                    "--cacert",
                    "/tmp/ica.pem",
                    "-o",
                    "/tmp/body",
                    "-w",
                    "%{http_code}",
                    "-X",
                    m,
                    "-d",
                    "x=1",
                    &format!("{url}/accounts/1"),
                ],
            )
            .await;
        assert_eq!(
            e.out(),
            "403",
            "{m}: {}",
            String::from_utf8_lossy(&e.stderr)
        );
    }
    let e = d.exec(&sb, &["cat", "/tmp/body"]).await;
    let refusal: Value = serde_json::from_str(&e.out()).expect("json refusal");
    assert_eq!(
        refusal["rule"], "connector:salesforce:read-only",
        "{refusal}"
    );

    // Python requests (or pip's vendored copy) with nothing given: the
    // default template was built trusting the CA (the system bundle) and
    // the daemon points REQUESTS_CA_BUNDLE at it for every exec.
    let py = format!(
        r#"
try:
    import requests
except ImportError:
    from pip._vendor import requests
r = requests.get("{url}/py")
print(r.status_code, r.text)
r = requests.post("{url}/py", data="x")
print(r.status_code)
"#
    );
    let e = d
        .exec_body(&sb, json!({ "cmd": ["python3", "-c", py] }))
        .await;
    assert_eq!(e.code, Some(0), "{}", String::from_utf8_lossy(&e.stderr));
    assert_eq!(
        e.out().trim(),
        "200 hello GET /py\n403".trim(),
        "{}",
        e.out()
    );
    let seen = good.seen();
    assert!(
        seen.iter().all(|s| s.method == "GET"),
        "a write reached the server: {seen:?}"
    );
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(seen[1].path, "/py");

    // An upstream whose certificate does not verify: refused, with why.
    let e = d
        .exec(
            &sb,
            &[
                "curl",
                "-s",
                "--cacert",
                "/tmp/ica.pem",
                "-w",
                "\n%{http_code}",
                &format!("https://bad.salesforce.test:{bp}/x"),
            ],
        )
        .await;
    let out = e.out();
    assert!(out.ends_with("502"), "{out}");
    assert!(out.contains("upstream_tls"), "{out}");
    assert!(bad.seen().is_empty(), "{:?}", bad.seen());

    let entries = audit(&d, &sb).await;
    let dump = || {
        entries
            .iter()
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    };
    let get = entries
        .iter()
        .find(|e| e["call"]["kind"]["method"] == "GET" && e["call"]["kind"]["path"] == "/accounts")
        .unwrap_or_else(|| panic!("no GET entry:\n{}", dump()));
    assert_eq!(get["call"]["kind"]["tls"], true, "{get}");
    assert_eq!(get["decision"]["outcome"], "allowed", "{get}");
    assert!(
        entries
            .iter()
            .any(|e| e["call"]["kind"]["method"] == "PATCH"
                && e["decision"]["rule_id"] == "connector:salesforce:read-only"),
        "{}",
        dump()
    );
    assert!(
        entries
            .iter()
            .any(|e| e["decision"]["rule_id"] == "upstream-tls"
                && e["call"]["kind"]["host"] == "bad.salesforce.test"),
        "{}",
        dump()
    );

    // A template built from a recipe trusts the CA (the build installs
    // it): a Python process its start command left running before the
    // fork completes an intercepted call in the fork, and curl trusts the
    // system bundle without --cacert. Nothing is installed at the fork.
    let warm_py = format!(
        r#"import os, time
try:
    import requests
except ImportError:
    from pip._vendor import requests
open("/tmp/warm-started", "w").write("1")
while not os.path.exists("/tmp/go"):
    time.sleep(0.2)
try:
    r = requests.get("{url}/warm", timeout=60)
    out = "%d %s" % (r.status_code, r.text)
except Exception as e:
    out = "error %r" % (e,)
open("/tmp/warm.tmp", "w").write(out)
os.rename("/tmp/warm.tmp", "/tmp/warm.out")
"#
    );
    let recipe = json!({
        "base": "default",
        "step": [{ "run": format!("cat > /opt/warm.py <<'PYEOF'\n{warm_py}PYEOF") }],
        "start": { "cmd": "python3 /opt/warm.py" },
        "ready": { "cmd": "test -f /tmp/warm-started", "timeout_secs": 300 },
    });
    let v = d
        .ok(
            "POST",
            "/v1/templates",
            Some(json!({ "id": "tpl-warm-tls", "recipe": recipe })),
            202,
        )
        .await;
    assert_eq!(v["id"], "tpl-warm-tls", "{v}");
    let t0 = std::time::Instant::now();
    loop {
        let v = d.ok("GET", "/v1/templates/tpl-warm-tls", None, 200).await;
        match v["status"].as_str() {
            Some("ready") => break,
            Some("building") => {}
            _ => panic!("template build: {v}\n{}", d.logs()),
        }
        assert!(
            t0.elapsed() < Duration::from_secs(600),
            "build too slow: {v}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let fork = d.create(json!({ "template": "tpl-warm-tls" })).await;
    let e = d.exec(&fork, &["touch", "/tmp/go"]).await;
    assert_eq!(e.code, Some(0));
    let t0 = std::time::Instant::now();
    let warm = loop {
        let e = d.exec(&fork, &["cat", "/tmp/warm.out"]).await;
        if e.code == Some(0) {
            break e.out();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the warm process did not answer"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(warm, "200 hello GET /warm");
    let e = d
        .exec(&fork, &["curl", "-sS", &format!("{url}/system-bundle")])
        .await;
    assert_eq!(e.code, Some(0), "{}", String::from_utf8_lossy(&e.stderr));
    assert_eq!(e.out(), "hello GET /system-bundle");
    // A new process in the fork: `requests` trusts the system bundle (the
    // daemon sets REQUESTS_CA_BUNDLE for every exec under interception).
    let py = format!(
        "try:\n    import requests\nexcept ImportError:\n    from pip._vendor import requests\nprint(requests.get('{url}/exec-env').text)\n"
    );
    let e = d.exec(&fork, &["python3", "-c", &py]).await;
    assert_eq!(e.code, Some(0), "{}", String::from_utf8_lossy(&e.stderr));
    assert_eq!(e.out().trim(), "hello GET /exec-env");

    // Tenant `other` names no connector: its guest gets no leaf of ours,
    // only the proxy's refusal of the tunnel.
    let (other, _) = d.tenant_token("other", "admin").await;
    let v = other
        .expect(reqwest::Method::POST, "/v1/sandboxes", Some(json!({})), 201)
        .await
        .expect("create in tenant other");
    let sb2 = v["id"].as_str().expect("id").to_owned();
    let e = other
        .exec(
            &sb2,
            json!({ "cmd": ["sh", "-c", &format!(
                "printf '%s' '{ca_pem}' > /tmp/ica.pem; curl -sS --cacert /tmp/ica.pem {url}/accounts; echo \" rc=$?\""
            )] }),
        )
        .await
        .expect("exec in tenant other");
    let out = format!("{}{}", e.out(), String::from_utf8_lossy(&e.stderr));
    assert!(out.contains("403"), "{out}");
    assert!(!out.contains("hello"), "{out}");
    assert_eq!(good.seen().len(), 5, "{:?}", good.seen());

    secrets_are_injected_by_the_proxy_and_never_reach_the_guest(&d, &test_ca, &other, &sb, &sb2)
        .await;
    d.shutdown();
}

/// One request the echo upstream received.
#[derive(Debug, Clone)]
struct Echoed {
    method: String,
    path: String,
    host: String,
    headers: Vec<(String, String)>,
}

impl Echoed {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// State of the echo upstream and its OAuth2 token endpoint.
#[derive(Default)]
struct EchoState {
    seen: Vec<Echoed>,
    /// Access tokens issued, in order.
    issued: Vec<String>,
    /// Tokens the API side no longer accepts (answered 401).
    revoked: Vec<String>,
}

/// A TLS server for several names (certificates of `ca`): `POST /token`
/// is an OAuth2 token endpoint (refresh-token grant of client `cid` with
/// [`CLIENT_SECRET`] and [`REFRESH_TOKEN`], tokens valid 33 s); every other
/// request is answered with its credentials echoed back in a header and
/// the body (what a careless API does), or `401` for a revoked token.
struct EchoUpstream {
    port: u16,
    state: Arc<Mutex<EchoState>>,
}

const CLIENT_SECRET: &str = "cs-6b1f0c2a9e7d4433";
const REFRESH_TOKEN: &str = "rt-91ce55d04fa6b7e2";

impl EchoUpstream {
    fn start(ca: &Ca, hosts: &[&str]) -> EchoUpstream {
        let key = KeyPair::generate().expect("key");
        let cert = CertificateParams::new(hosts.iter().map(|h| h.to_string()).collect::<Vec<_>>())
            .expect("params")
            .signed_by(&key, &ca.cert, &ca.key)
            .expect("sign");
        let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .expect("cert");
        let cfg = Arc::new(cfg);
        let l = TcpListener::bind("127.0.0.1:0").expect("bind echo");
        let port = l.local_addr().expect("addr").port();
        let state = Arc::new(Mutex::new(EchoState::default()));
        let st = state.clone();
        std::thread::spawn(move || {
            for conn in l.incoming() {
                let Ok(conn) = conn else { continue };
                let (st, cfg) = (st.clone(), cfg.clone());
                std::thread::spawn(move || echo(conn, cfg, &st));
            }
        });
        EchoUpstream { port, state }
    }

    fn seen(&self) -> Vec<Echoed> {
        self.state.lock().expect("state").seen.clone()
    }

    fn issued(&self) -> Vec<String> {
        self.state.lock().expect("state").issued.clone()
    }

    fn revoke(&self, t: &str) {
        self.state.lock().expect("state").revoked.push(t.to_owned());
    }
}

fn echo(conn: TcpStream, cfg: Arc<rustls::ServerConfig>, st: &Mutex<EchoState>) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
    let Ok(tls) = rustls::ServerConnection::new(cfg) else {
        return;
    };
    let mut s = rustls::StreamOwned::new(tls, conn);
    let mut r = BufReader::new(&mut s);
    let mut line = String::new();
    if r.read_line(&mut line).is_err() {
        return;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or_default().to_owned();
    let path = parts.next().unwrap_or_default().to_owned();
    let mut headers = Vec::new();
    let mut len = 0usize;
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).is_err() || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            let (k, v) = (k.trim().to_owned(), v.trim().to_owned());
            if k.eq_ignore_ascii_case("content-length") {
                len = v.parse().unwrap_or(0);
            }
            headers.push((k, v));
        }
    }
    let mut body = vec![0u8; len];
    let _ = r.read_exact(&mut body);
    let host = r
        .get_ref()
        .conn
        .server_name()
        .unwrap_or_default()
        .to_owned();
    let e = Echoed {
        method,
        path,
        host,
        headers,
    };
    let (status, extra, answer) = {
        let mut g = st.lock().expect("state");
        g.seen.push(e.clone());
        if e.path == "/token" && e.method == "POST" {
            let form = String::from_utf8_lossy(&body).to_string();
            let ok = form.contains("grant_type=refresh_token")
                && form.contains(&format!("refresh_token={REFRESH_TOKEN}"))
                && form.contains("client_id=cid")
                && form.contains(&format!("client_secret={CLIENT_SECRET}"));
            if ok {
                let t = format!(
                    "at-{}-{}",
                    g.issued.len() + 1,
                    hex::encode(rand::random::<[u8; 8]>())
                );
                g.issued.push(t.clone());
                (
                    "200 OK",
                    String::new(),
                    json!({ "access_token": t, "token_type": "Bearer", "expires_in": 33 })
                        .to_string(),
                )
            } else {
                (
                    "400 Bad Request",
                    String::new(),
                    "{\"error\":\"invalid_grant\"}".into(),
                )
            }
        } else {
            let auth = e.header("authorization").unwrap_or("-").to_owned();
            let key = e.header("x-api-key").unwrap_or("-").to_owned();
            let revoked = g.revoked.iter().any(|t| auth == format!("Bearer {t}"));
            (
                if revoked {
                    "401 Unauthorized"
                } else {
                    "200 OK"
                },
                format!("X-Echo-Auth: {auth}\r\nX-Echo-Key: {key}\r\n"),
                format!("auth={auth} key={key} path={}", e.path),
            )
        }
    };
    let _ = write!(
        s,
        "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\n{extra}Content-Length: {}\r\nConnection: close\r\n\r\n{answer}",
        answer.len()
    );
    let _ = s.flush();
    s.conn.send_close_notify();
    let _ = s.flush();
}

/// Which of `needles` the file at `path` holds (GNU grep over NUL-separated
/// records: fast on a sparse disk image, and no needle holds a NUL).
fn file_holds(path: &std::path::Path, needles: &[String]) -> Vec<String> {
    assert!(path.exists(), "{} missing", path.display());
    let pat = tempfile::NamedTempFile::new().expect("pattern file");
    std::fs::write(pat.path(), needles.join("\n")).expect("patterns");
    let out = std::process::Command::new("grep")
        .args(["-a", "-z", "-o", "-F", "-f"])
        .arg(pat.path())
        .arg(path)
        .output()
        .expect("grep");
    assert!(
        out.status.code() == Some(0) || out.status.code() == Some(1),
        "grep {}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let mut found: Vec<String> = out
        .stdout
        .split(|&b| b == 0)
        .filter(|m| !m.is_empty())
        .map(|m| String::from_utf8_lossy(m).into_owned())
        .collect();
    found.sort();
    found.dedup();
    found
}

/// Secrets brokered by the egress proxy (`docs/secrets.md`), from the
/// guests of the test above: tenant `default` binds a bearer, a header, a
/// basic and a query secret and an OAuth2 grant to connectors of its
/// policy; the guest sends no credential and the upstream sees them; what
/// the upstream echoes back reaches the guest stripped; a refused write
/// gets nothing and never reaches the upstream; tenant `other`'s connector
/// of the same name and hosts gets nothing; OAuth2 tokens are refreshed
/// before expiry and after a 401; no secret byte is in either guest's RAM
/// file or disk image.
async fn secrets_are_injected_by_the_proxy_and_never_reach_the_guest(
    d: &Daemon,
    test_ca: &Ca,
    other: &strata_testkit::http::Api,
    sb: &str,
    sb2: &str,
) {
    let t0 = std::time::Instant::now();
    let echo = EchoUpstream::start(
        test_ca,
        &[
            "bearer.crm.test",
            "header.crm.test",
            "basic.crm.test",
            "query.crm.test",
            "oauth.crm.test",
            "login.crm.test",
        ],
    );
    let ep = echo.port;
    let conn = |name: &str, extra: &str| {
        format!(
            "[[connector]]\nname = \"{name}\"\nhosts = [\"{name}.crm.test\"]\nports = [{ep}]\ntls_ports = [{ep}]\n{extra}\n"
        )
    };
    let policy = format!(
        "default = \"allow\"\n\n{}{}{}{}{}",
        conn("bearer", "read_only = true"),
        conn("header", ""),
        conn("basic", ""),
        conn("query", "secrets = [\"crm-query\"]"),
        conn("oauth", ""),
    );
    let (s, body) = d
        .raw("PUT", "/v1/policy", policy.clone().into_bytes())
        .await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&body));
    let nonce = hex::encode(rand::random::<[u8; 6]>());
    let bearer = format!("bearer-{nonce}-AAAA");
    let header = format!("header-{nonce}-BBBB");
    let basic = format!("basic-{nonce}-CCCC");
    let query = format!("query-{nonce}-DDDD");
    for (name, connector, rule, value) in [
        ("crm-bearer", "bearer", json!({ "type": "bearer" }), &bearer),
        (
            "crm-header",
            "header",
            json!({ "type": "header", "name": "X-Api-Key", "template": "Key {value}" }),
            &header,
        ),
        (
            "crm-basic",
            "basic",
            json!({ "type": "basic", "user": "bot" }),
            &basic,
        ),
        (
            "crm-query",
            "query",
            json!({ "type": "query", "param": "api_key" }),
            &query,
        ),
    ] {
        let (s, v) = d
            .call(
                "POST",
                "/v1/secrets",
                Some(json!({ "name": name, "connector": connector, "rule": rule, "value": value })),
            )
            .await;
        assert_eq!(s, 201, "{v}");
        assert!(!v.to_string().contains(value.as_str()), "{v}");
    }
    let token_url = format!("https://login.crm.test:{ep}/token");
    let (s, v) = d
        .call(
            "POST",
            "/v1/secrets",
            Some(
                json!({ "name": "crm-oauth", "connector": "oauth", "kind": "oauth2", "oauth2": {
                "token_url": token_url, "client_id": "cid",
                "client_secret": CLIENT_SECRET, "refresh_token": REFRESH_TOKEN } }),
            ),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(
        echo.issued().len(),
        0,
        "nothing is fetched before a request"
    );

    // curl with no credential (a made-up one, a placeholder): the upstream
    // sees the real ones; the echo reaches the guest stripped.
    let script = format!(
        r#"C="curl -sS --cacert /tmp/ica.pem -D -"
$C -H 'Authorization: Bearer guest-made-up' https://bearer.crm.test:{ep}/a; echo
$C -H 'X-Api-Key: strata:secret/crm-header' https://header.crm.test:{ep}/b; echo
$C https://basic.crm.test:{ep}/c; echo
$C 'https://query.crm.test:{ep}/d?x=1&api_key=guest'; echo
curl -s -o /dev/null -w 'write=%{{http_code}}' --cacert /tmp/ica.pem -X POST -d x=1 https://bearer.crm.test:{ep}/w; echo
"#
    );
    let e = d.sh(sb, &script).await;
    let out = e.out();
    assert_eq!(
        e.code,
        Some(0),
        "{out}\n{}",
        String::from_utf8_lossy(&e.stderr)
    );
    for v in [&bearer, &header, &basic, &query] {
        assert!(!out.contains(v.as_str()), "{v} reached the guest:\n{out}");
    }
    assert!(out.contains("auth=Bearer [strata:redacted]"), "{out}");
    assert!(out.contains("key=Key [strata:redacted]"), "{out}");
    assert!(out.contains("write=403"), "{out}");
    let seen = echo.seen();
    let find = |host: &str, path: &str| {
        seen.iter()
            .find(|x| x.host == host && x.path.starts_with(path))
            .unwrap_or_else(|| panic!("no {host}{path}: {seen:?}"))
            .clone()
    };
    assert_eq!(
        find("bearer.crm.test", "/a").header("authorization"),
        Some(format!("Bearer {bearer}").as_str())
    );
    assert_eq!(
        find("header.crm.test", "/b").header("x-api-key"),
        Some(format!("Key {header}").as_str())
    );
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode(format!("bot:{basic}"));
    assert_eq!(
        find("basic.crm.test", "/c").header("authorization"),
        Some(format!("Basic {b64}").as_str())
    );
    assert_eq!(
        find("query.crm.test", "/d").path,
        format!("/d?x=1&api_key={query}")
    );
    // Injection only where the secret is bound: no other host got any.
    assert_eq!(find("basic.crm.test", "/c").header("x-api-key"), None);
    assert_eq!(find("query.crm.test", "/d").header("authorization"), None);
    assert!(
        !seen.iter().any(|x| x.path == "/w"),
        "a refused write reached the upstream: {seen:?}"
    );

    // Python requests, no credential at all.
    let py = format!(
        "try:\n    import requests\nexcept ImportError:\n    from pip._vendor import requests\nr = requests.get('https://header.crm.test:{ep}/py')\nprint(r.status_code, r.headers.get('x-echo-key'), r.text)\n"
    );
    let e = d
        .exec_body(
            sb,
            json!({ "cmd": ["python3", "-c", py], "env": { "REQUESTS_CA_BUNDLE": "/tmp/ica.pem" } }),
        )
        .await;
    assert_eq!(e.code, Some(0), "{}", String::from_utf8_lossy(&e.stderr));
    assert_eq!(
        e.out().trim(),
        format!("200 Key [strata:redacted] auth=- key=Key [strata:redacted] path=/py")
    );
    assert_eq!(
        find_last(&echo, "header.crm.test", "/py").header("x-api-key"),
        Some(format!("Key {header}").as_str())
    );

    // OAuth2: a token is fetched at first use and cached; one close to
    // expiry is refreshed before use; a 401 makes the next use refresh.
    let oauth = |path: &'static str| {
        let url = format!("https://oauth.crm.test:{ep}{path}");
        async move {
            d.exec(
                sb,
                &[
                    "curl",
                    "-sS",
                    "--cacert",
                    "/tmp/ica.pem",
                    "-w",
                    " %{http_code}",
                    &url,
                ],
            )
            .await
            .out()
        }
    };
    let o1 = oauth("/o1").await;
    let o2 = oauth("/o2").await;
    assert!(o1.ends_with(" 200") && o2.ends_with(" 200"), "{o1}\n{o2}");
    assert!(o1.contains("auth=Bearer [strata:redacted]"), "{o1}");
    let issued = echo.issued();
    assert_eq!(issued.len(), 1, "one token for two requests: {issued:?}");
    assert_eq!(
        find_last(&echo, "oauth.crm.test", "/o2").header("authorization"),
        Some(format!("Bearer {}", issued[0]).as_str())
    );
    // 33 s tokens, refreshed with less than 30 s left.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let o3 = oauth("/o3").await;
    assert!(o3.ends_with(" 200"), "{o3}");
    let issued = echo.issued();
    assert_eq!(issued.len(), 2, "refreshed before use: {issued:?}");
    assert_eq!(
        find_last(&echo, "oauth.crm.test", "/o3").header("authorization"),
        Some(format!("Bearer {}", issued[1]).as_str())
    );
    echo.revoke(&issued[1]);
    let o4 = oauth("/o4").await;
    assert!(o4.ends_with(" 401"), "{o4}");
    let o5 = oauth("/o5").await;
    assert!(o5.ends_with(" 200"), "{o5}");
    let issued = echo.issued();
    assert_eq!(issued.len(), 3, "one refresh after the 401: {issued:?}");
    assert_eq!(
        find_last(&echo, "oauth.crm.test", "/o5").header("authorization"),
        Some(format!("Bearer {}", issued[2]).as_str())
    );
    // The token endpoint was reached by the daemon, never by the guest.
    assert!(echo
        .seen()
        .iter()
        .filter(|x| x.path == "/token")
        .all(|x| x.header("authorization").is_none() && x.host == "login.crm.test"));

    // Tenant `other` declares a connector of the same name and hosts: its
    // guest's requests carry none of tenant `default`'s secrets.
    let (s, b) = other
        .raw(reqwest::Method::PUT, "/v1/policy", policy.into_bytes())
        .await
        .expect("policy of tenant other");
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    let e = other
        .exec(
            sb2,
            json!({ "cmd": ["curl", "-sS", "--cacert", "/tmp/ica.pem",
                format!("https://header.crm.test:{ep}/from-other")] }),
        )
        .await
        .expect("exec in tenant other");
    assert!(e.out().contains("key=-"), "{}", e.out());
    let x = find_last(&echo, "header.crm.test", "/from-other");
    assert_eq!(x.header("x-api-key"), None, "{x:?}");

    // The audit names the secret, never its value.
    let entries = audit(d, sb).await;
    let text = entries
        .iter()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join("\n");
    for v in [&bearer, &header, &basic, &query] {
        assert!(!text.contains(v.as_str()), "a value in the audit log");
    }
    let a = entries
        .iter()
        .find(|e| {
            e["call"]["kind"]["host"] == "bearer.crm.test" && e["call"]["kind"]["path"] == "/a"
        })
        .unwrap_or_else(|| panic!("no entry for /a:\n{text}"));
    assert_eq!(a["decision"]["secret"], "crm-bearer", "{a}");
    let w = entries
        .iter()
        .find(|e| e["call"]["kind"]["path"] == "/w")
        .unwrap_or_else(|| panic!("no entry for /w:\n{text}"));
    assert_eq!(w["decision"]["outcome"], "denied", "{w}");
    assert!(w["decision"].get("secret").is_none(), "{w}");

    // No byte of any secret in either guest's RAM file or disk image.
    let mut needles: Vec<String> = vec![
        bearer.clone(),
        header.clone(),
        basic.clone(),
        b64,
        query.clone(),
        CLIENT_SECRET.into(),
        REFRESH_TOKEN.into(),
    ];
    needles.extend(echo.issued());
    // Something the guest did hold is found (the scan works).
    let e = d
        .sh(sb, &format!("echo canary-{nonce} > /root/canary; sync"))
        .await;
    assert_eq!(e.code, Some(0));
    let pool = d.root.join("data/pool/sandboxes");
    for id in [sb, sb2] {
        for f in ["mem", "disk.img"] {
            let p = pool.join(id).join(f);
            let found = file_holds(&p, &needles);
            assert!(found.is_empty(), "{found:?} in {}", p.display());
        }
    }
    let canary = vec![format!("canary-{nonce}")];
    assert_eq!(
        file_holds(&pool.join(sb).join("mem"), &canary),
        canary,
        "the scan finds what the guest holds"
    );
    eprintln!("secrets scenario: {:.1} s", t0.elapsed().as_secs_f64());
}

fn find_last(echo: &EchoUpstream, host: &str, path: &str) -> Echoed {
    let seen = echo.seen();
    seen.iter()
        .rev()
        .find(|x| x.host == host && x.path.starts_with(path))
        .unwrap_or_else(|| panic!("no {host}{path}: {seen:?}"))
        .clone()
}
