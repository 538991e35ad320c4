"""envd 0.6 file semantics through the unmodified e2b SDK: entry info (owner,
group, mode, symlink target, metadata), depth-first listings, removing a
missing path, gzip content encoding both ways, upload metadata stored as
`user.e2b.*` extended attributes, watch events with entries and recursion.
Real guest (the shared `sbx` fixture), real HTTP."""

import gzip
import os
import uuid

import httpx
import pytest
from e2b import FileType, FilesystemEventType
from e2b.exceptions import InvalidArgumentException


def _envd(sbx, method, path="/files", **kw):
    """A raw call to the sandbox's envd, as the SDK addresses it."""
    headers = {
        "E2b-Sandbox-Id": sbx.sandbox_id,
        "X-Access-Token": getattr(sbx, "_envd_access_token", None) or "",
    }
    headers.update(kw.pop("headers", {}))
    return httpx.request(method, os.environ["E2B_SANDBOX_URL"] + path, headers=headers,
                         timeout=120, **kw)


def _dir():
    return f"/home/user/envd-{uuid.uuid4().hex[:8]}"


def test_entry_info_has_owner_group_mode_and_names_ids_without_names(sbx):
    d = _dir()
    sbx.files.write(f"{d}/a.txt", "four")
    info = sbx.files.get_info(f"{d}/a.txt")
    assert (info.owner, info.group) == ("user", "user")
    assert info.mode == 0o644 and info.permissions == "-rw-r--r--"
    assert info.size == 4 and info.type == FileType.FILE
    assert info.symlink_target is None and info.metadata is None
    assert info.modified_time.tzinfo is not None
    dinfo = sbx.files.get_info(d)
    assert (dinfo.owner, dinfo.group, dinfo.mode) == ("user", "user", 0o755)
    assert dinfo.permissions == "drwxr-xr-x"
    # Root's files are root's; an id the guest has no name for shows as the id.
    assert (sbx.files.get_info("/etc/hostname").owner, sbx.files.get_info("/etc").group) == ("root", "root")
    sbx.commands.run(f"chown 4242:4343 {d}/a.txt", user="root")
    listed = {e.name: e for e in sbx.files.list(d)}
    assert (listed["a.txt"].owner, listed["a.txt"].group) == ("4242", "4343")


def test_symlink_entry_has_its_targets_type_and_path(sbx):
    d = _dir()
    sbx.files.write(f"{d}/t.txt", "Hello")
    sbx.files.make_dir(f"{d}/sub")
    sbx.commands.run("ln -s t.txt link && ln -s sub dlink", cwd=d)
    info = sbx.files.get_info(f"{d}/link")
    assert info.type == FileType.FILE
    assert info.symlink_target == f"{d}/t.txt"
    assert info.mode == 0o644
    listed = {e.name: e for e in sbx.files.list(d)}
    assert listed["dlink"].type == FileType.DIR
    assert listed["dlink"].symlink_target == f"{d}/sub"
    assert listed["t.txt"].symlink_target is None


def test_deep_listing_is_depth_first_in_name_order(sbx):
    d = _dir()
    for sub in ("b/b1", "b/b2", "a/a1"):
        sbx.files.make_dir(f"{d}/{sub}")
    sbx.files.write(f"{d}/c.txt", "x")
    names = [e.path[len(d) + 1:] for e in sbx.files.list(d, depth=2)]
    assert names == ["a", "a/a1", "b", "b/b1", "b/b2", "c.txt"]
    assert [e.name for e in sbx.files.list(d)] == ["a", "b", "c.txt"]


def test_removing_a_missing_path_is_not_an_error(sbx):
    d = _dir()
    sbx.files.remove(f"{d}/never-was.txt")
    sbx.files.write(f"{d}/x.txt", "x")
    sbx.files.remove(f"{d}/x.txt")
    sbx.files.remove(f"{d}/x.txt")
    assert not sbx.files.exists(f"{d}/x.txt")


