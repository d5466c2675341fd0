"""Building the shared environment for real: venvs, pins, the atomic swap, the lease."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aml_pipeline.envs import (
    DEFAULT_REQUIREMENTS,
    EnvBuildError,
    build_env,
    check_layout,
    current_env,
    read_requirements,
    rebuild_shared_env,
    shared_env_status,
    use_shared_env,
)
from aml_pipeline.errors import AmlError
from aml_pipeline.lease import EnvBusy
from aml_pipeline_tests.envs.support import REPO_ROOT, LeaseHolder, env_settings


def _builds(settings) -> list[str]:
    parent = settings.venv_path.parent
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("venv.")) if parent.is_dir() else []


def test_requirements_are_pins_at_the_constraint_versions():
    pins = {p.name: p.version for p in read_requirements(DEFAULT_REQUIREMENTS)}
    assert set(pins) == {"numpy", "dagster-pipes"}
    constraints = dict(
        line.split("==") for line in (REPO_ROOT / "requirements" / "constraints.txt").read_text().split() if "==" in line
    )
    assert pins == {name: constraints[name] for name in pins}


def test_requirements_refuse_anything_but_pins(tmp_path):
    ok = tmp_path / "ok.txt"
    ok.write_text("# comment\n\nnumpy == 2.4.6  # trailing\nDagster_Pipes==1.13.27\n")
    assert [str(p) for p in read_requirements(ok)] == ["numpy==2.4.6", "Dagster_Pipes==1.13.27"]
    for bad in ("numpy>=2\n", "--index-url http://x\n", "git+https://example.invalid/x.git\n", "numpy==1\nnumpy==2\n"):
        path = tmp_path / "bad.txt"
        path.write_text(bad)
        with pytest.raises(AmlError) as err:
            read_requirements(path)
        assert err.value.code == "ENV_REQUIREMENTS_INVALID"
    with pytest.raises(AmlError, match="missing.txt"):
        read_requirements(tmp_path / "missing.txt")


def test_lease_directory_may_not_live_where_a_rebuild_deletes(tmp_path):
    base = tmp_path / "se"
    for lease in (base / "venv", base / "venv" / "locks", base / "venv.20250101T000000Z-abcdef" / "l"):
        with pytest.raises(AmlError) as err:
            check_layout(env_settings(tmp_path).__class__(venv_path=base / "venv", lease_location=str(lease)))
        assert err.value.code == "ENV_CONFIG_INVALID"
    check_layout(env_settings(tmp_path))  # <base>/lease beside <base>/shared-env/venv: fine
    check_layout(env_settings(tmp_path).__class__(venv_path=base / "venv", lease_location=str(base / "venv-locks")))


def test_copy_build_is_isolated_pinned_and_swapped_in_atomically(tmp_path):
    settings = env_settings(tmp_path)
    # A half-built directory left by a crashed rebuild: never current, removed by the next one.
    settings.venv_path.parent.mkdir(parents=True)
    crashed = settings.venv_path.with_name("venv.20000101T000000Z-abcdef")
    (crashed / "bin").mkdir(parents=True)

    first = rebuild_shared_env(settings, holder="test")
    assert settings.venv_path.is_symlink() and os.readlink(settings.venv_path) == first.build_dir.name
    assert not crashed.exists() and str(crashed) in first.removed
    assert first.python == first.build_dir / "bin" / "python" and first.python.exists()
    names = {p["name"].lower(): p["version"] for p in first.packages}
    assert names["numpy"] == "2.4.6" and names["dagster-pipes"] == "1.13.27"
    assert set(names) <= {"numpy", "dagster-pipes", "pip", "setuptools", "wheel"}
    assert (first.build_dir / "aml-env.json").exists()

    # Isolated: the pins import, the project environment's other packages do not.
    code = (
        "import importlib.util as u, numpy, dagster_pipes, sys; "
        "print(numpy.__file__); print(u.find_spec('dagster') is None, u.find_spec('aml_pipeline') is None)"
    )
    out = subprocess.run(
        [str(settings.venv_path / "bin" / "python"), "-E", "-s", "-c", code],
        capture_output=True, text=True, check=True, cwd=tmp_path,  # not the repository: -c puts cwd on sys.path
    ).stdout.split()
    assert out[0].startswith(str(settings.venv_path)) and out[1:] == ["True", "True"]

    second = rebuild_shared_env(settings, holder="test")
    assert second.build_dir != first.build_dir
    assert os.readlink(settings.venv_path) == second.build_dir.name
    assert second.replaced == str(first.build_dir) and not first.build_dir.exists()
    assert _builds(settings) == [second.build_dir.name]
    assert second.packages == first.packages  # same pins, same environment content
    status = shared_env_status(settings)
    assert status["idle"] and status["env"]["exists"] and status["env"]["python_ok"]
    assert status["env"]["build_dir"] == str(second.build_dir)


def test_failed_build_leaves_the_current_environment_alone(tmp_path):
    settings = env_settings(tmp_path)
    good = rebuild_shared_env(settings, holder="test")
    broken = settings.__class__(**{**settings.__dict__, "check_imports": ("numpy", "no_such_module_anywhere")})
    with pytest.raises(EnvBuildError, match="no_such_module_anywhere"):
        rebuild_shared_env(broken, holder="test")
    assert os.readlink(settings.venv_path) == good.build_dir.name
    assert _builds(settings) == [good.build_dir.name]  # the failed build was removed
    with use_shared_env(settings, holder="reader") as env:
        assert env.python == good.python


def test_copy_refuses_pins_the_project_environment_does_not_have_before_building(tmp_path):
    req = tmp_path / "req.txt"
    req.write_text("numpy==0.0.1\n")
    settings = env_settings(tmp_path, requirements=req)
    with pytest.raises(EnvBuildError, match=r"numpy 2\.4\.6, the requirements pin 0\.0\.1"):
        rebuild_shared_env(settings, holder="test")
    assert not settings.venv_path.exists()  # refused before any venv was made and _builds(settings) == []


def test_building_needs_the_exclusive_lease(tmp_path):
    settings = env_settings(tmp_path)
    with settings.open_lease().read("someone") as handle:
        with pytest.raises(AmlError) as err:
            build_env(settings, handle)
    assert err.value.code == "ENV_LEASE_REQUIRED"
    assert not settings.venv_path.exists()


def test_rebuild_is_refused_with_env_busy_while_another_process_reads(tmp_path):
    settings = env_settings(tmp_path)
    with LeaseHolder(settings, "training job 7") as reader:
        with pytest.raises(EnvBusy) as err:
            rebuild_shared_env(settings, holder="test rebuild")
        assert err.value.code == "ENV_BUSY" and "training job 7" in err.value.one_line()
        assert "waited" not in err.value.message and not settings.venv_path.exists()  # at once, nothing built
        started = time.monotonic()
        with pytest.raises(EnvBusy, match="waited 0.3s"):
            rebuild_shared_env(settings, holder="test rebuild", wait_s=0.3)
        assert time.monotonic() - started >= 0.3
        status = shared_env_status(settings, probe=False)
        assert status["lease"]["holders"] == ["training job 7"]
        assert status["lease"]["reader_leases"][0]["pid"] == reader.pid
    assert not settings.venv_path.exists() and _builds(settings) == []


def test_readers_get_env_missing_until_built_and_env_busy_during_a_rebuild(tmp_path):
    settings = env_settings(tmp_path)
    with pytest.raises(AmlError) as err:
        with use_shared_env(settings, holder="reader"):
            pass
    assert err.value.code == "ENV_MISSING"
    with LeaseHolder(settings, "rebuild in progress", mode="exclusive"):
        with pytest.raises(EnvBusy, match="rebuild in progress"):
            with use_shared_env(settings, holder="reader"):
                pass
    assert shared_env_status(settings, probe=False)["idle"]


def test_status_of_an_environment_made_by_hand(tmp_path):
    settings = env_settings(tmp_path)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(settings.venv_path)], check=True)
    state = current_env(settings.venv_path)
    assert state.exists and state.marker is None
    env = shared_env_status(settings)["env"]
    assert env["exists"] and not env["complete"] and re.fullmatch(r"3\.\d+\.\d+", env["python_version"])
    # A reader refuses it (not verified against the pins) ...
    with pytest.raises(AmlError, match="not built"):
        with use_shared_env(settings, holder="reader"):
            pass
    # ... and a rebuild replaces it with a symlinked build.
    build = rebuild_shared_env(settings, holder="test")
    assert settings.venv_path.is_symlink() and os.readlink(settings.venv_path) == build.build_dir.name
    assert build.replaced and not Path(build.replaced).exists()
    assert json.loads((build.build_dir / "aml-env.json").read_text())["installer"] == "copy"


def test_packages_are_listed_without_pip_too(tmp_path):
    from aml_pipeline.envs import list_packages

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "v")], check=True)
    assert list_packages(tmp_path / "v" / "bin" / "python", "pip") == []  # importlib.metadata fallback
    here = {p["name"].lower(): p["version"] for p in list_packages(sys.executable, "pip")}  # pip list
    assert here["numpy"] == "2.4.6" and here["dagster"] == "1.13.27"
