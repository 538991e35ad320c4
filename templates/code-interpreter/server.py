#!/usr/bin/env python3
"""strata's code-interpreter server: runs in the guest of the
`code-interpreter` template and speaks the protocol E2B's code-interpreter
SDKs (PyPI `e2b-code-interpreter` 2.11.5, npm `@e2b/code-interpreter` 2.8.0)
speak to port 49999.

Routes:
  GET    /health                 200 "OK" once the default Python context is ready (503 before)
  POST   /execute                {code, context_id?, language?, env_vars?} -> 200, NDJSON stream
  POST   /contexts               {language?, cwd?} -> {id, language, cwd}
  GET    /contexts               [{id, language, cwd}, ...]
  DELETE /contexts/{id}          200 null
  POST   /contexts/{id}/restart  200 null

One Jupyter kernel (ipykernel, driven with jupyter_client) per context. The
stream answers one JSON object per line: stdout/stderr {text, timestamp},
result {text?, html?, markdown?, svg?, png?, jpeg?, pdf?, latex?, json?,
javascript?, extra?, is_main_result}, error {name, value, traceback},
number_of_executions {execution_count}, keepalive (every 5 s of silence,
ignored by the SDKs), and end_of_execution last. A client that goes away
(the SDK closes the stream on its timeout) interrupts the kernel.

Errors outside the stream: a JSON body {code, message} with a 4xx/5xx status.

Standard library only apart from jupyter_client (and ipykernel for the
kernels). See README.md beside this file.
"""

import argparse
import json
import logging
import math
import os
import pwd
import queue
import select
import signal
import socket
import shutil
import sys
import tempfile
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import zmq
from jupyter_client.manager import KernelManager

log = logging.getLogger("strata-interpreter")

HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL_INIT = os.path.join(HERE, "kernel_init.py")

# Run once in the default context before /health is OK (Context.warm_up):
# a figure shown and a value displayed inside a function that then goes, so
# the namespace stays empty and the execution count at 0.
WARMUP_CODE = (
    "def _strata_warm_up():\n"
    "    import matplotlib.pyplot as plt\n"
    "    from IPython.display import display\n"
    "    plt.plot([0, 1], [0, 1])\n"
    "    plt.show()\n"
    "    display(1)\n"
    "_strata_warm_up()\n"
    "del _strata_warm_up\n"
)

# Bounds (the server must not grow without one, whatever the code prints).
MAX_BODY_BYTES = 32 << 20  # a request body (the code and its env vars)
MAX_LINE_BYTES = 32 << 20  # one streamed output line: larger results are replaced by a notice
MAX_ZMQ_MSG_BYTES = 64 << 20  # a kernel message larger than this is dropped by zmq itself
ZMQ_RCVHWM = 256  # kernel messages queued in the server while the client reads slowly
MAX_ENV_FILE_BYTES = 1 << 20  # the sandbox env file
MAX_CONNECTIONS = 128  # concurrent HTTP connections (each holds a thread)
KEEPALIVE_SECS = 5.0  # a keepalive line after this much silence (detects a closed client)
REPLY_GRACE_SECS = 3.0  # after the kernel's reply, how long to wait for its idle status
INTERRUPT_REPEAT_SECS = 5.0  # an abandoned execution is interrupted again at this interval
KEEP_ALIVE_IDLE_SECS = 640  # an idle keep-alive connection is closed after this long
STREAM_WRITE_SECS = 120  # a stream write the client does not take in this long: the client is gone

# Languages with a kernel here. E2B's names for the others are recognised
# so the refusal says what is missing.
SUPPORTED = ("python",)
ALIASES = {"js": "javascript", "ts": "typescript", "py": "python", "python3": "python"}

# MIME type -> field of the SDK's Result; what is left goes to `extra`.
MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",
    "e2b/chart": "chart",
}


class ApiError(Exception):
    """A request refused before anything ran: HTTP status, stable code, message."""

    def __init__(self, status, code, message):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def normalize_language(language):
    if language is None:
        return "python"
    if not isinstance(language, str):
        raise ApiError(400, "invalid_request", "language must be a string")
    lang = language.strip().lower() or "python"
    return ALIASES.get(lang, lang)


