//! Section `events`: how long a human waits to be told. One daemon
//! (stratad's `App`: its router, security layer, store, approval queue,
//! journal and webhook worker, served on loopback; no VMs: the held call is
//! a create, decided before any VM is involved) holds every create for
//! approval; a local receiver takes the webhook deliveries and one
//! `GET /v1/events` stream stays open. For each of `--events-n` requests:
//! the time from sending the call (answered `202` with its approval) to the
//! webhook delivery arriving at the receiver, and to the stream's
//! `approval` message arriving at the client; and, with the browser leg
//! ([`browser`], on when Chromium and node are found), to the web console's
//! approvals queue showing its card in headless Chromium. Each approval is
//! denied once measured, so the queue holds one at a time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use futures::StreamExt;
use serde_json::{json, Value};
use strata_testkit::Api;
use stratad::clock::SystemClock;
use stratad::engine::unavailable::UnavailableEngine;
use stratad::store::SqliteStore;
use stratad::App;

use crate::ctx::Ctx;
use crate::report::{Section, Table};
use crate::stats::{fmt_ms, Samples, Summary};

pub mod browser;

/// Whether the browser leg (the console in headless Chromium) runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BrowserLeg {
    /// When Chromium, node >= 20 and playwright-core are there (or npm can
    /// install playwright-core); otherwise the section says why it is not.
    Auto,
    /// Always: the section fails without them.
    On,
    /// Never.
    Off,
}

/// Flags of the `events` section.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "events-args")]
pub struct Args {
    /// Approval requests measured (at least 100 for a p99).
    #[arg(long = "events-n", default_value_t = 200)]
    pub requests: usize,
    /// The browser leg: request → the web console's approvals queue showing
    /// it, in headless Chromium (Debian's `chromium`, playwright-core as
    /// `scripts/run-console.sh` installs it). `auto` runs it when they are
    /// found and says why not otherwise.
    #[arg(long = "events-browser", value_enum, default_value = "auto")]
    pub browser: BrowserLeg,
}

impl Args {
    /// The CI smoke size (still 100: the p99 needs them).
    pub fn smoke(&mut self) {
        self.requests = self.requests.min(100);
    }
}

const POLICY: &str = r#"
default = "allow"

[[rule]]
id = "creates-need-a-human"
effect = "approve"
kind = "lifecycle"
reason = "bench: every create is held"
"#;

/// When each approval id was seen, by the receiver or the stream.
type Seen = Arc<Mutex<HashMap<String, Instant>>>;

