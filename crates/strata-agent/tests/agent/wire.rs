//! The wire, spoken raw: malformed, truncated and garbage frames, a version
//! mismatch either way, and resynchronising on a re-sent Hello.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream as StdUnixStream;
use std::time::{Duration, Instant};

use strata_proto::frame::{decode_frame, Decoded, Frame, SYNC_MAGIC};
use strata_proto::{AgentClient, AgentError, RemoteErrorKind, Request, Response};

use crate::support::{raw_hello, raw_read_response, sh, Agent};

#[tokio::test]
async fn malformed_and_truncated_frames() {
    let mut agent = Agent::start();
    // Wait until the agent listens.
    let _ = agent.client().await;

    // 1. Malformed: a valid session, then a frame with an unknown kind.
    let mut s = StdUnixStream::connect(&agent.sock).unwrap();
    s.write_all(&raw_hello(strata_proto::PROTOCOL_VERSION))
        .unwrap();
    let (_, r) = raw_read_response(&mut s).unwrap();
    assert!(matches!(r, Response::HelloOk { nonce: 77, .. }), "{r:?}");
    s.write_all(&[0, 0, 0, 3, 200, 0, 0, 0, 9, 1, 2, 3])
        .unwrap();
    let (id, r) = raw_read_response(&mut s).unwrap();
    assert_eq!(id, 0);
    assert!(
        matches!(
            r,
            Response::Error {
                kind: RemoteErrorKind::Protocol,
                ..
            }
        ),
        "{r:?}"
    );
    // Invalid JSON in a control frame for a request id: that request fails, the session lives.
    s.write_all(&raw_hello(strata_proto::PROTOCOL_VERSION))
        .unwrap();
    let (_, r) = raw_read_response(&mut s).unwrap();
    assert!(matches!(r, Response::HelloOk { .. }), "{r:?}");
    let bad = Frame {
        kind: strata_proto::FrameKind::Control,
        id: 5,
        payload: bytes::Bytes::from_static(b"{not json"),
    };
    s.write_all(&bad.encode().unwrap()).unwrap();
    let (id, r) = raw_read_response(&mut s).unwrap();
    assert_eq!(id, 5);
    assert!(
        matches!(
            r,
            Response::Error {
                kind: RemoteErrorKind::InvalidArgument,
                ..
            }
        ),
        "{r:?}"
    );
    // An oversized length.
    s.write_all(&[0x7f, 0xff, 0xff, 0xff, 1, 0, 0, 0, 1])
        .unwrap();
    let (_, r) = raw_read_response(&mut s).unwrap();
    assert!(
        matches!(
            r,
            Response::Error {
                kind: RemoteErrorKind::Protocol,
                ..
            }
        ),
        "{r:?}"
    );
    drop(s);

    // 2. Truncated: hello, then half a frame, then hang up.
    let mut s = StdUnixStream::connect(&agent.sock).unwrap();
    s.write_all(&raw_hello(strata_proto::PROTOCOL_VERSION))
        .unwrap();
    let _ = raw_read_response(&mut s).unwrap();
    let ping = Frame::control(1, &Request::Ping {})
        .unwrap()
        .encode()
        .unwrap();
    s.write_all(&ping[..ping.len() - 3]).unwrap();
    drop(s);
    // Let the agent see this hang-up before the next connection replaces it.
    tokio::time::sleep(Duration::from_millis(300)).await;

    // 3. Garbage without any sync marker, then hang up.
    let mut s = StdUnixStream::connect(&agent.sock).unwrap();
    s.write_all(&[0xAB; 10_000]).unwrap();
    drop(s);

    // The agent survived and serves a new connection.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(agent.alive());
    let c = agent.client().await;
    assert!(c.exec_collect(sh("echo ok")).await.unwrap().stdout == b"ok\n");
    let log = agent.log();
    assert!(log.contains("protocol error"), "{log}");
    assert!(log.contains("ended inside a frame"), "{log}");
}

#[tokio::test]
async fn version_mismatch() {
    // Raw: an old/new host talking to this agent.
    let mut agent = Agent::start();
    let _ = agent.client().await;
    let mut s = StdUnixStream::connect(&agent.sock).unwrap();
    s.write_all(&raw_hello(99)).unwrap();
    let (_, r) = raw_read_response(&mut s).unwrap();
    assert_eq!(
        r,
        Response::VersionMismatch {
            nonce: 77,
            host_version: 99,
            agent_version: strata_proto::PROTOCOL_VERSION
        }
    );
    drop(s);
    assert!(agent.alive());

    // Client: this host talking to an agent that speaks another version.
    let mut other = Agent::start_with(&["--pretend-protocol-version", "2"]);
    let t = Instant::now();
    let e = AgentClient::connect_unix(&other.sock, Duration::from_secs(10))
        .await
        .unwrap_err();
    assert!(
        matches!(e, AgentError::VersionMismatch { host: 1, agent: 2 }),
        "{e}"
    );
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(other.alive());
}

#[tokio::test]
async fn stale_partial_frame_is_skipped_on_rehello() {
    // The agent missed a disconnect (virtio-serial reconnect between polls):
    // a fragment of the old host's frame sits in its buffer, and the new
    // host's Hello bytes land inside it. Re-sent Hellos must still get through.
    let agent = Agent::start();
    let _ = agent.client().await;
    let mut s = StdUnixStream::connect(&agent.sock).unwrap();
    s.write_all(&raw_hello(strata_proto::PROTOCOL_VERSION))
        .unwrap();
    let (_, r) = raw_read_response(&mut s).unwrap();
    assert!(matches!(r, Response::HelloOk { nonce: 77, .. }));
    s.write_all(&[0, 0, 0x10, 0, 1, 0, 0, 0, 3]).unwrap(); // header of a 4 KiB frame, no body
    let mut hello = SYNC_MAGIC.to_vec();
    hello.extend_from_slice(
        &Frame::control(
            0,
            &Request::Hello {
                version: strata_proto::PROTOCOL_VERSION,
                nonce: 78,
            },
        )
        .unwrap()
        .encode()
        .unwrap(),
    );
    let t = Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    let got = 'outer: loop {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "no reply to the re-sent hello"
        );
        s.write_all(&hello).unwrap();
        if let Ok(n) = s.read(&mut tmp) {
            buf.extend_from_slice(&tmp[..n]);
        }
        let mut off = 0;
        while let Ok(Some((item, used))) = decode_frame(&buf[off..]) {
            off += used;
            if let Decoded::Frame(f) = item {
                if let Ok(Response::HelloOk { nonce: 78, .. }) = f.parse::<Response>() {
                    break 'outer t.elapsed();
                }
            }
        }
        buf.drain(..off);
    };
    println!("resynchronised after {got:?}");
}
