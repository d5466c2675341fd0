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


def keep_freed_memory(budget_mb: int | None = None) -> bool:
    """Let the heap keep up to one cleaning chunk's share of the budget (``budget /
    CLEAN_BUDGET_SHARE``) of freed memory at its top, per arena, instead of glibc's default of
    128 KB (glibc ``M_TRIM_THRESHOLD``); False where unavailable.

    A run's stages allocate and free arrays of a few hundred KB to a few MB over and over (masks,
    index arrays, the Hampel network's and the alignment's blocks). With the default threshold
    every free that leaves more than that at the top of the heap returns it to the OS, and the next
    array of the next run page-faults it back: a large share of the cleaning's CPU time. The
    memory kept is bounded by the budget, and :func:`release_freed_memory` still returns all of it
    where the stages trim. Setting it also stops glibc from raising its mmap threshold as it goes,
    so arrays above 128 KB keep their own mappings; keeping those in the heap as well saves no
    more (``bench/README.md``, the series stages).
    """
    mb = config.memory_budget_mb() if budget_mb is None else int(budget_mb)
    mallopt = _libc_function("mallopt")
    return bool(mallopt(_M_TRIM_THRESHOLD, (mb << 20) // CLEAN_BUDGET_SHARE)) if mallopt is not None else False


_M_TRIM_THRESHOLD = -1  # glibc's malloc.h


def _malloc_trim():
    return _libc_function("malloc_trim")


@lru_cache(maxsize=4)
def _libc_function(name: str):
    try:
        import ctypes

        return getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):
        return None
