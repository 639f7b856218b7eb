"""Data-plane channels between workers (see docs/design.md, "Channels").

* ICI (hosts of one island): on the same machine a piece's bytes go through a
  POSIX shared-memory segment (a plain file under /dev/shm, mmapped) and ZeroMQ
  carries only a descriptor (``ShmPiece``). Segments are pooled per peer: the
  receiver copies the bytes out and answers ``ShmAck``, and the sender reuses
  the segment (fresh tmpfs pages cost a page fault each; reused ones do not).
  A piece's bytes are copied once: by the sender from its device buffer's
  host view into the segment (one ``np.copyto``, strided or not). A piece of
  at least :data:`ZERO_COPY_RECV` bytes is then lent to the receiver as it
  lies in the segment (:meth:`ShmReceiver.view`): XLA:CPU adopts the
  64-byte-aligned array as the device buffer without a copy (``jax.device_put``
  aliases an aligned numpy array, ``may_alias=False`` or not), so the
  receiver acknowledges the segment only once nothing refers to the array any
  more, XLA's device buffer included, and the sender reuses it after that. A
  smaller piece is copied out into a 64-byte-aligned array from a pool
  (:class:`RecvBuffers`, reused on the same rule) and acknowledged at once.
  The receiver unlinks a segment's name the first time it maps it, so from then
  on the memory lives only as long as the two mappings; a name that is never
  taken is unlinked by its creator at exit, or by the launcher, which removes
  every name with the cluster's prefix.
* Small pieces (inline ones, at most :data:`INLINE_PIECE_BYTES`) between
  workers of one machine go as one datagram on a Unix socket
  (:class:`DgramReceiver`, :class:`DgramSender`) named from the cluster and
  the receiver's data address, in the abstract namespace (no file): whichever
  thread has the piece hands it to the kernel, and the receiver's I/O thread
  wakes on the socket. A ZeroMQ message passes through a ZeroMQ I/O thread on
  each side (two more thread hand-offs); on a loaded 2-core machine those cost
  more than the rest of a small piece's trip. A datagram that cannot go (no
  such socket, e.g. the peer is in another network namespace; its queue is
  full) goes by ZeroMQ instead. It carries the same signed message as the
  ZeroMQ one would.
  A piece (not an error, not a bucket) whose dtype is in :data:`PIECE_DTYPES`
  goes in the channel's own compact format instead (:class:`PieceDatagrams`):
  a fixed binary header, the bytes, a keyed BLAKE3 MAC under a key derived from
  the workers' key; made and checked with a handful of C calls, where the
  signed envelope costs msgpack and the generic decoder on both sides.
* DCN (between islands): TCP, shaped on the sending side by :class:`Shaper`
  (added latency, bandwidth cap), optionally CURVE-encrypted.
"""
from __future__ import annotations

import glob
import hashlib
import heapq
import hmac
import itertools
import math
import mmap
import os
import queue
import socket
import struct
import threading
import weakref
from typing import Any, Callable

import blake3
import numpy as np

try:                 # bfloat16, float8_*, int4, ...: numpy's dtypes for JAX's (a JAX dependency)
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None

# where segments are made unless a caller names another folder (the worker
# passes CommonConfig.shm_dir, ZPATH_SHM_DIR)
SHM_DIR = "/dev/shm"
# pieces up to this many bytes go inline in their message (one ZeroMQ message:
# no segment, no acknowledgement, no sender thread); bigger ones on one machine
# go through shared memory
INLINE_PIECE_BYTES = 64 << 10
# pieces at least this big are lent to the receiver in their segment (no copy
# there); smaller ones are copied out and their segment is free again at once
ZERO_COPY_RECV = 1 << 20
# bytes of segments a receiver keeps lent at most; beyond, pieces are copied out
LEND_MAX_BYTES = 1 << 30
# free segments a sender keeps per peer, and the bytes they may hold together
POOL_SEGMENTS = 4
POOL_BYTES = 1 << 30
MIN_SEGMENT = 64 << 10
# XLA:CPU adopts a host array as a device buffer without copying it only when
# its data is aligned to this many bytes (numpy's own allocations are 16-aligned)
XLA_ALIGN = 64


