"""bench/url_image.py: the plot's markdown moved to a URL, and the folder served as the browser asks."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest

from aml_pipeline.pipeline.plots import data_uri_markdown
from bench.url_image import image_server, png_size, url_markdown


def _png(width: int, height: int) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.zeros((height, width, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def test_the_data_uri_becomes_a_served_url_and_the_rest_of_the_markdown_stays(tmp_path):
    png = _png(30, 20)
    markdown = f"{data_uri_markdown(png, 'run r1')}\n\nOne band per node; 3 outliers removed."
    folder = tmp_path / "images"
    folder.mkdir()
    with image_server(folder) as (base_url, requested):
        out = url_markdown(markdown, folder, base_url)
        head, rest = out.split("\n\n", 1)
        assert rest == "One band per node; 3 outliers removed."
        assert head.startswith(f"![run r1]({base_url}/") and head.endswith(".png)") and "base64" not in out
        url = head[len("![run r1]("):-1]
        with urllib.request.urlopen(url, timeout=30) as response:
            assert response.read() == png
        assert requested == ["/" + url.rsplit("/", 1)[1]]
    [written] = folder.iterdir()
    assert png_size(written) == (30, 20)


def test_markdown_without_exactly_one_png_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="found 0"):
        url_markdown("no image here", tmp_path, "http://127.0.0.1:1")
    two = data_uri_markdown(_png(2, 2), "a") + data_uri_markdown(_png(3, 3), "b")
    with pytest.raises(RuntimeError, match="found 2"):
        url_markdown(two, tmp_path, "http://127.0.0.1:1")
