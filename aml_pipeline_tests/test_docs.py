"""The documentation a user reads is in the repository, links where it says, names every spec field
and ingest column the code accepts, and its hash recipe computes the snapshot hash."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex

import numpy as np
import pytest
from pydantic.alias_generators import to_camel

from aml_pipeline.cli import build_parser
from aml_pipeline.config import REPO_ROOT
from aml_pipeline.core.hashing import snapshot_sha256
from aml_pipeline.pipeline.build import build_dataset
from aml_pipeline.simulate.plant import plant_spec_dict, simulate_plant
from aml_pipeline.spec import CleaningSpec, DatasetSpec, ExtrasSpec, NodeSpec, SplitSpec, VariableSpec, parse_spec
from aml_pipeline.tsdb import open_tsdb
from aml_pipeline.tsdb.ingest import NODE_OPTIONAL, NODE_REQUIRED, POINT_COLUMNS, RUN_OPTIONAL, RUN_REQUIRED

DOCS = REPO_ROOT / "docs"


def text(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def test_readme_points_at_docs_in_the_repository_and_runs_commands_that_exist():
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert "shared/DESIGN.md" not in readme and "DESIGN " not in readme
    for target in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (REPO_ROOT / target).is_file(), target
    for name in ("spec.md", "ingest.md", "snapshot.md", "lineage.md"):
        assert f"docs/{name}" in readme, name
    # after the documented set-up, `aml-pipeline` is .venv/bin/aml-pipeline, not on PATH
    for line in readme.splitlines():
        if re.match(r"\s*aml-pipeline ", line):
            pytest.fail(f"README runs a bare aml-pipeline: {line!r}")


def test_every_doc_link_resolves():
    for doc in DOCS.glob("*.md"):
        for target in re.findall(r"\]\(([^)#:]+\.md)", doc.read_text(encoding="utf-8")):
            assert (doc.parent / target).is_file(), f"{doc.name} links {target}"


@pytest.mark.parametrize("model", [DatasetSpec, NodeSpec, CleaningSpec, SplitSpec, ExtrasSpec, VariableSpec])
def test_spec_doc_names_every_field(model):
    doc = text("spec.md")
    for name in model.model_fields:
        assert f"`{to_camel(name)}`" in doc, f"{model.__name__}.{name} ({to_camel(name)}) is not in docs/spec.md"


def test_ingest_doc_names_every_column():
    doc = text("ingest.md")
    for column in (*POINT_COLUMNS, *RUN_REQUIRED, *RUN_OPTIONAL, *NODE_REQUIRED, *NODE_OPTIONAL):
        assert f"`{column}`" in doc, column


@pytest.mark.parametrize("extras,layout", [(False, "windows"), (True, "windows"), (False, "series"), (True, "series")],
                         ids=["v1", "v2", "series-v1", "series-v2"])
def test_the_documented_hash_recipe_computes_the_snapshot_hash(tmp_path, extras, layout):
    plant = simulate_plant(n_runs=3, run_minutes=8, seed=2)
    url = f"duckdb://{tmp_path / 'tsdb.duckdb'}"
    with open_tsdb(url, read_only=False) as db:
        db.ingest(runs=plant.runs, nodes=plant.nodes, points=plant.points)
    data = plant_spec_dict(plant, "doc_ds", history_steps=10, horizon_steps=5, extras=extras)
    spec = parse_spec({**data, "layout": layout})
    with open_tsdb(url) as db:
        published = build_dataset(spec, db, store_root=tmp_path / "store", datasets_root=tmp_path / "datasets")
    doc = text("snapshot.md")
    [code] = re.findall(r"In\s+Python:\s*```python\n(.*?)```", doc, flags=re.S)
    scope: dict = {}
    exec(code, scope)  # noqa: S102 - the documentation's own snippet, under test
    assert scope["snapshot_sha256"](str(published.snapshot_dir)) == published.sha256 == snapshot_sha256(published.snapshot_dir)
    assert published.snapshot_dir.name == published.sha256[:16]  # the layout the doc shows
    if layout == "series":  # the documented numpy reader cuts the windows the reader serves
        from aml_pipeline.snapshot import open_snapshot

        [reader] = re.findall(r"With numpy alone:\s*```python\n(.*?)```", doc, flags=re.S)
        scope = {}
        exec(reader.replace('".aml/datasets/reactor_a/current"', repr(str(published.snapshot_dir))), scope)  # noqa: S102
        assert np.array_equal(scope["x"], open_snapshot(published.snapshot_dir).x[100:356])


# --- The command line as the docs show it -------------------------------------------------------

DOC_FILES = (REPO_ROOT / "README.md", *sorted(DOCS.glob("*.md")))
# A command line: an optional prompt and environment assignments, then the command.
COMMAND = re.compile(r"^(?:\$\s+)?(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(?:\.venv/bin/)?aml-pipeline(?=\s|$)")
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*|<[^>]+>")


def parser_tree(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(subcommand path, parser) of the command and of every subcommand, depth first."""
    yield path, parser
    for action in parser._actions:  # argparse has no public walk over its subparsers
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parser_tree(sub, (*path, name))


def flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}


def doc_command_lines(files=DOC_FILES) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``aml-pipeline`` command lines the docs show: (where, line) in fenced code blocks (continued
    lines joined), and in inline code spans of the prose."""
    fenced, inline = [], []
    for path in files:
        in_fence, pending = False, ""
        for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            where = f"{path.name if path.parent == REPO_ROOT else path.parent.name + '/' + path.name}:{no}"
            if line.lstrip().startswith("```"):
                in_fence, pending = not in_fence, ""
                continue
            if in_fence:
                line = pending + line.strip()
                if line.endswith("\\"):
                    pending = line[:-1] + " "
                    continue
                pending = ""
                if COMMAND.match(line):
                    fenced.append((where, line))
            else:
                inline += [(where, span.strip()) for span in re.findall(r"`([^`\n]+)`", line) if COMMAND.match(span.strip())]
    return fenced, inline


def invocation(line: str) -> list[str]:
    """The arguments of a documented command line, as a user would type them: a synopsis's
    brackets dropped, its first alternative of ``a|b`` taken, placeholders (``SPEC``, ``N``,
    ``<run>``) given a value every argument type takes."""
    args = []
    for token in shlex.split(line, comments=True):
        token = token.replace("[", "").replace("]", "").removesuffix("...").split("|")[0]
        if token and token != "$" and not re.match(r"[A-Za-z_][A-Za-z0-9_]*=", token if not args else ""):
            args.append("1" if PLACEHOLDER.fullmatch(token) else token)
    assert args and args[0].endswith("aml-pipeline"), line
    return args[1:]


def shown(args: list[str]) -> tuple[tuple[str, ...], set[str]]:
    """The subcommand path of a command line and the flags it shows."""
    path, parser = (), build_parser()
    tree = dict(parser_tree(parser))
    for token in args:
        if (*path, token) not in tree:
            break
        path = (*path, token)
    return path, {t.split("=")[0] for t in args if t.startswith("-")}


def test_every_command_line_in_the_docs_parses():
    fenced, _ = doc_command_lines()
    assert len(fenced) > 20, "the docs show the commands they describe"
    failures = []
    for where, line in fenced:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                build_parser().parse_args(invocation(line))
        except SystemExit as e:
            if e.code:
                failures.append(f"{where}: {line}\n    {err.getvalue().strip().splitlines()[-1]}")
    assert not failures, "documented commands that do not parse:\n" + "\n".join(failures)


def test_every_subcommand_and_flag_is_shown_in_a_documented_command_line():
    fenced, inline = doc_command_lines()
    covered: dict[tuple[str, ...], set[str]] = {}
    for _, line in fenced + inline:
        path, used = shown(invocation(line))
        covered.setdefault(path, set()).update(used)
        for n in range(1, len(path)):  # `env status` shows `env` too
            covered.setdefault(path[:n], set())
    missing = []
    for path, parser in parser_tree(build_parser()):
        if not path:
            continue
        if path not in covered:
            missing.append(f"aml-pipeline {' '.join(path)}")
        missing += [f"aml-pipeline {' '.join(path)} {f}" for f in sorted(flags(parser) - covered.get(path, set()))]
    assert not missing, (
        "not shown in any command line of README.md or docs/*.md (add them to docs/cli.md):\n" + "\n".join(missing)
    )


def test_the_docs_check_can_fail(tmp_path):
    """The two checks above see a flag go missing and a command that does not parse."""
    doc = tmp_path / "cli.md"
    doc.write_text(
        "```bash\n.venv/bin/aml-pipeline build SPEC [--full] [--workers N]\n"
        ".venv/bin/aml-pipeline build --no-such-flag\n```\n`aml-pipeline gc --keep 2`\n", encoding="utf-8"
    )
    fenced, inline = doc_command_lines([doc])
    assert [line for _, line in fenced] == [".venv/bin/aml-pipeline build SPEC [--full] [--workers N]",
                                            ".venv/bin/aml-pipeline build --no-such-flag"]
    assert shown(invocation(fenced[0][1])) == (("build",), {"--full", "--workers"})
    assert shown(invocation(inline[0][1])) == (("gc",), {"--keep"})
    build_parser().parse_args(invocation(fenced[0][1]))
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        build_parser().parse_args(invocation(fenced[1][1]))


def test_no_doc_runs_a_bare_aml_pipeline():
    """After the documented set-up the command is .venv/bin/aml-pipeline; it is on PATH only in an
    activated environment, which the docs do not assume."""
    fenced, _ = doc_command_lines()
    bare = [f"{where}: {line}" for where, line in fenced if re.match(r"(?:\$\s+)?(?:\S+=\S*\s+)*aml-pipeline", line)]
    assert not bare, "\n".join(bare)


def test_help_names_every_subcommand():
    parser = build_parser()
    text = parser.format_help()
    for path, _ in parser_tree(parser):
        if len(path) == 1:
            assert path[0] in parser.description and path[0] in text, path


def test_the_architecture_names_only_modules_that_exist():
    doc = text("architecture.md")
    named = set(re.findall(r"`([\w./-]+(?:\.py|/))`", doc))
    assert len(named) > 40, "the module map names the modules"
    package = REPO_ROOT / "aml_pipeline"
    missing = []
    for name in sorted(named):
        if name.startswith("aml_pipeline/") or name.split("/")[0] in ("bench", "specs", "deploy", "scripts", "aml_pipeline_tests"):
            ok = (REPO_ROOT / name).exists()
        else:  # the map's paths are relative to aml_pipeline/, or a file named in its package's row
            ok = (package / name).exists() or any(package.glob(f"*/{name}")) or any(package.glob(f"*/*/{name}"))
        if not ok:
            missing.append(name)
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


# An error code, not a variable.
NOT_VARIABLES = {"AML_ERROR"}


def test_every_environment_variable_the_code_reads_is_in_the_readme():
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    sources = [p for d in ("aml_pipeline", "scripts", "deploy", "bench") for p in (REPO_ROOT / d).rglob("*") if p.is_file()
               and p.suffix in (".py", ".sh", ".yaml", ".example", ".service", "") and "__pycache__" not in p.parts]
    names = {n for p in sources for n in re.findall(r"\bAML_[A-Z0-9_]*[A-Z0-9]\b", p.read_text(encoding="utf-8", errors="replace"))}
    names -= NOT_VARIABLES
    assert {"AML_HOME", "AML_TSDB_URL", "AML_MEMORY_MB"} <= names
    missing = sorted(n for n in names if f"`{n}" not in readme)
    assert not missing, f"read by the code, not in README.md: {missing}"


DIARY = re.compile(r"this session|the runs? before\b|in the (?:previous|latest|last|earlier) (?:full )?runs?\b|ad hoc"
                   r"|patched in|until this run|\bissue \d+", re.I)


def test_no_doc_reads_as_a_diary():
    found = [f"{p.relative_to(REPO_ROOT)}:{no}: {line.strip()}"
             for p in (*DOC_FILES, REPO_ROOT / "bench" / "README.md")
             for no, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if DIARY.search(line)]
    assert not found, "\n".join(found)


def test_every_table_row_has_its_header_s_columns():
    """A `|` inside a cell (even inside backticks) splits the cell: the row then renders broken."""
    broken = []
    for path in (*DOC_FILES, REPO_ROOT / "bench" / "README.md"):
        columns, in_fence = None, False
        for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.lstrip().startswith("```"):
                in_fence = not in_fence
            if in_fence or not line.startswith("|"):
                columns = None
                continue
            cells = len(re.findall(r"(?<!\\)\|", line)) - 1
            if columns is None:
                columns = cells
            elif cells != columns:
                broken.append(f"{path.relative_to(REPO_ROOT)}:{no}: {cells} cells, the header has {columns}")
    assert not broken, "\n".join(broken)
