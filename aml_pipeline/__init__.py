"""aml_pipeline: leakage-free, tamper-evident training datasets from industrial time-series."""

__version__ = "0.1.0"
