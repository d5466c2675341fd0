"""The TSDB as an observable source asset: the upstream end of every dataset's lineage."""


import dagster as dg

from aml_pipeline.defs.assets import TSDB_POINTS
from aml_pipeline.defs.resources import TsdbResource


@dg.observable_source_asset(
    key=TSDB_POINTS,
    group_name="tsdb",
    description="Points, runs and nodes in the plant's time-series database. Observed by its "
    "availability watermark (the latest point timestamp), which versions everything downstream.",
)
def tsdb_points(tsdb: TsdbResource) -> dg.DataVersion:
    with tsdb.open() as db:
        watermark = db.availability_watermark()
    return dg.DataVersion(str(watermark) if watermark is not None else "empty")
