"""How a run is cut into pieces, so that memory depends on a budget, never on a run's length.

Two kinds of pieces:

* **Grid blocks** of a fixed number of rows. The streamed statistics (normalisation moments, the
  report's per-node summaries and lag correlations) add one batch per block, and floating-point
  batches only give the same bytes when they are cut at the same rows. So the block size is part
  of the numeric definition: it depends on the spec's width only (about 8 MB of float64 per
  block), never on the memory budget. A run shorter than one block (18 h at a 1 s beat with 16
  nodes) is one batch, exactly as if it were processed whole.
* **Point chunks** for cleaning, sized from the memory budget (``AML_MEMORY_MB``). Cleaning is
  exact per point (every rule carries the state it needs across a cut), so any chunk size gives
  the same bytes.
"""

from __future__ import annotations

from functools import lru_cache

from aml_pipeline import config

GRID_BLOCK_BYTES = 8 << 20
MIN_GRID_BLOCK_ROWS = 4096
# Working set of cleaning and aligning, per raw point: the raw columns, masks, index arrays and the
# Hampel network's buffers, with room to spare over the peak ``bench/memory.py`` sees.
CLEAN_BYTES_PER_POINT = 128
# Share of the budget one cleaning chunk may take (the rest: interpreter, libraries, TSDB cache,
# writer blocks). A small share also keeps the peak flat across run lengths: a run of a couple of
# days at 1 Hz already fills whole chunks, so a run of weeks peaks at about the same memory.
CLEAN_BUDGET_SHARE = 32


def grid_block_rows(n_cols: int) -> int:
    """Rows per fixed grid block for a grid of ``n_cols`` columns."""
    return max(MIN_GRID_BLOCK_ROWS, GRID_BLOCK_BYTES // (8 * max(1, int(n_cols))))


def clean_chunk_points(budget_mb: int | None = None) -> int:
    """Raw points per cleaning chunk under the memory budget."""
    mb = config.memory_budget_mb() if budget_mb is None else int(budget_mb)
    return max(1 << 16, (mb << 20) // (CLEAN_BUDGET_SHARE * CLEAN_BYTES_PER_POINT))


def release_freed_memory() -> bool:
    """Give the heap's free pages back to the OS (glibc ``malloc_trim``); False where unavailable.

    Streaming a run allocates and frees chunk-sized arrays over and over. glibc keeps freed
    blocks in its heap for reuse (fast: no page faults the next time), but fragmentation lets the
    resident size creep up with the number of chunks, i.e. with the run's length. The stages
    trim after each node that took more than one chunk (page, block), which bounds it; a node of
    one chunk leaves nothing the next node would not reuse, and trimming there too costs a build
    of short runs its time in page faults (as does a fixed mmap threshold: every large array in
    its own mapping).
    """
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


@lru_cache(maxsize=1)
def _malloc_trim():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
