"""The controller's decisions as a pure state machine: events in (a message
with the time it arrived, a tick of the clock), messages out.

``ControllerCore`` owns no socket, reads no clock and no environment: the loop
(server.py) passes the time with every event and sends the ``Send`` records it
returns (and carries out the other effects, ``RemoveSegments``). Its concerns
live in one module each, mixed into the core: peers.py (registration, status,
timeline), admission.py (memory waiting, pins, deferred releases),
dispatch.py (the parked-node graph, copy repair, the tenant scheduler, what is
in flight), fusion.py (templates and fused runs), fastcall.py (a repeated
op-by-op call), failures.py (host loss, client departure).
``validate_state`` checks the invariants of each."""
from __future__ import annotations

import collections
import logging
from typing import Any

from zpath.config import ControllerConfig
from zpath.controller.admission import SEND_BUDGET, Admission
from zpath.controller.directory import Directory
from zpath.controller.dispatch import Dispatch
from zpath.controller.failures import Failures
from zpath.controller.fastcall import FastCalls
from zpath.controller.fusion import Fusion
from zpath.controller.peers import Peers
from zpath.controller.records import Effect, Peer, RemoveSegments, Send
from zpath.controller.relays import Relays
from zpath.controller.resources import ResourceManager
from zpath.controller.scheduler import GangScheduler, TenantScheduler
from zpath.errors import ErrorKind
from zpath.keys import Keys
from zpath.net import messages as m
from zpath.net.codec import CLIENTS, CLUSTER, KeyOf, Record, constructor
from zpath.net.transport import LOG_BURST, LOG_RATE, REPLY_BURST, REPLY_RATE, RateLimit

__all__ = ["ControllerCore", "Effect", "RemoveSegments", "Send"]

# a client's messages handled at once even while its submission is paused
_NOT_DEFERRED = (m.Ping, m.Goodbye, m.StatusRequest, m.TimelineRequest)
# (CallAgain made whole without the constructors' checks: its buffer ids are
# the decoder's ints, the rest the kept Call's)
_call, _call_input, _call_output = (constructor(m.Call), constructor(m.CallInput),
                                    constructor(m.CallOutput))
_NO_AVAL = m.Aval([], "")

log = logging.getLogger(__name__)