def check_language(lang):
    if lang not in SUPPORTED:
        raise ApiError(
            400,
            "unsupported_language",
            f"language '{lang}' is not available in this template (supported: {', '.join(SUPPORTED)})",
        )


def _finite(obj):
    """JSON without NaN/Infinity (JavaScript's JSON.parse refuses them): they become null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def encode_line(obj):
    try:
        text = json.dumps(obj, ensure_ascii=False, allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(obj), ensure_ascii=False, allow_nan=False)
    return (text + "\n").encode("utf-8")


def to_result(data, is_main):
    """A kernel's mime bundle as the SDK's result message."""
    out = {"type": "result"}
    extra = {}
    for mime, value in data.items():
        field = MIME_FIELDS.get(mime)
        if field is None:
            extra[mime] = value
        else:
            out[field] = value
    text = out.get("text")
    # As E2B's interpreter: a string's repr loses its quotes ('a' -> a).
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        out["text"] = text[1:-1]
    if extra:
        out["extra"] = extra
    out["is_main_result"] = is_main
    return out


def too_large_notice(obj, size):
    """What replaces an output line over MAX_LINE_BYTES."""
    limit = MAX_LINE_BYTES >> 20
    if obj.get("type") in ("stdout", "stderr"):
        text = obj.get("text") or ""
        keep = text[: MAX_LINE_BYTES // 4]  # utf-8: at most 4 bytes a character
        return dict(obj, text=keep + f"\n[strata: output truncated: {size} bytes over the {limit} MiB limit]\n")
    if obj.get("type") == "result":
        return {
            "type": "result",
            "text": f"[strata: result of {size} bytes dropped: over the {limit} MiB limit]",
            "is_main_result": bool(obj.get("is_main_result")),
        }
    return {
        "type": "error",
        "name": "OutputTooLarge",
        "value": f"an output of {size} bytes was dropped: over the {limit} MiB limit",
        "traceback": "",
    }


class Context:
    """One kernel, one namespace: what the SDK calls a code context."""

    def __init__(self, server, ctx_id, language, cwd, warm=False):
        self.server = server
        self.warm = warm  # pre-import numpy/matplotlib (the default context: warm in the snapshot)
        self.id = ctx_id
        self.language = language
        self.cwd = cwd
        self.km = None
        self.kc = None
        self.exec_lock = threading.Lock()  # one execution at a time
        self.generation = 0  # bumped by a restart or delete: a running execution stops
        self.deleted = False
        self.envs_stamp = None  # (mtime, size) of the sandbox env file this kernel has

    def describe(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    # --- kernel life ---------------------------------------------------------

    def start(self):
        # IPC sockets (files only this user can open) rather than TCP ports on loopback.
        base = os.path.join(self.server.runtime_dir, self.id)
        km = KernelManager(
            kernel_name="python3",
            transport="ipc",
            ip=base,
            connection_file=base + ".json",
            context=zmq.Context.instance(),  # one zmq context (and I/O thread), with main()'s limits
        )
        km.kernel_spec  # noqa: B018 (fails early if ipykernel's spec is missing)
        env = dict(os.environ)
        env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
        env.pop("STRATA_INTERP_CWD", None)
        env.pop("STRATA_INTERP_WARM", None)
        if self.warm:
            env["STRATA_INTERP_WARM"] = "1"  # read (and removed) by kernel_init.py
        km.start_kernel(
            cwd=self.cwd,
            env=env,
            extra_arguments=[
                "--InteractiveShell.colors=nocolor",
                "--HistoryManager.hist_file=:memory:",
                f"--IPKernelApp.exec_files={json.dumps([KERNEL_INIT])}",
            ],
        )
        self.km = km
        self._connect()

    def _connect(self):
        kc = self.km.client(context=zmq.Context.instance())
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=self.server.kernel_timeout)
        except RuntimeError as err:
            kc.stop_channels()
            raise RuntimeError(f"the kernel did not become ready: {err}") from err
        self.kc = kc

    def _reconnect_client(self):
        """A new kernel client (fresh sockets) for the same kernel. exec_lock held."""
        if self.kc is not None:
            self.kc.stop_channels()
            self.kc = None
        self._connect()

    def _restart_kernel(self):
        """Kill the kernel and start a fresh one (same cwd, same arguments). exec_lock held."""
        if self.kc is not None:
            self.kc.stop_channels()
            self.kc = None
        self.km.restart_kernel(now=True)
        self.envs_stamp = None
        self._connect()

    def restart(self):
        self.generation += 1
        with self.exec_lock:
            if self.deleted:
                raise ApiError(404, "context_not_found", f"Context {self.id} not found")
            self._restart_kernel()

    def shutdown(self):
        self.deleted = True
        self.generation += 1
        with self.exec_lock:
            self._close()

    def _close(self):
        try:
            if self.kc is not None:
                self.kc.stop_channels()
            if self.km is not None and self.km.has_kernel:
                self.km.shutdown_kernel(now=True)
        except Exception:  # the kernel may be gone already
            log.exception("closing context %s", self.id)
        self.kc = None

    # --- execution -----------------------------------------------------------

    def warm_up(self):
        """One execution through the display machinery before the server
        says it is ready: a matplotlib figure shown (to PNG, with its chart
        data) and a displayed value, not counted and leaving no name behind.

        What IPython, the inline backend and the formatters do on their
        first use then happens here, once, in the template build, instead of
        in every fork's first run_code (measured under TCG: the first
        run_code in a fork of a template without it took ~35 s, a first
        plot ~27 s). Failures only cost the warmth."""
        kc = self.kc
        msg_id = kc.execute(WARMUP_CODE, silent=False, store_history=False, allow_stdin=False, stop_on_error=False)
        deadline = time.monotonic() + self.server.kernel_timeout
        while time.monotonic() < deadline:
            try:
                msg = kc.get_iopub_msg(timeout=1)
            except queue.Empty:
                if not self.km.is_alive():
                    return
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "error":
                log.warning("warm-up execution failed: %s", msg["content"].get("evalue"))
            if msg["msg_type"] == "status" and msg["content"].get("execution_state") == "idle":
                break
        self._wait_reply(kc, msg_id, 5.0)

    def _silent(self, code):
        """Run `code` silently (no execution count, no output); wait for its reply."""
        kc = self.kc
        msg_id = kc.execute(code, silent=True, store_history=False, allow_stdin=False, stop_on_error=False)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                reply = kc.get_shell_msg(timeout=0.5)
            except queue.Empty:
                if not self.km.is_alive():
                    return False
                continue
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply["content"].get("status") == "ok"
        return False

    def _apply_sandbox_envs(self):
        """The sandbox's own env vars (E2B: set at create), from the env file, into the kernel.

        Read when the file changed since this kernel last took it, so a warm
        kernel in a template snapshot takes each fork's values at its first
        execution. exec_lock held."""
        path = self.server.env_file
        try:
            st = os.stat(path)
        except OSError:
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self.envs_stamp:
            return
        self.envs_stamp = stamp
        try:
            if st.st_size > MAX_ENV_FILE_BYTES:
                raise ValueError(f"over {MAX_ENV_FILE_BYTES} bytes")
            with open(path, encoding="utf-8") as f:
                envs = json.load(f)
            if not isinstance(envs, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v for k, v in envs.items()
            ):
                raise ValueError("not a JSON object of strings")
        except (OSError, ValueError) as err:
            log.warning("sandbox env file %s ignored: %s", path, err)
            return
        if envs:
            self._silent(f"__import__('os').environ.update(__import__('json').loads({json.dumps(json.dumps(envs))}))")

    def execute(self, code, env_vars, stream):
        """Run `code`, sending each output to `stream` as it comes. exec_lock held."""
        gen = self.generation
        if not self.km.is_alive():
            # Died between executions (e.g. the OOM killer): as Jupyter's
            # auto-restart, the code runs in a fresh kernel (its state is gone).
            log.warning("kernel of context %s is dead: restarting it", self.id)
            self._restart_kernel()
        self._apply_sandbox_envs()
        if env_vars:
            if not self._silent(f"__import__('_strata_interp').set_env({json.dumps(json.dumps(env_vars))})"):
                stream.send(
                    {"type": "error", "name": "EnvVarsError", "value": "could not set the environment variables", "traceback": ""}
                )
                return
        try:
            self._run(code, stream, gen)
        finally:
            if env_vars and self.kc is not None and gen == self.generation:
                self._silent("__import__('_strata_interp').restore_env()")

    def _run(self, code, stream, gen):
        kc, km = self.kc, self.km
        msg_id = kc.execute(code, silent=False, store_history=True, allow_stdin=False, stop_on_error=True)
        idle = False
        reply = None
        reply_at = 0.0
        last_iopub = time.monotonic()
        error_sent = False
        interrupted_at = None
        last_check = time.monotonic()
        while True:
            if self.generation != gen:
                stream.send({"type": "error", "name": "ContextRestarting", "value": "Context was restarted", "traceback": ""})
                return
            try:
                msg = kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                msg = None
            if msg is not None:
                last_iopub = time.monotonic()
            if msg is not None and msg["parent_header"].get("msg_id") == msg_id:
                kind = msg["msg_type"]
                content = msg["content"]
                out = None
                if kind == "stream":
                    name = content.get("name")
                    if name in ("stdout", "stderr"):
                        date = msg["header"].get("date")
                        stamp = date.isoformat() if hasattr(date, "isoformat") else date
                        out = {"type": name, "text": content.get("text", ""), "timestamp": stamp}
                elif kind == "execute_result":
                    out = to_result(content.get("data", {}), True)
                elif kind == "display_data":
                    out = to_result(content.get("data", {}), False)
                elif kind == "error":
                    if not error_sent:
                        error_sent = True
                        out = {
                            "type": "error",
                            "name": content.get("ename", ""),
                            "value": content.get("evalue", ""),
                            "traceback": "\n".join(content.get("traceback", [])),
                        }
                elif kind == "execute_input":
                    out = {"type": "number_of_executions", "execution_count": content.get("execution_count")}
                elif kind == "status" and content.get("execution_state") == "idle":
                    idle = True
                if out is not None:
                    stream.send(out)
            if reply is None:
                reply = self._poll_reply(kc, msg_id)
                if reply is not None:
                    reply_at = time.monotonic()
            if idle and reply is None:
                # idle comes after every output; the reply follows at once.
                reply = self._wait_reply(kc, msg_id, 2.0)
            if idle:
                break
            if reply is not None and time.monotonic() - max(reply_at, last_iopub) > REPLY_GRACE_SECS:
                # The kernel replied but its idle status never came: iopub lost
                # messages (zmq drops a message over MAX_ZMQ_MSG_BYTES and
                # does not reconnect by itself). A fresh client sees the rest.
                log.warning("context %s: iopub lost messages: reconnecting", self.id)
                stream.send(
                    {
                        "type": "error",
                        "name": "OutputLost",
                        "value": f"some outputs of this execution were lost (a message over the {MAX_ZMQ_MSG_BYTES >> 20} MiB limit?)",
                        "traceback": "",
                    }
                )
                self._reconnect_client()
                return
            now = time.monotonic()
            if not stream.gone:
                stream.tick()
            if stream.gone and (interrupted_at is None or now - interrupted_at > INTERRUPT_REPEAT_SECS):
                log.info("client gone: interrupting context %s", self.id)
                km.interrupt_kernel()
                interrupted_at = now
            if now - last_check > 1.0:
                last_check = now
                if not km.is_alive():
                    log.warning("kernel of context %s died: restarting it", self.id)
                    self._restart_kernel()
                    stream.send(
                        {
                            "type": "error",
                            "name": "ContextRestarting",
                            "value": "Context was restarted: the kernel died during the execution",
                            "traceback": "",
                        }
                    )
                    return
        status = (reply or {}).get("content", {}).get("status")
        if status == "error" and not error_sent:
            c = reply["content"]
            stream.send(
                {"type": "error", "name": c.get("ename", ""), "value": c.get("evalue", ""), "traceback": "\n".join(c.get("traceback", []))}
            )
        elif status == "aborted":
            stream.send({"type": "error", "name": "ExecutionAborted", "value": "Execution was aborted", "traceback": ""})

    @staticmethod
    def _poll_reply(kc, msg_id):
        while True:
            try:
                reply = kc.get_shell_msg(timeout=0)
            except queue.Empty:
                return None
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply

    @staticmethod
    def _wait_reply(kc, msg_id, secs):
        deadline = time.monotonic() + secs
        while time.monotonic() < deadline:
            try:
                reply = kc.get_shell_msg(timeout=0.2)
            except queue.Empty:
                continue
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply
        return None


class Stream:
    """The chunked NDJSON answer of one /execute; notices a client that went away."""

    def __init__(self, handler):
        self.handler = handler
        self.conn = handler.connection
        self.gone = False
        self.last_write = time.monotonic()

    def _write(self, data):
        if self.gone:
            return
        try:
            self.handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.last_write = time.monotonic()
        except (OSError, ValueError):
            self.gone = True

    def send(self, obj):
        line = encode_line(obj)
        if len(line) > MAX_LINE_BYTES:
            line = encode_line(too_large_notice(obj, len(line)))
        self._write(line)

    def tick(self):
        """Between outputs: has the client closed? A keepalive line after a silence."""
        if self.gone:
            return
        try:
            readable, _, _ = select.select([self.conn], [], [], 0)
            if readable and self.conn.recv(1, socket.MSG_PEEK) == b"":
                self.gone = True
                return
        except (OSError, ValueError):
            self.gone = True
            return
        if time.monotonic() - self.last_write > KEEPALIVE_SECS:
            self._write(b'{"type": "keepalive"}\n')

    def finish(self):
        self._write(b'{"type": "end_of_execution"}\n')
        if not self.gone:
            try:
                self.handler.wfile.write(b"0\r\n\r\n")
            except (OSError, ValueError):
                self.gone = True


class Interpreter:
    """The contexts and the default context of each language."""

    def __init__(self, default_cwd, max_contexts, kernel_timeout, env_file):
        self.default_cwd = default_cwd
        self.env_file = env_file
        self.max_contexts = max_contexts
        self.kernel_timeout = kernel_timeout
        self.lock = threading.Lock()
        self.contexts = {}
        self.pending = 0  # contexts being started (counted against the limit)
        self.defaults = {}  # language -> context id
        self.default_lock = threading.Lock()
        self.ready = threading.Event()
        # Connection files and IPC sockets of the kernels (0700, removed at exit).
        self.runtime_dir = tempfile.mkdtemp(prefix="strata-interp-")
        self.startup_error = None

    def start_default(self):
        try:
            ctx = self.default_context("python")
            t0 = time.monotonic()
            with ctx.exec_lock:
                ctx.warm_up()
            log.info("default python context warmed up in %.1f s", time.monotonic() - t0)
            self.ready.set()
            log.info("default python context ready")
        except Exception as err:
            self.startup_error = str(err)
            log.exception("default context failed to start")

    def create(self, language, cwd, warm=False):
        check_language(language)
        if not isinstance(cwd, str) or not cwd or "\0" in cwd or len(cwd) > 4096:
            raise ApiError(400, "invalid_request", "cwd must be a non-empty path")
        if not os.path.isabs(cwd):
            cwd = os.path.join(self.default_cwd, cwd)
        if not os.path.isdir(cwd):
            raise ApiError(400, "invalid_cwd", f"cwd {cwd} is not a directory")
        with self.lock:
            if len(self.contexts) + self.pending >= self.max_contexts:
                raise ApiError(429, "too_many_contexts", f"at most {self.max_contexts} contexts: remove one first")
            self.pending += 1
        ctx = Context(self, str(uuid.uuid4()), language, cwd, warm)
        try:
            ctx.start()
        except Exception as err:
            ctx._close()
            raise ApiError(500, "context_start_failed", f"Failed to create context: {err}") from err
        finally:
            with self.lock:
                self.pending -= 1
        with self.lock:
            self.contexts[ctx.id] = ctx
        log.info("context %s (%s, %s) created", ctx.id, language, cwd)
        return ctx

    def default_context(self, language):
        with self.default_lock:
            ctx_id = self.defaults.get(language)
            with self.lock:
                ctx = self.contexts.get(ctx_id) if ctx_id else None
            if ctx is None:
                ctx = self.create(language, self.default_cwd, warm=True)
                self.defaults[language] = ctx.id
            return ctx

    def get(self, ctx_id):
        with self.lock:
            ctx = self.contexts.get(ctx_id)
        if ctx is None:
            raise ApiError(404, "context_not_found", f"Context {ctx_id} not found")
        return ctx

    def remove(self, ctx_id):
        with self.lock:
            ctx = self.contexts.pop(ctx_id, None)
        if ctx is None:
            raise ApiError(404, "context_not_found", f"Context {ctx_id} not found")
        ctx.shutdown()
        log.info("context %s removed", ctx_id)

    def list(self):
        with self.lock:
            return [c.describe() for c in self.contexts.values()]

    def close_all(self):
        with self.lock:
            contexts = list(self.contexts.values())
            self.contexts.clear()
        for ctx in contexts:
            ctx.deleted = True
            ctx.generation += 1
            ctx._close()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "strata-interpreter/1"
    timeout = KEEP_ALIVE_IDLE_SECS

    @property
    def interp(self):
        return self.server.interp

    def log_message(self, fmt, *args):
        log.debug("%s %s", self.address_string(), fmt % args)

    # --- plumbing ------------------------------------------------------------

    def _cors(self):
        self.send_header("Access-Control-Allow-Origin", "*")
        self.send_header("Access-Control-Allow-Methods", "*")
        self.send_header("Access-Control-Allow-Headers", "*")

    def _send_json(self, status, obj):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self._cors()
        self.end_headers()
        self.wfile.write(body)

    def _send_error(self, err):
        self._send_json(err.status, {"code": err.code, "message": err.message})

    def _body(self):
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise ApiError(411, "length_required", "send the body with a Content-Length")
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self.close_connection = True
            raise ApiError(400, "invalid_request", "bad Content-Length") from None
        if length < 0 or length > MAX_BODY_BYTES:
            self.close_connection = True
            raise ApiError(413, "body_too_large", f"the body is over {MAX_BODY_BYTES >> 20} MiB")
        raw = self.rfile.read(length) if length else b""
        self._consumed = True
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "invalid_json", "the body is not JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "invalid_json", "the body must be a JSON object")
        return body

    def _route(self, method):
        path = unquote(urlsplit(self.path).path).rstrip("/") or "/"
        parts = path.strip("/").split("/")
        self._consumed = False
        try:
            if path == "/health":
                self._need(method, "GET")
                return self._health()
            if path == "/execute":
                self._need(method, "POST")
                return self._execute()
            if path == "/contexts":
                if method == "GET":
                    return self._send_json(200, self.interp.list())
                self._need(method, "POST")
                return self._create_context()
            if len(parts) == 2 and parts[0] == "contexts":
                self._need(method, "DELETE")
                self._body()
                self.interp.remove(parts[1])
                return self._send_json(200, None)
            if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart":
                self._need(method, "POST")
                self._body()
                self.interp.get(parts[1]).restart()
                return self._send_json(200, None)
            raise ApiError(404, "not_found", f"no route {method} {path}")
        except ApiError as err:
            self._send_error(err)
        except OSError:  # the client went away mid-answer
            self.close_connection = True
        except Exception:  # a bug: say so rather than drop the connection
            log.exception("%s %s", method, path)
            self.close_connection = True
            try:
                self._send_error(ApiError(500, "internal_error", "internal error (see the server's log)"))
            except OSError:
                pass
        finally:
            # A body left unread would be parsed as the next request.
            if not self._consumed and (self.headers.get("Transfer-Encoding") or self.headers.get("Content-Length", "0") not in ("", "0")):
                self.close_connection = True

    @staticmethod
    def _need(method, want):
        if method != want:
            raise ApiError(405, "method_not_allowed", f"use {want}")

    def do_GET(self):
        self._route("GET")

    def do_POST(self):
        self._route("POST")

    def do_DELETE(self):
        self._route("DELETE")

    def do_PUT(self):
        self._route("PUT")

    def do_OPTIONS(self):
        self.send_response(204)
        self._cors()
        self.send_header("Content-Length", "0")
        self.end_headers()

    # --- routes --------------------------------------------------------------

    def _health(self):
        if self.interp.ready.is_set():
            return self._send_json(200, "OK")
        if self.interp.startup_error:
            raise ApiError(500, "kernel_start_failed", self.interp.startup_error)
        raise ApiError(503, "starting", "the default context is starting")

    def _create_context(self):
        body = self._body()
        language = normalize_language(body.get("language"))
        cwd = body.get("cwd") or self.interp.default_cwd
        ctx = self.interp.create(language, cwd)
        self._send_json(200, ctx.describe())

    def _execute(self):
        body = self._body()
        code = body.get("code")
        if not isinstance(code, str):
            raise ApiError(400, "invalid_request", "code must be a string")
        context_id = body.get("context_id")
        language = body.get("language")
        env_vars = body.get("env_vars")
        if context_id is not None and not isinstance(context_id, str):
            raise ApiError(400, "invalid_request", "context_id must be a string")
        if context_id and language:
            raise ApiError(400, "invalid_request", "Only one of context_id or language can be provided")
        if env_vars is not None:
            if not isinstance(env_vars, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
                for k, v in env_vars.items()
            ):
                raise ApiError(400, "invalid_request", "env_vars must map names to strings")
        if context_id:
            ctx = self.interp.get(context_id)
        else:
            lang = normalize_language(language)
            check_language(lang)
            if not self.interp.ready.wait(timeout=self.interp.kernel_timeout):
                raise ApiError(503, "starting", "the default context is starting")
            ctx = self.interp.default_context(lang)

        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-store")
        self._cors()
        self.end_headers()
        stream = Stream(self)
        self.connection.settimeout(STREAM_WRITE_SECS)
        # Wait our turn (one execution per context), watching the client.
        while not ctx.exec_lock.acquire(timeout=0.5):
            stream.tick()
            if stream.gone:
                self.close_connection = True
                return
        try:
            if ctx.deleted:
                stream.send({"type": "error", "name": "ContextNotFound", "value": f"Context {ctx.id} was removed", "traceback": ""})
            else:
                ctx.execute(code, env_vars, stream)
        except Exception as err:  # a broken kernel connection: say so in the stream
            log.exception("execution in context %s", ctx.id)
            stream.send({"type": "error", "name": type(err).__name__, "value": str(err), "traceback": ""})
        finally:
            ctx.exec_lock.release()
        stream.finish()
        if stream.gone:
            self.close_connection = True
        else:
            self.connection.settimeout(self.timeout)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, addr, interp):
        super().__init__(addr, Handler)
        self.interp = interp
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            try:
                body = b'{"code": "too_many_connections", "message": "too many connections"}'
                request.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                )
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default=os.environ.get("STRATA_INTERP_HOST", "0.0.0.0"))
    p.add_argument("--port", type=int, default=int(os.environ.get("STRATA_INTERP_PORT", "49999")))
    p.add_argument(
        "--cwd",
        default=os.environ.get("STRATA_INTERP_CWD") or ("/home/user" if os.path.isdir("/home/user") else os.getcwd()),
        help="working directory of contexts created without one (E2B: /home/user)",
    )
    p.add_argument("--max-contexts", type=int, default=int(os.environ.get("STRATA_INTERP_MAX_CONTEXTS", "64")))
    p.add_argument("--kernel-timeout", type=float, default=float(os.environ.get("STRATA_INTERP_KERNEL_TIMEOUT", "120")))
    p.add_argument(
        "--env-file",
        default=os.environ.get("STRATA_INTERP_ENV_FILE", "/run/strata/envs.json"),
        help="JSON object of the sandbox's env vars, applied to each kernel when it changes",
    )
    p.add_argument("--log-level", default=os.environ.get("STRATA_INTERP_LOG", "INFO"))
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)

    # Kernels (IPython, matplotlib's cache) write under HOME: make it this
    # user's own when the start command left another user's (or none).
    home = os.environ.get("HOME")
    if not home or not os.path.isdir(home) or not os.access(home, os.W_OK):
        try:
            os.environ["HOME"] = pwd.getpwuid(os.getuid()).pw_dir
        except KeyError:
            pass

    ctx = zmq.Context.instance()
    ctx.setsockopt(zmq.MAXMSGSIZE, MAX_ZMQ_MSG_BYTES)
    ctx.setsockopt(zmq.RCVHWM, ZMQ_RCVHWM)

    interp = Interpreter(os.path.abspath(args.cwd), args.max_contexts, args.kernel_timeout, args.env_file)
    server = Server((args.host, args.port), interp)
    log.info("listening on %s:%d (contexts in %s)", args.host, args.port, interp.default_cwd)

    def stop(signum, _frame):
        log.info("signal %d: stopping", signum)
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    threading.Thread(target=interp.start_default, name="default-context", daemon=True).start()
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        interp.close_all()
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
