//! TLS interception of connector hosts from inside a real guest
//! (`docs/tls-interception.md`).
//!
//! A real `stratad` with `[security] egress_tls_intercept = true` and this
//! test's CA as `egress_upstream_ca_bundle`. Two small TLS servers on
//! 127.0.0.1 stand in for `api.salesforce.test` (a certificate of the test
//! CA) and `bad.salesforce.test` (a certificate of a CA nobody trusts);
//! both names are pinned to 127.0.0.1 (`egress_static_hosts`). Tenant
//! `default` declares the read-only connector `salesforce` in its own
//! policy; tenant `other` declares nothing. The default template's guest
//! is given the deployment's interception CA as a file (`/tmp/ica.pem`,
//! from `<key_dir>/intercept-ca.pem`) and told to trust it per command; a
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
[security.egress_static_hosts]
"api.salesforce.test" = "127.0.0.1"
"bad.salesforce.test" = "127.0.0.1"
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

    // Python requests (or pip's vendored copy), trusting the CA by
    // REQUESTS_CA_BUNDLE as the template bakes it.
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
        .exec_body(
            &sb,
            json!({ "cmd": ["python3", "-c", py], "env": { "REQUESTS_CA_BUNDLE": "/tmp/ica.pem" } }),
        )
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

    d.shutdown();
}
