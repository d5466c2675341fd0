"""Fixtures of the lease tests: ``where`` (each backend in turn) and ``holders`` (processes)."""

from __future__ import annotations

import uuid

import pytest

from aml_pipeline_tests.lease.support import Holder, Where


@pytest.fixture(params=["file", "postgres"])
def where(request, tmp_path):
    if request.param == "file":
        return Where("file", str(tmp_path / "env-lease"), "aml-shared-env")
    url = request.getfixturevalue("postgres_url")
    return Where("postgres", url, f"test-{uuid.uuid4().hex[:12]}")  # a key per test


@pytest.fixture
def holders():
    started: list[Holder] = []
    yield started
    for h in started:
        h.close()
