"""The source description: every bad key is one line naming the file and the key; times convert
exactly; the URL forms."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np
import pytest
import yaml

from aml_pipeline.errors import SourceError
from aml_pipeline.sources import absolute_source_url, is_source_url, source_path
from aml_pipeline.sources.description import load_description, parse_description
from aml_pipeline.sources.timecodec import TimeCodec, resolve_codec

WINDOWS = {"windows": {"every": "1d", "start": "2025-01-01T00:00:00Z", "line": "L1", "product": "P", "recipe": "R"}}
NARROW = {"table": "hist.samples", "node": "tag", "time": "ts", "value": "value"}


def good(**over) -> dict:
    d = {"backend": "postgresql", "connection": "postgresql://reader@db/plant", "points": dict(NARROW), "runs": WINDOWS}
    d.update(over)
    return d


def error_of(data) -> str:
    with pytest.raises(SourceError) as e:
        parse_description(data, Path("/etc/aml/plant.yaml"))
    line = e.value.one_line()
    assert "\n" not in line
    return line


@pytest.mark.parametrize("data, key, fragment", [
    (good(points={**NARROW, "valu": "v"}), "points.valu", "unknown key"),
    (good(points={k: v for k, v in NARROW.items() if k != "value"}), "points.value", "required for the narrow layout"),
    (good(connection=None), "connection", "required for backend postgresql"),
    (good(backend="files"), "connection", "has no connection"),
    (good(points={**NARROW, "quality": {"column": "q", "good": [192], "states": {64: 0}}}), "points.quality",
     "list it under good"),
    (good(points={**NARROW, "quality": {"column": "q", "good": []}}), "points.quality", "at least one good code"),
    (good(points={**NARROW, "time_type": "epoch_min"}), "points.time_type", "Input should be"),
    (good(points={**NARROW, "time_zone": "UTC", "time_type": "epoch_ms"}), "points.time_zone", "only for time_type timestamp"),
    # A zone the reader cannot use is the file's error, named before anything connects.
    (good(points={**NARROW, "time_zone": "Mars/Olympus"}), "points.time_zone", "'Mars/Olympus' is not a known IANA zone"),
    (good(runs={"table": "b", "id": "i", "start": "s", "end": "e", "line": "l", "product": "p", "recipe": "r",
                "time_zone": "Mars/Olympus"}), "runs.time_zone", "'Mars/Olympus' is not a known IANA zone"),
    ({"backend": "opcua", "connection": "opc.tcp://historian:4840", "nodes": {"A": {"key": "i=85"}},
      "runs": {"files": "b.csv", "id": "i", "start": "s", "end": "e", "line": "l", "product": "p", "recipe": "r",
               "time_zone": "Europe/Nowhere"}}, "runs.time_zone", "'Europe/Nowhere' is not a known IANA zone"),
    (good(points={"table": "t", "time": "ts", "columns": {"TI 101": "a"}}), "points.columns", "not a valid id"),
    (good(points={"query": "SELECT 1", "time": "t", "value": "v"}), "nodes", "needs a node catalog"),
    (good(points={"query": "SELECT t, v FROM x WHERE tag = :node", "time": "t", "value": "v"}, nodes={"A": None}),
     "points.query", "must use :from"),
    (good(runs={"table": "b", "id": "i", "start": "s", "line": "l", "product": "p", "recipe": "r"}), "runs.end", "required"),
    (good(runs={**WINDOWS, "table": "b"}), "runs", "exactly one of"),
    (good(runs={"windows": {**WINDOWS["windows"], "every": "daily"}}), "runs.windows.every", "not a duration"),
    (good(runs={"batch_tag": {"node": "B", "line": "L", "product": "P", "recipe": "R"}, "line": "x"}), "runs.line",
     "belongs inside batch_tag"),
    (good(nodes={"TI101": {"low": 5, "high": 1}}), "nodes.TI101", "low 5.0 is above high 1.0"),
    (good(nodes={"TI101": {"low": float("inf")}}), "nodes.TI101", "low: inf; leave it out for an unknown or open bound"),
    (good(nodes={"TI101": {"high": float("-inf")}}), "nodes.TI101", "high: -inf; leave it out"),
    # Text or true/false where a number belongs, and a number or text where true/false does, as in a spec.
    (good(nodes={"TI101": {"low": "0"}}), "nodes.TI101.low", "'0' is text, not a number (write it without quotes"),
    (good(nodes={"TI101": {"high": True}}), "nodes.TI101.high", "true is not a number"),
    (good(runs={"windows": {**WINDOWS["windows"], "confirmed": "yes"}}), "runs.windows.confirmed",
     "'yes' is text, not true or false"),
    (good(runs={"windows": {**WINDOWS["windows"], "confirmed": 1}}), "runs.windows.confirmed", "1 is a number, not true or false"),
    (good(runs={"windows": {**WINDOWS["windows"], "recipe_version": "3"}}), "runs.windows.recipe_version", "is text, not a number"),
    (good(points={**NARROW, "quality": {"column": "q", "good": [192], "other": "2"}}), "points.quality.other",
     "'2' is text, not a number"),
    (good(backend="influxdb", connection="http://h:8086"), "database", "required for backend influxdb"),
    (good(database="x"), "database", "only for backend influxdb"),
    (good(points={**NARROW, "partition": {"column": "date"}}), "points.partition", "only for backend files"),
    ({"backend": "influxdb", "connection": "http://h:8086", "database": "d", "runs": WINDOWS,
      "points": {"measurement": "m", "node": "tag", "value": "v", "order": ["x"]}}, "points.order", "nothing to order"),
    (good(points={**NARROW, "table": 'public."samples"x'}), "points.table",
     """table name 'public."samples"x': expected '.' after a quoted part"""),
    (good(points={**NARROW, "table": "hist..samples"}), "points.table", "has an empty part"),
    (good(runs={"table": 'mes."batch', "id": "i", "start": "s", "end": "e", "line": "l", "product": "p", "recipe": "r"}),
     "runs.table", "a quoted part is not closed"),
    (good(node_table={"table": '"tags"x', "id": "name"}), "node_table.table", "expected '.' after a quoted part"),
    (good(points={"query": "SELECT * FROM {table} WHERE tag = :node AND ts BETWEEN :from AND :to", "time": "ts",
                  "value": "v", "periods": {"table": '"hist"_x.s_{period}', "every": "day"}}, nodes={"A": None}),
     "points.periods.table", "expected '.' after a quoted part"),
])
def test_a_bad_description_names_its_key(data, key, fragment):
    line = error_of(data)
    assert line.startswith(f"SOURCE_INVALID: /etc/aml/plant.yaml: {key}: "), line
    assert fragment in line, line


def test_load_reports_yaml_and_missing_files(tmp_path):
    with pytest.raises(SourceError, match="cannot read"):
        load_description(tmp_path / "none.yaml")
    (tmp_path / "bad.yaml").write_text("points: [\n")
    with pytest.raises(SourceError, match="not valid YAML"):
        load_description(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(SourceError, match="expected a mapping"):
        load_description(tmp_path / "list.yaml")


def test_a_description_that_is_not_utf8_is_one_line_naming_the_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(yaml.safe_dump(good()).encode() + 'note: "K\u00fchler"\n'.encode("latin-1"))
    with pytest.raises(SourceError) as e:
        load_description(path)
    line = e.value.one_line()
    assert line.startswith(f"SOURCE_INVALID: {path}: cannot read the source description: ") and "\n" not in line
    n = path.read_bytes().count(b"\n")  # the last line holds the Latin-1 byte
    assert f"line {n} is not UTF-8 text (byte 0xfc" in line, line


def test_quoted_table_names_that_parse_are_taken_as_written():
    loaded = parse_description(good(points={**NARROW, "table": 'hist."Samples ""2024"""'}), Path("/p.yaml"))
    from aml_pipeline.sources.sqlbuild import quote_dotted

    assert quote_dotted(loaded.spec.points.table) == '"hist"."Samples ""2024"""'


