"""Running a dataset's Dagster jobs from the command line: the same definitions the UI shows,
executed in this process (:mod:`~aml_pipeline.runner.build`), with ``--workers`` spreading the run
stages over step processes (:mod:`~aml_pipeline.runner.parallel`)."""
