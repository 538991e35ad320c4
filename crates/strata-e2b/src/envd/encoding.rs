//! `/files` content encodings as envd 0.6 does them: a gzip
//! `Content-Encoding` on uploads (decoded as the body streams, the decoded
//! bytes counted against the upload limit) and gzip for downloads whose
//! `Accept-Encoding` prefers it (RFC 7231 §5.3.4 quality values).

use std::io::Write as _;

use bytes::Bytes;
use flate2::write::{GzDecoder, GzEncoder};
use futures::{Stream, StreamExt};

/// The one content coding besides identity.
pub const GZIP: &str = "gzip";

/// A request's `Content-Encoding`: `Ok(false)` identity (absent too),
/// `Ok(true)` gzip, `Err` any other (envd: 400).
pub fn content_is_gzip(header: Option<&str>) -> Result<bool, String> {
    let Some(h) = header.map(str::trim).filter(|h| !h.is_empty()) else {
        return Ok(false);
    };
    let enc = h
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    match enc.as_str() {
        "identity" => Ok(false),
        GZIP => Ok(true),
        _ => Err(format!(
            "unsupported Content-Encoding: {h}, supported: [gzip]"
        )),
    }
}

/// What to answer an `Accept-Encoding` with: `Ok(true)` gzip, `Ok(false)`
/// identity, `Err` when identity is refused and gzip is not acceptable
/// (envd: 406).
pub fn accept_gzip(header: Option<&str>) -> Result<bool, String> {
    let Some(h) = header.map(str::trim).filter(|h| !h.is_empty()) else {
        return Ok(false);
    };
    let mut list: Vec<(String, f64)> = h
        .split(',')
        .map(|item| {
            let mut parts = item.split(';');
            let enc = parts.next().unwrap_or("").trim().to_ascii_lowercase();
            let q = parts
                .filter_map(|p| {
                    let p = p.trim();
                    let v = p.strip_prefix("q=").or_else(|| p.strip_prefix("Q="))?;
                    v.trim().parse::<f64>().ok()
                })
                .next_back()
                .unwrap_or(1.0);
            (enc, q)
        })
        .filter(|(e, _)| !e.is_empty())
        .collect();
    let identity_q = list.iter().find(|(e, _)| e == "identity").map(|x| x.1);
    let wildcard_q = list.iter().find(|(e, _)| e == "*").map(|x| x.1);
    let identity_refused =
        identity_q == Some(0.0) || (identity_q.is_none() && wildcard_q == Some(0.0));
    // Highest quality first; equal ones keep their order (stable sort).
    list.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap_or(std::cmp::Ordering::Equal));
    for (enc, q) in &list {
        if *q <= 0.0 {
            continue;
        }
        match enc.as_str() {
            "identity" => return Ok(false),
            "*" => return Ok(identity_refused),
            GZIP => return Ok(true),
            _ => {}
        }
    }
    if identity_refused {
        Err("no acceptable encoding found, supported: [gzip]".into())
    } else {
        Ok(false)
    }
}

/// Errors of a decoded stream: the source's, or the gzip data's.
#[derive(Debug)]
pub enum DecodeError<E> {
    /// The body could not be read.
    Source(E),
    /// The body is not valid gzip data.
    Gzip(std::io::Error),
}

impl<E: std::fmt::Display> std::fmt::Display for DecodeError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeError::Source(e) => e.fmt(f),
            DecodeError::Gzip(e) => write!(f, "error decompressing request body: {e}"),
        }
    }
}

/// Compressed bytes fed to the decoder per step: deflate expands at most
/// ~1032:1, so one step yields at most about 1 MiB.
const GUNZIP_STEP: usize = 1024;

/// `body` gunzipped as it streams: each step feeds [`GUNZIP_STEP`]
/// compressed bytes and yields what they decode to, so memory stays about
/// 1 MiB whatever the ratio (the caller meters the decoded bytes). A
/// truncated gzip stream is an error at its end.
pub fn gunzip<S, E>(body: S) -> impl Stream<Item = Result<Bytes, DecodeError<E>>> + Send
where
    S: Stream<Item = Result<Bytes, E>> + Send + Unpin + 'static,
    E: Send + 'static,
{
    let state = (body, Some(GzDecoder::new(Vec::new())), Bytes::new());
    futures::stream::unfold(state, |(mut body, mut dec, mut pending)| async move {
        let d = dec.as_mut()?;
        if pending.is_empty() {
            match body.next().await {
                Some(Ok(chunk)) => pending = chunk,
                Some(Err(e)) => return Some((Err(DecodeError::Source(e)), (body, None, pending))),
                None => {
                    let d = dec.take()?;
                    return match d.finish() {
                        Ok(rest) => Some((Ok(Bytes::from(rest)), (body, None, pending))),
                        Err(e) => Some((Err(DecodeError::Gzip(e)), (body, None, pending))),
                    };
                }
            }
        }
        let step = pending.split_to(pending.len().min(GUNZIP_STEP));
        let r = d.write_all(&step).and_then(|()| d.flush());
        let out = std::mem::take(d.get_mut());
        match r {
            Ok(()) => Some((Ok(Bytes::from(out)), (body, dec, pending))),
            Err(e) => Some((Err(DecodeError::Gzip(e)), (body, None, pending))),
        }
    })
    .filter(|r| futures::future::ready(!matches!(r, Ok(b) if b.is_empty())))
}

