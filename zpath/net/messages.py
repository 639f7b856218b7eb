"""Every message type of the zpath protocol, in one place (see docs/protocol.md).

Conventions: ids are plain ints; a *region* is the part of a global array one
shard holds, as ``[[start, stop], ...]`` per dimension; a *spec* is a
PartitionSpec as a list with one entry per array dimension, each ``None``, an
axis name, or a list of axis names.
"""
from __future__ import annotations

import dataclasses

from zpath.net.codec import IntRuns, Record, message, record

Region = list[list[int]]
Spec = list[None | str | list[str]]


# ---- shared records ---------------------------------------------------------

@record
class ErrorInfo(Record):
    kind: str                # a zpath.errors.ErrorKind ("RemoteError", "HostLost", ...)
    message: str
    host: int | None
    computation: str
    traceback: str


@record
class DeviceInfo(Record):
    id: int                  # global (physical) device id, assigned by the controller
    host: int                # host rank
    island: int
    local_index: int         # index into the worker's jax.local_devices()
    jax_id: int              # the device's id in JAX (global within an island's runtime)
    platform: str            # what its host's JAX lowers programs for ("cpu", "cuda", "rocm", "tpu"; "sim")


@record
class HostInfo(Record):
    rank: int
    island: int
    name: str
    data_address: str
    devices: list[DeviceInfo]


@record
class Aval(Record):
    shape: list[int]
    dtype: str



@record
class CallInput(Record):
    buffer: int
    aval: Aval
    spec: Spec
    put: bool

@record
class CallOutput(Record):
    buffer: int
    aval: Aval
    spec: Spec

@record
class PieceSource(Record):
    """Where one piece of an input shard comes from: a local shard
    (``piece_id == 0``) or a piece another worker sends (``piece_id > 0``).
    ``sub`` is the piece's region in global coordinates."""
    piece_id: int
    device: int
    region: Region
    sub: Region

@record
class ShardInput(Record):
    """One local device's shard of an input. No pieces: the shard is already
    in the store under (buffer, device, region)."""
    device: int
    region: Region
    pieces: list[PieceSource]

@record
class ExecInput(Record):
    buffer: int
    aval: Aval
    spec: Spec
    shards: list[ShardInput]

@record
class ExecOutput(Record):
    buffer: int
    aval: Aval
    spec: Spec


# ---- handshake and errors (any peer) ----------------------------------------

@message(1)
class Error(Record):
    """Reply to a message that could not be accepted."""
    code: str                # a zpath.errors.ErrorKind ("protocol", "bad_request", ...)
    message: str


@message(2)
class Hello(Record):
    """Client -> controller, first message on a connection."""
    name: str
    protocol: int
    weight: float            # proportional-share weight (> 0)
    nonce: bytes = b""       # fresh random bytes: the Welcome's session key is sealed with them
    shared: bool = False     # it carries others' work (the IFRT proxy's sessions): never the alone window


@message(3)
class Welcome(Record):
    """Controller -> client, answer to Hello."""
    client_id: int
    hosts: list[HostInfo]
    session_key: bytes = b""     # the client's session key, sealed (zpath.keys.seal)


@message(4)
class RegisterWorker(Record):
    """Worker -> controller, first message on a connection."""
    name: str
    island: int
    data_address: str
    pid: int
    platform: str
    num_devices: int
    protocol: int
    jax_ids: list[int]       # ids of its local devices in JAX
    coordinator: str         # the island's jax.distributed coordinator ("" if none)
    process_id: int          # its process id in that runtime
    num_processes: int       # processes in that runtime (1 if none)
    machine: str             # machine id (host name and boot id): same machine -> shared memory
    public_key: str          # CURVE public key (Z85) for encrypted DCN traffic ("" if off)
    dcn_address: str         # CURVE-encrypted data port for DCN traffic ("" if off)
    rank: int = -1           # the rank its launcher gave it (-1: any), so host numbers match names


@message(5)
class Registered(Record):
    """Controller -> worker, answer to RegisterWorker."""
    rank: int
    devices: list[DeviceInfo]


@message(6)
class Goodbye(Record):
    """Client -> controller: the client disconnects."""
    reason: str


@message(7)
class Ping(Record):
    seq: int


