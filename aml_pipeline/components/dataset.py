"""The dataset component types, and the one function that turns a spec into Dagster definitions.

A dataset contributes, per spec: the run-partitioned stage assets and the dataset assets with
their checks, the baseline model, the new-run sensor, the run, build, rebuild and verify jobs and
the rebuild and verify schedules (:func:`dataset_definitions`). Every dataset of a code location
shares one plant part (:func:`plant_definitions`): the ``tsdb``, ``store``, ``shared_env`` and
``pipes_subprocess_client`` resources, the ``tsdb/points`` source asset with its observation job
and schedule, the shared environment's asset and rebuild job, and the ``aml_gc`` job and schedule.
Components with the same settings share the very same plant objects, which is what lets Dagster
merge several datasets into one code location; components with different settings cannot be
merged (one TSDB and one store per code location: Dagster refuses two resources under one key).
"""


import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import dagster as dg
import yaml
from pydantic import BaseModel, ConfigDict, Field

from aml_pipeline.components.assets import dataset_assets
from aml_pipeline.components.baseline import baseline_assets
from aml_pipeline.components.dagster_internals import in_defs_validation
from aml_pipeline.components.maintenance import gc_job, gc_schedule, register_spec
from aml_pipeline.components.resources import plant_resources
from aml_pipeline.components.schedules import build_job, rebuild_job, rebuild_schedule, runs_job, verify_job, verify_schedule
from aml_pipeline.components.sensors import new_run_sensor
from aml_pipeline.components.shared_env import rebuild_shared_env_job, shared_env_asset
from aml_pipeline.components.sources import observe_tsdb_job, observe_tsdb_schedule, tsdb_points
from aml_pipeline.pipeline.registry import StageVersions
from aml_pipeline.errors import AmlError, SpecError
from aml_pipeline.spec import DatasetSpec, discover_specs, parse_spec

def dataset_definitions(spec: DatasetSpec, versions: StageVersions | None = None) -> dg.Definitions:
    """Everything one dataset spec contributes (its plant part aside: :func:`plant_definitions`);
    ``versions``: the spec's stage versions when the caller has them already."""
    versions = versions or StageVersions.of(spec)
    register_spec(spec)
    rebuild, verify = rebuild_job(spec), verify_job(spec)
    return dg.Definitions(
        assets=[*dataset_assets(spec, versions), *baseline_assets(spec)],
        sensors=[new_run_sensor(spec, versions)],
        jobs=[runs_job(spec), build_job(spec), rebuild, verify],
        schedules=[rebuild_schedule(spec, rebuild), verify_schedule(spec, verify)],
    )


def shared_resources(tsdb_url_env: str, home_env: str, env_location_env: str, datasets_dir: str | None) -> dg.Definitions:
    """The resources every dataset of a code location uses, one object per setting (and per value
    of the variables it names): components with the same settings hand Dagster the very same
    resources, which it merges."""
    names = (tsdb_url_env, home_env, env_location_env)
    return _shared_resources(names, tuple(os.environ.get(n) for n in names), datasets_dir, str(Path.cwd()))


@lru_cache(maxsize=16)
def _shared_resources(names: tuple[str, str, str], values: tuple[str | None, ...], datasets_dir: str | None,
                      cwd: str) -> dg.Definitions:
    tsdb_url_env, home_env, env_location_env = names
    return dg.Definitions(resources=plant_resources(tsdb_url_env=tsdb_url_env, home_env=home_env,
                                                    env_location_env=env_location_env, datasets_dir=datasets_dir))


def plant_definitions() -> dg.Definitions:
    """What a code location's datasets share besides the resources: the ``tsdb/points`` source with
    its observation job and schedule, the shared environment and its rebuild job, ``aml_gc``."""
    return dg.Definitions(
        assets=[tsdb_points, shared_env_asset],
        jobs=[observe_tsdb_job, rebuild_shared_env_job, gc_job],
        schedules=[observe_tsdb_schedule, gc_schedule],
    )


