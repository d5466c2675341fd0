"""The stages of a dataset build, one module each (``raw``, ``grid``, ``windows``, ``split``,
``norm``, ``manifest``), with what a stage is in ``base``. The registry of all six, and every
stage's fingerprint for a spec, is :mod:`aml_pipeline.pipeline.registry`: this package's init
imports nothing, so any one stage module (and the store they all use) imports on its own.
"""
