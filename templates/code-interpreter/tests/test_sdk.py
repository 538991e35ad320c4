"""The code-interpreter server driven by the unmodified e2b-code-interpreter
SDK (Sandbox.run_code, create/list/restart/remove_code_context): what a user
of the SDK checks."""

import asyncio
import base64
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from e2b import NotFoundException, SandboxException, TimeoutException

from conftest import make_sandbox


def test_state_survives_between_calls(sandbox):
    first = sandbox.run_code("state_x = 1")
    assert first.error is None
    second = sandbox.run_code("state_x + 1")
    assert second.error is None
    assert second.text == "2"
    assert second.execution_count == first.execution_count + 1


def test_stdout_and_stderr_stream_to_callbacks_while_the_code_runs(sandbox):
    seen = []
    t0 = time.monotonic()
    execution = sandbox.run_code(
        "import sys, time\nprint('first')\nsys.stdout.flush()\ntime.sleep(1.5)\nprint('oops', file=sys.stderr)\nprint('last')",
        on_stdout=lambda m: seen.append(("out", m.line, m.error, time.monotonic() - t0)),
        on_stderr=lambda m: seen.append(("err", m.line, m.error, time.monotonic() - t0)),
    )
    done = time.monotonic() - t0
    assert execution.error is None
    assert "".join(execution.logs.stdout) == "first\nlast\n"
    assert "".join(execution.logs.stderr) == "oops\n"
    first = next(s for s in seen if s[1] == "first\n")
    assert first[0] == "out" and first[2] is False
    # Streamed: 'first' reached the callback well before the call returned.
    assert done - first[3] > 1.0, (seen, done)
    assert any(s[0] == "err" and s[1] == "oops\n" and s[2] is True for s in seen)


def test_error_has_name_value_and_traceback(sandbox):
    errors = []
    execution = sandbox.run_code(
        "def explode():\n    raise ValueError('boom 42')\nexplode()",
        on_error=errors.append,
    )
    err = execution.error
    assert err is not None
    assert err.name == "ValueError"
    assert err.value == "boom 42"
    assert "explode()" in err.traceback and "ValueError" in err.traceback
    assert "\x1b[" not in err.traceback  # plain text, no terminal colours
    assert errors and errors[0].name == "ValueError"
    # The context still works after an error.
    assert sandbox.run_code("40 + 2").text == "42"


def test_matplotlib_figure_is_a_png_result(sandbox):
    execution = sandbox.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('strata')\nplt.show()"
    )
    assert execution.error is None
    pngs = [r for r in execution.results if r.png]
    assert len(pngs) == 1
    raw = base64.b64decode(pngs[0].png)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(raw) > 1000
    assert "png" in pngs[0].formats()


def test_display_html_json_and_the_main_result(sandbox):
    results = []
    execution = sandbox.run_code(
        "from IPython.display import display, HTML, JSON, Markdown\n"
        "display(HTML('<b>bold</b>'))\n"
        "display(JSON({'k': [1, 2]}))\n"
        "display(Markdown('# title'))\n"
        "{'answer': 42, 'ok': True}",
        on_result=results.append,
    )
    assert execution.error is None
    assert len(execution.results) == 4 and len(results) == 4
    html, js, md, main = execution.results
    assert html.html == "<b>bold</b>" and not html.is_main_result
    assert js.json == {"k": [1, 2]} and not js.is_main_result
    assert md.markdown == "# title"
    assert main.is_main_result
    assert main.json == {"answer": 42, "ok": True}
    assert main.text == "{'answer': 42, 'ok': True}"
    assert execution.text == main.text


def test_a_string_result_loses_its_quotes_as_in_e2b(sandbox):
    assert sandbox.run_code("'hello'").text == "hello"


