//! Minimal TLS ClientHello reader: extracts the server_name (SNI).

/// If `buf` starts with a TLS handshake record holding a ClientHello, return
/// `Some(sni)` (`Some(None)` when it carries no server_name). `None` when the
/// bytes are not a ClientHello or are cut short.
pub fn client_hello_sni(buf: &[u8]) -> Option<Option<String>> {
    let mut r = Reader(buf);
    if r.u8()? != 0x16 {
        return None; // not a handshake record
    }
    r.take(2)?; // record version
    let len = r.u16()? as usize;
    let mut rec = Reader(r.take(len)?);
    if rec.u8()? != 0x01 {
        return None; // not ClientHello
    }
    let hlen = rec.u24()? as usize;
    let mut h = Reader(rec.take(hlen)?);
    h.take(2 + 32)?; // version, random
    let sid = h.u8()? as usize;
    h.take(sid)?;
    let cs = h.u16()? as usize;
    h.take(cs)?;
    let comp = h.u8()? as usize;
    h.take(comp)?;
    if h.0.is_empty() {
        return Some(None);
    }
    let elen = h.u16()? as usize;
    let mut ext = Reader(h.take(elen)?);
    while !ext.0.is_empty() {
        let ty = ext.u16()?;
        let l = ext.u16()? as usize;
        let mut body = Reader(ext.take(l)?);
        if ty == 0 {
            let list = body.u16()? as usize;
            let mut names = Reader(body.take(list)?);
            while !names.0.is_empty() {
                let kind = names.u8()?;
                let nl = names.u16()? as usize;
                let name = names.take(nl)?;
                if kind == 0 {
                    return Some(Some(String::from_utf8_lossy(name).into_owned()));
                }
            }
        }
    }
    Some(None)
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }
    fn u24(&mut self) -> Option<u32> {
        self.take(3)
            .map(|b| u32::from_be_bytes([0, b[0], b[1], b[2]]))
    }
}

/// Build a minimal ClientHello carrying `sni` (for tests and benches).
pub fn fake_client_hello(sni: Option<&str>) -> Vec<u8> {
    let mut ext = Vec::new();
    if let Some(name) = sni {
        let n = name.as_bytes();
        let mut list = vec![0u8];
        list.extend_from_slice(&(n.len() as u16).to_be_bytes());
        list.extend_from_slice(n);
        ext.extend_from_slice(&0u16.to_be_bytes());
        ext.extend_from_slice(&((list.len() + 2) as u16).to_be_bytes());
        ext.extend_from_slice(&(list.len() as u16).to_be_bytes());
        ext.extend_from_slice(&list);
    }
    let mut hello = vec![0x03, 0x03];
    hello.extend_from_slice(&[7u8; 32]);
    hello.push(0); // session id
    hello.extend_from_slice(&2u16.to_be_bytes());
    hello.extend_from_slice(&[0x13, 0x01]);
    hello.extend_from_slice(&[1, 0]); // compression
    hello.extend_from_slice(&(ext.len() as u16).to_be_bytes());
    hello.extend_from_slice(&ext);
    let mut hs = vec![0x01];
    hs.extend_from_slice(&(hello.len() as u32).to_be_bytes()[1..]);
    hs.extend_from_slice(&hello);
    let mut rec = vec![0x16, 0x03, 0x01];
    rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
    rec.extend_from_slice(&hs);
    rec
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_sni_and_survives_garbage() {
        assert_eq!(
            client_hello_sni(&fake_client_hello(Some("api.x.com"))),
            Some(Some("api.x.com".into()))
        );
        assert_eq!(client_hello_sni(&fake_client_hello(None)), Some(None));
        assert_eq!(client_hello_sni(b"GET / HTTP/1.1\r\n"), None);
        let h = fake_client_hello(Some("api.x.com"));
        for cut in 0..h.len() {
            assert_eq!(client_hello_sni(&h[..cut]), None, "cut {cut}");
        }
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for _ in 0..20_000 {
            let mut b = h.clone();
            let i = rng.gen_range(0..b.len());
            b[i] = rng.gen();
            let _ = client_hello_sni(&b);
        }
    }
}