def test_connection_takes_variables_from_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(good(connection="postgresql://reader:${PLANT_PW}@db/plant")))
    loaded = load_description(path)
    monkeypatch.setenv("PLANT_PW", "s3cret")
    assert loaded.connection() == "postgresql://reader:s3cret@db/plant"
    monkeypatch.delenv("PLANT_PW")
    with pytest.raises(SourceError, match="PLANT_PW is not set"):
        loaded.connection()


def test_url_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_source_url("plant.yaml") and is_source_url("x/PLANT.YML") and is_source_url("source:///etc/p")
    assert not is_source_url("duckdb:///x.duckdb") and not is_source_url("postgresql://h/db")
    assert source_path("plant.yaml") == tmp_path / "plant.yaml"
    assert source_path("source:///etc/aml/plant.yaml") == Path("/etc/aml/plant.yaml")
    assert absolute_source_url("plant.yaml") == f"source://{tmp_path / 'plant.yaml'}"
    assert absolute_source_url("duckdb:///x.duckdb") == "duckdb:///x.duckdb"


# ---- times ---------------------------------------------------------------------------------


def test_time_codecs_floor_to_the_millisecond_and_bound_exactly():
    ms = np.array([-1500, -1, 0, 1, 1_738_368_000_123])
    for kind, scale in (("epoch_ms", 1), ("epoch_us", 1000), ("epoch_ns", 1_000_000)):
        c = TimeCodec(kind)
        np.testing.assert_array_equal(c.to_ms(ms * scale + scale - 1), ms)  # the last unit of a millisecond
        lo, hi = c.bounds(10, 20)
        assert c.to_ms(np.array([lo, hi])).tolist() == [10, 20]
        assert c.to_ms(np.array([lo - 1, hi + 1])).tolist() == [9, 21]
    s = TimeCodec("epoch_s")
    assert s.bounds(1001, 2999) == (2, 2) and s.to_ms(np.array([2])).tolist() == [2000]
    f = TimeCodec("epoch_s_float")
    np.testing.assert_array_equal(f.to_ms(ms / 1000.0), ms)  # rounding recovers every millisecond
    lo, hi = f.bounds(1_738_368_000_123, 1_738_368_000_125)
    assert f.to_ms(np.array([lo, hi])).tolist() == [1_738_368_000_123, 1_738_368_000_125]
    assert f.to_ms(np.array([np.nextafter(lo, -np.inf), np.nextafter(hi, np.inf)])).tolist() == [
        1_738_368_000_122, 1_738_368_000_126]


