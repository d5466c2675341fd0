"""NpyAppender: arrays appended one by one or several in one call give the same .npy file."""

from __future__ import annotations

import os

import numpy as np

from aml_pipeline.pipeline import store as store_module
from aml_pipeline.pipeline.store import NpyAppender


def test_parts_written_together_equal_parts_appended_one_by_one_even_when_writes_are_cut_short(tmp_path, monkeypatch):
    rng = np.random.default_rng(7)
    parts = [rng.normal(size=n) for n in (5, 0, 1000, 3, 4096)] + [np.arange(7, dtype=np.int32)]  # converted to <f8
    one = NpyAppender(tmp_path / "one.npy", "<f8")
    for p in parts:
        one.append(p)
    one.close()

    real = os.writev
    calls = []

    def short_writev(fd, buffers):  # the OS may write less than asked: at most 1000 bytes a call
        calls.append(len(buffers))
        budget, out = 1000, []
        for b in buffers:
            out.append(bytes(b)[:budget])
            budget -= len(out[-1])
            if not budget:
                break
        return real(fd, out)

    monkeypatch.setattr(store_module.os, "writev", short_writev)
    together = NpyAppender(tmp_path / "together.npy", "<f8")
    together.extend(parts[:3])
    together.extend(parts[3:])
    assert together.close() == (sum(p.size for p in parts),)
    assert (tmp_path / "together.npy").read_bytes() == (tmp_path / "one.npy").read_bytes()
    assert len(calls) > 2  # the short writes were resumed
    np.testing.assert_array_equal(np.load(tmp_path / "together.npy"), np.concatenate(parts).astype("<f8"))
