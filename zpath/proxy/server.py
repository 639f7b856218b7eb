"""The IFRT proxy's gRPC service (``xla.ifrt.proxy.GrpcIfrtService``), served
with grpcio's generic handlers from the message classes of the installed
jaxlib's own schema (zpath/proxy/schema.py).

One zpath client connection carries every session's work to the cluster; each
``IfrtSession`` stream is one :class:`~zpath.proxy.backend.Session`.
"""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import secrets
import threading
from typing import Any, Iterator

import grpc

from zpath.client.api import LOWERING_PLATFORMS
from zpath.proxy import backend
from zpath.proxy.launch import is_loopback
from zpath.proxy.schema import SERVICE_NAME, Schema, load

log = logging.getLogger(__name__)

# the protocol versions this server speaks (the installed jaxlib 0.10's client
# asks for 16..25; 25 is the one tested)
PROTOCOL_MIN, PROTOCOL_MAX = 20, 25
SESSION_METADATA = "ifrt-proxy-grpc-ifrt-session-metadata-bin"
STORE_METADATA = "ifrt-proxy-grpc-host-buffer-store-metadata-bin"
LOOKUP_CHUNK = 1 << 20
_END = object()


def cluster_platform(client: Any) -> str:
    """What the cluster's workers lower programs for (their registered
    platform; "cpu" for a cluster of simulated hosts or with none yet)."""
    found = {d.platform for d in client.devices.values()} & LOWERING_PLATFORMS
    if len(found) > 1:
        raise OSError(f"the cluster's hosts are of platforms {sorted(found)}: say which one JAX "
                      "clients lower for (--platform)")
    return found.pop() if found else "cpu"


