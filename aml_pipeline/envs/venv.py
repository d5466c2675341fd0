"""Building and inspecting the shared Python environment (a venv with pinned requirements).

Layout, for ``venv_path`` = ``P`` (default ``$AML_HOME/shared-env/venv``)::

    P                         symlink to the current build (relative), swapped with a rename
    P.<build id>/             one build: a complete venv, plus ``aml-env.json`` written last
                              (build id = UTC time + random suffix, e.g. 20250101T120000Z-1a2b3c)

A new build is created next to the old one *at its final path* and never moved afterwards
(a venv is not relocatable: ``pyvenv.cfg`` and the console scripts' shebangs hold its path).
Only when it is complete (installed, pins verified, imports checked, ``aml-env.json`` fsynced)
is the symlink ``P`` replaced atomically (``os.replace`` of a fresh symlink), so whoever opens
``P`` sees either the old or the new environment, never a half-built one. A crash at any
moment leaves ``P`` pointing at the old build; the half-built directory is removed by the next
rebuild. Old builds are deleted only by a caller that holds the exclusive lease (no reader can
be running in them). The lease directory is kept apart from all of this
(:func:`check_layout`): deleting a lease directory while leases are held would silently create
a second, independent lock.

Installers (``installer``):

* ``uv``   - ``uv venv`` + ``uv pip install -r requirements`` (network/index access);
* ``pip``  - ``python -m venv`` + ``pip install -r requirements`` (network/index access);
* ``auto`` - ``uv`` when it is on ``PATH``, else ``pip``;
* ``copy`` - offline: ``python -m venv`` and then the pinned distributions are copied (files
  listed in their ``RECORD``, site-packages only) from the environment running this code,
  i.e. the project environment, after checking that their installed versions equal the pins.
  Used by the tests and on machines without index access. Console scripts of the copied
  distributions are not copied (their shebangs point at the project environment).

Whatever the installer, the build is refused (and not swapped in) unless the packages listed
in the new environment (``uv pip list`` / ``pip list``) match every pin and ``check_imports``
import under the new interpreter.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

from aml_pipeline import config
from aml_pipeline.errors import AmlError
from aml_pipeline.fsutil import fsync_dir
from aml_pipeline.lease import DEFAULT_LEASE_NAME, EnvLease, LeaseHandle, is_postgres_location, open_lease

INSTALLERS = ("auto", "uv", "pip", "copy")
MARKER_FILE = "aml-env.json"
# Shipped with the package (requirements/shared-env.txt in the repository points at it).
DEFAULT_REQUIREMENTS = Path(__file__).with_name("shared-env.txt")
DEFAULT_CHECK_IMPORTS = ("numpy", "dagster_pipes")
DEFAULT_TIMEOUT_S = 1800.0
PROBE_TIMEOUT_S = 60.0

_PIN_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([A-Za-z0-9][A-Za-z0-9._+!-]*)$")
_BUILD_ID_RE = r"\d{8}T\d{6}Z-[0-9a-f]{6}"
# Variables that would make a subprocess see something other than the environment it runs in.
_LEAKY_VARS = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "VIRTUAL_ENV", "__PYVENV_LAUNCHER__")

# Run by the environment's own interpreter (with -E -s): what it is and whether imports work.
_PROBE = r"""
import importlib, json, platform, sys
errors = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as e:
        errors[name] = f"{type(e).__name__}: {e}"
print(json.dumps({"version": platform.python_version(), "implementation": platform.python_implementation(),
                  "executable": sys.executable, "prefix": sys.prefix,
                  "purelib": __import__("sysconfig").get_paths()["purelib"], "import_errors": errors}))
"""
# Fallback package listing when the environment has neither pip nor uv (what pip list reports).
_LIST = r"""
import importlib.metadata as m, json
seen = {}
for d in m.distributions():
    name = d.metadata["Name"]
    if name and name.lower() not in seen:
        seen[name.lower()] = {"name": name, "version": d.version}