# numpy works a dtype's name out anew on every ``dtype.name`` (~3 us): remembered
# here (there are few dtypes)
_NAMES: dict[np.dtype, str] = {}


def dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, remembered."""
    name = _NAMES.get(dtype)
    if name is None:
        name = dtype.name
        if len(_NAMES) < 256:
            _NAMES[dtype] = name
    return name


def aligned_empty(shape: Any, dtype: Any = np.uint8) -> np.ndarray:
    """An uninitialised C-contiguous array whose data is :data:`XLA_ALIGN`-byte
    aligned, so that ``jax.device_put`` on CPU takes it over instead of copying."""
    dtype = np.dtype(dtype)
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (int(shape),)
    nbytes = dtype.itemsize * int(math.prod(shape))
    raw = np.empty(nbytes + XLA_ALIGN, np.uint8)
    start = -raw.ctypes.data % XLA_ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


# Received pieces (and inputs assembled from pieces) of at least this many bytes
# land in pooled arrays, reused once free: writing fresh pages costs a page fault
# each, which measured slower than the copy itself on this machine, and erratic
# (a 256 MiB copy into fresh pages: 22 to 600 ms; into reused ones: 14 ms).
RECV_POOL_MIN = 1 << 20
# free arrays a process keeps, and the bytes they may hold together
RECV_POOL_ARRAYS = 4
RECV_POOL_BYTES = 1 << 30


class RecvBuffers:
    """Aligned arrays (see :func:`aligned_empty`) for received bytes, reused.

    :meth:`get` hands out an array A whose base is a memoryview, so that every
    view made from A (numpy collapses a view's base to the first array that
    owns its data or whose base is not an array) and every device buffer XLA
    makes of them (``device_put`` keeps the array it adopts) keeps A itself
    alive. A ``weakref.finalize`` on A returns the memory to the free list once
    A is gone: only then can nothing read it any more. Finalizers run in
    whatever thread drops the last reference, so they only put the memory on
    a ``queue.SimpleQueue`` (safe there); takers collect it under a lock.
    JAX lets go of an array it adopted at its next call after the device
    buffer is deleted (or at a garbage collection), so a loop of transfers
    of one size typically alternates between two arrays. Thread-safe."""

    def __init__(self, max_arrays: int = RECV_POOL_ARRAYS, max_bytes: int = RECV_POOL_BYTES,
                 min_bytes: int = RECV_POOL_MIN) -> None:
        self.max_arrays, self.max_bytes, self.min_bytes = max_arrays, max_bytes, min_bytes
        self._lock = threading.Lock()
        self._free: list[np.ndarray] = []        # aligned uint8 memory, oldest returned first
        self._back: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        self.made = self.reused = 0

    def get(self, shape: Any, dtype: Any = np.uint8) -> np.ndarray:
        """An uninitialised, aligned, C-contiguous array: pooled memory when it
        has at least :attr:`min_bytes`."""
        dtype = np.dtype(dtype)
        shape = tuple(shape) if isinstance(shape, (tuple, list)) else (int(shape),)
        n = dtype.itemsize * int(math.prod(shape))
        if n < self.min_bytes:
            return aligned_empty(shape, dtype)
        with self._lock:
            self._collect()
            fits = [i for i, b in enumerate(self._free) if n <= b.nbytes <= 2 * n]
            mem = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes)) if fits else None
            if mem is None:
                self.made += 1
            else:
                self.reused += 1
        if mem is None:
            mem = aligned_empty(n)
        out = np.frombuffer(memoryview(mem), np.uint8, count=n)
        weakref.finalize(out, self._back.put, mem).atexit = False
        return out.view(dtype).reshape(shape)

    def _collect(self) -> None:
        """With the lock held: take back returned memory, drop the oldest free
        arrays beyond the limits."""
        while True:
            try:
                self._free.append(self._back.get_nowait())
            except queue.Empty:
                break
        while self._free and (len(self._free) > self.max_arrays or
                              sum(b.nbytes for b in self._free) > self.max_bytes):
            del self._free[0]

    def free(self) -> int:
        """How many free arrays the pool holds now."""
        with self._lock:
            self._collect()
            return len(self._free)

    def clear(self) -> None:
        with self._lock:
            self._collect()
            self._free.clear()


# the process's pool: received pieces and inputs assembled from pieces
recv_buffers = RecvBuffers()


def machine_id(override: str = "") -> str:
    """Identifies this machine (and its /dev/shm) for this boot: the kernel's
    boot id and the host name (containers on one kernel share the boot id but
    not /dev/shm, and have their own host names). ``override`` (when not
    empty: CommonConfig.machine_id, ZPATH_MACHINE_ID) is returned as it is."""
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "noboot"
    return f"{socket.gethostname()}/{boot}"


def shm_prefix(key: bytes) -> str:
    """Prefix of every segment name of the cluster with this key."""
    return "zpath-" + hashlib.sha256(b"zpath-shm:" + key).hexdigest()[:8]


def shm_available(shm_dir: str = SHM_DIR) -> bool:
    return os.path.isdir(shm_dir) and os.access(shm_dir, os.W_OK)


def cleanup(prefix: str, pid: int | None = None, shm_dir: str = SHM_DIR) -> int:
    """Unlink segments named ``prefix-*`` in ``shm_dir`` (only ``prefix-pid-*``
    with a pid). Returns how many were removed."""
    pattern = f"{prefix}-{pid}-*" if pid is not None else f"{prefix}-*"
    n = 0
    for path in glob.glob(os.path.join(shm_dir, pattern)):
        try:
            os.unlink(path)
            n += 1
        except OSError:
            pass
    return n


def segments(prefix: str, shm_dir: str = SHM_DIR) -> list[str]:
    """Names of the segments with this prefix that exist now in ``shm_dir``."""
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(shm_dir, f"{prefix}-*")))


class _Segment:
    __slots__ = ("name", "mm", "cap", "busy", "used")

    def __init__(self, name: str, mm: mmap.mmap, cap: int) -> None:
        self.name, self.mm, self.cap, self.busy, self.used = name, mm, cap, True, 0


def _close(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except (BufferError, ValueError):
        pass   # a view still exists; the mapping goes when it does


class ShmSender:
    """Sending side: per-peer pools of segments in ``shm_dir``. Thread-safe."""

    def __init__(self, prefix: str, shm_dir: str = SHM_DIR) -> None:
        self.prefix = f"{prefix}-{os.getpid()}"
        self.shm_dir = shm_dir
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._pools: dict[int, list[_Segment]] = {}
        self._drops: dict[int, list[str]] = {}     # peer -> segments it should unmap
        self._by_name: dict[str, tuple[int, _Segment]] = {}

    def write(self, peer: int, data: np.ndarray) -> tuple[str, int, list[str]]:
        """Copy ``data`` (any layout: a view on the device buffer, strided or
        not; it lands C-ordered) into a free segment for ``peer`` with one
        copy; returns (segment name, offset, names the peer should unmap). The
        segment stays busy until :meth:`release`."""
        n = data.nbytes
        with self._lock:
            pool = self._pools.setdefault(peer, [])
            free = [s for s in pool if not s.busy and s.cap >= n]
            seg = min(free, key=lambda s: s.cap) if free else None
            if seg is not None:
                seg.busy = True
                seg.used = next(self._ids)
            drops = self._drops.pop(peer, [])
        if seg is None:
            seg = self._create(n)
            with self._lock:
                self._pools.setdefault(peer, []).append(seg)
                self._by_name[seg.name] = (peer, seg)
                self._evict(peer)
                drops += self._drops.pop(peer, [])
        dst = np.ndarray(data.shape, data.dtype, buffer=seg.mm)
        np.copyto(dst, data, casting="no")
        del dst
        return seg.name, 0, drops

    def _create(self, n: int) -> _Segment:
        cap = max(MIN_SEGMENT, 1 << max(0, n - 1).bit_length())
        name = f"{self.prefix}-{next(self._ids)}"
        path = os.path.join(self.shm_dir, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # reserve the pages now: a full /dev/shm fails here (and the piece
            # goes over TCP) instead of raising SIGBUS when the copy writes them
            os.posix_fallocate(fd, 0, cap)
            mm = mmap.mmap(fd, cap)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        seg = _Segment(name, mm, cap)
        seg.used = next(self._ids)
        return seg

    def release(self, name: str) -> None:
        """The peer has taken the bytes: the segment is free again."""
        with self._lock:
            got = self._by_name.get(name)
            if got is None:
                return
            peer, seg = got
            seg.busy = False
            self._evict(peer)

    def _evict(self, peer: int) -> None:
        """With the lock held: unmap free segments beyond the pool's limits, least
        recently used first, and tell the peer to unmap them too."""
        pool = self._pools[peer]
        while True:
            # busy segments do not count: one lent to the receiver for long (an
            # input it keeps) must not make every free one go
            free = [s for s in pool if not s.busy]
            if len(free) <= POOL_SEGMENTS and sum(s.cap for s in free) <= POOL_BYTES:
                return
            if not free:
                return
            seg = min(free, key=lambda s: s.used)
            pool.remove(seg)
            del self._by_name[seg.name]
            self._drops.setdefault(peer, []).append(seg.name)
            _close(seg.mm)
            try:
                os.unlink(os.path.join(self.shm_dir, seg.name))   # normally the peer did
            except OSError:
                pass

    def forget(self, peer: int) -> int:
        """The peer is gone: unmap (and unlink, if it never took them) every
        segment of its pool, lent ones included (nothing of ours reads them, and
        a mapping the peer may still have keeps its pages). Returns how many."""
        with self._lock:
            pool = self._pools.pop(peer, [])
            self._drops.pop(peer, None)
            for seg in pool:
                self._by_name.pop(seg.name, None)
                _close(seg.mm)
                try:
                    os.unlink(os.path.join(self.shm_dir, seg.name))
                except OSError:
                    pass
        return len(pool)

    def live(self) -> int:
        with self._lock:
            return len(self._by_name)

    def close(self) -> None:
        with self._lock:
            for pool in self._pools.values():
                for seg in pool:
                    _close(seg.mm)
            self._pools.clear()
            self._by_name.clear()
        cleanup(self.prefix.rsplit("-", 1)[0], os.getpid(), self.shm_dir)


class ShmReceiver:
    """Receiving side: maps segments (unlinking their names); takes pieces out
    with a copy (:meth:`take`), or lends them without one (:meth:`view`)."""

    def __init__(self, buffers: RecvBuffers | None = None, shm_dir: str = SHM_DIR) -> None:
        self._maps: dict[str, mmap.mmap] = {}
        self.shm_dir = shm_dir
        self.buffers = buffers if buffers is not None else recv_buffers

    def _map(self, name: str, offset: int, size: int, drop: list[str]) -> mmap.mmap:
        for d in drop:
            mm = self._maps.pop(d, None)
            if mm is not None:
                _close(mm)       # with a lent view alive, it goes when the view does
        if "/" in name or not name.startswith("zpath-"):
            raise ValueError(f"bad segment name {name!r}")
        mm = self._maps.get(name)
        if mm is None:
            path = os.path.join(self.shm_dir, name)
            # read-write: a lent piece becomes a device buffer, which XLA may write
            fd = os.open(path, os.O_RDWR)
            try:
                mm = mmap.mmap(fd, 0)
            finally:
                os.close(fd)
            try:
                os.unlink(path)       # taken: from now on only the mappings hold it
            except OSError:
                pass
            self._maps[name] = mm
        if offset < 0 or size < 0 or offset + size > len(mm):
            raise ValueError(f"segment {name} has {len(mm)} bytes, not [{offset}, {offset + size})")
        return mm

    def take(self, name: str, offset: int, size: int, drop: list[str]) -> np.ndarray:
        """A uint8 array with ``size`` bytes of segment ``name`` at ``offset``,
        copied (the one copy on this side) into an aligned array from
        ``buffers`` (:data:`recv_buffers` by default), which XLA can take over
        as a device buffer. Once it returns, the segment may be released."""
        mm = self._map(name, offset, size, drop)
        out = self.buffers.get(size)
        src = np.frombuffer(mm, np.uint8, count=size, offset=offset)
        np.copyto(out, src)
        del src
        return out

    def view(self, name: str, offset: int, size: int, drop: list[str],
             on_free: Any) -> np.ndarray:
        """The ``size`` bytes of segment ``name`` at ``offset`` as a uint8
        array on the mapping itself: no copy on this side. ``offset`` must be
        :data:`XLA_ALIGN`-aligned, so that XLA:CPU adopts the array (or a typed
        view of it) as a device buffer, which then lives in the segment. The
        segment must not be released until nothing refers to the array, XLA's
        device buffers included: ``on_free()`` is called then (from whatever
        thread drops the last reference, so it must only do what is safe
        there, e.g. ``SimpleQueue.put`` or ``os.write``)."""
        if offset % XLA_ALIGN:
            raise ValueError(f"offset {offset} is not {XLA_ALIGN}-byte aligned")
        mm = self._map(name, offset, size, drop)
        # based on a memoryview, so every view of it, and every device buffer
        # XLA makes of those, keeps this very array alive (see RecvBuffers)
        out = np.frombuffer(memoryview(mm)[offset:offset + size], np.uint8)
        weakref.finalize(out, on_free).atexit = False
        return out

    def close(self) -> None:
        for mm in self._maps.values():
            _close(mm)
        self._maps.clear()
        self.buffers.clear()


# the most bytes one datagram takes (its frames and their lengths): an inline
# piece, its message and the signature, with room to spare
DGRAM_MAX_BYTES = INLINE_PIECE_BYTES + (16 << 10)
# socket buffers asked for (the kernel caps them at net.core.{w,r}mem_max)
DGRAM_SOCKET_BYTES = 4 << 20
_LENGTH = struct.Struct("<I")
# a datagram's frames up to this size come out of :func:`dgram_frames` as bytes
# (copies, cheap at this size; codec.decode takes bytes on its shortest path),
# bigger ones as memoryviews on the datagram
DGRAM_COPY_BYTES = 4096
_HEADS: dict[int, struct.Struct] = {}


def _head(n: int) -> struct.Struct:
    """``<u32 * n``, made once per n."""
    head = _HEADS.get(n)
    if head is None:
        head = _HEADS[n] = struct.Struct(f"<{n}I")
    return head


def dgram_name(prefix: str, address: str) -> bytes:
    """The datagram socket's name of the worker whose data port is at
    ``address``, in the cluster whose segments are named ``prefix``
    (:func:`shm_prefix`): abstract (a leading NUL byte, Linux), so there is no
    file to remove. The name carries :data:`PIECE_FORMAT`: a worker that
    speaks another datagram format has another name, so a piece to it finds no
    socket and goes by ZeroMQ (whose envelope has the protocol version)."""
    digest = hashlib.sha256(f"{prefix}|{address}".encode()).hexdigest()[:24]
    return f"\0{prefix}-dgram{PIECE_FORMAT}-{digest}".encode()


def dgram_frames(data: bytes) -> list[bytes | memoryview]:
    """The frames of one datagram (a count, each frame's length, the frames):
    bytes up to :data:`DGRAM_COPY_BYTES`, memoryviews on ``data`` above;
    ValueError if the lengths do not add up. (Few calls: on the small piece's
    path each one costs several µs on a CPU that was idle.)"""
    total = len(data)
    if total < _LENGTH.size:
        raise ValueError("datagram too short")
    (n,) = _LENGTH.unpack_from(data, 0)
    at = _LENGTH.size * (n + 1)
    if n > 64 or at > total:
        raise ValueError(f"datagram with {n} frames in {total} bytes")
    sizes = _head(n).unpack_from(data, _LENGTH.size)
    end = at + sum(sizes)
    if end > total:
        raise ValueError("datagram frames longer than the datagram")
    if end != total:
        raise ValueError("datagram longer than its frames")
    view = memoryview(data) if max(sizes, default=0) > DGRAM_COPY_BYTES else None
    out: list[bytes | memoryview] = []
    for size in sizes:
        out.append(data[at:at + size] if size <= DGRAM_COPY_BYTES else view[at:at + size])
        at += size
    return out


# ---- a small piece's own datagram (see the module's docstring) -----------------------
#
#   offset 0   4 bytes  PIECE_MAGIC + the format (PIECE_FORMAT)
#          4   u8       dtype: its index in PIECE_DTYPES
#          5   u8       ndim (at most PIECE_MAX_NDIM)
#          6   2 bytes  zero
#          8   u64      piece id
#         16   u64 * ndim  the shape
#          .   the bytes, C order (dtype.itemsize * prod(shape) of them)
#    end - 32  32 bytes keyed BLAKE3 of everything before it
#
# All little-endian. The MAC's key is derived from the workers' key
# (PIECE_KEY_CONTEXT), so a tenant, who holds no worker key, cannot make one,
# and a piece of another cluster does not check. A datagram of the older kind
# (frames of a signed envelope, :func:`dgram_frames`) starts with its frame
# count (< 65), never with PIECE_MAGIC.

PIECE_MAGIC = b"ZPI"
PIECE_FORMAT = 1
PIECE_TAG = PIECE_MAGIC + bytes([PIECE_FORMAT])
PIECE_MAC_BYTES = 32
PIECE_MAX_NDIM = 32
PIECE_KEY_CONTEXT = "zpath ICI piece datagram 2026-11-26 MAC key"
# the dtypes a piece datagram can carry, by index: only ever appended to (the
# index is on the wire); a piece of any other dtype goes as a signed envelope
PIECE_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                "float16", "float32", "float64", "complex64", "complex128", "bfloat16",
                "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                "float8_e4m3b11fnuz", "int4", "uint4")


def _piece_dtype(name: str) -> np.dtype | None:
    try:
        return np.dtype(name)
    except TypeError:
        kind = getattr(ml_dtypes, name, None) if ml_dtypes is not None else None
        return np.dtype(kind) if kind is not None else None


# index -> dtype (None: not known in this process), dtype -> index
_PIECE_DTYPE_OF: tuple[np.dtype | None, ...] = tuple(_piece_dtype(n) for n in PIECE_DTYPES)
_PIECE_CODE_OF: dict[np.dtype, int] = {d: i for i, d in enumerate(_PIECE_DTYPE_OF) if d is not None}
_PIECE_HEADS = tuple(struct.Struct(f"<4sBBxxQ{n}Q") for n in range(PIECE_MAX_NDIM + 1))
_PIECE_MIN_BYTES = _PIECE_HEADS[0].size + PIECE_MAC_BYTES


class PieceError(ValueError):
    """A piece datagram refused. ``piece_id`` is not None when the datagram is
    authentic (its MAC checks) but what it says is not a piece (a dtype this
    side does not know, bytes that do not fill its shape): what waits for that
    piece can be failed. A datagram that does not check names no piece."""

    def __init__(self, reason: str, piece_id: int | None = None) -> None:
        super().__init__(reason)
        self.piece_id = piece_id


class PieceDatagrams:
    """Makes and checks a small piece's own datagram (the format above) under
    one cluster's workers' key. Thread-safe (no state after construction).

    On a small piece's path each Python call costs several µs on a CPU that
    was idle (docs/benchmarks.md, transfer.py): making one is a dict lookup,
    one struct pack and the MAC (three calls), checking one a slice compare,
    the MAC, one struct unpack and one ``np.ndarray`` on the datagram's bytes."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        self._key = blake3.blake3(bytes(key), derive_key_context=PIECE_KEY_CONTEXT).digest()

    def frames(self, piece_id: int, view: np.ndarray) -> list[Any] | None:
        """The datagram for piece ``piece_id`` with the bytes of ``view`` (any
        layout), as parts for one ``sendmsg``; None if this format cannot carry
        it (its dtype, its rank, more than :data:`INLINE_PIECE_BYTES`, an id
        that is not a u64)."""
        code = _PIECE_CODE_OF.get(view.dtype)
        if code is None or view.nbytes > INLINE_PIECE_BYTES:
            return None
        ndim = view.ndim
        if ndim > PIECE_MAX_NDIM:
            return None
        try:
            head = _PIECE_HEADS[ndim].pack(PIECE_TAG, code, ndim, piece_id, *view.shape)
        except struct.error:
            return None
        try:
            data = memoryview(view).cast("B")
        except (TypeError, ValueError, BufferError):     # strided, empty, or no buffer format (bfloat16)
            data = memoryview(np.ascontiguousarray(view).reshape(-1).view(np.uint8))
        mac = blake3.blake3(head, key=self._key)
        mac.update(data)
        return [head, data, mac.digest()]

    def read(self, data: bytes) -> tuple[int, np.ndarray]:
        """(piece id, array) of one datagram (whose first three bytes are
        :data:`PIECE_MAGIC`); the array lies on ``data`` (read-only, no copy).
        Raises :class:`PieceError` saying what is wrong."""
        end = len(data) - PIECE_MAC_BYTES
        if end < _PIECE_MIN_BYTES - PIECE_MAC_BYTES:
            raise PieceError(f"piece datagram of {len(data)} bytes (at least {_PIECE_MIN_BYTES})")
        if not data.startswith(PIECE_TAG):
            raise PieceError(f"piece datagram of format {data[3]} (this worker reads {PIECE_FORMAT})"
                             if data.startswith(PIECE_MAGIC) else "not a piece datagram")
        ndim = data[5]
        if ndim > PIECE_MAX_NDIM:
            raise PieceError(f"piece datagram of rank {ndim} (at most {PIECE_MAX_NDIM})")
        head = _PIECE_HEADS[ndim]
        if end < head.size:
            raise PieceError(f"piece datagram of {len(data)} bytes, too short for rank {ndim}")
        if not hmac.compare_digest(blake3.blake3(memoryview(data)[:end], key=self._key).digest(),
                                   data[end:]):
            raise PieceError("piece datagram with a bad MAC (wrong key or corrupted)")
        fields = head.unpack_from(data)
        piece_id, shape = fields[3], fields[4:]
        code = fields[1]
        dtype = _PIECE_DTYPE_OF[code] if code < len(_PIECE_DTYPE_OF) else None
        if dtype is None:
            raise PieceError(f"piece {piece_id}: dtype {code} unknown here", piece_id)
        if end - head.size != dtype.itemsize * math.prod(shape):
            raise PieceError(f"piece {piece_id}: {end - head.size} bytes do not make a "
                             f"{dtype_name(dtype)}{list(shape)}", piece_id)
        return piece_id, np.ndarray(shape, dtype, buffer=data, offset=head.size)


class DgramReceiver:
    """A worker's datagram socket (see the module's docstring): not blocking;
    poll :meth:`fileno`, then :meth:`recv` until it returns None."""

    def __init__(self, name: bytes) -> None:
        self.name = name
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.sock.bind(name)
            self.sock.setblocking(False)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, DGRAM_SOCKET_BYTES)
        except BaseException:
            self.sock.close()
            raise

    def fileno(self) -> int:
        return self.sock.fileno()

    def recv(self) -> bytes | None:
        """The next datagram (a new bytes object: what is made of it may keep
        it), or None if none is waiting."""
        try:
            return self.sock.recv(DGRAM_MAX_BYTES)
        except (BlockingIOError, InterruptedError):
            return None

    def close(self) -> None:
        self.sock.close()