/// `body` gzipped chunk by chunk (each input chunk's compressed output as
/// it comes, the trailer at the end).
pub fn gzip<S, E>(body: S) -> impl Stream<Item = Result<Bytes, E>> + Send
where
    S: Stream<Item = Result<Bytes, E>> + Send + Unpin + 'static,
    E: Send + 'static + From<std::io::Error>,
{
    let enc = GzEncoder::new(Vec::new(), flate2::Compression::fast());
    futures::stream::unfold((body, Some(enc)), |(mut body, mut enc)| async move {
        let e = enc.as_mut()?;
        match body.next().await {
            Some(Ok(chunk)) => match e.write_all(&chunk) {
                Ok(()) => {
                    let out = std::mem::take(e.get_mut());
                    Some((Ok(Bytes::from(out)), (body, enc)))
                }
                Err(err) => Some((Err(E::from(err)), (body, None))),
            },
            Some(Err(err)) => Some((Err(err), (body, None))),
            None => {
                let e = enc.take()?;
                match e.finish() {
                    Ok(rest) => Some((Ok(Bytes::from(rest)), (body, None))),
                    Err(err) => Some((Err(E::from(err)), (body, None))),
                }
            }
        }
    })
    .filter(|r| futures::future::ready(!matches!(r, Ok(b) if b.is_empty())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read as _;

    fn chunks(data: &[u8], n: usize) -> Vec<Result<Bytes, std::io::Error>> {
        data.chunks(n)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect()
    }

    #[tokio::test]
    async fn gzip_round_trips_in_chunks() {
        let data: Vec<u8> = (0..300_000u32).flat_map(|i| i.to_le_bytes()).collect();
        let z = gzip(futures::stream::iter(chunks(&data, 7_001)));
        let zipped: Vec<u8> = z
            .map(|r| r.unwrap().to_vec())
            .collect::<Vec<_>>()
            .await
            .concat();
        // What flate2's reader (any gzip reader) makes of it.
        let mut plain = Vec::new();
        flate2::read::GzDecoder::new(&zipped[..])
            .read_to_end(&mut plain)
            .unwrap();
        assert_eq!(plain, data);
        // And our streaming decoder, fed in odd-sized chunks.
        let back: Vec<u8> = gunzip(futures::stream::iter(chunks(&zipped, 333)))
            .map(|r| r.unwrap().to_vec())
            .collect::<Vec<_>>()
            .await
            .concat();
        assert_eq!(back, data);
    }

    #[tokio::test]
    async fn bad_and_truncated_gzip_fail() {
        let bad = gunzip(futures::stream::iter(chunks(b"not gzip at all", 4)));
        let out: Vec<_> = bad.collect().await;
        assert!(out.iter().any(|r| matches!(r, Err(DecodeError::Gzip(_)))));
        let mut e = GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(&[7u8; 10_000]).unwrap();
        let z = e.finish().unwrap();
        let cut = gunzip(futures::stream::iter(chunks(&z[..z.len() - 6], 64)));
        let out: Vec<_> = cut.collect().await;
        assert!(matches!(out.last(), Some(Err(DecodeError::Gzip(_)))));
    }

    #[tokio::test]
    async fn a_gzip_bomb_comes_out_in_small_pieces() {
        // 64 MiB of zeros compress to ~64 KiB: no decoded piece is large.
        let mut e = GzEncoder::new(Vec::new(), flate2::Compression::best());
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..64 {
            e.write_all(&zeros).unwrap();
        }
        let z = e.finish().unwrap();
        let mut s = Box::pin(gunzip(futures::stream::iter(chunks(&z, 1 << 16))));
        let (mut total, mut largest) = (0usize, 0usize);
        while let Some(piece) = s.next().await {
            let n = piece.unwrap().len();
            total += n;
            largest = largest.max(n);
        }
        assert_eq!(total, 64 << 20);
        assert!(largest <= 1100 * GUNZIP_STEP, "{largest}");
    }

    #[test]
    fn encodings() {
        assert_eq!(content_is_gzip(None), Ok(false));
        assert_eq!(content_is_gzip(Some("identity")), Ok(false));
        assert_eq!(content_is_gzip(Some("GZIP")), Ok(true));
        assert!(content_is_gzip(Some("br")).is_err());
        assert_eq!(accept_gzip(None), Ok(false));
        assert_eq!(accept_gzip(Some("gzip")), Ok(true));
        assert_eq!(accept_gzip(Some("gzip, deflate")), Ok(true));
        assert_eq!(accept_gzip(Some("gzip;q=0.5, identity")), Ok(false));
        assert_eq!(accept_gzip(Some("gzip;q=0")), Ok(false));
        assert_eq!(accept_gzip(Some("br")), Ok(false));
        assert_eq!(accept_gzip(Some("*")), Ok(false));
        assert_eq!(accept_gzip(Some("identity;q=0, *")), Ok(true));
        assert!(accept_gzip(Some("identity;q=0, br")).is_err());
        assert!(accept_gzip(Some("*;q=0")).is_err());
    }
}