print(json.dumps(sorted(seen.values(), key=lambda p: p["name"].lower())))
"""

Log = Callable[[str], None]


class EnvBuildError(AmlError):
    """The environment could not be built; the previous one (if any) is still current."""

    code = "ENV_BUILD_FAILED"


def normalize_name(name: str) -> str:
    """PEP 503 normalised distribution name (``Dagster_Pipes`` -> ``dagster-pipes``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def default_venv_path(home: Path | None = None) -> Path:
    return (home or config.aml_home()) / "shared-env" / "venv"


@dataclass(frozen=True)
class Pin:
    name: str
    version: str

    def __str__(self) -> str:
        return f"{self.name}=={self.version}"


def read_requirements(path: str | os.PathLike[str]) -> list[Pin]:
    """The pins of a requirements file: ``name==version`` per line; ``#`` comments, blank lines.

    Anything else (ranges, URLs, pip options) is refused: the shared environment is pinned.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise AmlError(f"requirements file {p}: {e.strerror or e}", code="ENV_REQUIREMENTS_INVALID") from None
    pins: list[Pin] = []
    seen: set[str] = set()
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _PIN_RE.fullmatch(line)
        if not m:
            raise AmlError(
                f"requirements file {p} line {lineno}: {line!r} is not a pin; the shared environment "
                "needs one `name==version` per line",
                code="ENV_REQUIREMENTS_INVALID",
            )
        key = normalize_name(m.group(1))
        if key in seen:
            raise AmlError(f"requirements file {p} line {lineno}: {m.group(1)} is pinned twice", code="ENV_REQUIREMENTS_INVALID")
        seen.add(key)
        pins.append(Pin(m.group(1), m.group(2)))
    return pins


@dataclass(frozen=True)
class EnvSettings:
    """Where the shared environment lives, what goes into it, and how it is built."""

    venv_path: Path
    lease_location: str
    lease_name: str = DEFAULT_LEASE_NAME
    requirements: Path = DEFAULT_REQUIREMENTS
    installer: str = "auto"
    python: str | None = None  # interpreter that creates the venv; default: the running one
    check_imports: tuple[str, ...] = DEFAULT_CHECK_IMPORTS
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.installer not in INSTALLERS:
            raise AmlError(f"installer {self.installer!r} must be one of {', '.join(INSTALLERS)}", code="ENV_CONFIG_INVALID")
        object.__setattr__(self, "venv_path", Path(os.path.abspath(os.fspath(self.venv_path))))
        object.__setattr__(self, "requirements", Path(os.path.abspath(os.fspath(self.requirements))))
        object.__setattr__(self, "check_imports", tuple(self.check_imports))

    @classmethod
    def from_environment(
        cls,
        *,
        venv_path: str | os.PathLike[str] | None = None,
        lease_location: str | None = None,
        **kw: Any,
    ) -> EnvSettings:
        """Settings with the documented defaults (``AML_ENV_LOCATION``, ``AML_HOME``) filled in."""
        kw = {k: v for k, v in kw.items() if v is not None}
        return cls(
            venv_path=Path(venv_path) if venv_path else default_venv_path(),
            lease_location=lease_location or config.env_location(),
            **kw,
        )

    def open_lease(self) -> EnvLease:
        return open_lease(self.lease_location, name=self.lease_name)

    def resolved_installer(self) -> str:
        if self.installer == "auto":
            return "uv" if shutil.which("uv") else "pip"
        return self.installer


def check_layout(settings: EnvSettings) -> None:
    """Refuse a venv path whose contents a rebuild would destroy, and a lease directory that a
    rebuild could delete (inside the venv path or a build)."""
    _check_venv_path(settings.venv_path)
    if is_postgres_location(settings.lease_location):
        return
    venv = settings.venv_path
    for lease_dir, parent in (
        (Path(os.path.abspath(settings.lease_location)), venv.parent),
        (Path(settings.lease_location).resolve(), venv.parent.resolve()),
    ):
        try:
            first = lease_dir.relative_to(parent).parts[0]
        except (ValueError, IndexError):
            continue
        if first == venv.name or first.startswith(venv.name + "."):
            raise AmlError(
                f"lease location {settings.lease_location} lies inside the shared environment's "
                f"path {venv} (or one of its builds), which a rebuild replaces; keep them apart",
                code="ENV_CONFIG_INVALID",
            )


def _check_venv_path(venv: Path) -> None:
    """A rebuild replaces the venv path by a symlink and deletes what stood there before as an
    old build, so the path must be a symlink (a rebuild's own), nothing yet, an empty directory,
    or a venv made by hand (``pyvenv.cfg``): a file or a directory of anything else (a typo'd
    ``--venv``) would be lost."""
    if venv.is_symlink() or not os.path.lexists(venv):
        return
    if venv.is_dir():
        try:
            if (venv / "pyvenv.cfg").is_file() or not any(venv.iterdir()):
                return
        except OSError as e:
            raise AmlError(f"the shared environment's path {venv}: cannot read it ({e.strerror or e})",
                           code="ENV_CONFIG_INVALID") from None
        what = "a directory that is not a Python environment (no pyvenv.cfg)"
    else:
        what = "a file"
    raise AmlError(
        f"the shared environment's path {venv} is {what}, which a rebuild would replace and delete; "
        "name another path (--venv) or move it away",
        code="ENV_CONFIG_INVALID",
    )


# ---- inspecting ----------------------------------------------------------------------------------


def _python_in(env_dir: Path) -> Path:
    return env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LEAKY_VARS}
    env.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    return env


def _run(
    cmd: Sequence[str], what: str, *, timeout: float, log: Log | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    if log:
        log(f"$ {' '.join(str(c) for c in cmd)}")
    try:
        proc = subprocess.run(
            [str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, env=_clean_env(),
            stdin=subprocess.DEVNULL, cwd=cwd,
        )
    except subprocess.TimeoutExpired:
        raise EnvBuildError(f"{what}: no result after {timeout:g}s ({cmd[0]} ...)") from None
    except OSError as e:
        raise EnvBuildError(f"{what}: cannot run {cmd[0]}: {e.strerror or e}") from None
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-5:])
        raise EnvBuildError(f"{what} failed (exit {proc.returncode}): {tail or 'no output'}")
    return proc


def _neutral_cwd(python: str | os.PathLike[str]) -> Path | None:
    """The environment's own root: ``-c``/``-m`` put the working directory on ``sys.path``, and
    the caller's (e.g. a repository with an ``.egg-info``) must not leak into what we inspect."""
    root = Path(python).parent.parent
    return root if root.is_dir() else None


def probe_python(python: str | os.PathLike[str], imports: Sequence[str] = (), *, timeout: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """Run ``python`` once: version, implementation, executable, prefix, failed imports."""
    proc = _run(
        [str(python), "-E", "-s", "-c", _PROBE, *imports], f"probing {python}", timeout=timeout, cwd=_neutral_cwd(python)
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def list_packages(python: str | os.PathLike[str], tool: str, *, timeout: float = PROBE_TIMEOUT_S) -> list[dict[str, str]]:
    """Installed distributions of the environment of ``python``: ``uv pip list`` (tool ``uv``) or
    ``pip list``; the same query through ``importlib.metadata`` if the environment has no pip."""
    if tool == "uv":
        cmd = ["uv", "pip", "list", "--python", str(python), "--format", "json"]
    else:
        has_pip = not probe_python(python, ("pip",), timeout=timeout)["import_errors"]
        cmd = (
            [str(python), "-E", "-s", "-m", "pip", "list", "--format", "json", "--disable-pip-version-check"]
            if has_pip
            else [str(python), "-E", "-s", "-c", _LIST]
        )
    proc = _run(cmd, f"listing the packages of {python}", timeout=timeout, cwd=_neutral_cwd(python))
    rows = json.loads(proc.stdout.strip() or "[]")
    return sorted(({"name": r["name"], "version": r["version"]} for r in rows), key=lambda r: normalize_name(r["name"]))


@dataclass
class EnvState:
    """What ``venv_path`` points at right now."""

    venv_path: Path
    build_dir: Path | None  # None: nothing there
    marker: dict[str, Any] | None  # aml-env.json of the build (None: not built by us / incomplete)

    @property
    def exists(self) -> bool:
        return self.build_dir is not None and _python_in(self.build_dir).exists()

    @property
    def python(self) -> Path | None:
        return _python_in(self.build_dir) if self.build_dir is not None else None


def current_env(venv_path: str | os.PathLike[str]) -> EnvState:
    path = Path(os.path.abspath(os.fspath(venv_path)))
    if path.is_symlink():
        target = Path(os.readlink(path))
        build = (path.parent / target) if not target.is_absolute() else target
        build = build if build.is_dir() else None
    elif path.is_dir():
        build = path  # a venv made by hand at the path itself (replaced by the next rebuild)
    else:
        build = None
    marker = None
    if build is not None:
        try:
            marker = json.loads((build / MARKER_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            marker = None
    return EnvState(path, build, marker)


def describe_env(venv_path: str | os.PathLike[str], *, probe: bool = True) -> dict[str, Any]:
    """The environment as ``env status`` shows it (runs its interpreter once when ``probe``)."""
    state = current_env(venv_path)
    info: dict[str, Any] = {
        "path": str(state.venv_path),
        "exists": state.exists,
        "build_dir": str(state.build_dir) if state.build_dir else None,
        "python": str(state.python) if state.exists else None,
        "complete": state.marker is not None,
    }
    if state.marker:
        for k in ("build_id", "created_at", "installer", "python_version", "requirements", "requirements_sha256", "packages"):
            info[k] = state.marker.get(k)
    if probe and state.exists:
        try:
            p = probe_python(state.python, timeout=15)  # type: ignore[arg-type]
            info["python_version"] = p["version"]
            info["implementation"] = p["implementation"]
            info["python_ok"] = True
        except AmlError as e:
            info["python_ok"] = False
            info["python_error"] = e.message
    return info


# ---- building ------------------------------------------------------------------------------------


@dataclass
class EnvBuild:
    """A finished rebuild: what is now current, and what it replaced."""

    venv_path: Path
    build_dir: Path
    build_id: str
    python: Path
    python_version: str
    implementation: str
    installer: str
    requirements_file: Path
    requirements: list[str]
    requirements_sha256: str
    packages: list[dict[str, str]]
    created_at: str
    duration_s: float
    replaced: str | None = None
    removed: list[str] = field(default_factory=list)

    def marker(self) -> dict[str, Any]:
        return {
            "build_id": self.build_id,
            "created_at": self.created_at,
            "installer": self.installer,
            "python": str(self.python),
            "python_version": self.python_version,
            "implementation": self.implementation,
            "requirements_file": str(self.requirements_file),
            "requirements": self.requirements,
            "requirements_sha256": self.requirements_sha256,
            "packages": self.packages,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "venv_path": str(self.venv_path),
            "build_dir": str(self.build_dir),
            **self.marker(),
            "duration_s": round(self.duration_s, 3),
            "replaced": self.replaced,
            "removed": self.removed,
        }

    @property
    def packages_fingerprint(self) -> str:
        """Identifies the environment's content (Python version + packages) across rebuilds."""
        blob = json.dumps([self.implementation, self.python_version, self.packages], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _new_build_id() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]


def _copy_plan(pins: list[Pin]) -> list[importlib_metadata.Distribution]:
    """The ``copy`` installer's sources: the pinned distributions of the running environment,
    checked against the pins before anything is built."""
    dists = []
    pinned = {normalize_name(p.name) for p in pins}
    for pin in pins:
        try:
            dist = importlib_metadata.distribution(pin.name)
        except importlib_metadata.PackageNotFoundError:
            raise EnvBuildError(
                f"copy installer: {pin.name} is not installed in the project environment ({sys.prefix})"
            ) from None
        if dist.version != pin.version:
            raise EnvBuildError(
                f"copy installer: the project environment has {pin.name} {dist.version}, the requirements pin {pin.version}"
            )
        for req in dist.requires or []:
            name = re.split(r"[\s\[<>=!~;(]", req, maxsplit=1)[0]
            if ";" not in req and normalize_name(name) not in pinned:
                raise EnvBuildError(f"copy installer: {pin.name} requires {name}, which the requirements do not pin")
        if not dist.files:
            raise EnvBuildError(f"copy installer: {pin.name} lists no files (no RECORD); it cannot be copied")
        dists.append(dist)
    return dists


def _copy_distributions(dists: list[importlib_metadata.Distribution], purelib: Path, log: Log) -> None:
    """Copy each distribution's files (as listed in its RECORD) that live in its site-packages."""
    for dist in dists:
        root = Path(dist.locate_file("")).resolve()
        copied = 0
        for rel in dist.files or []:
            src = Path(dist.locate_file(rel)).resolve()
            try:
                inside = src.relative_to(root)
            except ValueError:
                continue  # console scripts etc. outside site-packages
            if not src.is_file():
                continue
            dst = purelib / inside
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
            copied += 1
        log(f"copied {dist.metadata['Name']} {dist.version} ({copied} files) from {root}")


def _verify_pins(pins: list[Pin], packages: list[dict[str, str]]) -> None:
    have = {normalize_name(p["name"]): p["version"] for p in packages}
    wrong = [f"{p} (have {have.get(normalize_name(p.name), 'none')})" for p in pins if have.get(normalize_name(p.name)) != p.version]
    if wrong:
        raise EnvBuildError(f"the new environment does not match its pins: {', '.join(wrong)}")


def _old_builds(venv_path: Path) -> list[Path]:
    pattern = re.compile(re.escape(venv_path.name) + r"\." + _BUILD_ID_RE)
    if not venv_path.parent.is_dir():
        return []
    return sorted(p for p in venv_path.parent.iterdir() if pattern.fullmatch(p.name) and not p.is_symlink())


def _swap_in(venv_path: Path, build_dir: Path) -> str | None:
    """Point ``venv_path`` at ``build_dir`` atomically; return the build it pointed at before."""
    before = current_env(venv_path).build_dir
    if venv_path.is_dir() and not venv_path.is_symlink():
        # A venv made by hand at the path itself: move it aside first (readers are excluded by
        # the exclusive lease, and it is deleted with the other old builds).
        aside = venv_path.with_name(f"{venv_path.name}.{_new_build_id()}")
        os.rename(venv_path, aside)
        before = aside
    tmp = venv_path.with_name(f".{venv_path.name}.link-{uuid.uuid4().hex[:8]}")
    os.symlink(build_dir.name, tmp)
    os.replace(tmp, venv_path)
    fsync_dir(venv_path.parent)
    return str(before) if before is not None else None


def build_env(settings: EnvSettings, lease_handle: LeaseHandle, *, log: Log | None = None) -> EnvBuild:
    """Build a fresh environment next to the current one, verify it and swap it in.

    ``lease_handle`` must be the held *exclusive* lease of ``settings``' location: old builds
    are deleted, which is only safe while no reader can be running in them.
    """
    say: Log = log or (lambda _m: None)
    if lease_handle.mode != "exclusive" or not lease_handle.is_held():
        raise AmlError("rebuilding the shared environment needs the held exclusive lease", code="ENV_LEASE_REQUIRED")
    check_layout(settings)
    started = time.monotonic()
    pins = read_requirements(settings.requirements)
    req_sha = hashlib.sha256(settings.requirements.read_bytes()).hexdigest()
    installer = settings.resolved_installer()
    if installer == "uv" and not shutil.which("uv"):
        raise EnvBuildError("installer uv: uv is not on PATH (use installer auto or pip)")
    base_python = settings.python or sys.executable
    sources = _copy_plan(pins) if installer == "copy" else []
    venv = settings.venv_path
    venv.parent.mkdir(parents=True, exist_ok=True)
    build_id = _new_build_id()
    build_dir = venv.with_name(f"{venv.name}.{build_id}")
    say(f"building the shared environment in {build_dir} (installer {installer}, {len(pins)} pins, python {base_python})")
    ok = False
    try:
        t = settings.timeout_s
        if installer == "uv":
            _run(["uv", "venv", "--python", base_python, "--seed", str(build_dir)], "uv venv", timeout=t, log=say)
        else:
            _run([base_python, "-m", "venv", str(build_dir)], "python -m venv", timeout=t, log=say)
        python = _python_in(build_dir)
        probe = probe_python(python, timeout=t)
        if pins:
            if installer == "uv":
                _run(["uv", "pip", "install", "--python", str(python), "-r", str(settings.requirements)], "uv pip install", timeout=t, log=say)
            elif installer == "pip":
                _run(
                    [python, "-E", "-s", "-m", "pip", "install", "--no-input", "--disable-pip-version-check", "-r", settings.requirements],
                    "pip install", timeout=t, log=say, cwd=build_dir,
                )
            else:
                mine = f"{sys.version_info.major}.{sys.version_info.minor}"
                if not probe["version"].startswith(mine + "."):
                    raise EnvBuildError(
                        f"copy installer: the new environment runs Python {probe['version']}, the project "
                        f"environment {mine}; compiled packages cannot be copied across versions"
                    )
                _copy_distributions(sources, Path(probe["purelib"]), say)
        packages = list_packages(python, "uv" if installer == "uv" else "pip", timeout=t)
        _verify_pins(pins, packages)
        checked = probe_python(python, settings.check_imports, timeout=t)
        if checked["import_errors"]:
            bad = "; ".join(f"{m}: {err}" for m, err in checked["import_errors"].items())
            raise EnvBuildError(f"the new environment cannot import what it must: {bad}")
        build = EnvBuild(
            venv_path=venv,
            build_dir=build_dir,
            build_id=build_id,
            python=python,
            python_version=probe["version"],
            implementation=probe["implementation"],
            installer=installer,
            requirements_file=settings.requirements.resolve(),
            requirements=[str(p) for p in pins],
            requirements_sha256=req_sha,
            packages=packages,
            created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            duration_s=0.0,
        )
        marker = build_dir / MARKER_FILE
        with open(marker, "w", encoding="utf-8") as f:
            json.dump(build.marker(), f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(build_dir)
        if hasattr(os, "sync"):
            os.sync()  # the installed files too: the swap must never expose unflushed ones
        if not lease_handle.is_held():
            raise AmlError("the exclusive lease was lost during the rebuild; not swapping in", code="ENV_LEASE_REQUIRED")
        build.replaced = _swap_in(venv, build_dir)
        ok = True
        say(f"shared environment {venv} -> {build_dir.name} (Python {build.python_version}, {len(packages)} packages)")
    finally:
        if not ok:
            shutil.rmtree(build_dir, ignore_errors=True)
    for old in _old_builds(venv):
        if old != build_dir:
            shutil.rmtree(old, ignore_errors=True)
            build.removed.append(str(old))
    build.duration_s = time.monotonic() - started
    return build


__all__ = [
    "DEFAULT_CHECK_IMPORTS",
    "DEFAULT_REQUIREMENTS",
    "INSTALLERS",
    "MARKER_FILE",
    "EnvBuild",
    "EnvBuildError",
    "EnvSettings",
    "EnvState",
    "Pin",
    "build_env",
    "check_layout",
    "current_env",
    "default_venv_path",
    "describe_env",
    "list_packages",
    "normalize_name",
    "probe_python",
    "read_requirements",
]