async fn wait_seen(seen: &Seen, id: &str) -> Result<Instant> {
    let t0 = Instant::now();
    loop {
        if let Some(t) = seen.lock().unwrap_or_else(|p| p.into_inner()).get(id) {
            return Ok(*t);
        }
        if t0.elapsed() > Duration::from_secs(30) {
            return Err(anyhow!("approval {id} not seen within 30 s"));
        }
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
}

/// Measures and fills `sec`.
pub async fn run(_ctx: &Ctx, args: &Args, sec: &mut Section) -> Result<()> {
    // The browser leg's tools first: without them the leg is skipped
    // (`auto`, said in the report) or the section fails (`on`).
    let tools = match args.browser {
        BrowserLeg::Off => Err("off (--events-browser off)".to_owned()),
        _ => browser::tools().await,
    };
    let tools = match tools {
        Ok(t) => Some(t),
        Err(why) if args.browser == BrowserLeg::On => {
            return Err(anyhow!("--events-browser on: {why}"));
        }
        Err(why) => {
            eprintln!("events: the browser leg is skipped: {why}");
            sec.text(format!(
                "The browser leg (request → the console's approvals queue showing it) did not \
                 run: {why}."
            ));
            None
        }
    };

    let (_dir, mut cfg) = crate::ctx::control_plane_config("strata-bench-events-")?;
    cfg.security.max_pending_approvals_per_sandbox = args.requests.max(1) * 2;
    cfg.webhooks.allow_private = vec!["127.0.0.1".into()];
    let store = Arc::new(SqliteStore::open(&cfg.db_path(), cfg.db_readers)?);
    let app = Arc::new(App::new(
        cfg.clone(),
        store,
        Arc::new(UnavailableEngine),
        Arc::new(SystemClock),
    ));
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    app.service().spawn_webhook_worker(stop);
    let served = strata_testkit::serve(app.router()).await?;
    let http = Api::new(served.url.clone()).admin_token_of(&cfg.data_dir);
    let r = http
        .req(reqwest::Method::PUT, "/v1/policy")
        .body(POLICY)
        .send()
        .await?;
    if !r.status().is_success() {
        return Err(anyhow!("PUT /v1/policy: {}", r.status()));
    }

    // The receiver: when each approval's delivery arrived.
    let hooked: Seen = Arc::default();
    let h = hooked.clone();
    let receiver = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |body: bytes::Bytes| {
            let h = h.clone();
            async move {
                let at = Instant::now();
                if let Ok(v) = serde_json::from_slice::<Value>(&body) {
                    if let Some(id) = v["approval"]["id"].as_str() {
                        h.lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .entry(id.to_owned())
                            .or_insert(at);
                    }
                }
                "ok"
            }
        }),
    );
    let rx = strata_testkit::serve(receiver).await?;
    let (s, v) = http
        .json(
            reqwest::Method::POST,
            "/v1/webhooks",
            Some(json!({ "url": format!("{}/hook", rx.url) })),
        )
        .await?;
    if s != 201 {
        return Err(anyhow!("POST /v1/webhooks: {s} {v}"));
    }

    // The stream: when each approval's message arrived.
    let streamed: Seen = Arc::default();
    let resp = http
        .req(reqwest::Method::GET, "/v1/events")
        .header("accept", "text/event-stream")
        .send()
        .await?;
    if !resp.status().is_success() {
        return Err(anyhow!("GET /v1/events: {}", resp.status()));
    }
    let st = streamed.clone();
    let reader = tokio::spawn(async move {
        let mut body = resp.bytes_stream();
        let mut buf = String::new();
        while let Some(Ok(chunk)) = body.next().await {
            let at = Instant::now();
            buf.push_str(&String::from_utf8_lossy(&chunk));
            while let Some(i) = buf.find("\n\n") {
                let block: String = buf.drain(..i + 2).collect();
                let Some(data) = block.lines().find_map(|l| l.strip_prefix("data:")) else {
                    continue;
                };
                let Ok(v) = serde_json::from_str::<Value>(data.trim()) else {
                    continue;
                };
                if v["kind"] == "approval" && v["action"] == "requested" {
                    if let Some(id) = v["approval_id"].as_str() {
                        st.lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .insert(id.to_owned(), at);
                    }
                }
            }
        }
    });

    // The human: an approver, who answers each request (a requester cannot
    // answer their own) and, with the browser leg, watches the console's
    // approvals queue.
    let (s, v) = http
        .json(
            reqwest::Method::POST,
            "/v1/tokens",
            Some(json!({ "role": "approver", "name": "bench-approver" })),
        )
        .await?;
    let approver_token = v["token"]
        .as_str()
        .filter(|_| s == 201)
        .ok_or_else(|| anyhow!("POST /v1/tokens: {s} {v}"))?
        .to_owned();
    let approver = Api::new(served.url.clone()).bearer(approver_token.clone());
    let console = match &tools {
        Some(t) => {
            // Time enough for every request at 30 s each, capped at an hour.
            let max = Duration::from_secs((60 + 30 * args.requests as u64).min(3600));
            let (c, mode) = browser::Console::start(t, &served.url, &approver_token, max).await?;
            if mode != "live" {
                eprintln!("events: the console is {mode}, not live (the stream did not open)");
            }
            Some((c, mode))
        }
        None => None,
    };

    let mut to_hook = Samples::new();
    let mut to_sse = Samples::new();
    let mut to_dom = Samples::new();
    let mut to_frame = Samples::new();
    let measured: Result<()> = async {
        for i in 0..args.requests.max(1) {
            let w0 = browser::wall_ms();
            let t0 = Instant::now();
            let (s, v) = http
                .json(
                    reqwest::Method::POST,
                    "/v1/sandboxes?wait=false",
                    Some(json!({ "labels": { "n": i.to_string() } })),
                )
                .await?;
            if s != 202 {
                return Err(anyhow!("held create: {s} {v}"));
            }
            let id = v["approval"]["id"]
                .as_str()
                .ok_or_else(|| anyhow!("no approval id in {v}"))?
                .to_owned();
            let hook = wait_seen(&hooked, &id).await?;
            let sse = wait_seen(&streamed, &id).await?;
            to_hook.push_dur(hook.duration_since(t0));
            to_sse.push_dur(sse.duration_since(t0));
            if let Some((c, _)) = &console {
                let (dom, frame) = c.seen(&id).await?;
                to_dom.push(dom - w0);
                to_frame.push(frame - w0);
            }
            // Answered, so the queue holds one request at a time (as a
            // human working through it would keep it).
            let (s, v) = approver
                .json(
                    reqwest::Method::POST,
                    &format!("/v1/approvals/{id}/deny"),
                    Some(json!({ "reason": "bench" })),
                )
                .await?;
            if s != 200 {
                return Err(anyhow!("deny {id}: {s} {v}"));
            }
            if let Some((c, _)) = &console {
                c.gone(&id).await?;
            }
        }
        Ok(())
    }
    .await;
    let mode = match console {
        Some((c, mode)) => {
            c.stop().await;
            Some(mode)
        }
        None => None,
    };
    reader.abort();
    let _ = stop_tx.send(true);
    drop(served);
    drop(rx);
    measured?;

    sec.text(format!(
        "One daemon (stratad's router, security layer, SQLite store, approval queue, journal \
         and webhook worker, served on loopback; no VMs) with a policy that holds every create \
         for approval, one open `GET /v1/events` stream and one webhook to a local receiver{}. \
         Each of {} creates is sent with `?wait=false` and answered `202` with its approval; \
         the clock starts when the create is sent and stops when the webhook's POST reaches \
         the receiver, and when the stream's `approval` message reaches the client{}. \
         Requests are sequential; each approval is denied over the API by an approver once measured{}.",
        if tools.is_some() {
            ", and the web console signed in as an approver on its approvals queue in headless \
             Chromium"
        } else {
            ""
        },
        args.requests,
        match &tools {
            Some(_) => ", and when its card is put into the console page's DOM (a \
                 MutationObserver in the page; the console refreshes the queue on the \
                 stream's event: it reads `GET /v1/approvals` and redraws) and at the start of \
                 the next animation frame (the one that paints it). The console's times are \
                 the page's `Date.now()` minus the host's wall clock when the create was sent \
                 (the same clock on the same host, ms resolution); the other two are \
                 monotonic",
            None => "",
        },
        if tools.is_some() {
            ", and the next request waits until its card has left the queue"
        } else {
            ""
        },
    ));
    if let Some(t) = &tools {
        sec.text(format!(
            "Browser: {} (headless, --no-sandbox --disable-gpu), node {}, playwright-core {}; \
             the console was {} (`live`: reading the event stream; `polling`: every 2 s).",
            t.chromium.display(),
            t.node.display(),
            t.playwright,
            mode.as_deref().unwrap_or("?"),
        ));
    }
    let mut t = Table::latency("Approval request → notification (loopback)", &[]);
    let (hs, ss) = (to_hook.summary(), to_sse.summary());
    t.latency_row("→ webhook delivered (signed POST received)", &hs, vec![]);
    t.latency_row("→ event stream message received", &ss, vec![]);
    let (ds, fs): (Option<Summary>, Option<Summary>) = match tools {
        Some(_) => (Some(to_dom.summary()), Some(to_frame.summary())),
        None => (None, None),
    };
    if let (Some(d), Some(f)) = (&ds, &fs) {
        t.latency_row("→ console: card in the page's DOM", d, vec![]);
        t.latency_row("→ console: next animation frame (painted)", f, vec![]);
    }
    sec.table(t);
    let console_part = match &ds {
        Some(d) => format!(
            "; → console (card in the DOM) p50 {} / p99 {}",
            fmt_ms(d.p50),
            fmt_ms(d.p99)
        ),
        None => "; console not measured (no browser)".to_owned(),
    };
    sec.headline(format!(
        "approval request → webhook p50 {} / p99 {}; → event stream p50 {} / p99 {}{} (n = {})",
        fmt_ms(hs.p50),
        fmt_ms(hs.p99),
        fmt_ms(ss.p50),
        fmt_ms(ss.p99),
        console_part,
        args.requests
    ));
    eprintln!(
        "events: n={} request → webhook p50 {} p95 {} p99 {}; → stream p50 {} p95 {} p99 {}",
        args.requests,
        fmt_ms(hs.p50),
        fmt_ms(hs.p95),
        fmt_ms(hs.p99),
        fmt_ms(ss.p50),
        fmt_ms(ss.p95),
        fmt_ms(ss.p99),
    );
    match (&ds, &fs) {
        (Some(d), Some(f)) => eprintln!(
            "events: → console DOM p50 {} p95 {} p99 {}; → console frame p50 {} p95 {} p99 {} ({})",
            fmt_ms(d.p50),
            fmt_ms(d.p95),
            fmt_ms(d.p99),
            fmt_ms(f.p50),
            fmt_ms(f.p95),
            fmt_ms(f.p99),
            mode.as_deref().unwrap_or("?"),
        ),
        _ => eprintln!("events: → console: not measured (the browser leg did not run)"),
    }
    sec.data = json!({
        "webhook": hs,
        "stream": ss,
        "console_dom": ds,
        "console_frame": fs,
        "console_mode": mode,
        "n": args.requests,
    });
    Ok(())
}
