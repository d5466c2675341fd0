"""Live inputs: a snapshot's own recipe applied to raw points at a forecast origin, for a model
running in the plant (docs/consumers.md, "Running a model in the plant").

    from aml_pipeline.live import LiveRecipe

    recipe = LiveRecipe("/data/datasets/reactor_a/current")     # opens and verifies the snapshot
    inp = recipe.inputs(origin_ms, points)                      # or tsdb="duckdb:///...", run_id=...
    inp.x                                                       # [H, nodes] float32, as a window's x
    y = recipe.to_source_units(model(inp.x, u))                 # [F, targets] in source units

Dagster-free. Unlike :mod:`aml_pipeline.snapshot` (numpy only), it needs the package's cleaning and
grid code (:mod:`aml_pipeline.core`, the grid stage's parameter table, the spec model), so a model
server installs the package with its dependencies; reading from a TSDB needs that adapter's driver.
"""

from aml_pipeline.live.points import LiveInputError
from aml_pipeline.live.recipe import LiveInputs, LiveRecipe, live_inputs

__all__ = ["LiveInputError", "LiveInputs", "LiveRecipe", "live_inputs"]
