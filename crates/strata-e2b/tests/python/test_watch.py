"""Directory watches over the guest's inotify (the agent's `watch` op)
through the unmodified e2b SDK: the exact events of a file written through
the files API, of a command's chmod, and of a recursive watch (nested
files, directories made after the start), sync (CreateWatcher /
GetWatcherEvents) and async (the WatchDir stream). A poller (listing
diffs) gives a new file two events and a chmod none: these fail on it.
Real guest (the shared `sbx` fixture), real HTTP."""

import asyncio
import uuid

import pytest
from e2b import AsyncSandbox, FilesystemEventType as T, Sandbox

from conftest import SUITE


def _dir():
    return f"/home/user/watch-{uuid.uuid4().hex[:8]}"


def _seq(events):
    return [(e.name, e.type) for e in events]


def test_a_written_file_gives_exactly_create_write_chmod(sbx):
    d = _dir()
    sbx.files.make_dir(d)
    h = sbx.files.watch_dir(d)
    sbx.files.write(f"{d}/a.txt", "content")
    # The upload (written beside, renamed into place), then the new file
    # given to the user (chown: IN_ATTRIB). Nothing of the temporary file.
    assert _seq(h.get_new_events()) == [
        ("a.txt", T.CREATE), ("a.txt", T.WRITE), ("a.txt", T.CHMOD)]
    # A command's own changes, as the kernel reports them.
    sbx.commands.run(f"chmod 600 {d}/a.txt")
    assert _seq(h.get_new_events()) == [("a.txt", T.CHMOD)]
    sbx.commands.run(f"echo more >> {d}/a.txt && mv {d}/a.txt {d}/b.txt")
    assert _seq(h.get_new_events()) == [
        ("a.txt", T.WRITE), ("a.txt", T.RENAME), ("b.txt", T.CREATE)]
    sbx.files.remove(f"{d}/b.txt")
    assert _seq(h.get_new_events()) == [("b.txt", T.REMOVE)]
    assert h.get_new_events() == []
    h.stop()


def test_recursive_watch_names_nested_files_and_follows_new_directories(sbx):
    d = _dir()
    sbx.files.make_dir(f"{d}/nested")
    h = sbx.files.watch_dir(d, recursive=True)
    sbx.files.write(f"{d}/nested/f.txt", "hello")
    assert _seq(h.get_new_events()) == [
        ("nested/f.txt", T.CREATE), ("nested/f.txt", T.WRITE), ("nested/f.txt", T.CHMOD)]
    sbx.files.make_dir(f"{d}/later")
    sbx.files.write(f"{d}/later/g.txt", "x")
    assert _seq(h.get_new_events()) == [
        ("later", T.CREATE), ("later", T.CHMOD),
        ("later/g.txt", T.CREATE), ("later/g.txt", T.WRITE), ("later/g.txt", T.CHMOD)]
    h.stop()
    # Stopped: a new watcher of the same directory starts clean.
    h = sbx.files.watch_dir(d)
    sbx.files.write(f"{d}/nested/not-seen.txt", "flat watch")
    sbx.files.write(f"{d}/top.txt", "x")
    assert _seq(h.get_new_events()) == [
        ("top.txt", T.CREATE), ("top.txt", T.WRITE), ("top.txt", T.CHMOD)]
    h.stop()


def test_async_watch_dir_streams_the_same_events(sbx):
    d = _dir()
    sbx.files.make_dir(d)

    async def run():
        a = await AsyncSandbox.connect(sbx.sandbox_id)
        got, done = [], asyncio.Event()

        def on_event(e):
            got.append(e)
            if e.name == "s.txt" and e.type == T.CHMOD:
                done.set()

        h = await a.files.watch_dir(d, on_event=on_event)
        await a.files.write(f"{d}/s.txt", "streamed")
        await asyncio.wait_for(done.wait(), 30)
        await h.stop()
        return got

    got = asyncio.run(run())
    assert _seq(got) == [("s.txt", T.CREATE), ("s.txt", T.WRITE), ("s.txt", T.CHMOD)]


def test_watchers_are_capped_per_sandbox_and_a_stopped_one_frees_its_place(sbx):
    d = _dir()
    sbx.files.make_dir(d)
    held = []
    try:
        with pytest.raises(Exception) as e:
            for _ in range(65):
                held.append(sbx.files.watch_dir(d))
        assert "too many directory watches" in str(e.value)
        assert len(held) <= 64
        held.pop().stop()
        h = sbx.files.watch_dir(d)
        sbx.files.write(f"{d}/after-cap.txt", "x")
        assert _seq(h.get_new_events())[0] == ("after-cap.txt", T.CREATE)
        h.stop()
    finally:
        for h in held:
            h.stop()


def test_a_pause_ends_the_watcher_and_a_new_one_works():
    s = Sandbox.create(metadata={"suite": SUITE, "role": "watch-pause"}, timeout=600)
    try:
        d = _dir()
        s.files.make_dir(d)
        h = s.files.watch_dir(d)
        s.files.write(f"{d}/before.txt", "x")
        assert s.pause() is True
        s2 = Sandbox.connect(s.sandbox_id)
        # The guest's watch went with the agent connection of the paused VM.
        with pytest.raises(Exception) as e:
            h.get_new_events()
        assert "ended" in str(e.value)
        h2 = s2.files.watch_dir(d)
        s2.files.write(f"{d}/after.txt", "y")
        assert _seq(h2.get_new_events()) == [
            ("after.txt", T.CREATE), ("after.txt", T.WRITE), ("after.txt", T.CHMOD)]
        h2.stop()
    finally:
        s.kill()
