"""Failures: liveness (hosts and clients that stay silent), a host lost, a
client that left."""
from __future__ import annotations

import collections
import dataclasses
import logging

from zpath.controller.records import InFlight, Peer, RemoveSegments, Submission
from zpath.errors import ErrorKind
from zpath.net import messages as m


log = logging.getLogger(__name__)

# How long a host of a computation whose collective failed on another host
# (ExecDone with ErrorKind.PEER_FAILED) has to answer a ping before it counts as
# lost: a dead peer breaks the collective at once (gloo: "connection closed by
# peer"), so the call fails with HostLost naming it within about this long,
# not after the heartbeat timeout.
PEER_ANSWER_S = 0.5


@dataclasses.dataclass
class PeerFailure:
    """A computation's collective failed on ``host``: its outputs there wait,
    unsettled, for the verdict on the ``suspects`` (the computation's other hosts)."""
    host: int
    outputs: list[int]
    error: m.ErrorInfo
    suspects: list[int]
    deadline: float


class Failures:
    """Mixin of ControllerCore: host loss (heartbeats; peers of a failed
    collective that do not answer) and client departure."""

    def _init_failures(self) -> None:
        self.suspects: dict[int, float] = {}         # host rank -> since when it must answer
        self.peer_failures: list[PeerFailure] = []

    def _peer_failed(self, host: int, info: InFlight, error: m.ErrorInfo) -> None:
        """Host ``host`` reports that computation ``info`` failed in a collective
        with its other hosts (and left its outputs unsettled): ping those; the
        ones that stay silent for PEER_ANSWER_S are lost (``check_suspects``)."""
        suspects = sorted(r for r in info.host_devices if r != host and r in self.worker_ident)
        for r in suspects:
            if r not in self.suspects:
                self.suspects[r] = self.now
                self.to_host(r, m.Ping(self._ping_seq))
        self.peer_failures.append(PeerFailure(host, list(info.outputs), error, suspects,
                                              self.now + PEER_ANSWER_S))

    def suspects_due(self) -> float | None:
        """When ``check_suspects`` has a verdict to give (None: nothing pending)."""
        return min((f.deadline for f in self.peer_failures), default=None)

    def _check_suspects(self, now: float) -> None:
        for rank, since in list(self.suspects.items()):
            peer = self.peers.get(self.worker_ident.get(rank, b""))
            if peer is None or peer.last_seen > since:       # lost already, or it answered
                del self.suspects[rank]
            elif now >= since + PEER_ANSWER_S:
                del self.suspects[rank]
                self._host_lost(rank, f"a collective with it failed and it did not answer for "
                                      f"{now - since:.1f}s")
        for failure in list(self.peer_failures):
            if now < failure.deadline and any(r in self.suspects for r in failure.suspects):
                continue
            self.peer_failures.remove(failure)
            lost = [self.rm.hosts[r] for r in failure.suspects if not self.rm.hosts[r].alive]
            if lost:
                h = lost[0]
                err = m.ErrorInfo(ErrorKind.HOST_LOST, f"host {h.rank} ({h.name}, island {h.island}) was "
                                  f"lost: {h.lost_why}", h.rank, failure.error.computation, "")
            else:       # everyone answered: the collective failed for another reason
                err = dataclasses.replace(failure.error, kind=ErrorKind.REMOTE_ERROR)
            if failure.host in self.worker_ident:     # (lost with its island's runtime, often)
                self.to_host(failure.host, m.FailBuffers(failure.outputs, err))

    def late(self, now: float) -> bool:
        """Whether a peer has been silent past its timeout at ``now`` (the loop
        reads what waits before judging: see ``tick``)."""
        return any(now - self.seen(p) > self._timeout(p) for p in self.peers.values())

    def stalled(self, now: float, busy: float) -> None:
        """The loop was held up ``busy`` seconds beyond what it tolerates: that
        time does not count as the peers' silence."""
        for peer in self.peers.values():
            peer.last_seen = min(now, self.seen(peer) + busy)

    def _timeout(self, peer: Peer) -> float:
        return self.config.host_timeout_s if peer.role == "worker" else self.config.client_timeout_s

    def _check_liveness(self, now: float) -> None:
        self._check_suspects(now)
        for peer in list(self.peers.values()):
            if peer.ident not in self.peers:       # lost meanwhile (with its island)
                continue
            silent = now - self.seen(peer)
            if peer.role == "worker" and silent > self.config.host_timeout_s:
                self._host_lost(peer.id, f"no answer for {silent:.1f}s")
            elif peer.role == "client" and silent > self.config.client_timeout_s:
                log.warning("client %d (%s) silent for %.1fs: treating it as gone", peer.id,
                            peer.name, silent)
                self._client_left(peer)

    def _client_left(self, peer: Peer) -> None:
        """A client left (Goodbye) or vanished: its queued work is cancelled and
        everything it holds is freed (computations already at the workers finish)."""
        self.peers.pop(peer.ident, None)
        peer.gone = True
        # its waiting submissions leave the memory queue first (dropping one frees
        # memory, which resumes the queue), and are dropped once its queued nodes
        # are cancelled (so that resuming cannot send one of them)
        waiting_subs = [s for s in self.memory_waiting if s.peer is peer]
        if waiting_subs:
            self.memory_waiting = collections.deque(s for s in self.memory_waiting if s.peer is not peer)
        paused = [s for s in self._paused if type(s) is Submission and s.peer is peer]
        if paused:           # stopped at a flush point: the rest of them will not be planned
            self._paused = collections.deque(s for s in self._paused if not any(s is p for p in paused))
            waiting_subs += paused
        self.deferred_msgs.pop(peer.ident, None)      # what it sent meanwhile
        for key in [k for k in self.program_parts if k[0] == peer.ident]:
            del self.program_parts[key]                 # a long program whose last part never came
        islands = set(self.tenants.islands())
        cancelled = {id(r.item): r.item for r in self.tenants.remove_client(peer.id)}
        for key, waiting in list(self.waiters.items()):
            mine = [h for h in waiting if h.run.peer is peer]
            if mine:
                cancelled.update((id(h), h) for h in mine)
                rest = [h for h in waiting if h.run.peer is not peer]
                if rest:
                    self.waiters[key] = rest
                else:
                    del self.waiters[key]
        for node in cancelled.values():
            self._abandon(node, was_parked=True)
        for sub in waiting_subs:
            self._drop_waiting(sub)
        for island in islands:            # heads its queue held back may go now
            self._pump(island)
        if cancelled:
            log.info("client %d left: %d queued computations cancelled", peer.id, len(cancelled))
        # its computations already at the workers may wait for values it was
        # still putting: they fail rather than hold their devices until the
        # input deadline
        err = m.ErrorInfo(ErrorKind.REMOTE_ERROR, f"client {peer.id} ({peer.name}) left before its inputs "
                          "arrived", None, "", "")
        fails: dict[int, list[int]] = {}
        for inf in self.in_flight.values():
            if inf.client == peer.id and inf.puts:
                for rank in inf.hosts:
                    fails.setdefault(rank, []).extend(inf.puts)
        for rank, buffers in fails.items():
            self.to_host(rank, m.FailBuffers(buffers, err))
        self._release(self.directory.owned(peer.id), peer.id)
        # and what it put that no call took (a call this controller refused, or
        # made while it was being dropped): the workers free all of its buffers
        for rank in list(self.worker_ident):
            self.to_host(rank, m.ClientGone(peer.id))
        # its templates, and their fused programs on the hosts
        self._drop_templates(peer, [n for c, n in self.templates if c == peer.id])
        if self.memory_waiting:
            self._resume_waiting()

    def _host_lost(self, rank: int, why: str) -> None:
        """A worker stopped answering: fail what depended on it, keep serving."""
        host = self.rm.lose_host(rank, why)
        ident = self.worker_ident.pop(rank, None)
        if ident is not None:
            self.peers.pop(ident, None)
        self.host_programs.pop(rank, None)
        self.heard.pop(rank, None)
        self._forget_relays_of(rank)
        err = m.ErrorInfo(ErrorKind.HOST_LOST, f"host {rank} ({host.name}, island {host.island}) was lost: {why}",
                          rank, "", "")
        log.error("%s", err.message)
        failed: dict[bytes, list[int]] = {}
        broken_pieces: dict[int, list[int]] = {}
        for exec_id, inf in list(self.in_flight.items()):
            if inf.fused and rank in inf.hosts:
                # a fused run's hosts make their results on their own: those of
                # the lost host fail below, with everything that lives only
                # there; the run finishes when the others have reported
                inf.hosts.discard(rank)
                if not inf.hosts:
                    # (what waits for memory goes on below, once the lost
                    # host's copies are forgotten, so it is not planned to
                    # read from there)
                    self._release_transient(inf.transient, resume=False)
                    del self.in_flight[exec_id]
                    self._exec_finished(exec_id)
            elif rank in inf.hosts:        # it was still running there: it fails
                # (outputs the client released stay forgotten)
                self.directory.poison([b for b in inf.outputs if b in self.directory.buffers],
                                      inf.client, err)
                failed.setdefault(inf.client_ident, []).extend(inf.outputs)
                del self.in_flight[exec_id]
                self._exec_finished(exec_id)
            for piece_id, src, dst in inf.pieces:
                if src == rank and dst != rank:   # it will never send these
                    broken_pieces.setdefault(dst, []).append(piece_id)
        for owner, buffers in self.directory.drop_devices(set(host.devices), err).items():
            ident = next((p.ident for p in self.peers.values() if p.role == "client" and p.id == owner), None)
            if ident is not None:
                failed.setdefault(ident, []).extend(buffers)
        for dst, pieces in broken_pieces.items():
            if dst in self.worker_ident:
                self.to_host(dst, m.FailPieces(pieces, err))
        for ident, buffers in failed.items():
            if ident in self.peers:
                self.send(ident, m.CallFailed(0, buffers, err))
        # clients fail their fetches from it; workers let go of what they keep
        # for it (shared-memory segments it node, their connection to it)
        for peer in list(self.peers.values()):
            if peer.role in ("client", "worker"):
                self.send(peer.ident, m.HostDown(rank, err))
        # The hosts that share its island's JAX runtime cannot finish a collective
        # without it (after a hang or a partition nothing tells them): the island
        # is lost as a whole, and they are told to stop.
        if host.runtime:
            for other in list(self.rm.hosts.values()):
                if other.alive and other.runtime == host.runtime and other.island == host.island:
                    ident = self.worker_ident.get(other.rank)
                    if ident is not None:
                        self.send(ident, m.Shutdown(f"host {rank} of island {host.island}'s runtime was lost"))
                    self._host_lost(other.rank, f"it shares island {host.island}'s JAX runtime with "
                                                f"host {rank}, which was lost")
        if self.memory_waiting:           # what waited for memory there fails now
            self._resume_waiting()
        # its shared-memory segments: nobody else would remove them before the
        # cluster stops (mappings peers still hold stay valid after the unlink)
        if host.machine and host.pid and host.machine == self.machine:
            self._out.append(RemoveSegments(rank, host.pid))
