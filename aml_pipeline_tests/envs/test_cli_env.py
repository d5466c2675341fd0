"""``aml-pipeline env status|rebuild``, each run as its own process with AML_HOME defaults."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import pytest

from aml_pipeline.envs import EnvSettings, use_shared_env
from aml_pipeline.lease import EnvBusy
from aml_pipeline_tests.envs.support import CLI, REPO_ROOT, LeaseHolder, run_cli


def _settings(home) -> EnvSettings:
    # What the CLI uses by default under AML_HOME: lease $AML_HOME/env, venv $AML_HOME/shared-env/venv.
    return EnvSettings(venv_path=home / "shared-env" / "venv", lease_location=str(home / "env"))


def _defaults_under(home) -> dict[str, str]:
    """The CLI's environment with only AML_HOME set (lease and venv take their defaults)."""
    return {**{k: v for k, v in os.environ.items() if k != "AML_ENV_LOCATION"}, "AML_HOME": str(home)}


def test_env_status_rebuild_and_busy(tmp_path):
    home = tmp_path / "home"
    os_env = _defaults_under(home)

    first = run_cli("env", "status", "--json", env=os_env)
    assert first.returncode == 0, first.stderr
    status = json.loads(first.stdout)
    assert status["lease"]["location"] == str(home / "env") and status["lease"]["readers"] == 0
    assert status["lease"]["exclusive"] is None and status["env"]["exists"] is False

    built = run_cli("env", "rebuild", "--installer", "copy", "--json", env=os_env)
    assert built.returncode == 0, built.stderr
    build = json.loads(built.stdout)
    assert build["venv_path"] == str(home / "shared-env" / "venv")
    assert {p["name"]: p["version"] for p in build["packages"]}["numpy"] == "2.4.6"
    assert "holding the exclusive lease" in built.stderr

    settings = _settings(home)
    with LeaseHolder(settings, "nightly training") as reader:
        status = json.loads(run_cli("env", "status", "--json", env=os_env).stdout)
        assert status["lease"]["readers"] == 1 and status["lease"]["holders"] == ["nightly training"]
        lease = status["lease"]["reader_leases"][0]
        assert lease["pid"] == reader.pid and lease["host"] == socket.gethostname() and lease["since"] > 0
        assert status["env"]["exists"] and status["env"]["python"] == str(
            home / "shared-env" / build["build_dir"].rsplit("/", 1)[1] / "bin" / "python"
        )
        assert status["env"]["python_version"] == build["python_version"]

        text = run_cli("env", "status", env=os_env)
        assert text.returncode == 0
        assert "readers    1" in text.stdout and "nightly training (pid" in text.stdout
        assert "numpy" in text.stdout and build["python_version"] in text.stdout

        busy = run_cli("env", "rebuild", "--installer", "copy", env=os_env)
        assert busy.returncode == 2
        assert busy.stderr.startswith("ENV_BUSY: ") and "nightly training" in busy.stderr
        assert "Traceback" not in busy.stderr and len(busy.stderr.strip().splitlines()) == 1
        assert "waited" not in busy.stderr  # refused at once

        waited = run_cli("env", "rebuild", "--installer", "copy", "--wait-s", "0.5", env=os_env)
        assert waited.returncode == 2 and "waited 0.5s" in waited.stderr

    # The refused rebuilds changed nothing.
    after = json.loads(run_cli("env", "status", "--json", env=os_env).stdout)
    assert after["env"]["build_dir"] == build["build_dir"] and after["idle"]


def test_env_status_names_the_exclusive_owner(tmp_path):
    home = tmp_path / "home"
    os_env = _defaults_under(home)
    with LeaseHolder(_settings(home), "rebuild by ops", mode="exclusive") as owner:
        status = json.loads(run_cli("env", "status", "--json", env=os_env).stdout)
        ex = status["lease"]["exclusive"]
        assert ex["holder"] == "rebuild by ops" and ex["pid"] == owner.pid and ex["since_iso"].endswith("Z")
        text = run_cli("env", "status", env=os_env).stdout
        assert f"exclusive  rebuild by ops (pid {owner.pid}, host {socket.gethostname()}, since " in text