def test_contexts_are_isolated_and_listed(sandbox, server, tmp_path):
    sub = server.cwd / "project"
    sub.mkdir(exist_ok=True)
    a = sandbox.create_code_context()
    b = sandbox.create_code_context(cwd=str(sub), language="python")
    try:
        assert a.id != b.id
        assert a.language == "python" and a.cwd == str(server.cwd)
        assert b.cwd == str(sub)
        assert sandbox.run_code("iso = 'a'", context=a).error is None
        seen_b = sandbox.run_code("iso", context=b)
        assert seen_b.error is not None and seen_b.error.name == "NameError"
        assert sandbox.run_code("iso", context=a).text == "a"
        assert sandbox.run_code("import os; os.getcwd()", context=b).text == str(sub)
        # The default context does not see them either.
        assert sandbox.run_code("'iso' in globals()").text == "False"
        ids = {c.id for c in sandbox.list_code_contexts()}
        assert {a.id, b.id} <= ids
        assert all(c.language == "python" for c in sandbox.list_code_contexts())
    finally:
        sandbox.remove_code_context(a)
        sandbox.remove_code_context(b.id)


def test_restart_clears_the_state_of_that_context_only(sandbox):
    ctx = sandbox.create_code_context()
    try:
        sandbox.run_code("kept = 5", context=ctx)
        sandbox.run_code("default_kept = 6")
        sandbox.restart_code_context(ctx)
        after = sandbox.run_code("kept", context=ctx)
        assert after.error is not None and after.error.name == "NameError"
        assert sandbox.run_code("default_kept").text == "6"
        assert ctx.id in {c.id for c in sandbox.list_code_contexts()}
        # Restarted kernels count executions from 1 again, and still work.
        again = sandbox.run_code("1 + 1", context=ctx)
        assert again.text == "2" and again.execution_count <= 2
    finally:
        sandbox.remove_code_context(ctx)


def test_a_removed_context_is_not_found(sandbox):
    ctx = sandbox.create_code_context()
    sandbox.remove_code_context(ctx)
    assert ctx.id not in {c.id for c in sandbox.list_code_contexts()}
    with pytest.raises(NotFoundException):
        sandbox.run_code("1", context=ctx)
    with pytest.raises(NotFoundException):
        sandbox.restart_code_context(ctx)
    with pytest.raises(NotFoundException):
        sandbox.remove_code_context(ctx)


def test_timeout_interrupts_the_kernel(sandbox):
    ctx = sandbox.create_code_context()
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutException):
            sandbox.run_code("import time\nstep = 'before'\ntime.sleep(60)\nstep = 'after'", context=ctx, timeout=2)
        assert time.monotonic() - t0 < 10
        # Without the interrupt this call would wait ~58 s for the sleep.
        t1 = time.monotonic()
        after = sandbox.run_code("step", context=ctx, timeout=15)
        assert after.text == "before"
        assert time.monotonic() - t1 < 10
    finally:
        sandbox.remove_code_context(ctx)


def test_env_vars_apply_to_one_execution(sandbox):
    tricky = "it's \"quoted\"\\n and\nnewlined"
    got = sandbox.run_code(
        "import os\n(os.environ['STRATA_A'], os.environ.get('HOME') is not None)",
        envs={"STRATA_A": tricky},
    )
    assert got.error is None
    assert got.text == repr((tricky, True))
    after = sandbox.run_code("import os; os.environ.get('STRATA_A')")
    assert after.text is None  # None is not displayed: no main result
    assert all(not r.is_main_result for r in after.results)
    # A variable the kernel already had comes back to its value.
    sandbox.run_code("import os; os.environ['STRATA_B'] = 'kernel'")
    assert sandbox.run_code("import os; os.environ['STRATA_B']", envs={"STRATA_B": "call"}).text == "call"
    assert sandbox.run_code("import os; os.environ['STRATA_B']").text == "kernel"
    # A subprocess sees it too.
    sub = sandbox.run_code("import subprocess; print(subprocess.check_output(['sh', '-c', 'echo $STRATA_C'], text=True), end='')", envs={"STRATA_C": "child"})
    assert sub.logs.stdout == ["child\n"]


def test_javascript_is_refused_with_the_supported_list(sandbox):
    with pytest.raises(SandboxException) as info:
        sandbox.run_code("1 + 1", language="javascript")
    assert "400" in str(info.value) and "unsupported_language" in str(info.value)
    with pytest.raises(SandboxException):
        sandbox.create_code_context(language="js")