class ProxyServer:
    """Serve the IFRT proxy protocol at ``address`` (HOST:PORT; port 0: a free
    one, see ``port``) on the cluster that ``client`` (a
    :class:`zpath.client.connection.Client`) is connected to. ``platform``:
    the platform the cluster's devices are (what JAX lowers programs for).

    The service has no authentication of its own (docs/design.md: Security
    model), so it listens on a loopback address only unless ``insecure``: then
    anyone who reaches the port uses the cluster as the proxy's client."""

    def __init__(self, client: Any, address: str, *, platform: str = "cpu",
                 schema: Schema | None = None, threads: int = 32,
                 host_timeout_s: float = 60.0, insecure: bool = False) -> None:
        if not insecure and not is_loopback(address):
            raise OSError(f"the IFRT proxy serves on a loopback address only (127.0.0.1:PORT), not {address}: "
                          f"its gRPC service has no authentication; say --ifrt-proxy-insecure to serve "
                          f"every network interface anyone reaches")
        self.s = schema or load()
        self.client = client
        self.platform = platform
        self.host_timeout_s = host_timeout_s
        self.sessions: dict[int, backend.Session] = {}
        self._lock = threading.Lock()
        s = self.s
        handlers = {
            "GetVersion": grpc.unary_unary_rpc_method_handler(
                self._get_version, s.GrpcGetVersionRequest.FromString, s.GrpcGetVersionResponse.SerializeToString),
            "IfrtSession": grpc.stream_stream_rpc_method_handler(
                self._session, s.IfrtRequest.FromString, s.IfrtResponse.SerializeToString),
            "HostBufferStore": grpc.stream_unary_rpc_method_handler(
                self._store, s.GrpcHostBufferStoreRequest.FromString,
                s.GrpcHostBufferStoreResponse.SerializeToString),
            "HostBufferLookup": grpc.unary_stream_rpc_method_handler(
                self._lookup, s.GrpcHostBufferLookupRequest.FromString,
                s.GrpcHostBufferLookupResponse.SerializeToString),
            "HostBufferDelete": grpc.unary_unary_rpc_method_handler(
                self._delete, s.GrpcHostBufferDeleteRequest.FromString,
                s.GrpcHostBufferDeleteResponse.SerializeToString),
        }
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="ifrt-grpc"),
                                  options=[("grpc.max_receive_message_length", -1),
                                           ("grpc.max_send_message_length", -1)])
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)])
        self.port = self.server.add_insecure_port(address)
        if not self.port:
            raise OSError(f"cannot listen on {address}")
        self.address = f"{address.rsplit(':', 1)[0]}:{self.port}"

    def start(self) -> "ProxyServer":
        self.server.start()
        log.info("IFRT proxy serving at %s", self.address)
        return self

    def stop(self, grace: float = 1.0) -> None:
        self.server.stop(grace).wait()
        with self._lock:
            sessions = list(self.sessions.values())
            self.sessions.clear()
        for s in sessions:
            s.close()

    # ---- RPCs -----------------------------------------------------------------
    def _get_version(self, req: Any, ctx: grpc.ServicerContext) -> Any:
        lo, hi = req.min_version.protocol_version, req.max_version.protocol_version
        version = min(hi, PROTOCOL_MAX)
        if version < max(lo, PROTOCOL_MIN):
            ctx.abort(grpc.StatusCode.FAILED_PRECONDITION,
                      f"the client speaks IFRT proxy protocol versions {lo}..{hi}; zpath serves "
                      f"{PROTOCOL_MIN}..{PROTOCOL_MAX}")
        resp = self.s.GrpcGetVersionResponse()
        resp.version.protocol_version = version
        resp.version.ifrt_serdes_version_number = req.max_version.ifrt_serdes_version_number
        return resp

    def _session(self, requests: Iterator[Any], ctx: grpc.ServicerContext) -> Iterator[Any]:
        raw = dict(ctx.invocation_metadata()).get(SESSION_METADATA)
        if raw is None:
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"missing metadata {SESSION_METADATA}")
        meta = self.s.GrpcIfrtSessionMetadata.FromString(raw)
        v = meta.version.protocol_version
        if not PROTOCOL_MIN <= v <= PROTOCOL_MAX:
            ctx.abort(grpc.StatusCode.FAILED_PRECONDITION,
                      f"protocol version {v} is not one zpath serves ({PROTOCOL_MIN}..{PROTOCOL_MAX})")
        session = backend.Session(self._new_session_id(), self.s, self.client, self.platform, meta.version,
                                  self.host_timeout_s)
        with self._lock:
            self.sessions[session.id] = session
        log.info("IFRT session %d from %s (protocol %d)", session.id, ctx.peer(), v)
        out: queue.SimpleQueue = queue.SimpleQueue()

        def read() -> None:
            # requests are carried out in order, as they come; answers go out as
            # they are ready (a copy to the host answers when its value is here)
            try:
                for req in requests:
                    session.handle(req, out.put)
            except Exception as e:        # the client went away mid-stream
                log.info("IFRT session %d: %s", session.id, e)
            finally:
                out.put(_END)

        reader = threading.Thread(target=read, name=f"ifrt-session-{session.id}", daemon=True)
        reader.start()
        try:
            while (resp := out.get()) is not _END:
                yield resp
        finally:
            # the client closed the stream or disconnected: what it held is freed
            with self._lock:
                self.sessions.pop(session.id, None)
            session.close()
            log.info("IFRT session %d closed; its arrays were released", session.id)

    def _new_session_id(self) -> int:
        # host buffer RPCs name their session by id: an id nobody can guess
        # keeps one session from storing, reading or deleting another's buffers
        with self._lock:
            while (sid := secrets.randbits(62) + 1) in self.sessions:
                pass
            return sid

    def _session_of(self, session_id: int, ctx: grpc.ServicerContext) -> backend.Session:
        with self._lock:
            s = self.sessions.get(session_id)
        if s is None:
            ctx.abort(grpc.StatusCode.NOT_FOUND, f"no IFRT session {session_id}")
        return s

    def _store(self, chunks: Iterator[Any], ctx: grpc.ServicerContext) -> Any:
        raw = dict(ctx.invocation_metadata()).get(STORE_METADATA)
        if raw is None:
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"missing metadata {STORE_METADATA}")
        meta = self.s.GrpcHostBufferStoreMetadata.FromString(raw)
        session = self._session_of(meta.session_id, ctx)
        data = bytearray()
        for c in chunks:
            data += c.data
        if len(data) != meta.buffer_size:
            ctx.abort(grpc.StatusCode.DATA_LOSS, f"host buffer {meta.handle}: {len(data)} bytes of "
                                                 f"{meta.buffer_size}")
        try:
            session.buffers.store(meta.handle, bytes(data))
        except backend.Failed as e:
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return self.s.GrpcHostBufferStoreResponse()

    def _lookup(self, req: Any, ctx: grpc.ServicerContext) -> Iterator[Any]:
        session = self._session_of(req.session_id, ctx)
        try:
            data = session.buffers.lookup(req.handle)
        except backend.Failed as e:
            ctx.abort(grpc.StatusCode.NOT_FOUND, str(e))
        view = memoryview(data)
        for at in range(0, max(len(data), 1), LOOKUP_CHUNK):
            yield self.s.GrpcHostBufferLookupResponse(data=bytes(view[at:at + LOOKUP_CHUNK]))

    def _delete(self, req: Any, ctx: grpc.ServicerContext) -> Any:
        session = self._session_of(req.session_id, ctx)
        try:
            session.buffers.delete(req.handle)
        except backend.Failed as e:
            ctx.abort(grpc.StatusCode.NOT_FOUND, str(e))
        return self.s.GrpcHostBufferDeleteResponse()
