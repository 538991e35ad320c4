"""The unmodified `e2b-code-interpreter` (PyPI 2.11.5) against a real strata
daemon, as a self-hoster runs it: `E2B_API_URL` and `E2B_SANDBOX_URL` point
at the daemon (run-python.sh sets both), the SDK's own `Sandbox.create()`
asks for its default template `code-interpreter-v1`, which the E2B door
resolves to the template *named* `code-interpreter`, and every `run_code`
goes to port 49999 of the guest through the `E2b-Sandbox-Port` route.

The template is built once per session, through the daemon, from
templates/code-interpreter/recipe.toml (`strata template build -f …`; a
second build in the same daemon resumes from its cached steps). The
registries' TLS is re-signed on this host, so the build is given the host's
CA bundle (STRATA_CA_BUNDLE)."""

import base64
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from e2b_code_interpreter import Sandbox

ROOT = Path(__file__).resolve().parents[4]
# STRATA_INTERP_RECIPE: another copy of the recipe (its copy sources beside it).
RECIPE = Path(os.environ.get("STRATA_INTERP_RECIPE", ROOT / "templates/code-interpreter/recipe.toml"))
SUITE = os.environ.get("STRATA_E2B_SUITE", "strata-e2b-tests")
CA = os.environ.get("STRATA_CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt")

# Opt-in (STRATA_TEST_INTERP=1): a cold build of the template takes about
# 25 minutes under TCG (pip of numpy/matplotlib and the kernel's first
# start), over CI's per-issue budget; the host's template cache
# (STRATA_TEMPLATE_CACHE) makes later runs import it in seconds.
pytestmark = pytest.mark.skipif(
    os.environ.get("STRATA_TEST_INTERP") != "1",
    reason="code-interpreter end-to-end tests are opt-in: STRATA_TEST_INTERP=1 (cold template build ~25 min under TCG)",
)


def _strata(method, path, **kw):
    headers = {"Authorization": f"Bearer {os.environ['STRATA_TOKEN']}"}
    return httpx.request(method, os.environ["E2B_API_URL"] + path, headers=headers, timeout=600, **kw)


@pytest.fixture(scope="session")
def interp_template():
    """Builds the `code-interpreter` template from the recipe through the
    daemon (the `strata` CLI streams the build log), once per session."""
    cli = os.environ.get("STRATA_BIN", str(ROOT / "target/release/strata"))
    t = time.monotonic()
    out = subprocess.run(
        [cli, "--url", os.environ["E2B_API_URL"], "template", "build", "-f", str(RECIPE),
         "--name", "code-interpreter", "--ca-bundle", CA, "--timeout", "2400", "--json"],
        capture_output=True, text=True, timeout=2500,
        env={**os.environ, "STRATA_TOKEN": os.environ["STRATA_TOKEN"]},
    )
    secs = time.monotonic() - t
    assert out.returncode == 0, f"template build failed:\n{out.stdout}\n{out.stderr[-6000:]}"
    print(f"\ncode-interpreter template build: {secs:.1f} s")
    tpls = _strata("GET", "/v1/templates").json()["items"]
    ready = [x for x in tpls if x.get("name") == "code-interpreter" and x["status"] == "ready"]
    assert ready, tpls
    return max(ready, key=lambda x: x["created_at"])["id"]


@pytest.fixture(scope="session")
def sbx(interp_template):
    s = Sandbox.create(metadata={"suite": SUITE, "role": "interp"}, timeout=900)
    yield s
    try:
        s.kill()
    except Exception:
        pass


def _template_of(sandbox_id):
    r = _strata("GET", f"/v1/sandboxes/{sandbox_id}")
    assert r.status_code == 200, r.text
    return r.json().get("template")


def test_create_asks_for_code_interpreter_v1_and_gets_the_template(sbx, interp_template):
    # The SDK's default template is `code-interpreter-v1`: the door resolves
    # it to the template named `code-interpreter` (before: the default
    # template, where nothing listens on 49999).
    assert Sandbox.default_template == "code-interpreter-v1"
    assert _template_of(sbx.sandbox_id) == interp_template
    # The first call is answered by the warm kernel the snapshot holds.
    t = time.monotonic()
    ex = sbx.run_code("1+1")
    print(f"\nfirst run_code in a fresh sandbox: {(time.monotonic() - t) * 1000:.0f} ms")
    assert ex.error is None, ex.error
    assert ex.text == "2"


