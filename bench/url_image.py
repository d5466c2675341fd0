"""The run plot as an image URL instead of base64 in the event log: what it would save, and
whether Dagster's UI shows it.

Dagster 1.13 has no image metadata type; the run plot is a PNG inside the ``plot`` markdown as a
``data:`` URI, so the event log holds it (``event_log_kb_per_run``). The UI renders markdown
metadata through ``rehype-sanitize``, which lets ``http(s)`` image sources through, and the
webserver's content security policy has no ``img-src``, so a browser would fetch an image named
by URL from wherever it is served. This measures that alternative without building it:

* ``event_log_kb_per_run``: the real build (``materialize_dataset``) of ``LOG_RUNS``-like runs into
  fresh persistent SQLite instances, three times: the plot as the build writes it (``data_uri``);
  each run's PNG written to a folder and its markdown naming it by URL instead (``url``: the same
  markdown with ``http://127.0.0.1:PORT/<file>.png`` in place of the ``data:`` URI, everything
  else the build's own); and plots off (``AML_RUN_PLOTS=off``). Each side's instance directory
  size less the plots-off side's, per run (whole 4 KB pages: coarse for a few runs), and the
  plot's markdown per run both ways (``markdown_kb_per_run``).
* ``ui``: ``dagster dev`` on the ``url`` side's instance (the product's definitions over the same
  TSDB and specs), a headless chromium opening a run partition of the cleaned grid and the
  plot's markdown, as a person does: whether the image loads, its natural size against the PNG's,
  and the requests the image folder's server saw. The folder is served by Python's
  ``http.server`` on loopback, standing in for what a deployment already runs (an object store,
  the file server in front of the datasets); the project ships no such server.
* ``csp``: the webserver's ``Content-Security-Policy`` header, as served.

    .venv/bin/python -m bench.url_image [--runs 3] [--minutes 30] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import http.server
import os
import re
import shutil
import struct
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import dir_bytes, fresh_dir, print_results  # noqa: E402
from bench.workload import make_workload  # noqa: E402

_DATA_URI = re.compile(r"\(data:image/png;base64,([A-Za-z0-9+/=]+)\)")
# A page of the UI renders in seconds; these only bound waits on a busy host.
LOAD_TIMEOUT_S = 420
BROWSER_TIMEOUT_MS = 120_000


@contextlib.contextmanager
def image_server(folder: Path) -> Iterator[tuple[str, list[str]]]:
    """``folder`` served over HTTP on a free loopback port: its base URL and the paths requested."""
    requested: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            requested.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, name="image-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requested
    finally:
        server.shutdown()
        server.server_close()


def url_markdown(markdown: str, folder: Path, base_url: str) -> str:
    """``markdown`` with its ``data:`` PNG written to ``folder`` and named by URL under ``base_url``."""
    def to_url(m: re.Match[str]) -> str:
        import base64

        png = base64.b64decode(m.group(1))
        name = hashlib.sha256(png).hexdigest()[:16] + ".png"
        (folder / name).write_bytes(png)
        return f"({base_url}/{name})"

    out, n = _DATA_URI.subn(to_url, markdown)
    if n != 1:
        raise RuntimeError(f"url_image: expected one data: PNG in the plot's markdown, found {n}")
    return out


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's header."""
    head = path.read_bytes()[:24]
    return struct.unpack(">II", head[16:24])


def _build(workload: Any, directory: Path, *, plots: bool, url: tuple[Path, str] | None = None,
           markdown: dict[str, list[int]] | None = None) -> int:
    """The real build of ``workload`` into a fresh persistent SQLite instance in
    ``directory/instance``; its size after the build (closed). ``url``: (folder, base URL) for
    the plot by URL; ``markdown`` then gets the bytes of each run's plot markdown, as drawn
    (``data_uri``) and as recorded (``url``)."""
    from aml_pipeline.pipeline import plots as plots_module
    from aml_pipeline.runner.build import materialize_dataset
    from aml_pipeline.spec import parse_spec
    from bench.dagster_bench import persistent_instance

    fresh_dir(directory)
    patches = contextlib.ExitStack()
    patches.enter_context(mock.patch.dict(os.environ, {"AML_RUN_PLOTS": "on" if plots else "off"}))
    if url is not None:
        draw = plots_module.run_traces_markdown
        sizes = markdown if markdown is not None else {}

        def by_url(*a: Any, **k: Any) -> str:
            drawn = draw(*a, **k)
            recorded = url_markdown(drawn, *url)
            sizes.setdefault("data_uri", []).append(len(drawn.encode()))
            sizes.setdefault("url", []).append(len(recorded.encode()))
            return recorded

        patches.enter_context(mock.patch.object(plots_module, "run_traces_markdown", by_url))
    with patches, persistent_instance(directory / "instance") as instance:
        summary = materialize_dataset(parse_spec(workload.spec), tsdb_url=workload.tsdb_url, home=directory / "aml",
                                      instance=instance, console_log_level="CRITICAL")
    built = summary["materialized"]["run_windows"]
    if built != len(workload.runs):
        raise RuntimeError(f"url_image: the build recorded {built} of {len(workload.runs)} runs")
    return dir_bytes(directory / "instance")


