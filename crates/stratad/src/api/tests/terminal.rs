//! The console's terminal (`api::terminal`) over a real socket: who gets a
//! ticket, what a ticket opens (once, its own sandbox, from the daemon's own
//! origin only), the policy gate on the exec it runs, and the messages.
//! Real router, service, store, policy engine and audit log; the engine is
//! the test double (an echo).

use base64::Engine as _;
use futures::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::{self, client::IntoClientRequest, Message};

use super::security::{create_sb, req, sec_harness, token};
use super::*;

/// Serves the daemon's router on a local port.
async fn serve(h: &super::security::Sec) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let router = h.app.router();
    tokio::spawn(async move { axum::serve(l, router).await });
    addr.to_string()
}

async fn ticket(h: &super::security::Sec, tok: &str, sb: &str) -> (StatusCode, Value) {
    let (s, v, _) = req(
        h,
        "POST",
        &format!("/v1/sandboxes/{sb}/terminal"),
        Some(tok),
        r#"{"tty":{"cols":100,"rows":30}}"#,
    )
    .await;
    (s, v)
}

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// Opens the socket (`Err(status)`: refused before the upgrade).
async fn open(addr: &str, sb: &str, ticket: &str, origin: Option<&str>) -> Result<Ws, u16> {
    let mut r = format!("ws://{addr}/v1/sandboxes/{sb}/terminal?ticket={ticket}")
        .into_client_request()
        .unwrap();
    if let Some(o) = origin {
        r.headers_mut().insert("origin", o.parse().unwrap());
    }
    match tokio_tungstenite::connect_async(r).await {
        Ok((ws, _)) => Ok(ws),
        Err(tungstenite::Error::Http(resp)) => Err(resp.status().as_u16()),
        Err(e) => panic!("{e}"),
    }
}

#[tokio::test]
async fn a_ticket_opens_one_terminal_on_its_own_sandbox_from_the_daemons_origin() {
    let h = sec_harness(|_| {});
    let dev = token(&h, "acme", "developer").await;
    let viewer = token(&h, "acme", "viewer").await;
    let approver = token(&h, "acme", "approver").await;
    let other = token(&h, "beta", "developer").await;
    let a = create_sb(&h, &dev).await;
    let b = create_sb(&h, &dev).await;
    let addr = serve(&h).await;
    let origin = format!("http://{addr}");

    // Roles and tenancy decide who gets a ticket.
    for t in [&viewer, &approver] {
        let (s, v) = ticket(&h, t, &a).await;
        assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
        assert_eq!(code(&v), "forbidden");
    }
    let (s, v) = ticket(&h, &other, &a).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "another tenant's sandbox: {v}");
    let (s, v, _) = req(&h, "POST", &format!("/v1/sandboxes/{a}/terminal"), None, "").await;
    assert_eq!(s, StatusCode::UNAUTHORIZED, "{v}");
    let (s, v) = ticket(&h, &dev, &a).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let t = v["ticket"].as_str().unwrap().to_owned();

    // No or a foreign Origin: refused before the ticket is looked at.
    for o in [None, Some("http://evil.example"), Some("null")] {
        assert_eq!(open(&addr, &a, &t, o).await.err(), Some(403), "{o:?}");
    }
    // A ticket for A does not open B, and is spent by trying.
    assert_eq!(open(&addr, &b, &t, Some(&origin)).await.err(), Some(401));
    assert_eq!(open(&addr, &a, &t, Some(&origin)).await.err(), Some(401));
    // No ticket, a made-up one.
    assert_eq!(open(&addr, &a, "", Some(&origin)).await.err(), Some(401));
    assert_eq!(
        open(&addr, &a, &"0".repeat(64), Some(&origin)).await.err(),
        Some(401)
    );

    // A good ticket: the command's input and output, then its end.
    let (_, v) = ticket(&h, &dev, &a).await;
    let t = v["ticket"].as_str().unwrap().to_owned();
    let mut ws = open(&addr, &a, &t, Some(&origin)).await.unwrap();
    let b64 = base64::engine::general_purpose::STANDARD;
    let stdin = json!({ "stdin": b64.encode("echo hi\n") }).to_string();
    ws.send(Message::Text(stdin)).await.unwrap();
    let m = ws.next().await.unwrap().unwrap();
    assert_eq!(m, Message::Binary(b"echo hi\n".to_vec()));
    ws.send(Message::Binary(b"\x03".to_vec())).await.unwrap();
    assert_eq!(
        ws.next().await.unwrap().unwrap(),
        Message::Binary(b"\x03".to_vec())
    );
    let resize = json!({ "resize": { "cols": 120, "rows": 40 } }).to_string();
    ws.send(Message::Text(resize)).await.unwrap();
    ws.send(Message::Text(r#"{"signal":2}"#.into()))
        .await
        .unwrap();
    let m = ws.next().await.unwrap().unwrap();
    assert_eq!(m, Message::Text(r#"{"exit":130}"#.into()));
    // Used: it does not open a second terminal.
    assert_eq!(open(&addr, &a, &t, Some(&origin)).await.err(), Some(401));
}

#[tokio::test]
async fn the_exec_a_ticket_runs_is_gated_and_oversized_messages_end_the_socket() {
    let h = sec_harness(|_| {});
    let dev = token(&h, "acme", "developer").await;
    let admin = token(&h, "acme", "admin").await;
    let sb = create_sb(&h, &dev).await;
    let addr = serve(&h).await;
    let origin = format!("http://{addr}");
    let policy = r#"default = "allow"
[[rule]]
id = "no-shells"
effect = "deny"
program = "/bin/sh"
reason = "no shells here"
"#;
    let (s, v, _) = req(&h, "PUT", "/v1/policy", Some(&admin), policy).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    // The ticket is issued (it runs nothing); the exec is refused by the gate.
    let (s, v) = ticket(&h, &dev, &sb).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let t = v["ticket"].as_str().unwrap();
    assert_eq!(open(&addr, &sb, t, Some(&origin)).await.err(), Some(403));
    let audit = std::fs::read_to_string(h.dir.path().join("audit.jsonl")).unwrap();
    let last: Value = serde_json::from_str(audit.lines().last().unwrap()).unwrap();
    assert_eq!(last["decision"]["outcome"], "denied", "{last}");
    assert_eq!(last["tenant"], "acme");
    assert!(
        last["actor"].as_str().unwrap().starts_with("token:"),
        "{last}"
    );

    let (s, v, _) = req(
        &h,
        "PUT",
        "/v1/policy",
        Some(&admin),
        "default = \"allow\"\n",
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (_, v) = ticket(&h, &dev, &sb).await;
    let t = v["ticket"].as_str().unwrap();
    let mut ws = open(&addr, &sb, t, Some(&origin)).await.unwrap();
    ws.send(Message::Binary(vec![
        b'x';
        crate::api::terminal::MAX_MESSAGE + 1
    ]))
    .await
    .unwrap();
    // The daemon refuses the message: the socket ends (a hangup for the command).
    let mut ended = false;
    for _ in 0..4 {
        match ws.next().await {
            None | Some(Err(_)) | Some(Ok(Message::Close(_))) => {
                ended = true;
                break;
            }
            Some(Ok(m)) => assert!(!matches!(m, Message::Binary(ref b) if b.len() > 1000)),
        }
    }
    assert!(ended);
}
