"""Kept call forms: a client keeps an op-by-op call's form at the controller
(``Call.keep``) and sends its repeats as ``CallAgain`` (the form's number and
the call's buffer ids). The controller makes the whole ``Call`` as the message
comes; the client numbers its forms (``Client.post_call``)."""
from __future__ import annotations

import dataclasses
import gc
import threading
from typing import Any

import pytest

from zpath.client.connection import Client
from zpath.controller.core import Send
from zpath.errors import ErrorKind
from zpath.net import messages as m
from tests.test_controller_tenancy import make_rig  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(60)


def _kept(call: m.Call, keep: int) -> m.Call:
    return dataclasses.replace(call, keep=keep)


def _again(call: m.Call, form: int) -> m.CallAgain:
    return m.CallAgain(call.call_id, form, [i.buffer for i in call.inputs], [o.buffer for o in call.outputs])


def _executes(rig) -> list[tuple]:
    return [(x.program, [i.buffer for i in x.inputs], [o.buffer for o in x.outputs], list(x.devices))
            for x in rig.executes()]


def _errors(rig, ident: bytes) -> list[m.CallFailed]:
    return [x for i, x in rig.log if i == ident and isinstance(x, m.CallFailed)]


def test_a_call_again_runs_as_the_whole_call_would(make_rig):
    """A chain sent as whole Calls and the same chain sent as its first two
    calls with their forms kept and CallAgains after: the same Executes, the
    same buffers in the directory, nothing failed, all freed at the end."""
    rigs = [make_rig(), make_rig()]
    for k, rig in enumerate(rigs):
        a, _ = rig.client("a")
        first, prev = rig.call(a, 0)                    # a value put: its own form
        rig.handle(a, _kept(first, 1) if k else first)
        for n in range(6):
            call, out = rig.call(a, 0, prev)
            if not k:
                rig.handle(a, call)
            elif n == 0:
                rig.handle(a, _kept(call, 2))
            else:
                rig.handle(a, _again(call, 2))
            rig.handle(a, m.Release([prev]))
            prev = out
            if n % 2:
                rig.drain()
        assert not _errors(rig, a)
        assert prev in rig.c.directory.buffers
        rig.drain()
        rig.handle(a, m.Release([prev]))
        assert rig.idle() and not rig.c.directory.buffers
    assert _executes(rigs[0]) == _executes(rigs[1]) and len(_executes(rigs[0])) == 7


def test_a_call_again_of_a_form_not_kept_or_of_other_counts_fails_its_outputs(make_rig):
    rig = make_rig()
    a, _ = rig.client("a")
    call, out = rig.call(a, 0)
    rig.handle(a, _again(call, 5))
    rig.handle(a, _kept(rig.call(a, 0)[0], 5))          # kept (and run) from here on
    bad = m.CallAgain(next(rig.ids), 5, [], [rig.new_id(a)])
    rig.handle(a, bad)
    failed = _errors(rig, a)
    assert [f.buffers for f in failed] == [[out], bad.outputs]
    assert failed[0].error.kind == failed[1].error.kind == ErrorKind.BAD_REQUEST
    assert "call form 5 was not kept by this client" in failed[0].error.message
    assert "has 1 inputs and 1 outputs, not 0 and 1" in failed[1].error.message
    # the outputs failed (poisoned): a call reading one fails with the same cause
    assert out in rig.failed(a)
    again, out2 = rig.call(a, 0, bad.outputs[0])
    rig.handle(a, again)
    assert out2 in rig.failed(a) and "call form 5" in _errors(rig, a)[-1].error.message
    assert len(rig.executes()) == 1


@pytest.mark.parametrize("keep", [-1, m.MAX_CALL_FORMS + 1, 1 << 40])
def test_a_call_keeping_its_form_under_a_number_out_of_range_fails(make_rig, keep):
    rig = make_rig()
    a, _ = rig.client("a")
    call, out = rig.call(a, 0)
    rig.handle(a, _kept(call, keep))
    (failed,) = _errors(rig, a)
    assert failed.buffers == [out] and failed.error.kind == ErrorKind.BAD_REQUEST
    assert f"Call.keep must be 0 to {m.MAX_CALL_FORMS}, not {keep}" in failed.error.message
    assert not rig.executes() and not rig.c.peers[a].forms


def test_a_client_s_forms_are_its_own_and_go_with_it(make_rig):
    rig = make_rig()
    a, _ = rig.client("a")
    b, _ = rig.client("b")
    call, _ = rig.call(a, 0)
    rig.handle(a, _kept(call, m.MAX_CALL_FORMS))
    theirs, out = rig.call(b, 0)
    rig.handle(b, _again(theirs, m.MAX_CALL_FORMS))    # b's own ids, a's form number
    assert [f.buffers for f in _errors(rig, b)] == [[out]]
    assert "was not kept by this client" in _errors(rig, b)[0].error.message
    assert len(rig.executes()) == 1 and not _errors(rig, a)
    peer = rig.c.peers[a]
    rig.handle(a, m.Goodbye("done"))
    assert a not in rig.c.peers and peer.forms        # (the peer, and its forms, are dropped)