def _ui(workload: Any, directory: Path, images: Path, base_url: str, requested: list[str]) -> dict[str, Any]:
    """``dagster dev`` on the ``url`` side's instance (built in ``directory``, its PNGs in ``images``);
    a run partition's plot opened in chromium."""
    import requests
    import yaml

    from aml_pipeline_tests.browser import browser_page, dismiss_dialogs
    from aml_pipeline_tests.dagster_server import DagsterDev, running

    specs = directory / "specs"
    specs.mkdir(exist_ok=True)
    spec_id = workload.spec["id"]
    (specs / f"{spec_id}.yaml").write_text(yaml.safe_dump(workload.spec, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "AML_"))}
    env.update(DAGSTER_HOME=str(directory / "instance"), AML_HOME=str(directory / "aml"),
               AML_TSDB_URL=workload.tsdb_url, AML_SPECS=str(specs), AML_ENV_LOCATION=str(directory / "aml" / "env"),
               PYTHONUNBUFFERED="1")
    server = DagsterDev(module="aml_pipeline.definitions", env=env, cwd=directory, log_path=directory / "dagster-dev.log")
    run_id = workload.runs[0]["run_id"]
    before = len(requested)
    with running(server):
        server.wait_for_graphql(LOAD_TIMEOUT_S)
        server.wait_for_location(LOAD_TIMEOUT_S)
        csp = requests.get(server.url, timeout=60).headers.get("Content-Security-Policy")
        with browser_page(1366, 768) as page:
            page.goto(f"{server.url}/assets/{spec_id}/cleaned_grid?view=partitions&partition={run_id}")
            dismiss_dialogs(page)
            try:
                plot_row = page.locator("tr", has=page.get_by_role("cell", name="plot", exact=True)).first
                plot_row.wait_for(timeout=BROWSER_TIMEOUT_MS)
                # The UI shows markdown of fewer than 1,000 characters in the metadata table itself;
                # longer markdown (the base64 plot) behind "[Show Markdown]".
                inline = plot_row.get_by_text("[Show Markdown]").count() == 0
                if not inline:
                    plot_row.get_by_text("[Show Markdown]").click(timeout=BROWSER_TIMEOUT_MS)
                image = page.locator(f"img[src^='{base_url}/']").first
                image.wait_for(timeout=BROWSER_TIMEOUT_MS)
                image.scroll_into_view_if_needed()
            except Exception:
                page.screenshot(path=str(directory / "ui-plot-by-url-failed.png"), full_page=True)
                raise
            shown = image.evaluate("""async e => {
                if (!e.complete) await new Promise(r => { e.onload = r; e.onerror = r; });
                let box = e.parentElement;  // the nearest box that clips or scrolls it
                while (box && getComputedStyle(box).overflowX === 'visible') box = box.parentElement;
                const right = box ? Math.min(box.getBoundingClientRect().right, window.innerWidth) : window.innerWidth;
                const r = e.getBoundingClientRect();
                return {src: e.getAttribute('src'), complete: e.complete, width: e.naturalWidth, height: e.naturalHeight,
                        rendered: e.offsetWidth, visible: Math.max(0, Math.min(r.right, right) - r.left)};
            }""")
            page.screenshot(path=str(directory / "ui-plot-by-url.png"))
    name = shown["src"].rsplit("/", 1)[-1]
    expected = list(png_size(images / name))
    return {
        "run": run_id,
        "inline": inline,
        "rendered": bool(shown["complete"]) and [shown["width"], shown["height"]] == expected,
        "natural_size": [shown["width"], shown["height"]],
        "png_size": expected,
        # Pixels of the image's width drawn (offsetWidth) and in view on the 1366 x 768 screen.
        "rendered_width": shown["rendered"],
        "visible_width": round(shown["visible"]),
        "requests": [p for p in requested[before:] if p.endswith(".png")],
        "csp": csp,
        "csp_has_img_src": bool(csp) and "img-src" in csp,
        "screenshot": str(directory / "ui-plot-by-url.png"),
    }


def run(*, runs: int = 3, minutes: float = 30.0, workdir: Path | None = None, ui: bool = True) -> dict[str, Any]:
    """Measure (module docstring); ``ui=False`` skips the browser part."""
    import logging

    logging.getLogger("dagster").setLevel(logging.WARNING)
    own = workdir is None
    work = Path(tempfile.mkdtemp(prefix="aml-url-image-")) if own else Path(workdir)
    try:
        workload = make_workload(work / "plant", runs=runs, minutes=minutes)
        n = len(workload.runs)
        images = work / "url" / "images"
        sizes: dict[str, int] = {}
        with image_server(fresh_dir(images)) as (base_url, requested):
            sizes["without_plot"] = _build(workload, work / "without", plots=False)
            sizes["data_uri"] = _build(workload, work / "data_uri", plots=True)
            markdown: dict[str, list[int]] = {}
            sizes["url"] = _build(workload, work / "url" / "build", plots=True, url=(images, base_url), markdown=markdown)
            served = sorted(p.name for p in images.iterdir())
            result: dict[str, Any] = {
                "runs": n,
                "event_log_kb_per_run": {
                    side: (sizes[side] - sizes["without_plot"]) / 1e3 / n for side in ("data_uri", "url")},
                "event_log_kb_per_run_without_plot": sizes["without_plot"] / 1e3 / n,
                # The instance grows by whole 4 KB pages, so a few runs' KB above are coarse; the
                # plot's markdown itself (stored twice on SQLite: the run's shard and the index):
                "markdown_kb_per_run": {side: sum(v) / 1e3 / len(v) for side, v in markdown.items()},
                "instance_bytes": sizes,
                "images": len(served),
                "image_kb_per_run": sum((images / p).stat().st_size for p in served) / 1e3 / n,
            }
            if ui:
                result["ui"] = _ui(workload, work / "url" / "build", images, base_url, requested)
        return result
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.url_image", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--workdir", type=Path, help="work here and keep it (default: a temporary folder, removed)")
    a = ap.parse_args(argv)
    res = run(runs=a.runs, minutes=a.minutes, workdir=a.workdir)
    print_results(res, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
