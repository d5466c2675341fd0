"""The documentation a user reads is in the repository, links where it says, names every spec field
and ingest column the code accepts, and its hash recipe computes the snapshot hash."""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from pydantic.alias_generators import to_camel

from aml_pipeline.cli import build_parser
from aml_pipeline.config import REPO_ROOT
from aml_pipeline.core.hashing import snapshot_sha256
from aml_pipeline_tests.library_build import build_dataset
from aml_pipeline.simulate.plant import plant_spec_dict, simulate_plant
from aml_pipeline.spec import CleaningSpec, DatasetSpec, ExtrasSpec, NodeSpec, SplitSpec, VariableSpec, parse_spec
from aml_pipeline.tsdb_open import open_tsdb
from aml_pipeline.tsdb.ingest import NODE_OPTIONAL, NODE_REQUIRED, POINT_COLUMNS, RUN_OPTIONAL, RUN_REQUIRED
from aml_pipeline_tests.cli_tree import flags, parser_tree

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


def anchors(path) -> dict[str, str]:
    """The anchors of a markdown file's headings, as GitHub makes them (lower case, punctuation
    but ``-`` and ``_`` dropped, spaces to ``-``, ``-1``, ``-2``, ... for repeats; code blocks
    skipped), each with its heading's text."""
    seen: dict[str, int] = {}
    out, in_fence = {}, False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        heading = None if in_fence else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out[slug if n == 0 else f"{slug}-{n}"] = heading.group(1)
    return out


def markdown_files():
    return (*DOC_FILES, REPO_ROOT / "bench" / "README.md")


def anchor_problems(doc) -> list[str]:
    """Links of ``doc`` to an anchor no heading has, or whose text is a heading's text but whose
    anchor is another heading's (two swapped anchors)."""
    problems = []
    body = re.sub(r"```.*?```", "", doc.read_text(encoding="utf-8"), flags=re.S)
    for label, target, anchor in re.findall(r"\[([^\]]*)\]\(([^)#\s:]*)#([^)\s]+)\)", body):
        file = (doc.parent / target).resolve() if target else doc
        headings = anchors(file) if file.is_file() else {}
        named = [a for a, text in headings.items() if text == label]
        if anchor not in headings:
            problems.append(f"({target}#{anchor}): no such heading")
        elif named and anchor not in named:
            problems.append(f"[{label}]({target}#{anchor}): the heading {label!r} is #{named[0]}")
    return problems


def test_every_anchor_link_resolves_to_its_heading():
    """``[x](#a)`` and ``[x](other.md#a)`` in the README, docs/ and bench/README.md name a heading
    that is there, and the heading the link's text names (a renamed heading, two swapped anchors)."""
    broken = [f"{doc.relative_to(REPO_ROOT)}: {p}" for doc in markdown_files() for p in anchor_problems(doc)]
    assert not broken, "\n".join(broken)