def test_gzip_upload_and_download(sbx):
    d = _dir()
    text = "gzip both ways. " * 5000
    info = sbx.files.write(f"{d}/z.txt", text, gzip=True)
    assert info.path == f"{d}/z.txt"
    # Stored decoded: the guest sees the text, a plain read returns it.
    assert sbx.commands.run(f"wc -c < {d}/z.txt").stdout.strip() == str(len(text))
    assert sbx.files.read(f"{d}/z.txt") == text
    assert sbx.files.read(f"{d}/z.txt", gzip=True) == text
    # On the wire the download is gzip when asked for.
    r = _envd(sbx, "GET", params={"path": f"{d}/z.txt"}, headers={"Accept-Encoding": "gzip"})
    assert r.status_code == 200 and r.headers["content-encoding"] == "gzip"
    assert len(r.read()) == len(text)  # httpx decoded it
    raw = httpx.Client().send(_envd_request(sbx, "GET", params={"path": f"{d}/z.txt"},
                                            headers={"Accept-Encoding": "gzip"}), stream=True)
    body = b"".join(raw.iter_raw())
    assert len(body) < len(text) // 10 and gzip.decompress(body).decode() == text
    # Not gzip at all, or a coding envd does not know: 400, nothing written.
    r = _envd(sbx, "POST", params={"path": f"{d}/bad.txt"}, content=b"not gzip data",
              headers={"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
    assert r.status_code == 400, r.text
    r = _envd(sbx, "POST", params={"path": f"{d}/bad.txt"}, content=b"x",
              headers={"Content-Type": "application/octet-stream", "Content-Encoding": "br"})
    assert r.status_code == 400, r.text
    assert not sbx.files.exists(f"{d}/bad.txt")


def _envd_request(sbx, method, path="/files", **kw):
    headers = {
        "E2b-Sandbox-Id": sbx.sandbox_id,
        "X-Access-Token": getattr(sbx, "_envd_access_token", None) or "",
    }
    headers.update(kw.pop("headers", {}))
    return httpx.Request(method, os.environ["E2B_SANDBOX_URL"] + path, headers=headers, **kw)


def test_a_gzip_upload_is_limited_by_what_it_decodes_to(sbx):
    limit = int(os.environ["STRATA_MAX_UPLOAD_BYTES"])
    d = _dir()
    bomb = gzip.compress(b"\0" * (limit + 1))
    assert len(bomb) < limit // 100
    r = _envd(sbx, "POST", params={"path": f"{d}/bomb.bin"}, content=bomb,
              headers={"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
    assert r.status_code == 413, r.text
    assert not sbx.files.exists(f"{d}/bomb.bin")


def test_upload_metadata_is_stored_as_xattrs_and_reported(sbx):
    d = _dir()
    meta = {"author": "mish", "purpose": "upload"}
    info = sbx.files.write(f"{d}/m.txt", "content", metadata=meta)
    assert info.metadata == meta
    assert sbx.files.get_info(f"{d}/m.txt").metadata == meta
    assert {e.name: e.metadata for e in sbx.files.list(d)} == {"m.txt": meta}
    # In the guest: user.e2b.* attributes.
    out = sbx.commands.run(
        f"python3 -c \"import os; print(sorted(os.listxattr('{d}/m.txt')))\"").stdout.strip()
    assert out == "['user.e2b.author', 'user.e2b.purpose']"
    # Octet-stream and multi-file uploads carry it too; keys are lowercased.
    info = sbx.files.write(f"{d}/o.txt", "x", metadata={"Tag": "T"}, use_octet_stream=True)
    assert info.metadata == {"tag": "T"}
    # Overwriting without metadata clears it; a rename keeps it.
    sbx.files.write(f"{d}/m.txt", "second")
    assert sbx.files.get_info(f"{d}/m.txt").metadata is None
    assert sbx.files.rename(f"{d}/o.txt", f"{d}/p.txt").metadata == {"tag": "T"}
    # Set in the guest out of band: surfaces as metadata.
    sbx.commands.run(f"python3 -c \"import os; os.setxattr('{d}/m.txt', 'user.e2b.who', b'me')\"")
    assert sbx.files.get_info(f"{d}/m.txt").metadata == {"who": "me"}


def test_bad_metadata_is_refused_and_writes_nothing(sbx):
    d = _dir()
    with pytest.raises(InvalidArgumentException):
        sbx.files.write(f"{d}/bad.txt", "x", metadata={"bad key": "v"})
    # What the SDK lets through but envd refuses: a tab, an oversized set.
    for hdr in ({"X-Metadata-k": "a\tb"}, {"X-Metadata-k": "v" * 5000}):
        r = _envd(sbx, "POST", params={"path": f"{d}/bad.txt"}, content=b"x",
                  headers={"Content-Type": "application/octet-stream", **hdr})
        assert r.status_code == 400, r.text
        assert "invalid metadata" in r.json()["message"]
    assert not sbx.files.exists(f"{d}/bad.txt")


def test_watch_recursive_with_entries(sbx):
    d = _dir()
    sbx.files.make_dir(d)
    h = sbx.files.watch_dir(d, recursive=True, include_entry=True)
    sbx.files.make_dir(f"{d}/nested")
    sbx.files.write(f"{d}/nested/f.txt", "hello")
    events = h.get_new_events()
    by = {(e.name, e.type) for e in events}
    assert ("nested", FilesystemEventType.CREATE) in by
    assert ("nested/f.txt", FilesystemEventType.CREATE) in by
    assert ("nested/f.txt", FilesystemEventType.WRITE) in by
    f = next(e for e in events if e.name == "nested/f.txt")
    assert f.entry is not None and f.entry.path == f"{d}/nested/f.txt"
    assert f.entry.type == FileType.FILE and f.entry.size == 5
    assert f.entry.owner == "user"
    sbx.files.remove(f"{d}/nested/f.txt")
    gone = h.get_new_events()
    assert [(e.name, e.type, e.entry) for e in gone] == [
        ("nested/f.txt", FilesystemEventType.REMOVE, None)]
    h.stop()
    # Without include_entry, no entries.
    h = sbx.files.watch_dir(d, allow_network_mounts=True)
    sbx.files.write(f"{d}/g.txt", "x")
    assert all(e.entry is None for e in h.get_new_events())
    h.stop()


def test_signed_urls_download_and_upload_without_headers(sbx):
    import urllib.error
    import urllib.request

    d = _dir()
    sbx.files.write(f"{d}/s.txt", "signed content")
    # No E2b-Sandbox-Id, no X-Access-Token: the signature names the sandbox.
    with urllib.request.urlopen(sbx.download_url(f"{d}/s.txt", "user")) as r:
        assert r.status == 200 and r.read() == b"signed content"
    with urllib.request.urlopen(sbx.download_url(f"{d}/s.txt", "user", 120)) as r:
        assert r.read() == b"signed content"
    for url, message in (
        (sbx.download_url(f"{d}/s.txt", "user", use_signature_expiration=-120),
         "signature is already expired"),
        (sbx.download_url(f"{d}/s.txt", "user").replace("signature=v1_", "signature=v1_x"),
         "invalid signature"),
        # Signed for another path.
        (sbx.download_url(f"{d}/s.txt", "user").replace("s.txt", "t.txt", 1), "invalid signature"),
    ):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url)
        assert e.value.code == 401
        assert __import__("json").loads(e.value.read()) == {"code": 401, "message": message}
    # An upload URL writes (as its user); a download URL does not.
    up = sbx.upload_url(f"{d}/up.txt", "user")
    r = httpx.post(up, files={"file": ("up.txt", b"uploaded")}, timeout=60)
    assert r.status_code == 200, r.text
    assert sbx.files.read(f"{d}/up.txt") == "uploaded"
    assert sbx.files.get_info(f"{d}/up.txt").owner == "user"
    r = httpx.post(sbx.download_url(f"{d}/other.txt", "user"),
                   files={"file": ("x", b"x")}, timeout=60)
    assert r.status_code == 401
    assert not sbx.files.exists(f"{d}/other.txt")


def test_async_watch_dir_streams_events_with_entries(sbx):
    """The async SDK watches over the server-streaming WatchDir."""
    import asyncio

    from e2b import AsyncSandbox

    d = _dir()
    sbx.files.make_dir(f"{d}/n")

    async def run():
        a = await AsyncSandbox.connect(sbx.sandbox_id)
        got, seen = [], asyncio.Event()

        def on_event(e):
            got.append(e)
            if e.name == "n/f.txt" and e.type == FilesystemEventType.WRITE:
                seen.set()

        h = await a.files.watch_dir(d, on_event=on_event, recursive=True, include_entry=True)
        await a.files.write(f"{d}/n/f.txt", "hello")
        await asyncio.wait_for(seen.wait(), 30)
        await h.stop()
        return got

    got = asyncio.run(run())
    names = [(e.name, e.type) for e in got]
    assert ("n/f.txt", FilesystemEventType.CREATE) in names
    w = next(e for e in got if e.type == FilesystemEventType.WRITE)
    assert w.entry is not None and w.entry.path == f"{d}/n/f.txt" and w.entry.size == 5