class DgramSender:
    """Sends datagrams to workers' :class:`DgramReceiver` sockets, from any
    thread (the kernel orders each whole; nothing here is shared state)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, DGRAM_SOCKET_BYTES)

    def send(self, name: bytes, frames: list[Any]) -> bool:
        """Send ``frames`` (bytes-like) as one datagram to the socket ``name``;
        False if it could not go now (no such socket, its queue full, too big)."""
        sizes = [len(f) if type(f) is bytes else memoryview(f).nbytes for f in frames]
        if sum(sizes) + _LENGTH.size * (len(frames) + 1) > DGRAM_MAX_BYTES:
            return False
        head = _head(len(frames) + 1).pack(len(frames), *sizes)
        try:
            self.sock.sendmsg([head, *frames], (), 0, name)
        except OSError:       # ECONNREFUSED, ENOENT, EAGAIN (its queue is full), ...
            return False
        return True

    def send_parts(self, name: bytes, parts: list[Any]) -> bool:
        """Send ``parts`` (bytes-like, e.g. :meth:`PieceDatagrams.frames`) as
        one datagram as they are, without :meth:`send`'s frame lengths; False
        if it could not go now."""
        try:
            self.sock.sendmsg(parts, (), 0, name)
        except OSError:
            return False
        return True

    def close(self) -> None:
        self.sock.close()


# a shaped DCN piece larger than this goes out as chunks of this size, each
# handed to TCP at its paced time, so pacing and the real transfer overlap
CHUNK_BYTES = 1 << 20


class Shaper:
    """Emulated DCN link of one sending host: a piece of N bytes leaves the link
    N*8/rate seconds after the link is free (or now), and arrives ``latency``
    later. :meth:`due` gives the monotonic time at which to hand a whole piece
    to TCP; :meth:`chunks` paces a capped piece as chunks, like a NIC's queue
    discipline shapes frames, so the real transfer of one chunk overlaps the
    pacing of the next and the piece arrives about when the emulated link
    would deliver it (not that plus the real transfer time)."""

    def __init__(self, latency_ms: float = 0.0, gbps: float = 0.0,
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        if latency_ms < 0 or gbps < 0:
            raise ValueError("DCN latency and bandwidth must be >= 0")
        if chunk_bytes <= 0:
            raise ValueError("chunk size must be > 0")
        self.latency = latency_ms / 1e3
        self.rate = gbps * 1e9 / 8 if gbps else 0.0    # bytes per second; 0 = no cap
        self.chunk_bytes = chunk_bytes
        self._free_at = 0.0

    @property
    def active(self) -> bool:
        return self.latency > 0 or self.rate > 0

    def due(self, nbytes: int, now: float) -> float:
        start = max(now, self._free_at)
        end = start + (nbytes / self.rate if self.rate else 0.0)
        self._free_at = end
        return end + self.latency

    def repace(self, queued: list[tuple], dropped: Callable[[tuple], bool],
               now: float) -> list[tuple]:
        """This link's queue, as a heap of (due, seq, rank, message, buffers),
        less the entries that ``dropped`` picks (for a peer that was lost): the
        link time they had booked is given back, the others keep their order
        (``seq``) and are paced again from ``now``. Returns the new heap."""
        kept = sorted((e for e in queued if not dropped(e)), key=lambda e: e[1])
        self._free_at = 0.0
        out = [(self.due(piece_nbytes(e[4]), now), *e[1:]) for e in kept]
        heapq.heapify(out)
        return out

    def chunks(self, nbytes: int, now: float) -> list[tuple[int, int, float]]:
        """(offset, size, due) of each chunk of a piece of ``nbytes``: one chunk
        (the whole piece) when there is no cap or it fits in one chunk."""
        if not self.rate or nbytes <= self.chunk_bytes:
            return [(0, nbytes, self.due(nbytes, now))]
        return [(off, min(self.chunk_bytes, nbytes - off),
                 self.due(min(self.chunk_bytes, nbytes - off), now))
                for off in range(0, nbytes, self.chunk_bytes)]


def piece_nbytes(buffers: Any) -> int:
    return sum(memoryview(b).nbytes if not isinstance(b, np.ndarray) else b.nbytes for b in buffers)