@message(8)
class Pong(Record):
    """Answer to Ping. From a worker it carries the object-store shard's size."""
    seq: int
    shards: int
    nbytes: int
    device_bytes: list[int]  # from a worker: bytes held per local device, in Registered.devices order


@message(9)
class Shutdown(Record):
    """Controller -> worker: exit now. Controller -> client: the controller is
    stopping (what waits on it fails)."""
    reason: str


# ---- resources and status ---------------------------------------------------

@message(20)
class AllocSlice(Record):
    """Client -> controller: allocate ``devices`` virtual devices."""
    devices: int
    island: int | None
    host: int | None


@message(21)
class SliceAllocated(Record):
    slice_id: int
    devices: list[DeviceInfo]


@message(22)
class StatusRequest(Record):
    verbose: bool


@record
class HostStatus(Record):
    rank: int
    shards: int              # shards held in the host's object store
    nbytes: int              # bytes they take


@record
class DeviceUsage(Record):
    id: int                  # global device id
    host: int
    nbytes: int              # bytes of buffers the controller placed on it
    held: int                # bytes its worker reported holding for it (last Pong)


@record
class ClientStatus(Record):
    id: int
    name: str
    weight: float
    device_seconds: float    # device time its computations used (measured by the workers)
    running: int             # its computations at the workers
    queued: int              # its computations waiting for their turn or for inputs


@message(23)
class Status(Record):
    hosts: list[HostInfo]
    stores: list[HostStatus]
    clients: list[ClientStatus]
    buffers: int
    programs: int
    calls: int
    lost: list[HostInfo]     # hosts that stopped answering
    running: int             # computations dispatched and not finished on every host
    queued: int              # computations held back (waiting for other nodes or memory)
    devices: list[DeviceUsage]
    policy: str              # multi-tenant scheduling policy: "fifo" or "share"
    relayed: int = 0         # messages sent through relays (Relay), in all


# ---- programs and calls -----------------------------------------------------

@message(24)
class Locate(Record):
    """Client -> controller: where is a copy of this (own) buffer now? Sent
    when a host that held its shards was lost."""
    buffer: int


@message(25)
class Location(Record):
    """Controller -> client, answering ``Locate``: one surviving copy of the
    buffer as regions that tile it, each with a device (on a live host) that
    holds it; or, with no copy left (or an unknown buffer), ``error``."""
    buffer: int
    regions: list[Region]
    devices: list[int]
    error: ErrorInfo | None


@message(30)
class RegisterProgram(Record):
    """Client -> controller and controller -> worker. One buffer: the
    ``jax.export`` serialisation, whose sha256 hex is ``digest``."""
    digest: str
    name: str


@message(31)
class Call(Record):
    """Client -> controller: run a registered program on a mesh of devices.

    ``inputs`` name buffers (existing ones, or ones the client has put straight
    onto the workers in the input's layout when ``put`` is true). ``keep``
    (1 to MAX_CALL_FORMS, 0: none): the controller also keeps this call's form,
    all of it but its call id and buffer ids, as the client's form ``keep``
    (replacing the one kept under that number), for ``CallAgain``."""
    call_id: int
    program: str
    mesh_shape: list[int]
    axis_names: list[str]
    devices: list[int]       # global device ids, mesh positions in row-major order
    inputs: list[CallInput]
    outputs: list[CallOutput]
    keep: int = 0


# the call forms a client may have kept at once (Call.keep: 1 to this), and the
# inputs and outputs one form may have in all (a kept form lives as long as its
# client: at most 65,536 buffer entries per client)
MAX_CALL_FORMS = 256
MAX_FORM_BUFFERS = 256


@message(67)
class CallAgain(Record):
    """Client -> controller: a ``Call`` of the client's kept form ``form``
    (``Call.keep``) with this call id and these buffers, position for position
    (as many as the form has inputs and outputs)."""
    call_id: int
    form: int
    inputs: list[int]
    outputs: list[int]






@message(32)
class CallFailed(Record):
    """Controller -> client: a call was rejected before it ran."""
    call_id: int
    buffers: list[int]
    error: ErrorInfo


