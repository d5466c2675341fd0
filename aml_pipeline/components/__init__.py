"""Datasets as Dagster Components: add them to any Dagster project with a ``defs.yaml``.

``AmlDataset`` is one dataset (its spec inline); ``AmlPlant`` what the datasets of a code location
share (resources, the TSDB source, the shared environment, retention), added once; ``AmlSpecFolder``
is every spec file of a folder, each built as an ``AmlDataset``, with the plant. This repository's own ``specs/`` folder is loaded through
``AmlSpecFolder`` (``aml_pipeline/defs/datasets/defs.yaml``), so there is one way to turn a spec
into definitions. See docs/dagster.md, "Adding datasets to your own Dagster project".
"""

from aml_pipeline.components.dataset import AmlDataset, AmlPlant, AmlSpecFolder

__all__ = ["AmlDataset", "AmlPlant", "AmlSpecFolder"]
