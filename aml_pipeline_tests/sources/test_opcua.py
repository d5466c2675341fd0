"""An OPC UA server's raw history as a source (``backend: opcua``), against a real server on
loopback (``aml_pipeline_tests.opcua_server``: asyncua's Server and its SQL history): StatusCodes
as states, points sharing a millisecond, continuation points followed and released, runs from
a batch-id node and fixed windows, a secured channel with a user and password, and the errors a
bad description or a refusing server gets. The same-bytes build, the versions and a server that
goes away mid-build are in ``test_same_bytes.py``, ``test_versions.py`` and ``test_faults.py``."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import numpy as np
import pytest

from aml_pipeline.cli import main
from aml_pipeline.errors import SourceError, TsdbUnavailableError
from aml_pipeline.sources import open_source
from aml_pipeline.sources.description import parse_description
from aml_pipeline_tests import opcua_server
from aml_pipeline_tests.pg_server import free_port
from aml_pipeline_tests.sources import layouts
from aml_pipeline_tests.sources.support import T0, check_pages, read_all, tie_points
from aml_pipeline_tests.tsdb.series import fetch_node_series

RUNS = {"windows": {"every": "1d", "start": "2025-02-01T00:00:00Z", "end": "2025-02-02T00:00:00Z",
                    "line": "L1", "product": "P", "recipe": "R"}}
# The DA quality codes of test_pages' rows as StatusCodes of the same severity.
STATUS_OF_DA = {192: opcua_server.GOOD, 64: opcua_server.UNCERTAIN_SENSOR_NOT_ACCURATE, 0: opcua_server.BAD_SENSOR_FAILURE}


def describe(url: str, nodes: dict, runs=None, **over) -> dict:
    return {"backend": "opcua", "connection": url, "nodes": nodes, "runs": runs or RUNS, **over}


def check(capsys, path, *extra) -> tuple[int, str, str]:
    code = main(["source", "check", str(path), *extra])
    out = capsys.readouterr()
    return code, out.out, out.err.strip()


def one_error(capsys, path) -> str:
    code, out, err = check(capsys, path)
    assert code == 2 and out == "", (code, out, err)
    assert "\n" not in err and "Traceback" not in err
    return err


def test_status_codes_by_severity_and_values_that_are_missing(tmp_path):
    codes = [0x00000000, 0x00D80000, 0x00000400, 0x40000000, 0x40900000, 0x80000000, 0x808B0000, 0x80310000,
             0xC0000000]
    value = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, np.nan, 8.0, 9.0])
    ts = T0 + np.arange(len(codes)) * 1000
    opcua_server.write_history(tmp_path / "srv", "Q", ts, value, np.array(codes))
    with opcua_server.running(tmp_path / "srv") as server:
        path = layouts.write_description(tmp_path / "s.yaml", describe(server.url, {"Q": {"key": "ns=2;s=Q"}}))
        with open_source(str(path)) as db:
            got_ts, got_value, state, _, _ = read_all(db, "Q", 100)
    np.testing.assert_array_equal(got_ts, ts)
    np.testing.assert_array_equal(got_value, value)
    # Good (with or without its sub-code and info bits) 0, Uncertain 1, Bad 2
    assert state.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]


@pytest.fixture(scope="module")
def tie_server(tmp_path_factory):
    """The rows of test_pages (bursts of hundreds of values at one millisecond) as history, the
    server returning at most 50 values a read."""
    rows = tie_points()
    base = tmp_path_factory.mktemp("ties")
    status = np.vectorize(STATUS_OF_DA.get)(rows["quality"])
    for node in ("TIE", "ONE"):
        sel = rows["tag"] == node
        opcua_server.write_history(base, f"Plant.{node}", rows["ts"][sel], rows["value"][sel], status[sel])
    with opcua_server.running(base, max_values=50) as server:
        yield server, rows


def test_ties_in_the_order_the_server_keeps_them_across_pages_and_continuation_points(tie_server, tmp_path):
    server, rows = tie_server
    nodes = {"TIE": {"key": "ns=2;s=Plant.TIE"}, "ONE": {"key": "/Objects/2:Plant/2:ONE"}}
    with open_source(str(layouts.write_description(tmp_path / "s.yaml", describe(server.url, nodes)))) as db:
        before = server.stats()
        check_pages(db, rows, limits=(7, 299, 301, 100_000))
    after = server.stats()
    # bursts of 300 values at one time outlast the server's 50 values a read
    assert after["continuation_points"] > before["continuation_points"]
    assert after["released"] > before["released"]  # pages that stop early let go of theirs
    assert after["open"] == 0


def test_a_read_that_stops_early_releases_its_continuation_point(tie_server, tmp_path):
    server, _ = tie_server
    path = layouts.write_description(tmp_path / "s.yaml", describe(server.url, {"TIE": {"key": "ns=2;s=Plant.TIE"}}))
    with open_source(str(path)) as db:
        run = db.list_runs(finished_only=False)[0]
        before = server.stats()
        page = db.query_page("TIE", run.run_id, run.started_at, run.ended_at, limit=60)
        after = server.stats()
    assert len(page) == 60 and not page.done
    # 61 values asked (one more than the page, for done): two reads, the second one cut short
    assert after["continuation_points"] - before["continuation_points"] == 2
    assert after["released"] - before["released"] == 1 and after["open"] == 0


def test_sub_millisecond_source_timestamps_share_their_millisecond(tmp_path):
    """SourceTimestamps 0.1 ms apart are values of one millisecond: in time order, numbered 0, 1,
    ... within it, floored to the millisecond (as ingest floors)."""
    micros = np.array([700, 100, 999, 1000, 1500, 2999])  # written out of time order
    stamps = (np.datetime64(T0, "ms") + micros.astype("timedelta64[us]")).astype("datetime64[us]")
    opcua_server.write_history(tmp_path / "srv", "A", stamps, np.arange(6, dtype=float), np.zeros(6, np.int64))
    by_time = np.argsort(micros)
    with opcua_server.running(tmp_path / "srv") as server:
        path = layouts.write_description(tmp_path / "s.yaml", describe(server.url, {"A": {"key": "ns=2;s=A"}}))
        with open_source(str(path)) as db:
            ts, value, _, seq, _ = read_all(db, "A", 2)
    np.testing.assert_array_equal(ts, T0 + micros[by_time] // 1000)
    np.testing.assert_array_equal(value, by_time.astype(float))
    np.testing.assert_array_equal(seq, [0, 1, 2, 0, 1, 0])


def test_runs_from_a_batch_id_node_and_from_fixed_windows(plant, tmp_path):
    base = tmp_path / "srv"
    layouts.opcua_history(base, plant)
    starts = np.array([r.started_at for r in plant.runs])
    ends = np.array([r.ended_at if r.ended_at is not None else -1 for r in plant.runs])
    # the batch number at each start, 0 (idle) a millisecond after each end
    ts = np.concatenate([starts, ends[ends >= 0] + 1])
    value = np.concatenate([np.arange(1, len(starts) + 1), np.zeros(int((ends >= 0).sum()))]).astype(float)
    order = np.argsort(ts, kind="stable")
    opcua_server.write_history(base, "MES.BATCH_NO", ts[order], value[order], np.zeros(ts.size, np.int64))
    nodes = {**{k: v for k, v in layouts.opcua_layout("", plant)["nodes"].items()},
             "BATCH_NO": {"key": "nsu=urn:aml-pipeline:test-plant;s=MES.BATCH_NO"}}
    constants = {"line": "L1", "product": "P100", "recipe": "R7"}
    with opcua_server.running(base) as server:
        by_tag = describe(server.url, nodes, runs={"batch_tag": {"node": "BATCH_NO", "idle": [0], "id_prefix": "B",
                                                                  **constants}})
        with open_source(str(layouts.write_description(tmp_path / "tag.yaml", by_tag))) as db:
            runs = db.list_runs(finished_only=False)
            assert [(r.run_id, r.started_at, r.ended_at) for r in runs] == [
                (f"B{i + 1}", r.started_at, r.ended_at) for i, r in enumerate(plant.runs)]
            first = plant.runs[0]
            s = fetch_node_series(db, "TI101", runs[0].run_id, first.started_at, first.ended_at)
            want = (plant.points.node_id == "TI101") & (plant.points.run_id == first.run_id)
            assert len(s) == int(want.sum())
        windows = describe(server.url, nodes, runs={"windows": {"every": "10min", "start": "2025-01-31T23:00:00Z",
                                                                 **constants}})
        with open_source(str(layouts.write_description(tmp_path / "win.yaml", windows))) as db:
            latest = db.availability_watermark()
            runs = db.list_runs(finished_only=False)
    assert latest == int(plant.points.ts.max())
    assert runs[0].started_at == int(np.datetime64("2025-01-31T23:00", "ms").astype(np.int64))
    assert runs[-1].started_at <= latest and runs[-1].ended_at is None and len(runs) >= 5


def test_a_secured_channel_with_a_user_and_password_from_the_environment(plant, tmp_path, monkeypatch, capsys):
    pki = tmp_path / "pki"
    server_cert, server_key = opcua_server.make_certificate(pki, "server", opcua_server.SERVER_URI, server=True)
    client_cert, client_key = opcua_server.make_certificate(pki, "aml", "urn:aml-pipeline:test-client")
    base = tmp_path / "srv"
    layouts.opcua_history(base, plant)
    layouts._runs_file(plant, tmp_path / "batches.csv")
    security = {"policy": "Basic256Sha256_SignAndEncrypt", "certificate": str(server_cert), "private_key": str(server_key)}
    with opcua_server.running(base, users={"reader": "s3cret"}, security=security) as server:
        desc = {**layouts.opcua_layout(server.url, plant),
                "security": {"mode": "SignAndEncrypt", "policy": "Basic256Sha256",
                             "certificate": "pki/aml.der", "private_key": "pki/aml-key.pem"},
                "user": "reader", "password": "${OPC_TEST_PASSWORD}"}
        path = layouts.write_description(tmp_path / "secure.yaml", desc)
        monkeypatch.setenv("OPC_TEST_PASSWORD", "s3cret")
        code, out, err = check(capsys, path, "--json")
        assert code == 0, err
        found = json.loads(out)
        assert found["security"] == "SignAndEncrypt Basic256Sha256" and found["user"] == "reader"
        assert found["runs"]["count"] == len(plant.runs) and len(found["nodes"]) == len(plant.nodes)
        n = int(((plant.points.run_id == plant.runs[3].run_id) & (plant.points.node_id == "TI101")).sum())
        assert found["sample_run"]["points"]["TI101"] == n

        monkeypatch.setenv("OPC_TEST_PASSWORD", "wrong")
        err = one_error(capsys, path)
        assert err.startswith("SOURCE_PERMISSION:") and "user 'reader'" in err and "s3cret" not in err
        monkeypatch.delenv("OPC_TEST_PASSWORD")
        err = one_error(capsys, path)
        assert err.startswith("SOURCE_INVALID:") and "password: environment variable OPC_TEST_PASSWORD is not set" in err
        monkeypatch.setenv("OPC_TEST_PASSWORD", "s3cret")
        plain = {k: v for k, v in desc.items() if k != "security"}
        err = one_error(capsys, layouts.write_description(tmp_path / "plain.yaml", plain))
        assert err.startswith("SOURCE_PERMISSION:") and "no endpoint with security mode None" in err
        stats = server.stats()
    assert stats["writes"] == stats["subscriptions"] == stats["history_updates"] == 0


def test_check_names_what_is_wrong(plant, opcua_plant, tmp_path, capsys):
    layouts._runs_file(plant, tmp_path / "batches.csv")
    desc = layouts.opcua_layout(opcua_plant.url, plant)
    code, out, err = check(capsys, layouts.write_description(tmp_path / "ok.yaml", desc))
    assert code == 0, err
    assert "source " in out and ": opcua opc.tcp://127.0.0.1:" in out
    assert "time: column SourceTimestamp, OPC UA SourceTimestamp" in out
    assert "runs (table): 5, 4 finished" in out

    def with_key(node: str, key: str):
        nodes = {**desc["nodes"], node: {**desc["nodes"][node], "key": key}}
        return layouts.write_description(tmp_path / "bad.yaml", {**desc, "nodes": nodes})

    err = one_error(capsys, with_key("TI101", "ns=2;s=Reactor.TI1O1"))
    assert err.startswith("SOURCE_NOT_FOUND:") and "node 'TI101' (ns=2;s=Reactor.TI1O1) is not on" in err
    err = one_error(capsys, with_key("QI301", "/Objects/2:Reactor/2:QI3O1"))
    assert err.startswith("SOURCE_NOT_FOUND:") and "node 'QI301': key '/Objects/2:Reactor/2:QI3O1': no node at this browse path" in err
    err = one_error(capsys, with_key("TI101", "Reactor.TI101"))
    assert err.startswith("SOURCE_INVALID:") and "neither a NodeId" in err
    err = one_error(capsys, with_key("TI101", "nsu=urn:elsewhere;s=Reactor.TI101"))
    assert err.startswith("SOURCE_NOT_FOUND:") and "namespace 'urn:elsewhere' is not on" in err
    err = one_error(capsys, layouts.write_description(
        tmp_path / "down.yaml", {**desc, "connection": f"opc.tcp://127.0.0.1:{free_port()}"}))
    assert err.startswith("TSDB_UNAVAILABLE:") and "cannot connect" in err
    assert opcua_plant.stats()["open"] == 0


@pytest.mark.parametrize("over, key, message", [
    ({"points": {"table": "x"}}, "points.table", "not for an OPC UA source"),
    ({"connection": None}, "connection", "required for backend opcua"),
    ({"security": {"mode": "SignAndEncrypt"}}, "security.certificate", "required for mode SignAndEncrypt"),
    ({"security": {"mode": "None", "certificate": "a.der"}}, "security.certificate", "only with mode Sign"),
    ({"security": {"mode": "Sign", "policy": "Basic128Rsa15", "certificate": "a", "private_key": "b"}}, "security.policy", ""),
    ({"nodes": {}}, "nodes", "needs its nodes"),
    ({"runs": {"table": "mes.batches", "id": "i", "start": "s", "end": "e", "line": "l", "product": "p",
               "recipe": "r"}}, "runs", "files only"),
])
def test_description_errors_name_the_key(over, key, message):
    desc = {**describe("opc.tcp://historian:4840", {"A": {"key": "ns=2;s=A"}}), **over}
    with pytest.raises(SourceError) as e:
        parse_description({k: v for k, v in desc.items() if v is not None}, Path("/p.yaml"))
    assert f"/p.yaml: {key}: " in e.value.message and message in e.value.message


def test_user_and_security_are_for_opcua_only():
    desc = {"backend": "postgresql", "connection": "postgresql://h/db", "user": "x",
            "points": {"table": "s", "node": "tag", "time": "ts", "value": "v"}, "runs": RUNS}
    with pytest.raises(SourceError, match="user: only for backend opcua"):
        parse_description(desc, Path("/p.yaml"))


def test_a_value_that_is_not_a_number_is_an_error_naming_the_node(tmp_path):
    from asyncua import ua
    from asyncua.ua.ua_binary import variant_to_binary

    opcua_server.write_history(tmp_path / "srv", "S", np.array([T0, T0 + 1]), np.array([1.0, 2.0]), np.zeros(2, np.int64))
    opcua_server.history_sql(tmp_path / "srv", f'UPDATE "{opcua_server.table_name("S")}" SET VariantBinary = ? WHERE _Id = 2',
                             [variant_to_binary(ua.Variant("open", ua.VariantType.String))])
    with opcua_server.running(tmp_path / "srv") as server:
        path = layouts.write_description(tmp_path / "s.yaml", describe(server.url, {"S": {"key": "ns=2;s=S"}}))
        with open_source(str(path)) as db, pytest.raises(SourceError) as e:
            read_all(db, "S", 10)
    assert "node 'S' (ns=2;s=S): value 'open' is not a number" in e.value.message


def test_an_unreachable_server_is_unavailable(tmp_path):
    path = layouts.write_description(tmp_path / "s.yaml", describe(f"opc.tcp://127.0.0.1:{free_port()}", {"A": {"key": "i=85"}}))
    with pytest.raises(TsdbUnavailableError, match="cannot connect"):
        open_source(str(path))


def test_times_are_utc_milliseconds(tmp_path):
    """A SourceTimestamp is UTC: 2025-02-01T00:00:00.123456Z is epoch ms 1738368000123."""
    stamp = np.array([np.datetime64("2025-02-01T00:00:00.123456", "us")])
    opcua_server.write_history(tmp_path / "srv", "A", stamp, np.array([1.0]), np.zeros(1, np.int64))
    with opcua_server.running(tmp_path / "srv") as server:
        path = layouts.write_description(tmp_path / "s.yaml", describe(server.url, {"A": {"key": "ns=2;s=A"}}))
        with open_source(str(path)) as db:
            assert db.availability_watermark() == 1_738_368_000_123
    assert dt.datetime(2025, 2, 1, tzinfo=dt.timezone.utc).timestamp() * 1000 == T0


def test_check_sets_the_servers_engineering_units_and_ranges_beside_the_descriptions(tmp_path, capsys):
    """An AnalogItem's EngineeringUnits and EURange are what the server says of a node: ``source
    check`` shows them beside the description's, and names a unit the server contradicts (the
    same unit spelt another way, degC and °C, is no contradiction)."""
    ts = T0 + np.arange(3) * 1000
    for path in ("R.TI", "R.QI", "R.FI", "R.XI", "R.LI"):
        opcua_server.write_history(tmp_path / "srv", path, ts, np.array([1.0, 2.0, 3.0]), np.zeros(3, np.int64))
    opcua_server.set_engineering(tmp_path / "srv", "R.TI", unit="°C", eu_range=(0.0, 150.0))
    opcua_server.set_engineering(tmp_path / "srv", "R.QI", unit="ppm")
    opcua_server.set_engineering(tmp_path / "srv", "R.FI", eu_range=(0.0, 50.0))
    # a span the server does not know (NaN, or an open end) is no range: left out as a missing one
    opcua_server.set_engineering(tmp_path / "srv", "R.XI", eu_range=(float("nan"), float("nan")))
    opcua_server.set_engineering(tmp_path / "srv", "R.LI", unit="m", eu_range=(0.0, float("inf")))
    nodes = {"TI": {"key": "ns=2;s=R.TI", "unit": "degC", "low": 0, "high": 150},
             "QI": {"key": "/Objects/2:R/2:QI", "unit": "%"},
             "FI": {"key": "ns=2;s=R.FI", "unit": "kg/h"},
             "XI": {"key": "ns=2;s=R.XI"}, "LI": {"key": "ns=2;s=R.LI", "unit": "m"}}
    with opcua_server.running(tmp_path / "srv") as server:
        path = layouts.write_description(tmp_path / "s.yaml", describe(server.url, nodes))
        code, out, err = check(capsys, path)
        assert code == 0, err
        assert "the source's own units and ranges (4 nodes): FI 0..50, LI [m], QI [ppm], TI [°C] 0..150" in out
        notes = [line for line in out.splitlines() if line.startswith("note:")]
        assert notes == ["note: node QI: the description says unit '%', the source says 'ppm'; the description's "
                         "unit is the one recorded (check which is right)"]
        code, out, err = check(capsys, path, "--json")
        found = json.loads(out)
        assert found["engineering"] == {"FI": {"unit": None, "range": [0.0, 50.0]}, "LI": {"unit": "m", "range": None},
                                        "QI": {"unit": "ppm", "range": None},
                                        "TI": {"unit": "°C", "range": [0.0, 150.0]}}
        assert found["unit_conflicts"] == [{"node_id": "QI", "description": "%", "source": "ppm"}]
        # What a build reads stays the description's: units and ranges are not taken from the server.
        with open_source(str(path)) as db:
            listed = {n.node_id: (n.unit, n.range_lo, n.range_hi) for n in db.list_nodes()}
        assert listed["QI"] == ("%", None, None) and listed["XI"] == ("", None, None)


@pytest.mark.parametrize("url,problem", [
    ("opc.tcp://127.0.0.1:99999", "Port out of range"),
    ("opc.tcp://127.0.0.1:abc", "Port could not be cast"),
    ("opc.tcp://", "no host"),
    ("opc.tcp://[::1", "Invalid IPv6 URL"),
    ("opc.tcp://127.0.0.1", "no port"),
    ("opc.tcp://127.0.0.1:", "no port"),
    ("http://127.0.0.1:4840", "its scheme is not opc.tcp"),
])
def test_an_endpoint_that_cannot_be_connected_to_is_refused_naming_the_field(tmp_path, url, problem):
    path = layouts.write_description(tmp_path / "s.yaml", describe(url, {"A": {"key": "i=85"}}))
    with pytest.raises(SourceError) as e:
        open_source(str(path))
    assert f"{path}: connection: " in e.value.message and "is not an OPC UA endpoint" in e.value.message, e.value.message
    assert problem in e.value.message, e.value.message