@message(33)
class Execute(Record):
    """Controller -> worker: this host's part of one computation. ``seq`` is its
    place in its island's gang order; ``jax_ids`` are the JAX ids of ``devices``.
    ``hold``: the worker may hold its ExecDone while work is queued behind it
    (nothing in the controller waits for it at once). An input whose
    ``shards`` is empty has each of this host's devices' shards in place at the
    region its spec gives that device: then every host of the computation gets
    the same message (encoded and signed once, with one ``msg_id``).
    ``devices`` and ``jax_ids`` go as runs (IntRuns: a computation over every
    device is one [start, stop, step] each)."""
    exec_id: int
    seq: int
    program: str
    name: str
    mesh_shape: list[int]
    axis_names: list[str]
    devices: IntRuns
    jax_ids: IntRuns
    inputs: list[ExecInput]
    outputs: list[ExecOutput]
    hold: bool = False


@message(34)
class ExecDone(Record):
    """Worker -> controller: a computation finished (error is None) or failed;
    ``start``/``end`` are the worker's wall-clock times (seconds since the epoch)."""
    exec_id: int
    error: ErrorInfo | None
    start: float
    end: float
    waited: float = 0.0      # seconds of [start, end] it waited for inputs that were not there yet


@message(35)
class SendPiece(Record):
    """Controller -> worker: send part ``sub`` of shard (buffer, device, region)
    to host ``dst_host`` as piece ``piece_id``."""
    piece_id: int
    buffer: int
    device: int
    region: Region
    sub: Region
    dst_host: int
    dst_address: str         # the data port to use (the encrypted one for encrypted DCN)
    channel: str             # "ICI" (same island) or "DCN" (between islands)
    dst_machine: str         # the destination's machine id (ICI: same as ours -> shm)
    dst_key: str             # the destination's CURVE public key ("" = plain TCP)


@message(36)
class Free(Record):
    """Controller -> worker: drop every shard of these buffers once every
    computation received before this message has finished."""
    buffers: list[int]


@message(39)
class Release(Record):
    """Client -> controller: the client holds no more references to these
    buffers (its futures were dropped)."""
    buffers: list[int]


@message(37)
class TimelineRequest(Record):
    """Client -> controller: the most recent ``limit`` finished computations."""
    limit: int


@record
class ExecRecord(Record):
    exec_id: int
    seq: int
    island: int
    host: int
    client: int
    name: str
    devices: IntRuns         # (as runs: a fused run's record names every device it spans)
    start: float
    end: float
    ok: bool
    waited: float = 0.0      # as ExecDone.waited


@record
class ControllerEvent(Record):
    """What the controller did or what waited there, for timelines: ``kind``
    "plan" (planning and dispatching a submission, or a slice of a long one:
    ``name`` is its program's) or "memory" (a submission waiting for device
    memory); wall-clock ``start`` and ``end``."""
    kind: str
    client: int
    name: str
    start: float
    end: float


@message(38)
class Timeline(Record):
    records: list[ExecRecord]
    events: list[ControllerEvent] = dataclasses.field(default_factory=list)   # the most recent, oldest first
    now: float = 0.0         # the controller's wall clock when it answered (to align clocks)


@message(40)
class Program(Record):
    """Client -> controller: a traced program, one ``Call`` per node in program
    order. ``dispatch`` is "parallel" (every node is sent to its hosts at once)
    or "sequential" (a node is sent once the nodes it reads have finished).
    ``release`` names buffers to free once the program has used them (its
    intermediates and the values the client put for it). A long program comes
    in parts (``more``: another part follows; the controller takes the calls and
    releases of every part, in order, and runs them when the last has come), so
    that no one message takes long to decode."""
    program_id: int
    name: str
    dispatch: str
    calls: list[Call]
    release: list[int]
    more: bool = False       # more of its calls follow, in Programs of the same program_id


# calls per part of a long Program (see Program.more)
PROGRAM_PART_CALLS = 1024


def program_parts(prog: Program) -> list[Program]:
    """``prog`` as the Programs that carry it: itself, or parts of at most
    PROGRAM_PART_CALLS calls (the releases go with the last)."""
    n = PROGRAM_PART_CALLS
    if len(prog.calls) <= n:
        return [prog]
    starts = range(0, len(prog.calls), n)
    return [Program(prog.program_id, prog.name, prog.dispatch, prog.calls[k:k + n],
                    prog.release if k + n >= len(prog.calls) else [], more=k + n < len(prog.calls))
            for k in starts]


@message(41)
class ExplainRequest(Record):
    """Client -> controller: plan a program without running it."""
    calls: list[Call]


