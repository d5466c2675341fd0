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

from aml_pipeline import config

GRID_BLOCK_BYTES = 8 << 20
MIN_GRID_BLOCK_ROWS = 4096
# Working set of cleaning and aligning, per raw point: the raw columns, masks, index arrays and the
# Hampel network's buffers (measured peak about 100 bytes per point).
CLEAN_BYTES_PER_POINT = 128
# Share of the budget one cleaning chunk may take (the rest: interpreter, libraries, TSDB cache,
# writer blocks). A small share also keeps the peak flat across run lengths: a 2-day run at 1 Hz
# already fills whole chunks (262,144 points at the default 1024 MB), so a 16-day run peaks at
# about the same memory (measured: 228 MB and 250 MB).
CLEAN_BUDGET_SHARE = 32


def grid_block_rows(n_cols: int) -> int:
    """Rows per fixed grid block for a grid of ``n_cols`` columns."""
    return max(MIN_GRID_BLOCK_ROWS, GRID_BLOCK_BYTES // (8 * max(1, int(n_cols))))


def clean_chunk_points(budget_mb: int | None = None) -> int:
    """Raw points per cleaning chunk under the memory budget."""
    mb = config.memory_budget_mb() if budget_mb is None else int(budget_mb)
    return max(1 << 16, (mb << 20) // (CLEAN_BUDGET_SHARE * CLEAN_BYTES_PER_POINT))


_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def return_freed_blocks_to_the_os(threshold_bytes: int = 128 << 10) -> bool:
    """Make glibc give every freed block of ``threshold_bytes`` or more back to the OS at once.

    Streaming a run allocates and frees many chunk-sized arrays. glibc raises its mmap threshold
    after such frees, so later chunks come from the heap, which it does not shrink: the process's
    memory then creeps up with the number of chunks, i.e. with the run's length (measured: a
    16-day run peaked 1.33x a 2-day one; 1.19x with this). Fixing the threshold keeps large arrays
    in their own mappings, released when freed. Linux/glibc only; elsewhere nothing happens.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold_bytes)))
    except (OSError, AttributeError):
        return False
