"""The stages of a dataset build, with their I/O (the Dagster assets call these)."""