class PlantSettings(BaseModel):
    """Where datasets' data comes from and where it goes: names of environment variables, so no
    URL or password is ever written into a ``defs.yaml``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tsdb_url_env: str = Field(
        default="AML_TSDB_URL",
        description="Environment variable holding the TSDB: duckdb:///file.duckdb, postgresql://user@host/db, or a "
        "source description (YAML) of the plant's own tables.",
    )
    home_env: str = Field(
        default="AML_HOME",
        description="Environment variable holding the directory of intermediates and published datasets (unset: ./.aml).",
    )
    env_location_env: str = Field(
        default="AML_ENV_LOCATION",
        description="Environment variable holding the shared environment's lease location (unset: <home>/env).",
    )
    datasets_dir: str | None = Field(default=None, description="Where snapshots are published (None: <home>/datasets).")

    def resources(self) -> dg.Definitions:
        return shared_resources(self.tsdb_url_env, self.home_env, self.env_location_env, self.datasets_dir)


class DatasetAttributes(PlantSettings):
    spec: DatasetSpec = Field(description="The dataset spec: the keys of a spec file (docs/spec.md), camelCase.")


class SpecFolderAttributes(PlantSettings):
    path: str | None = Field(
        default=None,
        description="The folder of spec files (*.yaml), relative to the project root (the folder of its "
        "pyproject.toml) unless absolute. Unset: $AML_SPECS, else specs/ in the project root. A missing or "
        "empty folder, or an invalid spec in it, fails loading (dg check defs) naming the folder or the file.",
    )


class _Component(dg.Component):
    """A component whose ``defs.yaml`` attributes are validated by a pydantic model (its JSON
    schema is what ``dg check yaml`` checks, its validators what loading checks, errors naming
    the field) and kept as :attr:`attributes`."""

    attributes_model: type[BaseModel]

    def __init__(self, attributes: BaseModel) -> None:
        self.attributes = attributes

    @classmethod
    def get_model_cls(cls) -> type[BaseModel]:
        return cls.attributes_model

    @classmethod
    def load(cls, attributes: BaseModel | None, context: dg.ComponentLoadContext) -> "_Component":
        return cls(attributes if attributes is not None else cls.attributes_model())


STARTER = """\
type: {type_name}

attributes:
  # Where the data comes from and where datasets go: names of environment variables (never a
  # URL or a password in this file). These are the defaults.
  tsdb_url_env: AML_TSDB_URL      # duckdb:///..., postgresql://..., or a source description .yaml
  home_env: AML_HOME              # intermediates and published snapshots (unset: ./.aml)

  # The dataset spec: the keys of a spec file (camelCase), validated the same way.
  spec:
    id: {spec_id}                 # [a-z0-9_]+, the asset key prefix
    lineId: L1
    productId: P100
    recipeId: R7
    beatMs: {beatMs}                  # grid period
    maxInterpMs: {maxInterpMs}             # longest gap bridged
    historySteps: {historySteps}              # H
    horizonSteps: {horizonSteps}              # F
    stride: {stride}
    nodes:                        # order = x column order
      - {{nodeId: TI101, role: target}}
      - {{nodeId: FIC200_SP, role: control, interp: hold, hampelK: 0}}
      - {{nodeId: TI900, role: feature}}
    cleaning: {cleaning}
    split: {split}
    # schedule: "15 * * * *"      # the rebuild schedule (default hourly at :15)
"""


def starter_defs_yaml(type_name: str, spec_id: str) -> str:
    """The scaffolded ``defs.yaml``: a commented starter spec whose settings are the spec model's
    defaults, so they never disagree with it and a new cleaning or split key shows by itself."""
    defaults = DatasetSpec(id="starter", line_id="L1", product_id="P100", recipe_id="R7",
                           nodes=({"node_id": "TI101", "role": "target"},)).to_json_dict()
    flow = {k: yaml.safe_dump(defaults[k], default_flow_style=True, sort_keys=False, width=1 << 16).strip()
            for k in ("cleaning", "split")}
    shown = {k: defaults[k] for k in ("beatMs", "maxInterpMs", "historySteps", "horizonSteps", "stride")}
    return STARTER.format(type_name=type_name, spec_id=spec_id, **shown, **flow)


class AmlDatasetScaffolder(dg.Scaffolder):
    """``dg scaffold defs aml_pipeline.components.AmlDataset <path>``: a ``defs.yaml`` with a
    commented starter spec named after the path."""

    def scaffold(self, request: dg.ScaffoldRequest) -> None:
        target = Path(request.target_path)
        target.mkdir(parents=True, exist_ok=True)
        spec_id = "".join(c if c.isalnum() else "_" for c in target.name.lower()).strip("_") or "my_dataset"
        (target / "defs.yaml").write_text(starter_defs_yaml(request.type_name, spec_id))


@dg.scaffold_with(AmlDatasetScaffolder)
class AmlDataset(_Component):
    """A training dataset for a dynamic process model, built from a plant's time-series: the run
    stages (fetch, clean and align, windows) partitioned by production run, the split,
    normalisation and published snapshot, their checks, the new-run sensor and the rebuild
    schedule. ``spec`` takes the keys of a spec file (docs/spec.md)."""

    attributes_model = DatasetAttributes

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        return self.definitions(source=str(Path(context.path) / "defs.yaml"))

    def definitions(self, *, source: str) -> dg.Definitions:
        """The dataset's definitions; ``source`` names where its spec came from in errors."""
        with one_line_in_validation():
            spec = checked_spec(self.attributes.spec, source)
        return dg.Definitions.merge(dataset_definitions(spec), self.attributes.resources())


