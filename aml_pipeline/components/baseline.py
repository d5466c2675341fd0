"""A real consumer of the shared environment: ``[<spec id>, baseline_model]`` per spec.

Downstream of the spec's manifest asset (and of ``shared_env`` in the lineage). It runs
``aml_pipeline/training/ridge_baseline.py`` with the shared environment's interpreter through
Dagster Pipes (resource ``pipes_subprocess_client``) while holding a READ lease for the whole
subprocess, so a rebuild is refused with ENV_BUSY until training is over (and training is
refused with ENV_BUSY while a rebuild runs). The script verifies the current snapshot's hash
(``sha256.json`` and the catalog's record) before it reads a byte of it, fits a ridge model,
compares it with persistence on val and test in model units, and streams the metrics back as
this asset's materialisation metadata.

Added for every spec by ``datasets.py``.
"""

import hashlib
import json
import tempfile
from pathlib import Path

import dagster as dg

from aml_pipeline.components.resources import StoreResource
from aml_pipeline.components.shared_env import SHARED_ENV_KEY, SharedEnvResource, busy_failure
from aml_pipeline.errors import AmlError
from aml_pipeline.lease import EnvBusy
from aml_pipeline.pipeline.publish import Catalog, current_snapshot
from aml_pipeline.pipeline.registry import MANIFEST
from aml_pipeline.spec import DatasetSpec
from aml_pipeline.training import RIDGE_BASELINE_FILES, RIDGE_BASELINE_SCRIPT

BASELINE_MODEL = "baseline_model"


def _code_version() -> str:
    h = hashlib.sha256()
    for path in RIDGE_BASELINE_FILES:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _script_failure(outcome: Path, spec_id: str) -> dg.Failure | None:
    """The script's own reason for failing (e.g. SNAPSHOT_TAMPERED naming the file), if it gave one."""
    try:
        data = json.loads(outcome.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if data.get("ok"):
        return None
    return dg.Failure(
        description=f"{spec_id}/{BASELINE_MODEL}: {data.get('code', 'TRAINING_FAILED')}: {data.get('message', '')}",
        metadata={"code": data.get("code", ""), "changed_files": ", ".join(data.get("changed") or []) or "-"},
    )


def baseline_assets(spec: DatasetSpec) -> list[dg.AssetsDefinition]:
    manifest_key = dg.AssetKey([spec.id, MANIFEST.asset])

    @dg.asset(
        key=dg.AssetKey([spec.id, BASELINE_MODEL]),
        deps=[manifest_key, SHARED_ENV_KEY],
        group_name=spec.id,
        kinds={"python", "numpy"},
        code_version=_code_version(),
        description=(
            "Ridge baseline (history x + future controls u -> future targets y) on the current snapshot, "
            "trained in the shared environment under a read lease via Dagster Pipes; val/test RMSE per "
            "target in model units next to persistence. Refuses a snapshot whose hash does not verify."
        ),
    )
    def baseline_model(
        context: dg.AssetExecutionContext,
        shared_env: SharedEnvResource,
        store: StoreResource,
        pipes_subprocess_client: dg.PipesSubprocessClient,
    ) -> dg.MaterializeResult:
        root = store.datasets_root
        snapshot = current_snapshot(root, spec.id)
        if snapshot is None or not snapshot.is_dir():
            raise dg.Failure(
                description=f"NO_SNAPSHOT: spec {spec.id!r} has no current snapshot under {root}; "
                f"materialise {manifest_key.to_user_string()} first"
            )
        entry = Catalog(root).find_by_path(snapshot)
        out_dir = Path(store.home) / "models" / spec.id / snapshot.name
        holder = f"{spec.id}/{BASELINE_MODEL} (run {context.run.run_id[:8]})"
        try:
            with shared_env.read(holder) as env, tempfile.TemporaryDirectory(prefix="aml-baseline-") as tmp:
                outcome = Path(tmp) / "outcome.json"
                context.log.info(
                    f"holding a read lease on the shared environment as {holder!r}; running "
                    f"{RIDGE_BASELINE_SCRIPT.name} with {env.python} (Python {env.python_version}) on {snapshot}"
                )
                try:
                    invocation = pipes_subprocess_client.run(
                        context=context,
                        command=env.command(RIDGE_BASELINE_SCRIPT),
                        extras={
                            "snapshot_dir": str(snapshot),
                            "expected_sha256": entry.sha256 if entry else None,
                            "output_dir": str(out_dir),
                            "outcome_path": str(outcome),
                        },
                    )
                except Exception as e:
                    failure = _script_failure(outcome, spec.id)
                    if failure is not None:
                        raise failure from e
                    raise
                result = invocation.get_materialize_result(implicit_materialization=False)
        except EnvBusy as e:
            raise busy_failure(e, f"cannot run {spec.id}/{BASELINE_MODEL} in the shared environment") from e
        except AmlError as e:  # e.g. ENV_MISSING: the environment was never built
            raise dg.Failure(description=f"{spec.id}/{BASELINE_MODEL}: {e.one_line()}") from e
        return dg.MaterializeResult(
            asset_key=result.asset_key,
            metadata={
                **(result.metadata or {}),
                "shared_env_python": dg.MetadataValue.path(str(env.python)),
                "shared_env_build": env.build_dir.name,
                "read_lease_holder": holder,
                "catalog_sha256": entry.sha256 if entry else "-",
            },
            check_results=result.check_results,
            data_version=result.data_version,
            tags=result.tags,
        )

    return [baseline_model]


__all__ = ["BASELINE_MODEL", "baseline_assets"]