def test_state_persists_between_calls(sbx):
    assert sbx.run_code("x = 1").error is None
    ex = sbx.run_code("x + 1")
    assert ex.error is None, ex.error
    assert ex.text == "2"


def test_stdout_and_stderr_come_to_the_callbacks(sbx):
    out, err = [], []
    ex = sbx.run_code(
        "import sys\nprint('to out')\nprint('to err', file=sys.stderr)",
        on_stdout=lambda m: out.append(m.line),
        on_stderr=lambda m: err.append(m.line),
    )
    assert ex.error is None, ex.error
    assert "".join(out) == "to out\n"
    assert "".join(err) == "to err\n"
    assert ex.logs.stdout == ["to out\n"]
    assert ex.logs.stderr == ["to err\n"]


def test_an_error_has_its_name_value_and_traceback(sbx):
    ex = sbx.run_code("def f():\n    raise ValueError('bad value')\nf()")
    assert ex.error is not None
    assert ex.error.name == "ValueError"
    assert ex.error.value == "bad value"
    assert "raise ValueError('bad value')" in ex.error.traceback
    assert "\x1b[" not in ex.error.traceback
    # The kernel keeps working after an error.
    assert sbx.run_code("40 + 2").text == "42"


def test_a_matplotlib_figure_is_a_png_result(sbx):
    ex = sbx.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.title('squares')\nplt.show()"
    )
    assert ex.error is None, ex.error
    pngs = [r.png for r in ex.results if r.png]
    assert len(pngs) == 1, ex.results
    raw = base64.b64decode(pngs[0])
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and len(raw) > 1000


def test_state_survives_pause_and_connect(sbx):
    assert sbx.run_code("paused_state = 'kept'").error is None
    sbx.pause()
    info = _strata("GET", f"/v1/sandboxes/{sbx.sandbox_id}").json()
    assert info["state"] in ("hibernated", "paused"), info
    s = Sandbox.connect(sbx.sandbox_id)
    ex = s.run_code("paused_state")
    assert ex.error is None, ex.error
    assert ex.text == "kept"


def test_state_is_copied_by_fork_and_then_independent(sbx):
    assert sbx.run_code("forked = [1, 2]").error is None
    forks = sbx.fork(count=1, timeout=600)
    assert len(forks) == 1 and isinstance(forks[0], Sandbox), forks
    f = forks[0]
    try:
        ex = f.run_code("forked.append(3); forked")
        assert ex.error is None, ex.error
        assert ex.text == "[1, 2, 3]"
        # The source's kernel is its own.
        assert sbx.run_code("forked").text == "[1, 2]"
    finally:
        f.kill()


def test_rewind_brings_back_the_kernel_state_of_the_snapshot(sbx):
    assert sbx.run_code("rewound = 'at snapshot'").error is None
    r = _strata("POST", f"/v1/sandboxes/{sbx.sandbox_id}/snapshots", json={"label": "interp-rewind"})
    assert r.status_code < 300, r.text
    snap = r.json()["id"]
    assert sbx.run_code("rewound = 'after snapshot'; made_later = 1").error is None
    r = _strata("POST", f"/v1/sandboxes/{sbx.sandbox_id}/rewind", json={"to": snap})
    assert r.status_code == 200, r.text
    ex = sbx.run_code("rewound")
    assert ex.error is None, ex.error
    assert ex.text == "at snapshot"
    ex = sbx.run_code("made_later")
    assert ex.error is not None and ex.error.name == "NameError", ex


def test_base_and_unknown_names_keep_the_default_template(interp_template):
    # `base` and a name no template has still get the default template.
    for asked in ("base", "no-such-template-name"):
        r = httpx.post(
            os.environ["E2B_API_URL"] + "/sandboxes",
            json={"templateID": asked, "metadata": {"suite": SUITE}, "timeout": 300},
            headers={"X-API-Key": os.environ["E2B_API_KEY"]},
            timeout=300,
        )
        assert r.status_code == 201, r.text
        sid = r.json()["sandboxID"]
        try:
            t = _template_of(sid)
            assert t and t != interp_template, t
        finally:
            _strata("DELETE", f"/v1/sandboxes/{sid}")
