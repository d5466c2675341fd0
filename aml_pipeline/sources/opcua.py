"""An OPC UA server's raw history (OPC UA Historical Access) read through HistoryRead, read-only.

Most plant historians speak OPC UA (PI, Kepware, Prosys, WinCC OA, Ignition, DCS historians):
this backend reads each node's raw history with ``HistoryRead`` and ``ReadRawModifiedDetails``,
and nothing else is asked of the server (no Write, no HistoryUpdate, no subscription).

Connection
    ``connection: opc.tcp://host:4840`` with an optional ``security`` block (mode, policy, this
    client's certificate and key, the server's certificate to accept) and ``user`` /
    ``password`` (``${VAR}`` from the environment). The client is asyncua's; it runs in one
    event loop on a thread of its own (asyncua's ``ThreadLoop``), and each call of the backend
    is one coroutine posted to it, so nothing blocks inside the loop and the loop never runs
    inside a caller's. A lost connection (refused, reset, timed out, the session gone) is
    :class:`~aml_pipeline.errors.TsdbUnavailableError`; the next call connects again.

Nodes
    Each node's ``key`` is its NodeId (``ns=2;s=Reactor.TI101``, ``nsu=urn:plant;s=TI101``,
    ``i=2258``) or its browse path from the root (``/Objects/2:Reactor/2:TI101``), resolved once
    per connection (``nsu=`` through the server's namespace array, paths through
    TranslateBrowsePathsToNodeIds).

Points
    A read asks for ``[lo, hi + 1 ms)`` of SourceTimestamps and keeps the values whose
    millisecond is within ``[lo, hi]`` (servers differ on whether the end is included). It pages
    with ``numValuesPerNode`` and follows continuation points until the server returns none
    (never a silent cut: a continuation point that does not advance is an error), and releases
    the one it holds when it stops early. SourceTimestamps (UTC, 100 ns) are floored to the
    millisecond, as ``ingest`` floors; values of one millisecond keep the server's order (finer
    time, then its order of values at one time). Only SourceTimestamps are asked for; a value
    without one is an error naming the node. The StatusCode's severity is the state: Good 0, Uncertain 1, Bad 2; a
    value that is not a number is an error naming the node; a missing one is NaN.

Versions
    OPC UA has no checksum over raw values, so a run's version reads its points: per node the
    count, first and last time and a sum of a hash of each value's time, value and StatusCode.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime as dt
import functools
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from aml_pipeline.errors import PaginationError, SourceError, TsdbError, TsdbUnavailableError
from aml_pipeline.sources.backend import Backend, NodeRef, Series, Window
from aml_pipeline.sources.description import LoadedDescription
from aml_pipeline.urls import redact_url

# Values one HistoryRead asks for in all, shared out among its nodes (numValuesPerNode): an
# answer stays a few megabytes and a second or so of a server's work; the server may return fewer.
VALUES_PER_READ = 10_000
# Nodes per HistoryRead request where several are read at once.
NODES_PER_READ = 100
# Seconds a request may take before the connection counts as lost.
REQUEST_TIMEOUT_S = 60.0
# State of each StatusCode severity (its top two bits): Good, Uncertain, Bad, Bad (reserved).
STATE_OF_SEVERITY = np.array([0, 1, 2, 2], dtype=np.int32)
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
# OPC UA's DateTime range (1601 .. 9999); its lowest value means "not specified".
_FIRST = dt.datetime(1601, 1, 2, tzinfo=dt.timezone.utc)
_LAST = dt.datetime(9999, 12, 31, tzinfo=dt.timezone.utc)
_MS = dt.timedelta(milliseconds=1)

POLICIES = {
    "Basic256Sha256": "SecurityPolicyBasic256Sha256",
    "Aes128_Sha256_RsaOaep": "SecurityPolicyAes128Sha256RsaOaep",
    "Aes256_Sha256_RsaPss": "SecurityPolicyAes256Sha256RsaPss",
}

# StatusCodes that mean the connection or session is gone (retry), or a refusal (permission).
_UNAVAILABLE = {
    "BadConnectionClosed", "BadSecureChannelClosed", "BadSessionClosed", "BadSessionIdInvalid",
    "BadSecureChannelIdInvalid", "BadServerHalted", "BadServerNotConnected", "BadCommunicationError",
    "BadTimeout", "BadNotConnected", "BadShutdown", "BadNoCommunication", "BadTooManySessions",
    "BadResourceUnavailable", "BadServerTooBusy", "BadTcpServerTooBusy", "BadTooManyOperations",
    "BadRequestTimeout", "BadConnectionRejected", "BadDisconnect", "BadInvalidState",
}
_PERMISSION = {
    "BadUserAccessDenied", "BadIdentityTokenInvalid", "BadIdentityTokenRejected", "BadNotReadable",
    "BadSecurityPolicyRejected", "BadSecurityModeRejected", "BadCertificateInvalid", "BadCertificateUntrusted",
    "BadCertificateRevoked", "BadCertificateTimeInvalid", "BadCertificateUriInvalid", "BadCertificateHostNameInvalid",
    "BadSecurityChecksFailed", "BadApplicationSignatureInvalid", "BadUserSignatureInvalid",
    "BadCertificateUseNotAllowed", "BadNoValidCertificates",
}
_NOT_FOUND = {"BadNodeIdUnknown", "BadNodeIdInvalid", "BadNoMatch", "BadBrowseNameInvalid"}


def _status_name(code: int) -> str:
    from asyncua.ua.status_codes import get_name_and_doc

    return get_name_and_doc(code)[0]


def _opc_time(ms: int) -> dt.datetime:
    """Epoch ms as an OPC UA DateTime, inside the range it can hold."""
    try:
        moment = _EPOCH + dt.timedelta(milliseconds=int(ms))
    except OverflowError:
        return _FIRST if ms < 0 else _LAST
    return min(max(moment, _FIRST), _LAST)


def _epoch_ms(stamps: list[dt.datetime]) -> np.ndarray:
    """Datetimes (UTC) as epoch ms, floored."""
    return np.fromiter(((t - _EPOCH) // _MS for t in stamps), dtype=np.int64, count=len(stamps))



def _endpoint_problem(url: str) -> str | None:
    """What makes ``url`` unusable as an ``opc.tcp://host:port`` endpoint (None: nothing), checked
    before connecting: the client would fail on it with a bare ValueError."""
    if not url.startswith("opc.tcp://"):
        return "its scheme is not opc.tcp"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsed here: out of range or not a number raises ValueError
    except ValueError as e:
        return str(e)
    if not parts.hostname:
        return "no host"
    if parts.port is None:
        return "no port (a server's is usually 4840)"
    return None

class _Columns:
    """One node's values as they arrive, page by page, as columns."""

    def __init__(self) -> None:
        self.ts: list[np.ndarray] = []
        self.value: list[np.ndarray] = []
        self.status: list[np.ndarray] = []
        self.count = 0

    def add(self, ts: np.ndarray, value: np.ndarray, status: np.ndarray) -> None:
        self.ts.append(ts)
        self.value.append(value)
        self.status.append(status)
        self.count += int(ts.shape[0])

    def series(self) -> Series:
        if not self.ts:
            return Series.empty()
        status = np.concatenate(self.status)
        return Series(np.concatenate(self.ts), np.concatenate(self.value),
                      STATE_OF_SEVERITY[(status >> 30) & 3])

    def digest(self) -> list[int]:
        """Count, first and last time, and a sum (mod 2**64) of a hash of each value."""
        if not self.ts:
            return [0, None, None, 0]
        ts, value, status = np.concatenate(self.ts), np.concatenate(self.value), np.concatenate(self.status)
        with np.errstate(over="ignore"):
            h = (ts.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ value.view(np.uint64)
            h ^= status.astype(np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F)
            h ^= h >> np.uint64(31)
            h *= np.uint64(0x94D049BB133111EB)
            total = int(h.sum(dtype=np.uint64))
        return [int(ts.shape[0]), int(ts.min()), int(ts.max()), total]


class OpcUaSource(Backend):
    """The OPC UA backend of :class:`~aml_pipeline.sources.mapped.MappedTsdb`: runs and node
    tables from files (``read_table``'s default)."""

    codec = None  # OPC UA keeps its own time (SourceTimestamp)

    def __init__(self, loaded: LoadedDescription) -> None:
        from asyncua.sync import ThreadLoop

        quiet = logging.getLogger("asyncua")
        if quiet.level == logging.NOTSET:  # its notes (a revised session timeout) are not the user's business
            quiet.setLevel(logging.ERROR)

        self.loaded = loaded
        self.spec = loaded.spec
        self._url = loaded.connection()
        problem = _endpoint_problem(self._url)
        if problem is not None:
            raise loaded.error("connection", f"{redact_url(self._url)!r} is not an OPC UA endpoint (opc.tcp://host:port): {problem}")
        self.label = redact_url(self._url)
        self._user = loaded.expand("user", self.spec.user) if self.spec.user else None
        self._password = loaded.expand("password", self.spec.password) if self.spec.password else None
        self._security = self.spec.security
        self._files = self._security_files()
        self._client: Any = None
        self._ids: dict[str, Any] = {}
        self._closed = False
        self.pages = 0  # HistoryRead answers received (continuation points followed included)
        self._loop = ThreadLoop(timeout=None)
        self._loop.daemon = True  # a handle never closed does not keep the interpreter alive
        self._loop.start()
        try:
            self._call(self._connected)
        except BaseException:
            self.close()
            raise

    # ---- the connection ----------------------------------------------------------------------
    def _security_files(self) -> dict[str, Path]:
        s = self._security
        files: dict[str, Path] = {}
        if s is None:
            return files
        for key in ("certificate", "private_key", "server_certificate"):
            name = getattr(s, key)
            if name:
                path = Path(name).expanduser()
                path = path if path.is_absolute() else self.loaded.base_dir / path
                if not path.is_file():
                    raise SourceError(f"{self.loaded.path}: security.{key}: no file {path}", code="SOURCE_NOT_FOUND")
                files[key] = path
        return files

    def _call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Run ``fn(*args, **kw)`` (a coroutine function) in the source's event loop and wait."""
        if self._closed:
            raise TsdbError(f"{self.label}: this source handle is closed")
        try:
            return self._loop.post(self._guarded(functools.partial(fn, *args, **kw)))
        except concurrent.futures.TimeoutError:
            raise TsdbUnavailableError(f"{self.label}: no answer in time") from None

    async def _guarded(self, fn: Callable[[], Any]) -> Any:
        from asyncua import ua

        try:
            await self._connected()
            return await fn()
        except TsdbUnavailableError:
            await self._drop()
            raise
        except (SourceError, TsdbError):
            raise
        except ua.UaStatusCodeError as e:
            name = _status_name(e.code)
            if name in _UNAVAILABLE:
                await self._drop()
                raise TsdbUnavailableError(f"{self.label}: the connection was lost ({name})") from None
            raise self._refused(name, "the server refused a request") from None
        except (OSError, EOFError, asyncio.TimeoutError, asyncio.IncompleteReadError, ua.UaError) as e:
            await self._drop()
            raise TsdbUnavailableError(f"{self.label}: the connection was lost ({type(e).__name__}: {e or 'no answer'})") from None

    def _refused(self, name: str, what: str) -> SourceError:
        if name in _PERMISSION:
            who = f"user {self._user!r}" if self._user else "an anonymous session"
            return SourceError(f"{self.loaded.path}: connection {self.label}: {what} for {who} ({name}); check user, "
                               "password and security, and that the server grants this user HistoryRead", code="SOURCE_PERMISSION")
        if name in _NOT_FOUND:
            return SourceError(f"{self.loaded.path}: {self.label}: {what} ({name})", code="SOURCE_NOT_FOUND")
        return SourceError(f"{self.loaded.path}: {self.label}: {what} ({name})", code="SOURCE_QUERY")

    async def _connected(self) -> Any:
        from asyncua import Client, ua

        if self._client is not None:
            return self._client
        # The client's watchdog probes the server every watchdog_intervall seconds and gives up on
        # a probe that takes as long: a server busy with a long answer is not a lost connection.
        client = Client(self._url, timeout=REQUEST_TIMEOUT_S, watchdog_intervall=REQUEST_TIMEOUT_S)
        if self._user:
            client.set_user(self._user)
        if self._password is not None:
            client.set_password(self._password)
        s = self._security
        if s is not None and s.mode != "None":
            from asyncua.crypto import security_policies, uacrypto

            cert = await uacrypto.load_certificate(self._files["certificate"])
            uris = _certificate_uris(cert)
            if uris:  # the application URI servers check against the certificate
                client.application_uri = uris[0]
            key_password = self.loaded.expand("security.private_key_password", s.private_key_password) \
                if s.private_key_password else None
            try:
                await client.set_security(
                    getattr(security_policies, POLICIES[s.policy or "Basic256Sha256"]),
                    str(self._files["certificate"]), str(self._files["private_key"]), key_password,
                    str(self._files["server_certificate"]) if "server_certificate" in self._files else None,
                    getattr(ua.MessageSecurityMode, s.mode))
            except ua.UaError as e:
                if isinstance(e, ua.UaStatusCodeError):
                    raise
                raise SourceError(f"{self.loaded.path}: security: the server at {self.label} offers no endpoint with "
                                  f"mode {s.mode} and policy {s.policy or 'Basic256Sha256'} ({e})",
                                  code="SOURCE_PERMISSION") from None
            except ValueError as e:
                raise SourceError(f"{self.loaded.path}: security: cannot read the certificate or key ({e})") from None
        try:
            await client.connect()
        except ua.UaStatusCodeError as e:
            client.disconnect_socket()
            name = _status_name(e.code)
            if name in _UNAVAILABLE:
                raise TsdbUnavailableError(f"{self.label}: cannot connect ({name})") from None
            raise self._refused(name, "the session was refused") from None
        except (OSError, EOFError, asyncio.TimeoutError, ua.UaError) as e:
            client.disconnect_socket()
            if isinstance(e, ua.UaError) and "endpoint" in str(e).lower():
                mode = "None" if s is None else s.mode
                raise SourceError(f"{self.loaded.path}: security: the server at {self.label} offers no endpoint with "
                                  f"security mode {mode} ({e}); set security: to a mode and policy it offers",
                                  code="SOURCE_PERMISSION") from None
            raise TsdbUnavailableError(f"{self.label}: cannot connect ({type(e).__name__}: {e or 'no answer'})") from None
        self._client = client
        self._ids = {}
        return client

    async def _drop(self) -> None:
        client, self._client = self._client, None
        self._ids = {}
        if client is not None:
            with _quiet():
                await asyncio.wait_for(client.disconnect(), 5)
            with _quiet():
                client.disconnect_socket()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loop.is_alive():
            with _quiet():
                self._loop.post(self._drop())
            self._loop.stop()

    # ---- nodes -------------------------------------------------------------------------------
    async def _node_ids(self, nodes: Sequence[NodeRef]) -> list[Any]:
        """The NodeId of each node's key (resolved once per connection)."""
        from asyncua import ua

        client = self._client
        out = []
        for ref in nodes:
            key = "" if ref.key is None else str(ref.key).strip()
            if key not in self._ids:
                self._ids[key] = await self._resolve(client, ref, key, ua)
            out.append(self._ids[key])
        return out

    async def _resolve(self, client: Any, ref: NodeRef, key: str, ua: Any) -> Any:
        where = f"{self.loaded.path}: node {ref.node_id!r}: key {key!r}"
        if key.startswith("/"):
            parts = [p for p in key.split("/") if p]
            path = [p if ":" in p else f"0:{p}" for p in parts]
            try:
                node = await client.nodes.root.get_child(path)
            except ua.UaStatusCodeError as e:
                name = _status_name(e.code)
                if name in _NOT_FOUND:
                    raise SourceError(f"{where}: no node at this browse path on {self.label} ({name})",
                                      code="SOURCE_NOT_FOUND") from None
                raise
            except ValueError as e:
                raise SourceError(f"{where}: not a browse path (/Objects/2:Folder/2:Name): {e}") from None
            return node.nodeid
        try:
            nid = ua.NodeId.from_string(key)
        except (ua.UaStringParsingError, ValueError) as e:
            raise SourceError(f"{where}: neither a NodeId (ns=2;s=Reactor.TI101) nor a browse path "
                              f"(/Objects/2:Reactor/2:TI101) ({e})") from None
        uri = getattr(nid, "NamespaceUri", None)
        if uri:
            names = await client.get_namespace_array()
            if uri not in names:
                raise SourceError(f"{where}: namespace {uri!r} is not on {self.label} (it has {', '.join(names)})",
                                  code="SOURCE_NOT_FOUND")
            nid = ua.NodeId(nid.Identifier, names.index(uri), nid.NodeIdType)
        return nid

    # ---- HistoryRead -------------------------------------------------------------------------
    async def _history(self, refs: Sequence[NodeRef], lo: int, hi: int, *, each: int = 0, most: int = 0,
                       backward: bool = False) -> list[_Columns] | None:
        """Raw history of ``refs`` with ``lo <= ts <= hi`` (ms), following continuation points.
        ``each``: stop a node after this many values (0: all); ``most``: give up (None) past this
        many values in all (0: no bound); ``backward``: the latest ``each`` values first."""
        from asyncua import ua

        nids = await self._node_ids(refs)
        out = [_Columns() for _ in refs]
        share = max(VALUES_PER_READ // min(len(refs), NODES_PER_READ), 1)
        per_read = min(each, share) if each else share
        if backward:
            details = ua.ReadRawModifiedDetails(IsReadModified=False, StartTime=ua.get_win_epoch(),
                                                EndTime=_opc_time(hi + 1), NumValuesPerNode=per_read, ReturnBounds=False)
        else:
            details = ua.ReadRawModifiedDetails(IsReadModified=False, StartTime=_opc_time(lo), EndTime=_opc_time(hi + 1),
                                                NumValuesPerNode=per_read, ReturnBounds=False)
        total = 0
        for start in range(0, len(nids), NODES_PER_READ):
            batch = list(range(start, min(start + NODES_PER_READ, len(nids))))
            points: dict[int, bytes | None] = {i: None for i in batch}  # node -> its continuation point
            try:
                while points:
                    sent = dict(points)
                    results = await self._read(details, [(nids[i], cp) for i, cp in sent.items()])
                    self.pages += 1
                    for i, res in zip(sent, results):  # the points to release if anything fails
                        points[i] = res.ContinuationPoint or None
                    for i, res in zip(sent, results):
                        done = self._take(refs[i], res, out[i], lo, hi, each, sent[i])
                        if done and points[i]:
                            await self._release([(nids[i], points[i])])
                        if done or not points[i]:
                            del points[i]
                    total = sum(c.count for c in out)
                    if most and total > most:
                        return None
            finally:
                if points and self._client is not None:
                    open_points = [(nids[i], cp) for i, cp in points.items() if cp]
                    if open_points:
                        with _quiet():
                            await self._release(open_points)
        return out

    async def _read(self, details: Any, nodes: list[tuple[Any, bytes | None]]) -> list[Any]:
        from asyncua import ua

        params = ua.HistoryReadParameters(
            HistoryReadDetails=details, TimestampsToReturn=ua.TimestampsToReturn.Source, ReleaseContinuationPoints=False,
            NodesToRead=[ua.HistoryReadValueId(NodeId=nid, ContinuationPoint=cp) for nid, cp in nodes])
        return await self._client.uaclient.history_read(params)

    async def _release(self, nodes: list[tuple[Any, bytes]]) -> None:
        from asyncua import ua

        params = ua.HistoryReadParameters(
            HistoryReadDetails=ua.ReadRawModifiedDetails(IsReadModified=False, NumValuesPerNode=1),
            TimestampsToReturn=ua.TimestampsToReturn.Both, ReleaseContinuationPoints=True,
            NodesToRead=[ua.HistoryReadValueId(NodeId=nid, ContinuationPoint=cp) for nid, cp in nodes])
        await self._client.uaclient.history_read(params)

    def _take(self, ref: NodeRef, res: Any, into: _Columns, lo: int, hi: int, each: int, sent: bytes | None) -> bool:
        """Add one answer's values of ``ref`` within ``[lo, hi]`` to ``into``; whether the node is
        done (enough values, or values past the range)."""
        status = res.StatusCode
        if status is not None and status.is_bad():
            name = _status_name(status.value)
            what = f"node {ref.node_id!r} ({ref.key})"
            if name in _NOT_FOUND:
                raise SourceError(f"{self.loaded.path}: {what} is not on {self.label} ({name})", code="SOURCE_NOT_FOUND")
            if name in ("BadHistoryOperationUnsupported", "BadHistoryOperationInvalid"):
                raise SourceError(f"{self.loaded.path}: {what}: the server keeps no raw history of it ({name})",
                                  code="SOURCE_NOT_FOUND")
            if name in _UNAVAILABLE:
                raise TsdbUnavailableError(f"{self.label}: history of {what} unavailable ({name})")
            raise self._refused(name, f"HistoryRead of {what} was refused")
        values = list(res.HistoryData.DataValues or []) if res.HistoryData is not None else []
        if not values:
            if sent is not None and res.ContinuationPoint and bytes(res.ContinuationPoint) == bytes(sent):
                raise PaginationError(f"{self.label}: HistoryRead of node {ref.node_id!r} returned no values and the "
                                      "same continuation point; refusing to loop")
            return False
        stamps = [dv.SourceTimestamp for dv in values]
        if None in stamps:
            raise SourceError(f"{self.loaded.path}: node {ref.node_id!r} ({ref.key}): the server returned a value "
                              "without SourceTimestamp", code="SOURCE_INVALID")
        ts = _epoch_ms(stamps)
        try:
            value = np.array([None if dv.Value is None else dv.Value.Value for dv in values], dtype=np.float64)
        except (TypeError, ValueError):
            bad = next(dv.Value.Value for dv in values if not _is_number(dv.Value.Value if dv.Value else None))
            raise SourceError(f"{self.loaded.path}: node {ref.node_id!r} ({ref.key}): value {bad!r} is not a number",
                              code="SOURCE_INVALID") from None
        status = np.fromiter((0 if dv.StatusCode is None else dv.StatusCode.value for dv in values), np.int64, len(values))
        backward = ts.shape[0] > 1 and ts[0] > ts[-1]
        keep = (ts >= lo) & (ts <= hi)
        past = bool(np.any(ts < lo) if backward else np.any(ts > hi))
        if not keep.all():
            ts, value, status = ts[keep], value[keep], status[keep]
        if each and into.count + ts.shape[0] > each:
            n = each - into.count
            ts, value, status = ts[:n], value[:n], status[:n]
        into.add(ts, value, status)
        return past or bool(each and into.count >= each)

    # ---- the Backend -------------------------------------------------------------------------
    def fetch(self, node: NodeRef, lo: int, hi: int, line: str | None, limit: int) -> Series:
        cols = self._call(self._history, [node], lo, hi, each=int(limit))
        return cols[0].series()

    def fetch_many(self, nodes: Sequence[NodeRef], lo: int, hi: int, line: str | None, limit: int,
                   hold: int = 0) -> list[Series] | None:
        cols = self._call(self._history, list(nodes), lo, hi, most=int(limit))
        return None if cols is None else [c.series() for c in cols]

    def distinct_keys(self) -> list[Any]:
        raise SourceError(f"{self.loaded.path}: nodes: an OPC UA source needs its nodes listed (nodes, with key: "
                          "the NodeId or browse path, or node_table)")

    def max_time(self, nodes: Sequence[NodeRef]) -> int | None:
        cols = self._call(self._history, list(nodes), -(2**62), 2**62, each=1, backward=True)
        latest = [int(c.ts[0][0]) for c in cols if c.count]
        return max(latest) if latest else None

    def aggregates(self, windows: Sequence[Window], nodes: Sequence[NodeRef]) -> list[Any]:
        out = []
        for w in windows:
            cols = self._call(self._history, list(nodes), w.lo, w.hi)
            out.append([[str(n.key), *c.digest()] for n, c in zip(nodes, cols)])
        return out

    def engineering(self, nodes: Sequence[NodeRef]) -> dict[str, dict[str, Any]]:
        return self._call(self._engineering, nodes)

    async def _engineering(self, nodes: Sequence[NodeRef]) -> dict[str, dict[str, Any]]:
        """Each node's AnalogItem properties: the display name of its ``EngineeringUnits`` and
        its ``EURange``, where the server has them (a node without either is left out). A range
        whose Low or High is NaN or infinite says nothing of the instrument's span and is left
        out like a missing one."""
        from asyncua import ua

        out: dict[str, dict[str, Any]] = {}
        for ref, nid in zip(nodes, await self._node_ids(nodes)):
            node = self._client.get_node(nid)
            found: dict[str, Any] = {"unit": None, "range": None}
            for name in ("EngineeringUnits", "EURange"):
                try:
                    value = await (await node.get_child(f"0:{name}")).read_value()
                except ua.UaStatusCodeError as e:
                    if _status_name(e.code) in _UNAVAILABLE:
                        raise
                    continue  # not an AnalogItem, or not readable: the server does not say
                if name == "EngineeringUnits" and getattr(value, "DisplayName", None) is not None:
                    found["unit"] = value.DisplayName.Text or None
                elif name == "EURange" and hasattr(value, "Low"):
                    low, high = float(value.Low), float(value.High)
                    if math.isfinite(low) and math.isfinite(high):
                        found["range"] = [low, high]
            if found["unit"] is not None or found["range"] is not None:
                out[ref.node_id] = found
        return out

    def describe(self) -> dict[str, Any]:
        s = self._security
        security = "None" if s is None or s.mode == "None" else f"{s.mode} {s.policy or 'Basic256Sha256'}"
        return {
            "backend": "opcua",
            "connection": self.label,
            "security": security,
            "user": self._user,
            "points": "raw history (HistoryRead)",
            "layout": "node",
            "time": {"column": "SourceTimestamp", "type": "OPC UA SourceTimestamp (UTC, 100 ns), floored to the millisecond",
                     "kind": "opcua", "zone": None},
            "order": "SourceTimestamp, then the server's order of values at one time",
            "quality": "StatusCode severity: Good 0, Uncertain 1, Bad 2",
        }


def _certificate_uris(cert: Any) -> list[str]:
    from cryptography import x509

    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    return list(san.value.get_values_for_type(x509.UniformResourceIdentifier))


def _is_number(v: Any) -> bool:
    try:
        float(v)
    except (TypeError, ValueError):
        return v is None
    return True


def _quiet() -> contextlib.suppress:
    """Ignore any failure of a best-effort step (closing what is already broken)."""
    return contextlib.suppress(Exception)