class AmlPlant(_Component):
    """What the datasets of a code location share, added once next to its ``AmlDataset``
    components: the resources (the TSDB, the store, the shared environment and its lease), the
    ``tsdb/points`` source with its observation schedule, the shared environment's rebuild job
    and the ``aml_gc`` retention job. (``AmlSpecFolder`` includes it.)"""

    attributes_model = PlantSettings

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        return dg.Definitions.merge(plant_definitions(), self.attributes.resources())


class AmlSpecFolder(_Component):
    """Every spec file (``*.yaml``, ``*.yml``) of a folder as an :class:`AmlDataset`, with the
    :class:`AmlPlant`. ``path``: the folder, relative to the project root (default ``$AML_SPECS``,
    else ``specs/``). It fails closed: a missing or empty folder, or a spec that fails validation,
    stops loading with one line naming the folder or the file and field, so ``dg check defs``
    fails rather than load a code location without the datasets it was meant to have."""

    attributes_model = SpecFolderAttributes

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        a = self.attributes
        root = Path(context.project_root)
        folder = spec_folder(a.path, root)
        set_by = (f"path: {a.path} in {Path(context.path) / 'defs.yaml'}, relative to the project root {root}"
                  if a.path is not None else "AML_SPECS" if os.environ.get("AML_SPECS")
                  else f"the default, specs/ in the project root; set the component's path or AML_SPECS")
        with one_line_in_validation():
            specs = folder_specs(folder, set_by=set_by)
        datasets = [dataset_definitions(spec) for spec in specs]
        return dg.Definitions.merge(*datasets, plant_definitions(), a.resources())


@contextmanager
def one_line_in_validation() -> Iterator[None]:
    """A user error while the definitions load: under ``dg check defs`` (which sets
    ``DAGSTER_IS_DEFS_VALIDATION_CLI=1``) its one line on stderr and exit 2, no traceback; elsewhere
    (``dg dev``, the UI) raised, so the code location shows it as its load error."""
    try:
        yield
    except AmlError as e:
        if not in_defs_validation():
            raise
        print(e.one_line(), file=sys.stderr)
        raise SystemExit(2) from None


def spec_folder(path: str | None, project_root: Path) -> Path:
    """The folder an :class:`AmlSpecFolder` reads: ``path`` (relative to ``project_root``), else
    ``$AML_SPECS``, else ``specs/`` in the project root."""
    if path is not None:
        return (project_root / path).resolve()
    configured = os.environ.get("AML_SPECS")
    return Path(configured).resolve() if configured else project_root / "specs"


def folder_specs(folder: Path, *, set_by: str) -> list[DatasetSpec]:
    """The specs of ``folder``; a missing or empty folder or an invalid spec is an AmlError whose one
    line names the folder (and what set it: ``set_by``) or the file and field."""
    found, errors = discover_specs(folder)
    if not folder.is_dir():
        raise SpecError(f"AmlSpecFolder: specs folder {folder} does not exist ({set_by})")
    if errors:
        (_, first), more = errors[0], len(errors) - 1
        code, message = first.split(": ", 1)
        raise AmlError(message + (f" (and {more} more invalid spec file{'s' if more > 1 else ''})" if more else ""),
                       code=code)
    if not found:
        raise SpecError(f"AmlSpecFolder: specs folder {folder} holds no spec file (*.yaml, *.yml) ({set_by})")
    return [spec for _, spec in found]


def checked_spec(spec: DatasetSpec, source: str) -> DatasetSpec:
    """``spec`` with the checks a spec file gets beyond its fields' types (the v2 unit contract),
    errors naming ``source``."""
    return parse_spec(spec.to_json_dict() | {"schedule": spec.schedule}, source=source)
