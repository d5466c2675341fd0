"""The Dagster fixtures of the definitions' tests (a simulated plant, resources, an instance)."""

from aml_pipeline_tests.components.conftest import dagster_plant, dagster_plant_url, dagster_spec, instance, resources  # noqa: F401