@record
class TransferInfo(Record):
    buffer: int
    src_host: int
    dst_host: int
    nbytes: int
    channel: str             # "local" (same host), "ICI" (same island) or "DCN"


@record
class NodePlan(Record):
    call_id: int
    name: str
    island: int
    hosts: IntRuns
    devices: IntRuns
    transfers: list[TransferInfo]


@message(42)
class Explanation(Record):
    nodes: list[NodePlan]


@message(43)
class HostDown(Record):
    """Controller -> client: a host was lost; fetches from it fail with ``error``."""
    rank: int
    error: ErrorInfo


@message(44)
class FailPieces(Record):
    """Controller -> worker: these pieces will never come (their source host was
    lost); whatever waits on them fails with ``error``."""
    piece_ids: list[int]
    error: ErrorInfo


@message(45)
class FailBuffers(Record):
    """Controller -> worker: these buffers (a departed client's inputs) will
    never come; whatever waits on their shards, now or later, fails with ``error``."""
    buffers: list[int]
    error: ErrorInfo


@message(46)
class DefineProgram(Record):
    """Client -> controller: run ``program`` and keep it as template ``template``
    (a number the client picks), so later runs can be sent as ``RunProgram``.
    Every buffer the program's calls name is either one of ``inputs`` (the
    *slots*: each call input not made inside the program, in program order,
    one entry per such input; a value the client puts for the run, or an
    existing buffer) or a new one in ``first_buffer .. first_buffer + buffers
    - 1`` (the outputs of its calls)."""
    template: int
    inputs: list[int]
    first_buffer: int
    buffers: int
    program: Program


@message(47)
class RunProgram(Record):
    """Client -> controller: run template ``template`` again, with ``inputs``
    in its slots and its new buffers numbered from ``first_buffer``.
    ``outputs`` (the program's results) fail if the template is unknown."""
    program_id: int
    template: int
    inputs: list[int]
    first_buffer: int
    outputs: list[int]


@message(28)
class DropTemplates(Record):
    """Client -> controller: these templates will not be run again."""
    templates: list[int]


@message(48)
class DefineFused(Record):
    """Controller -> worker: this host's part of a fused program: its
    computations in order, as ``Execute`` messages whose ``exec_id`` and
    ``seq`` are 0 and whose buffer ids are codes: ``n >= 0`` is the run's
    ``first_buffer + n``, ``n < 0`` is the run's ``inputs[-n - 1]``.
    ``release`` (codes) are freed once the run's computations have finished."""
    fused: int
    executes: list[Execute]
    release: list[int]


@message(49)
class RunFused(Record):
    """Controller -> worker: run fused program ``fused`` once, as one
    computation (one place ``seq`` in the gang order, one ``ExecDone`` for
    ``exec_id``, with the first error if any of its computations failed).
    ``hold`` as for Execute."""
    exec_id: int
    seq: int
    fused: int
    inputs: list[int]
    first_buffer: int
    hold: bool = False


@message(29)
class DropFused(Record):
    """Controller -> worker: forget these fused programs (their client left)."""
    fused: list[int]


# ---- data plane (worker data port) ------------------------------------------

@message(50)
class Put(Record):
    """Client -> worker: one shard of a client value. One buffer: the bytes."""
    buffer: int
    device: int
    region: Region
    aval: Aval               # the shard's shape and dtype


@message(51)
class Piece(Record):
    """Worker -> worker: one piece of a shard. One buffer unless ``error``."""
    piece_id: int
    aval: Aval
    error: ErrorInfo | None


@message(52)
class Fetch(Record):
    """Client -> worker: send me shard (buffer, device, region); with
    ``wait_only``, only say when it is done (a reply without the shard)."""
    request: int
    buffer: int
    device: int
    region: Region
    timeout_s: float
    wait_only: bool = False


@message(53)
class FetchReply(Record):
    """Worker -> client. One buffer unless ``error``."""
    request: int
    aval: Aval
    error: ErrorInfo | None


@message(54)
class ShmPiece(Record):
    """Worker -> worker (ICI, same machine): piece ``piece_id`` is ``size``
    bytes at ``offset`` of shared-memory segment ``segment``; no buffers. The
    receiver copies them out and answers ``ShmAck``. ``drop`` names segments
    the sender no longer uses (the receiver unmaps them)."""
    piece_id: int
    aval: Aval
    segment: str
    offset: int
    size: int
    drop: list[str]