def test_the_anchor_check_knows_repeated_headings_and_sees_a_swap(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text("- [Runs](#runs)\n# `runs`\n## Runs\n```bash\n# not a heading\n```\n### Keeping disk bounded: gc\n"
                   "[below](#runs-1) [x](#nope)\n")
    assert anchors(doc) == {"runs": "`runs`", "runs-1": "Runs", "keeping-disk-bounded-gc": "Keeping disk bounded: gc"}
    assert anchor_problems(doc) == ["[Runs](#runs): the heading 'Runs' is #runs-1", "(#nope): no such heading"]


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


def test_ingest_doc_says_which_columns_are_required_as_the_reader_does():
    """Each column table of docs/ingest.md says "required" for exactly the columns the reader
    requires (a column may be required and still hold empty cells, as `ended_at` does)."""
    doc = text("ingest.md")
    for heading, required, optional in (("Points", POINT_COLUMNS, ()), ("Runs", RUN_REQUIRED, RUN_OPTIONAL),
                                        ("Nodes", NODE_REQUIRED, NODE_OPTIONAL)):
        section = doc.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
        said = {}
        for row in re.findall(r"^\| (`[^|]+) \| [^|]+ \| ([^|]+) \|$", section, flags=re.M):
            for column in re.findall(r"`(\w+)`", row[0]):
                said[column] = row[1].strip()
        assert set(said) == {*required, *optional}, heading
        for column, rules in said.items():
            assert rules.startswith("required") == (column in required), f"{heading}: {column}: {rules}"


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
    activated environment, which the docs do not assume. (docs/dagster.md is the exception: there
    the package is installed into the plant's own Dagster project, whose environment `dg` runs in.)"""
    fenced, _ = doc_command_lines()
    bare = [f"{where}: {line}" for where, line in fenced if re.match(r"(?:\$\s+)?(?:\S+=\S*\s+)*aml-pipeline", line)
            and not where.startswith("docs/dagster.md:")]
    assert not bare, "\n".join(bare)


def test_help_names_every_subcommand():
    parser = build_parser()
    text = parser.format_help()
    for path, _ in parser_tree(parser):
        if len(path) == 1:
            assert path[0] in parser.description and path[0] in text, path


def section(doc: str, heading: str) -> str:
    """The text under ``heading`` (a whole heading line) up to the next heading of its level."""
    level = heading.split(" ")[0]
    return doc.split(heading + "\n", 1)[1].split(f"\n{level} ", 1)[0]


def test_every_command_is_in_the_readme_s_table_and_has_its_section_in_the_cli_doc():
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    table = [line.split("|")[1] for line in section(readme, "## Commands").splitlines() if line.startswith("| `")]
    shown = [span for cell in table for span in re.findall(r"`([^`]+)`", cell)]
    cli_doc = text("cli.md")
    headings = re.findall(r"^## (.+)$", cli_doc, flags=re.M)
    missing = []
    for path, parser in parser_tree(build_parser()):
        if not path or any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
            continue  # the command itself, and groups (`env`, `source`): their commands count
        name = " ".join(path)
        if not any(span == name or span.startswith(name + " ") for span in shown):
            missing.append(f"README.md's command table: {name}")
        if not any(h == name or name.startswith(h + " ") for h in headings):
            missing.append(f"docs/cli.md: ## {name}")
    assert not missing, "\n".join(missing)


def test_the_architecture_names_only_modules_that_exist():
    doc = text("architecture.md")
    named = set(re.findall(r"`([\w./-]+(?:\.py|/))`", doc))
    assert len(named) > 40, "the module map names the modules"
    package = REPO_ROOT / "aml_pipeline"
    missing = []
    for name in sorted(named):
        if name.startswith("aml_pipeline/") or name.split("/")[0] in ("bench", "specs", "deploy", "scripts", "aml_pipeline_tests", "examples"):
            ok = (REPO_ROOT / name).exists()
        else:  # the map's paths are relative to aml_pipeline/, or a file named in its package's row
            ok = (package / name).exists() or any(package.glob(f"*/{name}")) or any(package.glob(f"*/*/{name}"))
        if not ok:
            missing.append(name)
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


# An error code, not a variable.
NOT_VARIABLES = {"AML_ERROR"}
# Set by the operating system, the shell or systemd for every program; read, never configured here.
STANDARD_VARIABLES = {"PATH", "PYTHONPATH", "HOME", "VIRTUAL_ENV", "CREDENTIALS_DIRECTORY"}
# Where a variable is read: os.environ / os.getenv / dg.EnvVar / the settings helpers in Python, a
# ${VAR:-default} (or :?, :=, -) expansion in a shell script.
PY_READ = re.compile(
    r"""(?:os\.environ(?:\.get|\.setdefault|\.pop)?\(|os\.environ\[|os\.getenv\(|EnvVar(?:\.int|\.bool)?\("""
    r"""|_env_or\(|whole_number_env\()\s*["']([A-Z][A-Z0-9_]*)["']|["']([A-Z][A-Z0-9_]*)["']\s+(?:not\s+)?in\s+os\.environ""")
SH_READ = re.compile(r"\$\{([A-Z][A-Z0-9_]*)(?::?[-?=])")
CODE_DIRS = ("aml_pipeline", "aml_pipeline_tests", "scripts", "bench", "deploy")


def variables_read() -> dict[str, set[str]]:
    """Every environment variable the code, the tests, the scripts, the benchmark and the
    deployment files read, with the files that read it."""
    found: dict[str, set[str]] = {}
    for d in CODE_DIRS:
        for p in (REPO_ROOT / d).rglob("*"):
            if not p.is_file() or "__pycache__" in p.parts or p == Path(__file__):  # this file: examples
                continue
            text = p.read_text(encoding="utf-8", errors="replace")
            names = set()
            if p.suffix == ".py":
                names |= {a or b for a, b in PY_READ.findall(text)}
            if p.suffix in (".sh", "") and text.startswith("#!"):
                names |= set(SH_READ.findall(text))
            if p.suffix in (".py", ".sh", ".yaml", ".example", ".service", ""):
                names |= set(re.findall(r"\bAML_[A-Z0-9_]*[A-Z0-9]\b", text))
            for name in names - NOT_VARIABLES - STANDARD_VARIABLES:
                found.setdefault(name, set()).add(str(p.relative_to(REPO_ROOT)))
    return found


def documented_variables() -> set[str]:
    """The variables of the README's "Settings" table and of the tables it links for the rest
    (docs/deployment.md's "Settings", a deployment's; docs/development.md's, the tests')."""
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/deployment.md#settings" in readme and "docs/development.md#settings" in readme
    names = set()
    for doc, heading in ((readme, "## Settings"), (text("deployment.md"), "## Settings"),
                         (text("development.md"), "## Settings")):
        rows = [line.split("|")[1] for line in section(doc, heading).splitlines() if line.startswith("| `")]
        names |= {n for cell in rows for n in re.findall(r"`([A-Z][A-Z0-9_]*)`", cell)}
    return names


# Variables Dagster itself sets for the code it loads, read to learn how the code is run: no
# user sets them, so they are not settings.
SET_BY_DAGSTER = {"DAGSTER_IS_DEFS_VALIDATION_CLI"}


def test_every_environment_variable_the_code_and_tests_read_is_documented():
    read = {name: where for name, where in variables_read().items() if name not in SET_BY_DAGSTER}
    assert {"AML_HOME", "AML_TSDB_URL", "AML_MEMORY_MB", "AML_TEST_PG_URL", "PORT", "DAGSTER_HOME"} <= set(read)
    missing = sorted(f"{name} (read in {', '.join(sorted(where)[:3])})" for name, where in read.items()
                     if name not in documented_variables())
    assert not missing, "read, not in README.md's Settings table (or docs/deployment.md's, docs/development.md's):\n" + "\n".join(missing)


def test_the_variable_scan_sees_each_way_of_reading_one(tmp_path):
    py = 'os.environ.get("A_1")\nos.environ["A_2"]\nos.getenv("A_3")\ndg.EnvVar("A_4")\nif "A_5" in os.environ: pass\n'
    assert {a or b for a, b in PY_READ.findall(py)} == {"A_1", "A_2", "A_3", "A_4", "A_5"}
    assert set(SH_READ.findall('x=${B_1:-1} ${B_2:?set it} ${B_3} ${b_4:-1}')) == {"B_1", "B_2"}


DIARY = re.compile(
    r"this session|the runs? before\b|in the (?:previous|latest|last|earlier) (?:full )?runs?\b|ad hoc"
    r"|patched in|until this run|\bissue \d+|not tested here|(?:were|was) tried|we tried|at that commit"
    r"|\bcommit [0-9a-f]{7,40}\b|\b(?:at|since|before|after) [0-9a-f]{7,40}\b|\b(?:these|they|it)(?: \w+)? (?:were|was) run on"
    r"|\b(?:January|February|March|April|May|June|July|August|September|October|November|December) 20\d\d\b"
    r"|\b(?:on|measured|run|ran) 20\d\d-\d\d-\d\d\b",
    re.I,
)


def every_doc() -> list[Path]:
    """Every document a reader opens: the README, docs/, bench/README.md and everything in
    examples/ (source descriptions are read as recipes)."""
    examples = sorted(p for p in (REPO_ROOT / "examples").rglob("*") if p.is_file())
    return [*markdown_files(), *examples]


# Where code lives whose comments a maintainer reads (tests too: they are read to change code).
CODE_DIRS = ("aml_pipeline", "aml_pipeline_tests", "bench", "deploy", "scripts")


@functools.cache
def code_comments() -> tuple[tuple[str, int, str], ...]:
    """(file, line, text) of every comment and docstring line of every Python file under
    :data:`CODE_DIRS`, and of every ``#`` comment of their other text files (shell scripts,
    YAML, INI, systemd units, environment files); not this file, whose tests quote what they
    forbid."""
    out = []
    for d in CODE_DIRS:
        for path in sorted((REPO_ROOT / d).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts or path == Path(__file__):
                continue
            name = str(path.relative_to(REPO_ROOT))
            if path.suffix == ".py":
                out += [(name, no, line) for no, line in comments_and_docstrings(path)]
                continue
            if path.suffix == ".md":
                continue  # a doc: every_doc()
            try:
                source = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # not text
            out += [(name, no, "#" + line.split("#", 1)[1]) for no, line in enumerate(source.splitlines(), 1)
                    if "#" in line and not line.startswith("#!")]
    return tuple(out)


def test_no_doc_reads_as_a_diary():
    """Every doc (README.md, docs/, bench/README.md, examples/) states what is true, not how it
    was found: no session, commit, date or "was tried"."""
    found = [f"{p.relative_to(REPO_ROOT)}:{no}: {line.strip()}"
             for p in every_doc()
             for no, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if DIARY.search(line)]
    assert not found, "\n".join(found)


def test_no_code_comment_reads_as_a_diary():
    """Comments and docstrings say why the code is as it is, not its history: no session, issue
    number, commit or date."""
    found = [f"{name}:{no}: {line.strip()}" for name, no, line in code_comments() if DIARY.search(line)]
    assert not found, "\n".join(found)


def test_the_diary_check_sees_diary_phrases():
    for line in ("measured at commit 3039ef5", "This was not tested here.", "were tried and did not help",
                 "at that commit", "These three were run on an export", "measured in March 2025"):
        assert DIARY.search(line), line
    for line in ("a commit of the transaction", "run 2025-01-01T00:00:00Z", "`date=2026-01-05/`"):
        assert not DIARY.search(line), line


# A measured figure: a rate, a speed ratio, a duration or a size said to be taken, spent or
# measured. Constants that are settings ("default 120 s", "at most 64 MiB") do not match.
NUM = r"\d[\d,.]*"
MEASURED = re.compile(
    rf"{NUM}\s?[kMG]?\s?(?:points|rows|windows|runs|series|events|pages|calls|B|bytes)\s?/\s?(?:s|sec|second)\b"
    rf"|{NUM}\s?[kMG]i?B/s\b"
    rf"|{NUM}\s?(?:x|times)\s+(?:faster|slower|quicker|as\s+fast|as\s+slow|longer|shorter)\b"
    rf"|{NUM}\s?%\s+(?:faster|slower|quicker|of\s+the\s+(?:time|build|wall|run))"
    rf"|\b(?:takes?|took|costs?|spends?|spent|lasts?|in\s+about|about)\s+(?:about\s+)?{NUM}\s?"
    rf"(?:ms|µs|us|ns|s|sec|seconds|minutes|min)\b"
    rf"|[~≈]\s*{NUM}\s?(?:ms|µs|us|ns|s|sec|seconds|minutes|min|KB|MB|GB|KiB|MiB|GiB)\b"
    rf"|\b(?:peak|rss|uses?|used|takes?|took)\s+(?:about\s+)?{NUM}\s?(?:KB|MB|GB|KiB|MiB|GiB)\b"
    rf"|\bmeasured(?:\s*:|\s+(?:at|on|with|in)\b)[^.]*?{NUM}",
    re.I,
)
# Lines that match but state a setting or a rule of thumb, not a measurement: (file, part of the line).
SETTINGS_NOT_FIGURES = {
    ("docs/deployment.md", "K ≈ 180 s / (seconds per run"),  # sizing a chunk for a 3-minute target
    ("docs/operations.md", "connection retries, about 6 s"),  # Dagster's retry schedule, a setting
}


def a_setting(name: str, line: str) -> bool:
    return any(name == file and part in line for file, part in SETTINGS_NOT_FIGURES)


def comments_and_docstrings(path):
    """(line, text) of every comment and docstring line of a Python file."""
    import ast
    import io
    import tokenize

    source = path.read_text(encoding="utf-8")
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc and isinstance(node.body[0], ast.Expr):
                for i, line in enumerate(doc.splitlines()):
                    yield node.body[0].lineno + i, line


def test_no_code_comment_states_a_measured_figure():
    """Figures belong in bench/README.md, with the command that measured them: a comment's figure
    goes stale with the code and the host. Comments say why."""
    found = [f"{name}:{no}: {line.strip()}" for name, no, line in code_comments()
             if MEASURED.search(line) and not a_setting(name, line)]
    assert not found, "measured figures in comments (move them to bench/README.md):\n" + "\n".join(found)


def readme_headline_lines() -> set[int]:
    """Line numbers of the README's "Benchmarks" section: its few headline figures, each with the
    command that produced it."""
    lines = (REPO_ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    start = lines.index("## Benchmarks")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    return set(range(start + 1, end + 1))


def test_no_doc_but_the_benchmark_s_states_a_measured_figure():
    """bench/README.md holds the figures, each with what it is and the command that produced it,
    and the README's "Benchmarks" section a few headline ones with their command; every other
    doc points there rather than repeat a figure that goes stale with the host."""
    bench_readme, readme = REPO_ROOT / "bench" / "README.md", REPO_ROOT / "README.md"
    headline = readme_headline_lines()
    found = [f"{p.relative_to(REPO_ROOT)}:{no}: {line.strip()}"
             for p in every_doc() if p != bench_readme
             for no, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if MEASURED.search(line) and not a_setting(str(p.relative_to(REPO_ROOT)), line)
             and not (p == readme and no in headline)]
    assert not found, "measured figures in docs (they live in bench/README.md):\n" + "\n".join(found)


def test_the_comment_scan_reads_python_and_other_text_files():
    comments = {(name, line.strip()) for name, _, line in code_comments()}
    assert any(name == "aml_pipeline/core/hampel.py" and text.startswith("#") for name, text in comments)
    assert any(name.startswith("scripts/") and name.endswith(".sh") for name, _ in comments)
    assert any(name.startswith("deploy/") for name, _ in comments)
    assert not any(name == "aml_pipeline_tests/test_docs.py" for name, _ in comments)


def test_the_figure_check_tells_a_measurement_from_a_setting():
    for line in ("# the hash runs at 2.3 GB/s", "instead of starting a database each time (~10 ms)",
                 "(measured: 2.7x slower per-series reads", "a fetch takes about 40 ms", "25.9 M points/s",
                 "peak RSS 277 MB", "3.4x faster than numpy"):
        assert MEASURED.search(line), line
    for line in ("(default 3600 s)", "at most 64 MiB", "controls every 1 s", "every 15 minutes",
                 "4 MB of float64 per block", "on measured nodes (targets, features)", "wait_s=0.5",
                 "a gap over 5 s"):
        assert not MEASURED.search(line), line


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


# The docs that describe the new-run sensor's chunks and attempts to a deployment's operator.
SENSOR_DOCS = ("deployment.md", "dagster.md", "operations.md")


def sensor_wording_problems(doc: str) -> list[str]:
    """What a doc says of the sensor, its chunks and its steps that the code's constants contradict."""
    from aml_pipeline.components.sensors import MAX_ATTEMPTS
    from aml_pipeline.config import DEFAULT_BACKFILL_RUNS_PER_CHUNK
    from aml_pipeline.pipeline.registry import RUN_STAGES

    flat = " ".join(doc.split())
    problems = [f"says {m.group(0)!r}: the sensor requests chunks of runs"
                for m in re.finditer(r"one Dagster run per (new )?run\b", flat)]
    problems += [f"says {m.group(0)!r}: each stage's figures are observed on its own asset"
                 for m in re.finditer(r"observed on `run_windows`", flat)]
    # The run stages of a chunk are one multi-asset step, whatever their number.
    problems += [f"says {m.group(0)!r}: a chunk has one step" for m in re.finditer(r"\b(three|\d+) steps\b", flat)]
    for m in re.finditer(r"default (\d+)\) per Dagster run", flat):
        if int(m.group(1)) != DEFAULT_BACKFILL_RUNS_PER_CHUNK:
            problems.append(f"says chunks of default {m.group(1)}, the code {DEFAULT_BACKFILL_RUNS_PER_CHUNK}")
    for m in re.finditer(r"(again|retried)[^.]{0,60} at most (\d+) times|at most (\d+) times in all", flat):
        if m.group(1) or int(m.group(3)) != MAX_ATTEMPTS:
            problems.append(f"says {m.group(0)!r}: a run is requested at most {MAX_ATTEMPTS} times in all")
    if len(RUN_STAGES) != 3 and "three run stages" in flat:
        problems.append(f"says three run stages; there are {len(RUN_STAGES)}")
    return problems


@pytest.mark.parametrize("name", SENSOR_DOCS)
def test_the_sensor_wording_follows_the_constants(name):
    assert sensor_wording_problems(text(name)) == []


def test_the_deployment_doc_states_the_chunk_size_and_attempts():
    from aml_pipeline.components.sensors import MAX_ATTEMPTS
    from aml_pipeline.config import DEFAULT_BACKFILL_RUNS_PER_CHUNK

    flat = " ".join(text("deployment.md").split())
    assert (f"chunks of at most `AML_BACKFILL_RUNS_PER_CHUNK` runs (default {DEFAULT_BACKFILL_RUNS_PER_CHUNK}) "
            "per Dagster run") in flat
    assert f"at most {MAX_ATTEMPTS} times in all" in flat
    row = next(line for line in text("deployment.md").splitlines() if line.startswith("| `AML_BACKFILL_RUNS_PER_CHUNK`"))
    assert f"default {DEFAULT_BACKFILL_RUNS_PER_CHUNK}" in row


def test_the_sensor_wording_check_sees_each_mismatch():
    wrong = ("The new-run sensor requests one Dagster run per new run. Figures are observed on `run_windows`. "
             "A chunk runs its three steps. A failed run is requested again on later ticks, at most 3 times. "
             "Chunks of at most K runs (default 7) per Dagster run.")
    assert len(sensor_wording_problems(wrong)) == 5
    assert sensor_wording_problems("requests a run whose build failed at most 3 times in all") == []