def test_a_call_again_takes_the_form_kept_when_it_came_even_behind_a_paused_program(make_rig):
    """Messages of a client whose long program is still being planned wait
    (deferred); a CallAgain among them is made whole as it comes, from the
    form the client had kept then, and a form kept again replaces it for the
    ones after."""
    rig = make_rig()
    a, _ = rig.client("a")
    rig.c.tenants._cost[(rig.programs["f"][0], (0,))] = 1e-6
    rig.c.tenants._cost[(rig.programs["g"][0], (0,))] = 1e-6
    calls, prev = [], None
    for _ in range(40):
        call, prev = rig.call(a, 0, prev)
        calls.append(call)
    out = rig.c.handle(rig.now, a, 1, m.Program(1, "chain", "parallel", calls, []), [])
    rig.log += [(e.ident, e.msg) for e in out if isinstance(e, Send)]
    assert rig.c.busy                                   # paused at a flush point
    f1, o1 = rig.call(a, 0, prev)
    f2, o2 = rig.call(a, 0, o1)
    g1, o3 = rig.call(a, 0, o2, program="g")
    g2, o4 = rig.call(a, 0, o3, program="g")
    for msg in (_kept(f1, 1), _again(f2, 1), _kept(g1, 1), _again(g2, 1)):
        assert not [e for e in rig.c.handle(rig.now, a, next(rig.ids), msg, []) if isinstance(e, Send)]
    assert len(rig.c.deferred_msgs[a]) == 4
    while rig.c.busy:
        rig.record(rig.c.resume(rig.now))
    rig.drain()
    progs = [x.program for x in rig.executes() if x.outputs[0].buffer in (o1, o2, o3, o4)]
    assert progs == [rig.programs["f"][0]] * 2 + [rig.programs["g"][0]] * 2
    assert not _errors(rig, a)


class _Traced:
    """A stand-in for a traced function (weakly referenced by the connection)."""


class _Posting:
    """What ``Client.post_call`` needs of a connection: it posts into a list."""

    def __init__(self) -> None:
        import collections

        self._forms: Any = collections.OrderedDict()
        self._forms_lock = threading.Lock()
        self.posted: list = []

    def post(self, msg: Any) -> None:
        self.posted.append(msg)

    def call(self, traced: Any, puts: tuple = (False,), keep_seen: list | None = None) -> Any:
        def whole(keep: int) -> m.Call:
            if keep_seen is not None:
                keep_seen.append(keep)
            return m.Call(7, "d", [1], ["i"], [0], [], [], keep)
        return Client.post_call(self, traced, puts, 7, [1], [2], whole)


def test_the_client_sends_a_repeat_as_a_call_again_of_the_form_it_kept():
    c = _Posting()
    f, g = _Traced(), _Traced()
    first = c.call(f)
    assert type(first) is m.Call and first.keep == 1
    again = c.call(f)
    assert again == m.CallAgain(7, 1, [1], [2]) and c.posted == [first, again]
    assert c.call(f, (True,)).keep == 2            # values put where futures were: another form
    assert c.call(g).keep == 3
    assert c.call(f, (True,)) == m.CallAgain(7, 2, [1], [2])


def test_the_client_keeps_at_most_max_call_forms_and_reuses_the_least_recently_used_number():
    c = _Posting()
    fns = [_Traced() for _ in range(m.MAX_CALL_FORMS + 1)]
    for fn in fns[:-1]:
        c.call(fn)
    assert type(c.call(fns[0])) is m.CallAgain          # used again: now the most recent
    last = c.call(fns[-1])
    assert type(last) is m.Call and last.keep == 2      # fns[1]'s number, the least recently used
    assert len(c._forms) == m.MAX_CALL_FORMS
    again = c.call(fns[1])                              # forgotten: whole again, under fns[2]'s number
    assert type(again) is m.Call and again.keep == 3
    assert c.call(fns[-1]) == m.CallAgain(7, 2, [1], [2])


def test_a_form_of_a_traced_function_that_is_gone_is_not_used_for_another():
    c = _Posting()
    f = _Traced()
    c.call(f)
    key = next(iter(c._forms))
    del f
    gc.collect()
    g = _Traced()
    c._forms[(id(g), key[1])] = c._forms.pop(key)       # as if g had f's id
    made = c.call(g)
    assert type(made) is m.Call and made.keep == 1


def test_a_form_of_more_than_max_form_buffers_is_neither_kept_nor_asked_for(make_rig):
    rig = make_rig()
    a, _ = rig.client("a")
    call, out = rig.call(a, 0)
    many = [m.CallOutput(rig.new_id(a), o.aval, o.spec) for o in call.outputs * m.MAX_FORM_BUFFERS]
    rig.handle(a, dataclasses.replace(call, outputs=many, keep=1))
    (failed,) = _errors(rig, a)
    assert failed.error.kind == ErrorKind.BAD_REQUEST and "cannot keep its form (at most 256)" in failed.error.message
    assert not rig.c.peers[a].forms and not rig.executes()
    c = _Posting()
    f = _Traced()
    seen: list = []
    for _ in range(2):        # the client sends such a call whole, keeping nothing
        made = Client.post_call(c, f, (False,), 7, [1], list(range(m.MAX_FORM_BUFFERS)),
                                lambda keep: seen.append(keep) or m.Call(7, "d", [1], ["i"], [0], [], [], keep))
        assert type(made) is m.Call and made.keep == 0
    assert seen == [0, 0] and not c._forms