@message(55)
class ShmAck(Record):
    """Worker -> worker, answer to ShmPiece: these segments are free again."""
    segments: list[str]


@message(56)
class ChannelStatsRequest(Record):
    """Anyone with the key -> worker data port: the data-plane counters."""
    reset: bool


@record
class SentPiece(Record):
    """A piece a worker sent: when the send began (its wall time), through which
    channel ("ICI-shm", "ICI-tcp", "DCN"), how many bytes, to which host."""
    piece_id: int
    at: float
    channel: str
    nbytes: int
    dst_host: int


@message(57)
class ChannelStats(Record):
    """Worker -> asker: pieces and bytes sent per channel since start (or the
    last reset), pieces received through shared memory and TCP, and the shared
    memory segments this worker holds now."""
    sent_shm: int
    sent_ici_tcp: int
    sent_dcn: int
    bytes_shm: int
    bytes_ici_tcp: int
    bytes_dcn: int
    recv_shm: int
    recv_tcp: int
    segments: int
    sent_at: list[list[float]]   # recent pieces sent: [piece_id, wall time the send began]
    received_at: list[list[float]]   # recent pieces received: [piece_id, wall time it was stored]
    # (added at the end, with defaults) the same recent pieces sent, with their channel,
    # bytes and destination; the worker's wall time when it answered (clock offsets)
    sent: list[SentPiece] = dataclasses.field(default_factory=list)
    now: float = 0.0


@message(58)
class PieceChunk(Record):
    """Worker -> worker (shaped DCN): part of piece ``piece_id``, whose bytes (C
    order) total ``nbytes``. One buffer: the bytes at ``offset``. The receiver
    has the piece once chunks covering all ``nbytes`` have come."""
    piece_id: int
    aval: Aval
    offset: int
    nbytes: int


@message(59)
class ClientGone(Record):
    """Controller -> worker: client ``client`` left or was dropped. The worker
    frees every buffer of its (ids ``client << 32 | n``) once the computations
    that arrived before have finished, values it put that no call took
    included, and drops its later ``Put``s."""
    client: int


@message(60)     # codec.BATCH_TYPE
class Batch(Record):
    """Any -> one peer: several messages without buffers under one signature,
    in order; each item is ``[type_id, msg_id, parent, body]`` with ``body`` the
    message's own msgpack body. Received as ``codec.Batched`` (its messages,
    each checked as if it came alone); a nested Batch or an unknown type
    refuses the whole batch."""
    items: list[tuple[int, int, int, bytes]]


@record
class PieceOrder(Record):
    """One piece of a ``SendPieces``: part ``sub`` of shard (buffer, device,
    region), as piece ``piece_id``."""
    piece_id: int
    buffer: int
    device: int
    region: Region
    sub: Region


@message(61)
class SendPieces(Record):
    """Controller -> worker: small pieces of one computation's inputs, all from
    this host to host ``dst_host`` over one channel (a bucket): once every
    source shard is done, send them together as one ``Pieces`` (the fields
    after ``pieces`` as in ``SendPiece``)."""
    pieces: list[PieceOrder]
    dst_host: int
    dst_address: str
    channel: str
    dst_machine: str
    dst_key: str


@message(62)
class Pieces(Record):
    """Worker -> worker: several pieces in one message, buffer ``k`` holding
    piece ``piece_ids[k]`` of ``avals[k]`` (a piece whose shard failed goes as
    its own ``Piece`` with the error)."""
    piece_ids: list[int]
    avals: list[Aval]


# ---- relays (protocol version 4) -------------------------------------------------

@record
class ExecRow(Record):
    """One host's report of one computation, as in ``ExecDone``: a row of an
    ``ExecDoneBatch`` (``batch_of``, ``rows_of``; not itself on the wire)."""
    host: int
    exec_id: int
    error: ErrorInfo | None
    start: float
    end: float
    waited: float = 0.0


# the most buffers of its own a message a Relay or Forwarded carries may have
# (a RegisterProgram has one: the program)
RELAY_BUFFERS = 4


