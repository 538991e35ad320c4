"""E2B's template build API through the unmodified e2b SDK:
`Template().from_base_image().pip_install(…).copy(…)…` built with
`Template.build` (request, file upload by hash, steps, status and logs
polled), then sandboxes created from it see the package and the files and
have the size the build asked for.
Real builds (a builder guest, pip through the builder's egress proxy), real
HTTP. Without the door's template routes every build fails at its first
request (404)."""

import os
import stat
import uuid

import pytest
from e2b import Sandbox, Template

ALIAS = f"strata-tpl-{uuid.uuid4().hex[:8]}"
HELLO = "hello from the build context\n"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    ctx = tmp_path_factory.mktemp("ctx")
    (ctx / "app").mkdir()
    (ctx / "app" / "hello.txt").write_text(HELLO)
    (ctx / "app" / "run.sh").write_text("#!/bin/sh\necho run\n")
    os.chmod(ctx / "app" / "run.sh", 0o755)
    (ctx / "notes.md").write_text("notes\n")
    logs = []
    t = (
        Template(file_context_path=str(ctx))
        .from_base_image()
        .pip_install("tomli-w==1.0.0")
        .copy("app", "app")
        .copy("notes.md", "/opt/docs/", user="root", mode=0o600)
        .run_cmd("cat app/hello.txt > from-run.txt && whoami > whoami.txt")
    )
    info = Template.build(
        t, f"{ALIAS}:v1", cpu_count=1, memory_mb=1024, on_build_logs=logs.append
    )
    return info, [l.message for l in logs]


def test_the_build_reports_its_steps_and_is_found_by_name(built):
    info, logs = built
    assert info.template_id and info.build_id
    # Lines of the daemon's build log, streamed through the status call.
    assert any("pip install" in m for m in logs), logs
    assert Template.exists(ALIAS)
    assert not Template.exists(f"{ALIAS}-nope")
    tags = {t.tag for t in Template.get_tags(ALIAS)}
    assert "v1" in tags


def test_a_sandbox_of_the_template_sees_the_package_and_the_files(built):
    info, _ = built
    s = Sandbox.create(info.template_id, timeout=120)
    try:
        r = s.commands.run("python3 -c 'import tomli_w; print(tomli_w.dumps({\"a\": 1}))'")
        assert r.stdout.strip() == "a = 1"
        assert s.files.read("/home/user/app/hello.txt") == HELLO
        # The steps ran as `user` in /home/user (E2B's defaults); a copy is
        # owned by the step's user unless it names one, and keeps its mode.
        r = s.commands.run(
            "cat /home/user/from-run.txt /home/user/whoami.txt; "
            "stat -c '%U %a' /home/user/app/hello.txt /home/user/app/run.sh /opt/docs/notes.md"
        )
        assert r.stdout.splitlines() == [
            HELLO.strip(),
            "user",
            "user 644",
            "user 755",
            "root 600",
        ], r.stdout
        # cpu_count=1, memory_mb=1024 is the template's size (the default
        # template is 512 MiB: the build ran on its 1 GiB size variant).
        r = s.commands.run("nproc; awk '/^MemTotal:/ {print int($2/1024)}' /proc/meminfo")
        cpus, mib = r.stdout.split()
        assert int(cpus) == 1, r.stdout
        assert 896 <= int(mib) <= 1024, r.stdout
    finally:
        s.kill()


def test_a_sandbox_created_by_the_templates_name(built):
    s = Sandbox.create(ALIAS, timeout=120)
    try:
        assert s.files.read("/home/user/app/hello.txt") == HELLO
    finally:
        s.kill()


def test_an_image_strata_does_not_have_is_refused_with_the_supported_list():
    with pytest.raises(Exception) as e:
        Template.build(
            Template().from_image("ubuntu:22.04").run_cmd("true"),
            f"{ALIAS}-ubuntu",
            cpu_count=1,
            memory_mb=1024,
        )
    assert "e2bdev/base" in str(e.value)
    assert not Template.exists(f"{ALIAS}-ubuntu")