def test_env_location_and_paths_from_flags_and_environment(tmp_path):
    lease_dir = tmp_path / "elsewhere" / "lease"
    os_env = {**os.environ, "AML_HOME": str(tmp_path / "home"), "AML_ENV_LOCATION": str(lease_dir)}
    status = json.loads(run_cli("env", "status", "--json", env=os_env).stdout)
    assert status["lease"]["location"] == str(lease_dir)
    flagged = json.loads(
        run_cli("env", "status", "--json", "--location", str(tmp_path / "l2"), "--venv", str(tmp_path / "v"), env=os_env).stdout
    )
    assert flagged["lease"]["location"] == str(tmp_path / "l2") and flagged["env"]["path"] == str(tmp_path / "v")
    bad = run_cli("env", "rebuild", "--location", str(tmp_path / "v" / "lease"), "--venv", str(tmp_path / "v"), env=os_env)
    assert bad.returncode == 2 and bad.stderr.startswith("ENV_CONFIG_INVALID: ")


def test_env_status_shows_a_waiting_rebuild_that_then_gets_the_lease(tmp_path):
    home = tmp_path / "home"
    os_env = _defaults_under(home)
    settings = _settings(home)
    reader = LeaseHolder(settings, "nightly training")
    try:
        rebuild = subprocess.Popen(
            [*CLI, "env", "rebuild", "--installer", "copy", "--wait-s", "120", "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os_env, cwd=REPO_ROOT,
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                status = json.loads(run_cli("env", "status", "--json", env=os_env).stdout)
                if status["lease"]["waiting"] is not None:
                    break
                assert rebuild.poll() is None and time.monotonic() < deadline, status
                time.sleep(0.1)
            waiting = status["lease"]["waiting"]
            assert waiting["holder"] == "aml-pipeline env rebuild" and waiting["pid"] == rebuild.pid
            assert waiting["deadline"] - waiting["since"] == pytest.approx(120, abs=1e-3)
            assert status["lease"]["holders"] == ["nightly training"] and not status["idle"]

            text = run_cli("env", "status", env=os_env).stdout
            assert (f"waiting    aml-pipeline env rebuild (pid {rebuild.pid}, host {socket.gethostname()}, "
                    f"since {waiting['since_iso']}, until {waiting['deadline_iso']}): no new read lease meanwhile") in text
            assert "readers    1" in text and "nightly training (pid" in text
            # A new reader is refused naming the waiting rebuild and its deadline.
            with pytest.raises(EnvBusy) as info:
                with use_shared_env(settings, holder="evaluation"):
                    pass
            assert "a rebuild is waiting for the exclusive lock: aml-pipeline env rebuild" in info.value.message
            assert f"until {waiting['deadline_iso']}" in info.value.message

            reader.release()  # the reader is done: the rebuild gets the lease and builds
            out, err = rebuild.communicate(timeout=300)
            assert rebuild.returncode == 0, err
            assert json.loads(out)["venv_path"] == str(home / "shared-env" / "venv")
        finally:
            if rebuild.poll() is None:
                rebuild.kill()
                rebuild.communicate()
    finally:
        reader.close()
    after = json.loads(run_cli("env", "status", "--json", env=os_env).stdout)
    assert after["idle"] and after["lease"]["waiting"] is None and after["env"]["exists"]


@pytest.mark.parametrize("what", ["file", "directory"])
def test_rebuild_refuses_a_venv_path_holding_something_else_and_leaves_it_alone(tmp_path, what):
    """A rebuild puts a symlink where --venv points and deletes what stood there as an old build:
    a file, or a directory that is no venv (a mistyped --venv), is refused before anything is built."""
    target = tmp_path / "notes"
    if what == "file":
        target.write_text("keep me\n")
    else:
        (target / "sub").mkdir(parents=True)
        (target / "sub" / "data.txt").write_text("keep me\n")
    done = run_cli("env", "rebuild", "--installer", "copy", "--venv", str(target),
                   "--location", str(tmp_path / "lease"), env=_defaults_under(tmp_path / "home"))
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("ENV_CONFIG_INVALID: ") and str(target) in line and "--venv" in line
    assert ("is a file" if what == "file" else "no pyvenv.cfg") in line
    assert not target.is_symlink()
    assert (target if what == "file" else target / "sub" / "data.txt").read_text() == "keep me\n"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("notes")) == ["notes"]  # no build begun
