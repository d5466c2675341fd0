"""Pure numeric core: numpy functions over columns. Never imports dagster or a database."""