def test_language_python_uses_the_default_context(sandbox):
    sandbox.run_code("lang_marker = 'default'")
    assert sandbox.run_code("lang_marker", language="python").text == "default"


def test_default_cwd_is_the_server_cwd(sandbox, server):
    assert sandbox.run_code("import os; os.getcwd()").text == str(server.cwd)


def test_sandbox_env_file_reaches_a_warm_kernel(start_server, monkeypatch, tmp_path):
    envs = tmp_path / "sandbox-envs.json"
    srv = start_server("--env-file", str(envs))
    sandbox = make_sandbox(srv.url, monkeypatch)
    code = "import os; os.environ.get('SANDBOX_LEVEL', 'unset')"
    assert sandbox.run_code(code).text == "unset"
    # The kernel was started before the file existed (as in a template
    # snapshot): a fork's values arrive with its next execution.
    envs.write_text('{"SANDBOX_LEVEL": "fork-1"}')
    assert sandbox.run_code(code).text == "fork-1"
    ctx = sandbox.create_code_context()
    assert sandbox.run_code(code, context=ctx).text == "fork-1"
    envs.write_text('{"SANDBOX_LEVEL": "fork-two"}')
    assert sandbox.run_code(code).text == "fork-two"
    # A per-execution value wins, and the sandbox's comes back after it.
    assert sandbox.run_code(code, envs={"SANDBOX_LEVEL": "call"}).text == "call"
    assert sandbox.run_code(code).text == "fork-two"
    # A file that is not a JSON object of strings is ignored (and logged).
    envs.write_text('{"SANDBOX_LEVEL": 7}')
    assert sandbox.run_code(code).text == "fork-two"
    assert "sandbox env file" in srv.logs()


def test_contexts_run_in_parallel_and_one_context_in_turn(sandbox):
    a = sandbox.create_code_context()
    b = sandbox.create_code_context()
    try:
        code = "import time; t0 = time.time(); time.sleep(2); (t0, time.time())"
        with ThreadPoolExecutor(4) as pool:
            t0 = time.monotonic()
            runs = [pool.submit(sandbox.run_code, code, context=c) for c in (a, b)]
            spans = [eval(r.result().text) for r in runs]
            parallel = time.monotonic() - t0
        assert parallel < 3.8, parallel  # two kernels at once, not 4 s in a row
        with ThreadPoolExecutor(4) as pool:
            runs = [pool.submit(sandbox.run_code, code, context=a) for _ in range(2)]
            spans = sorted(eval(r.result().text) for r in runs)
        # One context runs one execution at a time: the second starts after the first ends.
        assert spans[1][0] >= spans[0][1] - 0.05, spans
    finally:
        sandbox.remove_code_context(a)
        sandbox.remove_code_context(b)


def test_a_queued_execution_whose_client_left_does_not_run(sandbox):
    ctx = sandbox.create_code_context()
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(sandbox.run_code, "import time; time.sleep(4); 'first'", context=ctx, timeout=30)
            time.sleep(0.5)
            with pytest.raises(TimeoutException):
                sandbox.run_code("queued_ran = True", context=ctx, timeout=1)
            assert first.result().text == "first"
        assert sandbox.run_code("'queued_ran' in globals()", context=ctx).text == "False"
    finally:
        sandbox.remove_code_context(ctx)


def test_the_async_sdk_speaks_the_same_protocol(server, monkeypatch):
    from e2b import ConnectionConfig
    from e2b_code_interpreter import AsyncSandbox
    from packaging.version import Version

    monkeypatch.setenv("E2B_SANDBOX_URL", server.url)
    monkeypatch.setenv("E2B_API_KEY", "e2b_unused")

    async def scenario():
        sbx = AsyncSandbox(
            sandbox_id="strata-local",
            sandbox_domain=None,
            envd_version=Version("0.5.0"),
            envd_access_token=None,
            traffic_access_token=None,
            connection_config=ConnectionConfig(),
        )
        ctx = await sbx.create_code_context()
        out = []
        await sbx.run_code("async_x = 20", context=ctx)
        got = await sbx.run_code("print('async'); async_x * 2", context=ctx, on_stdout=out.append)
        await sbx.remove_code_context(ctx)
        return got, out

    got, out = asyncio.run(scenario())
    assert got.text == "40" and [m.line for m in out] == ["async\n"]