class ControllerCore(Peers, FastCalls, Admission, Dispatch, Fusion, Failures, Relays):
    """Every decision of the controller. Events: ``handle`` (a message),
    ``tick`` (pings, liveness), ``resume`` (go on planning while ``busy``),
    ``reject`` (a message that could not be decoded), ``farewell`` (shutdown).
    Each returns the effects to carry out, in order."""

    def __init__(self, config: ControllerConfig, machine: str = "",
                 gang: GangScheduler | None = None, keys: Keys | None = None) -> None:
        """``machine``: this machine's id (lost hosts on it: their segments
        are removed); ``gang``: the gang scheduler (tests may give another);
        ``keys``: the cluster's keys (default: new random ones)."""
        self.config = config
        self.machine = machine
        self.keys = keys if keys is not None else Keys.random()
        # bad messages: an Error reply per peer and a log line in all, rate-limited
        self.reply_limit = RateLimit(REPLY_RATE, REPLY_BURST)
        self.log_limit = RateLimit(LOG_RATE, LOG_BURST)
        self.now = 0.0                     # the time of the event being handled
        self._out: list[Effect] = []
        self.rm = ResourceManager()
        self.directory = Directory(lambda d: self.rm.devices[d].host,
                                   lambda h: self.rm.hosts[h].data_address,
                                   lambda d: self.rm.devices[d].jax_id, self.rm.route,
                                   mapping_version=lambda: self.rm.version)
        self.scheduler = gang if gang is not None else GangScheduler()
        self.tenants = TenantScheduler(config.policy, window_s=config.window_ms / 1000,
                                       solo_window_s=config.solo_window_ms / 1000,
                                       alone_window_s=config.alone_window_ms / 1000,
                                       clock=lambda: self.now)
        # per client with a paused submission: the messages it sent since, in
        # order, handled once that submission is planned (see handle)
        self.deferred_msgs: dict[bytes, collections.deque[tuple[int, Record, list]]] = {}
        self._init_peers()
        self._init_admission(config.device_memory_limit)
        self._init_dispatch()
        self._init_fusion()
        self._init_failures()
        self._init_relays()
        self._init_fastcalls()

    # ---- output ----------------------------------------------------------------
    def send(self, ident: bytes, msg: Record, parent: int = 0, buffers: Any = ()) -> None:
        peer = self.peers.get(ident)
        if peer is not None and peer.role == "worker" and type(msg) is not m.Registered:
            self._direct(peer.id, ident, msg)       # (relays.py: the order counts)
        self._out.append(Send(ident, msg, parent, buffers))

    def reply_error(self, ident: bytes, parent: int, code: str, text: str) -> None:
        self.send(ident, m.Error(code, text), parent)

    def to_host(self, rank: int, msg: Record, buffers: Any = ()) -> None:
        ident = self.worker_ident.get(rank)
        if ident is None:
            log.warning("host %d is gone: %s not sent", rank, type(msg).__name__)
            return
        self.send(ident, msg, buffers=buffers)

    def to_hosts(self, messages: list[tuple[int, Record]]) -> None:
        """``to_host`` for many (host, message) pairs, in order (a message
        many of them get alike through relays: relays.py)."""
        if self.relay_min and len(messages) >= self.relay_min:
            messages = self._relay(messages)
        idents, out, sent = self.worker_ident, self._out, self.direct_sent
        # (while ``_direct`` only counts a message, counted here without the call)
        direct = None if self._direct_only_counts() else self._direct
        counted = 0
        for rank, msg in messages:
            ident = idents.get(rank)
            if ident is None:
                log.warning("host %d is gone: %s not sent", rank, type(msg).__name__)
                continue
            if direct is None:
                sent[rank] = sent.get(rank, 0) + 1
                counted += 1
            else:
                direct(rank, ident, msg)
            out.append(Send(ident, msg, 0, ()))
        self._epoch += counted

    def _take(self) -> list[Effect]:
        if self.frees_pending:
            self.send_frees()
        out, self._out = self._out, []
        return out

    # ---- events ----------------------------------------------------------------
    def handle(self, now: float, ident: bytes, parent: int, msg: Record, buffers: list) -> list[Effect]:
        """A message from ``ident`` (``parent``: its id, for the answer). While a
        submission of a client is paused at a flush point (``busy``), that
        client's later messages (but pings and a goodbye) wait until it is
        planned in full: one of them may read or release what its unplanned
        nodes make. Everyone else's are handled at once."""
        self.now = now
        peer = self.peers.get(ident)
        kind = type(msg)
        if (kind is m.ExecDone or kind is m.ExecDoneBatch) and peer is not None and peer.role == "worker":
            # reports, the most frequent messages of all (one per host, or per
            # relay's group, per computation): straight to them
            peer.last_seen = self.heard[peer.id] = now
            try:
                if kind is m.ExecDone:
                    self._exec_done(peer.id, msg)
                else:
                    self._exec_done_batch(peer.id, msg)
            except Exception:  # a handler bug must not take the controller down
                log.exception("error handling %s from host %d", kind.__name__, peer.id)
            return self._take()
        if (kind is m.Call or kind is m.CallAgain or kind is m.Release) and peer is not None \
                and peer.role == "client":
            # a call of a kept form made whole, and a form kept, as they come
            # (what waits behind a paused submission waits made)
            if kind is m.CallAgain:
                msg = self._call_again(ident, peer, msg)
                if msg is None:
                    return self._take()
                kind = m.Call
            elif kind is m.Call and msg.keep and not self._keep_form(ident, peer, msg):
                return self._take()
            if not self._paused and ident not in self.deferred_msgs:
                # a client's most frequent messages, nothing of its own paused
                # nor waiting: straight to them (as ``_handle`` does)
                peer.last_seen = now
                try:
                    if kind is m.Call:
                        self._call(ident, peer, msg)
                    else:
                        self._release(msg.buffers, peer.id)
                except Exception:  # a handler bug must not take the controller down
                    self._handling_failed(ident, parent, msg)
                return self._take()
        if peer is not None and peer.role == "client" and type(msg) not in _NOT_DEFERRED and \
                (ident in self.deferred_msgs or self.paused_client(peer)):
            self.deferred_msgs.setdefault(ident, collections.deque()).append((parent, msg, buffers))
            peer.last_seen = now
            return self._take()
        self._handle_safely(ident, parent, msg, buffers)
        return self._take()

    def _keep_form(self, ident: bytes, peer: Peer, call: m.Call) -> bool:
        """Keep ``call``'s form as the client's form ``call.keep``; False (the
        call failed) for a number out of range or a form too large to keep."""
        n = len(call.inputs) + len(call.outputs)
        if not 0 < call.keep <= m.MAX_CALL_FORMS:
            why = f"Call.keep must be 0 to {m.MAX_CALL_FORMS}, not {call.keep}"
        elif n > m.MAX_FORM_BUFFERS:
            why = f"a call with {n} inputs and outputs cannot keep its form (at most {m.MAX_FORM_BUFFERS})"
        else:
            peer.forms[call.keep] = call
            return True
        self._fail_call(ident, peer.id, call, m.ErrorInfo(ErrorKind.BAD_REQUEST, why, None, "", ""))
        return False

    def _call_again(self, ident: bytes, peer: Peer, again: m.CallAgain) -> m.Call | None:
        """The ``Call`` a ``CallAgain`` names: its kept form with its call id
        and buffers; None (its outputs failed) for a form not kept or other
        numbers of buffers."""
        form = peer.forms.get(again.form)
        if form is None or len(again.inputs) != len(form.inputs) or len(again.outputs) != len(form.outputs):
            why = f"call form {again.form} was not kept by this client" if form is None else \
                f"call form {again.form} has {len(form.inputs)} inputs and {len(form.outputs)} outputs, " \
                f"not {len(again.inputs)} and {len(again.outputs)}"
            self._fail_call(ident, peer.id, _call(again.call_id, "", [], [], [], [], [
                _call_output(b, _NO_AVAL, []) for b in again.outputs], 0),
                m.ErrorInfo(ErrorKind.BAD_REQUEST, why, None, "", ""))
            return None
        return _call(again.call_id, form.program, form.mesh_shape, form.axis_names, form.devices,
                     [_call_input(b, i.aval, i.spec, i.put) for b, i in zip(again.inputs, form.inputs)],
                     [_call_output(b, o.aval, o.spec) for b, o in zip(again.outputs, form.outputs)], 0)

    def _replay(self, ident: bytes) -> None:
        """The client's paused submission is planned (or waits for memory):
        handle what it sent meanwhile, in order, until one of them pauses."""
        waiting = self.deferred_msgs.get(ident)
        peer = self.peers.get(ident)
        while waiting and peer is not None and not self.paused_client(peer):
            parent, msg, buffers = waiting.popleft()
            self._handle_safely(ident, parent, msg, buffers)
        if not waiting or peer is None:
            self.deferred_msgs.pop(ident, None)

    def _handle_safely(self, ident: bytes, parent: int, msg: Record, buffers: list) -> None:
        try:
            self._handle(ident, parent, msg, buffers)
        except Exception:  # a handler bug must not take the controller down
            self._handling_failed(ident, parent, msg)

    def _handling_failed(self, ident: bytes, parent: int, msg: Record) -> None:
        """A handler raised on ``msg`` (in an ``except``): logged, and its
        sender told (a call's futures fail)."""
        peer = self.peers.get(ident)
        log.exception("error handling %s from %s", type(msg).__name__,
                      f"{peer.role} {peer.id}" if peer else repr(ident))
        if isinstance(msg, m.Call) and peer is not None:   # fail its futures, don't leave them waiting
            self._fail_call(ident, peer.id, msg, m.ErrorInfo(
                ErrorKind.REMOTE_ERROR, "the controller failed planning this call (see its log)", None, "", ""))
        else:
            self.reply_error(ident, parent, ErrorKind.INTERNAL,
                             f"controller failed handling {type(msg).__name__}")

    def program_name(self, digest: str) -> str:
        prog = self.programs.get(digest)
        return prog[0] if prog else ""

    def resume_label(self) -> tuple[int, str]:
        """(client, name) of what ``resume`` goes on with (-1, "" if not a submission)."""
        head = self._paused[0] if self._paused else None
        if head is not None and type(head) is not tuple:
            return head.peer.id, self.program_name(head.calls[head.next].program) if head.next < len(head.calls) else ""
        return -1, "sending planned nodes" if head is not None else ""

    def begin_turn(self) -> None:
        """The loop starts reading a round of messages: what their handling may
        send of nodes already planned is one budget (``send_budget``) for the
        round; beyond it, the core is ``busy`` and ``resume`` goes on."""
        self.send_budget = SEND_BUDGET

    def tick(self, now: float) -> list[Effect]:
        """Ping every worker; a worker silent past its timeout is lost, a client
        has left."""
        self.now = now
        self.send_budget = SEND_BUDGET
        self._pings()
        try:
            self._check_liveness(now)
        except Exception:  # a bug here must not take the controller down
            log.exception("error while checking hosts and clients")
        return self._take()

    def check(self, now: float) -> list[Effect]:
        """The hosts of a failed collective that did not answer in time are
        lost (``suspects_due`` says when)."""
        self.now = now
        try:
            self._check_suspects(now)
        except Exception:  # a bug here must not take the controller down
            log.exception("error while checking suspect hosts")
        return self._take()

    def unreachable(self, now: float, rank: int, what: str) -> list[Effect]:
        """A message to host ``rank`` was dropped: its queue is full, it has
        stopped reading. It is lost, as a silent host is: what it ran fails,
        and the hosts that wait for a message it was to forward as a relay
        (or for what it relayed to them) are released by its ``HostDown``
        rather than after ``ORDER_WAIT_S`` (docs/design.md, "Reports through
        relays")."""
        self.now = now
        if rank in self.worker_ident:           # (not lost already)
            try:
                self._host_lost(rank, f"it stopped reading its messages (queue full): {what} dropped")
            except Exception:  # a bug here must not take the controller down
                log.exception("error while losing host %d", rank)
        return self._take()

    def resume(self, now: float) -> list[Effect]:
        """Go on with the planning (or sending) that stopped at a flush point
        (``busy``)."""
        self.now = now
        self.send_budget = SEND_BUDGET
        try:
            self._go_on()
        except Exception:
            log.exception("error while planning")
        return self._take()

    def reject(self, now: float, ident: bytes | None, parent: int, why: str) -> list[Effect]:
        """A message that could not be decoded (or was signed by the wrong key
        for what it asks): a log line and an Error reply, each rate-limited (a
        flood of garbage gets a few of each per second)."""
        self.now = now
        who = self.peers.get(ident) if ident else None
        n = self.log_limit.allow(None, now)
        if n:
            log.warning("rejected message from %s: %s%s", f"{who.role} {who.id}" if who else repr(ident), why,
                        f" ({n - 1} more rejected messages not logged)" if n > 1 else "")
        if ident is not None and self.reply_limit.allow(ident, now):
            self.reply_error(ident, parent, ErrorKind.PROTOCOL, why)
        return self._take()

    # ---- credentials -------------------------------------------------------------
    def keys_of(self, ident: bytes) -> KeyOf:
        """What checks a message from ``ident`` (see ``codec.decode``): a worker
        signs with the worker key, a client with its own session key; a new
        connection with the cluster key (Hello, StatusRequest) or the worker key
        (RegisterWorker); a client the controller dropped with its session key
        (it is then told it is not registered)."""
        peer = self.peers.get(ident)
        if peer is None:
            return self.keys.of
        if peer.role == "worker":
            return self._worker_keys
        return peer.keys

    def _worker_keys(self, signer: int) -> bytes | None:
        return self.keys.workers if signer == CLUSTER else None

    def sign_for(self, ident: bytes) -> tuple[bytes, int]:
        """What the messages to ``ident`` are signed with: the worker key for a
        worker, the cluster key for anyone else (a client checks the
        controller's messages with it)."""
        peer = self.peers.get(ident)
        if peer is not None and peer.role == "worker":
            return self.keys.workers, CLUSTER
        return self.keys.clients, CLIENTS

    def refuses(self, ident: bytes, signer: int, msg: Record) -> str:
        """Why a message, checked against ``keys_of(ident)``, is refused for
        what it asks ("" if it is not): only the worker key registers a worker,
        and a client says Hello with the cluster key."""
        if ident in self.peers:
            return ""
        if type(msg) is m.RegisterWorker and signer != CLUSTER:
            return "RegisterWorker must be signed with the worker key"
        if type(msg) is m.Hello and signer != CLIENTS:
            return "Hello must be signed with the cluster key"
        return ""

    def farewell(self, reason: str) -> list[Effect]:
        """Shutting down: the workers stop, the clients fail what waits."""
        for ident in self.worker_ident.values():
            self.send(ident, m.Shutdown(reason))
        for peer in self.peers.values():
            if peer.role == "client":
                self.send(peer.ident, m.Shutdown(reason))
        return self._take()

    def validate_state(self) -> None:
        """Check every component's invariants (AssertionError if one is broken)."""
        self.validate_peers()
        for ident in self.deferred_msgs:     # only while its submission is paused
            peer = self.peers.get(ident)
            assert peer is not None and self.paused_client(peer), f"messages of {ident!r} deferred for nothing"
        self.validate_admission()
        self.validate_dispatch()
        self.validate_fusion()
        self.validate_relays()
        self.validate_fastcalls()

    # ---- messages --------------------------------------------------------------
    def _handle(self, ident: bytes, parent: int, msg: Record, buffers: list) -> None:
        peer = self.peers.get(ident)
        if peer is not None:
            peer.last_seen = self.now
            # a client's most frequent messages (Call, Release): here, not in the match
            kind = type(msg)
            if kind is m.Call and peer.role == "client":
                self._call(ident, peer, msg)
                return
            if kind is m.Release and peer.role == "client":
                self._release(msg.buffers, peer.id)
                return
        match msg:
            case m.RegisterWorker():
                self._register_worker(ident, parent, msg)
            case m.Hello():
                self._hello(ident, parent, msg)
            case m.StatusRequest():
                self._status(ident, parent)
            case m.Pong() if peer is not None:
                self._pong(peer, msg)
            case m.Ping() if peer is not None:
                self.send(ident, m.Pong(msg.seq, 0, 0, []), parent)
            case m.Goodbye() if peer is None:
                pass            # a connection already dropped: nothing to answer
            case _ if peer is None:
                self.reply_error(ident, parent, ErrorKind.NOT_REGISTERED,
                                 f"{type(msg).__name__} before Hello/RegisterWorker")
            case m.AllocSlice() if peer.role == "client":
                self._alloc_slice(ident, parent, msg)
            case m.RegisterProgram() if peer.role == "client":
                self._register_program(ident, parent, msg, buffers)
            case m.Program() if peer.role == "client":
                self._program(ident, peer, msg)
            case m.DefineProgram() if peer.role == "client":
                self._define_program(ident, parent, peer, msg)
            case m.RunProgram() if peer.role == "client":
                self._run_program(ident, peer, msg)
            case m.DropTemplates() if peer.role == "client":
                self._drop_templates(peer, msg.templates)
            case m.ExplainRequest() if peer.role == "client":
                self._explain(ident, parent, peer, msg)
            case m.Locate() if peer.role == "client":
                self.send(ident, self._locate(peer.id, msg.buffer), parent)
            case m.ExecDone() if peer.role == "worker":
                self._exec_done(peer.id, msg)
            case m.ExecDoneBatch() if peer.role == "worker":
                self._exec_done_batch(peer.id, msg)
            case m.TimelineRequest():
                self.send(ident, m.Timeline(self.timeline_records(msg.limit), self.event_records(msg.limit),
                                            self.now + self.wall_offset), parent)
            case m.Goodbye() if peer.role == "client":
                log.info("client %d (%s) disconnected: %s", peer.id, peer.name, msg.reason)
                self._client_left(peer)
            case m.Error():
                log.warning("%s %d reported an error: %s: %s", peer.role, peer.id, msg.code, msg.message)
            case _:
                self.reply_error(ident, parent, ErrorKind.BAD_REQUEST,
                                 f"{type(msg).__name__} is not accepted from a {peer.role}")