def test_local_timestamps_in_their_zone():
    c = TimeCodec("timestamp", "Europe/Berlin")
    # 2025-03-30 01:30 local is 00:30 UTC (winter); 03:30 local is 01:30 UTC (summer)
    local = np.array([dt.datetime(2025, 3, 30, 1, 30), dt.datetime(2025, 3, 30, 3, 30)], dtype="datetime64[us]")
    got = c.to_ms(local.astype(np.int64))
    want = np.array([dt.datetime(2025, 3, 30, 0, 30), dt.datetime(2025, 3, 30, 1, 30)], dtype="datetime64[ms]").astype(np.int64)
    np.testing.assert_array_equal(got, want)
    lo, hi = c.bounds(int(want[0]), int(want[1]))
    assert (lo, hi) == (int(local[0].astype(np.int64)), int(local[1].astype(np.int64)) + 999)
    assert c.bind(lo) == dt.datetime(2025, 3, 30, 1, 30)
    assert TimeCodec("timestamptz").bind(0) == dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


@pytest.mark.parametrize("declared, zone, type_name, kind, fragment", [
    (None, None, "timestamp with time zone", "timestamptz", ""),
    (None, None, "TIMESTAMP WITH TIME ZONE", "timestamptz", ""),
    (None, "Europe/Berlin", "timestamp without time zone", "timestamp", ""),
    (None, None, "timestamp without time zone", None, "say which zone"),
    (None, None, "bigint", None, "say which epoch unit"),
    (None, None, "double precision", "epoch_s_float", ""),
    ("epoch_ms", None, "BIGINT", "epoch_ms", ""),
    ("timestamptz", None, "bigint", None, "does not fit"),
    (None, "Mars/Olympus", "timestamp", None, "not a known IANA zone"),
    (None, None, "text", None, "not a time"),
])
def test_time_type_from_the_column(declared, zone, type_name, kind, fragment):
    codec, why = resolve_codec(declared, zone, type_name, "ts")
    assert (codec.kind if codec else None) == kind
    assert fragment in why