PIL_IMAGE = (
    "import numpy as np\nfrom PIL import Image\n"
    "image = Image.fromarray((np.arange(16 * 16 * 3) % 256).astype('uint8').reshape(16, 16, 3))\n"
)


@pytest.mark.parametrize(
    "last",
    ["image.show()\nprint('shown')", "image", "image.save('pil-saved.png')\nprint('saved')"],
    ids=["show", "value", "save"],
)
def test_a_pil_image_shown_returned_or_saved_is_a_png_result(sandbox, server, last):
    execution = sandbox.run_code(PIL_IMAGE + last)
    assert execution.error is None
    pngs = [r for r in execution.results if r.png]
    assert len(pngs) == 1, execution
    assert base64.b64decode(pngs[0].png)[:4] == b"\x89PNG"
    if "save" in last:
        assert (server.cwd / "pil-saved.png").read_bytes()[:4] == b"\x89PNG"


def test_the_default_context_is_warm_and_its_namespace_empty(start_server, monkeypatch):
    sandbox = make_sandbox(start_server().url, monkeypatch)  # a server no other test has used
    probe = "import sys, os\n(sorted(m for m in ('numpy', 'matplotlib.pyplot') if m in sys.modules), 'np' in globals(), 'plt' in globals(), 'STRATA_INTERP_WARM' in os.environ)"
    # The default context (the one a template snapshot holds) has numpy and
    # pyplot imported already, without binding a name the user did not write.
    first = sandbox.run_code(probe)
    assert first.text == "(['matplotlib.pyplot', 'numpy'], False, False, False)"
    # The warm-up ran a figure through the display path (the Agg renderer is
    # loaded) without counting an execution or leaving a name.
    assert first.execution_count == 1
    warmed = sandbox.run_code("import sys; ('matplotlib.backends.backend_agg' in sys.modules, [n for n in globals() if 'warm' in n])")
    assert warmed.text == "(True, [])"
    ctx = sandbox.create_code_context()
    try:
        assert sandbox.run_code(probe, context=ctx).text == "([], False, False, False)"
    finally:
        sandbox.remove_code_context(ctx)


def test_a_matplotlib_figure_also_carries_its_chart_data(sandbox):
    from e2b_code_interpreter.charts import BarChart, ChartType, LineChart

    line = sandbox.run_code(
        "import matplotlib.pyplot as plt\n"
        "plt.figure()\nplt.plot([0, 1, 2], [0, 1, 4], label='squares')\n"
        "plt.xlabel('x (s)')\nplt.ylabel('y (m)')\nplt.title('growth')\nplt.legend()\nplt.show()"
    )
    assert line.error is None
    result = line.results[0]
    assert result.png and isinstance(result.chart, LineChart)
    chart = result.chart
    assert chart.type == ChartType.LINE and chart.title == "growth"
    assert chart.x_label == "x (s)" and chart.x_unit == "s" and chart.y_unit == "m"
    assert [e.label for e in chart.elements] == ["squares"]
    assert [tuple(p) for p in chart.elements[0].points] == [(0, 0), (1, 1), (2, 4)]
    bars = sandbox.run_code(
        "import matplotlib.pyplot as plt\nplt.figure()\nplt.bar(['a', 'b'], [3, 5])\nplt.title('bars')\nplt.show()"
    )
    chart = bars.results[0].chart
    assert isinstance(chart, BarChart) and chart.title == "bars"
    assert [(e.label, e.value) for e in chart.elements] == [("a", 3), ("b", 5)]
    # Not a figure: no chart.
    assert sandbox.run_code("[1, 2]").results[0].chart is None