@message(63)
class Relay(Record):
    """Controller -> worker (a relay): forward the message whose frames (a
    signed envelope: signature, header, body, then its own buffers, at most
    ``RELAY_BUFFERS``) are the buffers to ``hosts``, whose data ports are ``addresses``; each is to handle it once
    it has handled the first ``after[k]`` messages the controller sent it
    directly. The reports of the computations in ``collect`` (the
    forwarded message's exec id) come back through this relay (see
    ``ExecDoneBatch``). The relay is itself one of ``hosts`` when it runs
    the message too."""
    hosts: list[int]
    addresses: list[str]
    after: list[int]
    collect: list[int]


@message(64)
class Forwarded(Record):
    """Worker (a relay) -> worker: a message of the controller (its frames
    are the buffers, as ``Relay``'s, checked as if it came on the control socket), for
    ``hosts`` of the receiving process, each handling it after its first
    ``after[k]`` direct messages (as ``Relay``). ``relay`` and ``address``:
    where the reports of ``collect`` go."""
    relay: int
    address: str
    hosts: list[int]
    after: list[int]
    collect: list[int]


@record
class RowError(Record):
    """The error of row ``row`` of an ``ExecDoneBatch`` (a failed computation)."""
    row: int
    error: ErrorInfo


@message(65)
class ExecDoneBatch(Record):
    """Worker -> worker (a group host to its relay, ``relay`` its rank) and
    worker -> controller (``relay`` -1: a relay; a host resending its own rows
    after its relay was lost; or a host's own reports, two or more at once
    and none a failure: ``own_batch``): reports of computations, one row per host
    and computation, by column (row ``k``: ``hosts[k]`` finished
    ``exec_ids[k]`` as ``ExecDone`` would say with ``starts[k]``, ``ends[k]``,
    ``waited[k]``, and the error ``errors`` gives for ``k``, if any). See
    ``batch_of`` and ``rows_of``."""
    exec_ids: list[int]
    hosts: list[int]
    starts: list[float]
    ends: list[float]
    waited: list[float]
    errors: list[RowError]
    relay: int = -1


def batch_of(rows: list[ExecRow], relay: int = -1) -> ExecDoneBatch:
    """The ``ExecDoneBatch`` of these rows."""
    return ExecDoneBatch([r.exec_id for r in rows], [r.host for r in rows], [r.start for r in rows],
                         [r.end for r in rows], [r.waited for r in rows],
                         [RowError(k, r.error) for k, r in enumerate(rows) if r.error is not None], relay)


def own_batch(rank: int, reports: list[ExecDone]) -> ExecDoneBatch:
    """Host ``rank``'s own reports, none a failure, as one batch (what a
    worker sends the controller for two or more at once: read in one step,
    where a ``Batch`` of ``ExecDone`` is read record by record)."""
    return ExecDoneBatch([d.exec_id for d in reports], [rank] * len(reports), [d.start for d in reports],
                         [d.end for d in reports], [d.waited for d in reports], [], -1)


def rows_of(batch: ExecDoneBatch) -> list[ExecRow]:
    """A batch's rows (ValueError if its columns do not agree)."""
    n = len(batch.hosts)
    if not len(batch.exec_ids) == len(batch.starts) == len(batch.ends) == len(batch.waited) == n or \
            any(not 0 <= e.row < n for e in batch.errors):
        raise ValueError(f"ExecDoneBatch: columns of {len(batch.exec_ids)}, {n}, {len(batch.starts)}, "
                         f"{len(batch.ends)} and {len(batch.waited)} rows, errors for rows "
                         f"{[e.row for e in batch.errors][:4]}")
    errors = {e.row: e.error for e in batch.errors}
    return [ExecRow(h, x, errors.get(k), s, e, w) for k, (h, x, s, e, w) in
            enumerate(zip(batch.hosts, batch.exec_ids, batch.starts, batch.ends, batch.waited, strict=True))]


@message(66)
class Await(Record):
    """Controller -> worker: handle the next messages (but ``Ping``,
    ``HostDown`` and ``Shutdown``) only after the first ``count`` messages
    forwarded to this host by host ``relay`` (or once ``relay`` is lost)."""
    relay: int
    count: int


# what a worker handles whenever it comes: never held back for the order of
# its two paths from the controller (the controller does not count them in
# Relay.after or Await; see controller/relays.py and worker/relay.py)
UNORDERED = (Ping, HostDown, Shutdown, Relay)
