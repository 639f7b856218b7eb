"""Fusion: program templates (DefineProgram) and their runs (RunProgram),
as plain calls or, once fused, as one fused computation (see templates.py)."""
from __future__ import annotations

import collections
import itertools
import logging

from zpath.controller import templates
from zpath.controller.records import ParkedNode, Peer, ProgramRun, Submission
from zpath.errors import ErrorKind
from zpath.ids import client_of
from zpath.net import messages as m


log = logging.getLogger(__name__)


class Fusion:
    """Mixin of ControllerCore: templates, fused programs on the hosts."""

    def _init_fusion(self) -> None:
        # (client, template) -> its program template; fused plans sent to each host
        self.templates: dict[tuple[int, int], templates.ProgramTemplate] = {}
        self.host_fused: dict[int, set[int]] = {}
        self.fused_live: set[int] = set()      # fused ids of templates still kept
        self._fused_ids = itertools.count(1)

    def _define_program(self, ident: bytes, parent: int, peer: Peer, msg: m.DefineProgram) -> None:
        """Keep a program as a template (if it is a valid one), and run it."""
        key = (peer.id, msg.template)
        try:
            if key in self.templates:
                raise templates.TemplateError(f"template {msg.template} is already defined")
            if sum(1 for c, _ in self.templates if c == peer.id) >= templates.MAX_TEMPLATES:
                raise templates.TemplateError(f"a client keeps at most {templates.MAX_TEMPLATES} templates")
            t = templates.ProgramTemplate(msg, peer.id)
        except templates.TemplateError as e:
            self.reply_error(ident, parent, ErrorKind.BAD_REQUEST, f"program {msg.program.name!r} not kept "
                             f"as template {msg.template}: {e}")
            self._program(ident, peer, msg.program)
            return
        self.templates[key] = t
        self._run_expanded(ident, peer, t, msg.program.program_id, msg.inputs, msg.first_buffer,
                           msg.program.calls, msg.program.release)

    def _run_program(self, ident: bytes, peer: Peer, msg: m.RunProgram) -> None:
        """One run of a template: fused if it can be, else as its plain calls."""
        t = self.templates.get((peer.id, msg.template))
        try:
            if t is None:
                raise templates.TemplateError(f"template {msg.template} is not defined")
            t.check_run(peer.id, msg.inputs, msg.first_buffer)
            taken = next((b for b in range(msg.first_buffer, msg.first_buffer + t.buffers)
                          if b in self.directory.buffers), None)
            if taken is not None:
                raise templates.TemplateError(f"new buffer {taken} exists already")
        except templates.TemplateError as e:
            err = m.ErrorInfo(ErrorKind.CALL_FAILED, f"program run rejected: {e}", None, t.name if t else "", "")
            outs = [b for b in msg.outputs if client_of(b) == peer.id and b not in self.directory.buffers]
            self.directory.poison(outs, peer.id, err)
            self.send(ident, m.CallFailed(msg.program_id, outs, err))
            # values the client may have put for it: freed wherever they went
            puts = [b for b in msg.inputs if client_of(b) == peer.id and b not in self.directory.buffers]
            if puts:
                self._free({h.rank: puts for h in self.rm.hosts.values() if h.alive})
            return
        if t.fused is not None and self._run_fused(peer, t, t.fused, msg):
            return
        calls, release = t.expand(msg.program_id, msg.inputs, msg.first_buffer)
        self._run_expanded(ident, peer, t, msg.program_id, msg.inputs, msg.first_buffer, calls, release)

    def _run_expanded(self, ident: bytes, peer: Peer, t: templates.ProgramTemplate, call_id: int,
                      inputs: list[int], first: int, calls: list[m.Call], release: list[int]) -> None:
        """Run a template's plain calls; when it may be fused, record their plans
        and fuse it from them."""
        fuse = self._may_fuse(t)
        before = t.slot_keys(self.directory.buffers, inputs) if fuse else []

        def fuse_recorded(sub: Submission) -> None:
            self._fuse_recorded(peer, t, sub, before, inputs, first)
        # fused once planned in full without waiting for memory
        self._submit(ident, peer, calls, "parallel", release, record=fuse,
                     then=fuse_recorded if fuse else None)

    def _fuse_recorded(self, peer: Peer, t: templates.ProgramTemplate, sub: Submission,
                       before: list, inputs: list[int], first: int) -> None:
        """Fuse a template from the plans of a run of its plain calls."""
        assert sub.record is not None
        t.fuse_tries += 1
        island_of = {h: self.rm.hosts[h].island for h in set().union(*(p.executes for p in sub.record))}
        devices = self.rm.devices
        executes = {id(ex): ex for p in sub.record for ex in p.executes.values()}    # (one for many hosts)
        host_of = {d: devices[d].host for devs in {tuple(ex.devices) for ex in executes.values()} for d in devs}
        t.fused = t.fuse(next(self._fused_ids), self.rm.version, sub.record, island_of, host_of, before,
                         self.directory.buffers, inputs, first)
        if t.fused is not None:
            self.fused_live.add(t.fused.id)
            log.info("client %d: program %s fused (%d nodes on %d hosts)", peer.id, t.name,
                     len(sub.calls), len(t.fused.hosts))

    def _may_fuse(self, t: templates.ProgramTemplate) -> bool:
        """Not while work waits for memory (it keeps its place in line)."""
        if self.memory_waiting:
            return False
        if t.fused is not None and t.fused.version == self.rm.version:
            return False                  # fused, but this run could not use it
        if t.fused is not None:           # the mapping changed: fuse again
            self._drop_fused({t.fused.id})
            t.fused, t.fuse_tries = None, 0
        return t.fuse_tries < templates.FUSE_TRIES

    def _release_transient(self, transient: dict[int, int] | None, resume: bool = True) -> None:
        """What a fused run held only while it ran is free again (``resume``:
        let work that waits for memory go on now)."""
        if transient:
            self.directory.device_bytes.subtract(transient)
            if resume and self.memory_waiting:
                self._resume_waiting()

    def _drop_templates(self, peer: Peer, numbers: list[int]) -> None:
        """The client will not run these templates again: forget them."""
        fused = set()
        for n in numbers:
            t = self.templates.pop((peer.id, n), None)
            if t is not None and t.fused is not None:
                fused.add(t.fused.id)
        self._drop_fused(fused)

    def _drop_fused(self, fused: set[int]) -> None:
        """Hosts that keep these fused programs forget them."""
        self.fused_live -= fused
        for rank, ids in self.host_fused.items():
            drop = ids & fused
            if drop:
                ids -= drop
                if rank in self.worker_ident and self.rm.hosts[rank].alive:
                    self.to_host(rank, m.DropFused(sorted(drop)))

    def _run_fused(self, peer: Peer, t: templates.ProgramTemplate, f: templates.Fused,
                   msg: m.RunProgram) -> bool:
        """Send a run as one fused computation; False (nothing done) if this run
        cannot be: the mapping changed, a host was lost, an input is not where
        the fused plan reads it, a result exists already, or, under a memory
        limit, work waits for memory or the run would not fit (its results, values
        put and intermediates; as plain calls it waits its turn)."""
        if f.version != self.rm.version or self.memory_waiting:
            return False
        if not all(self.rm.hosts[h].alive for h in f.hosts):
            return False
        if t.slot_keys(self.directory.buffers, msg.inputs) != f.slot_keys:
            return False
        if (self.unsent_copies or self.copies_dropped) and any(
                b in self.unsent_copies or b in self.copies_dropped for b in msg.inputs):
            return False          # it may read a copy not made yet: plain calls move it (_send)
        made = templates.fused_buffers(f, peer.id, msg.inputs, msg.first_buffer)
        ids = [buf.id for buf, _ in made]
        if len(set(ids)) != len(ids) or any(msg.first_buffer <= b < msg.first_buffer + t.buffers
                                            for b in ids[:len(f.puts)]):
            return False          # planned as plain calls, which refuse them
        if self.memory_limit:
            need = collections.Counter(f.transient)
            for _, footprint in made:
                need.update(footprint)
            if any(self.directory.device_bytes[d] + n > self.memory_limit for d, n in need.items()):
                return False
        for buf, footprint in made:
            self.directory.buffers[buf.id] = buf
            self.directory.device_bytes.update(footprint)
        self.directory.device_bytes.update(f.transient)     # until it has run
        self.calls += f.nodes
        call = templates.fused_call(f, msg.program_id, msg.inputs, msg.first_buffer)
        exec_id = self.directory.new_exec_id()
        plan = templates.run_plan(f, exec_id, msg.inputs, msg.first_buffer)
        # the values put are released once it is sent (workers free them after it ran)
        run = ProgramRun(peer, [msg.inputs[s] for s, *_ in f.puts], 1)
        self._start(ParkedNode(run, call, (plan, f"{t.name} ({f.nodes} nodes, fused)"),
                              self._parked_producers(call), exec_id, f.island))
        self._maybe_release(run)
        return True

    def validate_fusion(self) -> None:
        """Fused programs kept on hosts belong to templates still kept."""
        for (client, _), t in self.templates.items():
            assert t.fused is None or t.fused.id in self.fused_live, "a template's fused program is not live"
        for rank, ids in self.host_fused.items():
            assert ids <= self.fused_live, f"host {rank} keeps fused programs {ids - self.fused_live} dropped"
