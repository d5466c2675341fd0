"""The stages of a dataset build, with their I/O (the Dagster assets call these)."""

from aml_pipeline.pipeline.chunks import return_freed_blocks_to_the_os

# Once per process that builds: memory must follow the chunk sizes, not a run's length.
return_freed_blocks_to_the_os()
