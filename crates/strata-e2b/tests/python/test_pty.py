"""PTYs through the unmodified e2b SDK: `sandbox.pty.create` (envd
`Process/Start` with `pty`), `send_stdin` (`SendInput` with `pty` bytes),
`resize` (`Process/Update`), `connect`, `kill` — the terminal output comes
as `pty` data events to `on_pty`."""

import threading
import time

from e2b import PtySize

WAIT = 60  # seconds: TCG guests are slow


class Screen:
    """Collects a PTY handle's output on a thread (as a terminal UI would)."""

    def __init__(self, handle):
        self.handle = handle
        self.buf = b""
        self.lock = threading.Lock()
        self.error = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _on_pty(self, data):
        with self.lock:
            self.buf += data

    def _run(self):
        try:
            self.handle.wait(on_pty=self._on_pty)
        except Exception as e:  # killed: a non-zero end raises
            self.error = e
        finally:
            self.done.set()

    def text(self):
        with self.lock:
            return self.buf.decode("utf-8", "replace")

    def wait_for(self, needle, timeout=WAIT):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.text():
                return
            if self.done.is_set():
                break
            time.sleep(0.05)
        raise AssertionError(f"{needle!r} not in the terminal output: {self.text()!r}")


def test_pty_create_input_resize_connect_ctrl_c_kill(sbx):
    h = sbx.pty.create(PtySize(rows=24, cols=80), timeout=0)
    assert h.pid > 0
    screen = Screen(h)

    # Input goes to the terminal; the arithmetic makes the answer differ
    # from the echo of the line typed.
    sbx.pty.send_stdin(h.pid, b"echo hi-$((40+2))\n")
    screen.wait_for("hi-42")

    # A real terminal: the shell's tty, and the size we asked for.
    sbx.pty.send_stdin(h.pid, b"tty; stty size\n")
    screen.wait_for("/dev/pts/")
    screen.wait_for("24 80")

    sbx.pty.resize(h.pid, PtySize(rows=31, cols=101))
    sbx.pty.send_stdin(h.pid, b"stty size\n")
    screen.wait_for("31 101")

    # ^C interrupts the foreground job, not the shell.
    sbx.pty.send_stdin(h.pid, b"sleep 1000\n")
    time.sleep(1)
    sbx.pty.send_stdin(h.pid, b"\x03")
    sbx.pty.send_stdin(h.pid, b"echo back-$((2+3))\n")
    screen.wait_for("back-5")

    # A second client attaches to the running PTY and sees its output.
    other = Screen(sbx.pty.connect(h.pid, timeout=0))
    sbx.pty.send_stdin(h.pid, b"echo again-$((1+1))\n")
    other.wait_for("again-2")
    screen.wait_for("again-2")

    # It is listed, then killed; both streams end.
    assert h.pid in [p.pid for p in sbx.commands.list()]
    assert sbx.pty.kill(h.pid) is True
    assert screen.done.wait(WAIT), "the PTY stream did not end after kill"
    assert other.done.wait(WAIT), "the connected stream did not end after kill"
    assert sbx.pty.kill(h.pid) is False
    assert h.pid not in [p.pid for p in sbx.commands.list()]


def test_pty_exit_ends_the_stream_with_its_code(sbx):
    h = sbx.pty.create(PtySize(rows=10, cols=40), timeout=0)
    screen = Screen(h)
    sbx.pty.send_stdin(h.pid, b"exit 0\n")
    assert screen.done.wait(WAIT), screen.text()
    assert screen.error is None, screen.error
