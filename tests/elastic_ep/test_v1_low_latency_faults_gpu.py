"""Low-latency mode's faults on the native runtime, two ranks sharing one GPU on the CUDA-IPC window: the
"low-latency mode: …" rows of the README's "What happens when … (native runtime)" table.

Each parameter of ``test_low_latency_fault`` (one row) runs its cases one after the other in one pair of
ranks (about 10-20 s each on one GPU); every case starts from new buffers
(``num_gpu_timeout_secs`` = 3 s), and once the fault is seen every rank destroys its buffer (at once), runs
a CUDA op and makes a new buffer whose round is bitwise right (the context stays usable, the broken
buffer is the only loss). The faults:

* ``refused``: a rank refuses its dispatch or combine (``ValueError`` before launching anything): its peer's receive
  waits for it until the deadline and the peer's next call raises ``CommTimeoutError`` naming the call
  (receive), its rank and the refusing peer; the call after it ``CommError`` "unusable";
* ``other_arguments``: one rank passes another ``num_max_dispatch_tokens_per_rank``, ``hidden``, top-k, ``use_fp8`` or
  ``num_experts``: each receiver finds that rank's geometry words unlike its own and copies nothing (every
  output of the receive keeps the bytes the test wrote there between the send and the hook); its next call
  raises ``CommError`` naming the argument, the peer's value and its own (with ``num_experts`` too: the rank
  with more experts also waits for count words its peer never writes, and the report ends those waits);
* ``corrupted``: a peer word written by the test into the receiver's window between the sender's send phase
  and the receiver's receive hook (no kernel change): the count word of (local expert l, rank 0) set above
  M (nothing is copied), or the header of rank 0's first message for l naming a token >= M or a lane >= K
  (the row is still placed by the counts, its ``src_info`` and route become -1); the next call raises
  ``CommError`` naming rank 0 and the value;
* ``out_of_step``: rank 1 makes three dispatches more (send phases, hooks never called), so its signal in
  the half of rank 0's next dispatch is two calls ahead: rank 0 copies nothing and its next call raises
  ``CommError`` "out of step" naming both call numbers; ``clean_low_latency_buffer`` on every rank after
  such a drift puts the calls back in step;
* ``absent``: a peer that never makes the dispatch or the combine: ``CommTimeoutError`` as for a refusal; with
  ``enable_shrink=True`` the waiting rank masks the peer at the deadline instead, the call completes without
  it (bitwise against the reference with that rank masked), the mask query reports it and the next round
  does not wait.

Where the words are (csrc/kernels/ll_sizing.hpp, sizing.hpp ``WorkspaceLayout``): a message of rank s for
local expert l, slot j, lies at ``half_offset + ((l * R + s) * M + j) * msg`` in the buffer
(``get_local_buffer_tensor``; msg = 16-byte header {token, lane, 0, 0} + the BF16 row); the count words are
u64 ``(seq << 32) | tokens`` at ``ll_count + 8 * (half * MAX_EXPERTS + l * R + s)`` in the workspace,
found from the runtime's ``ll_mask_address`` (ll_count, ll_done, ll_geo, ll_seq, ll_grid, ll_mask follow
each other 128-byte aligned). Both are checked to hold what the send phase wrote before they are changed,
so a layout change fails here by name instead of corrupting another word. No named segment of ours is left
in /dev/shm (the window is CUDA IPC memory, the host workspace cudaHostAlloc'd).
"""
from __future__ import annotations

import time
from typing import Any, List, Tuple

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_workers
from tests.elastic_ep._common import no_shm_leftovers
from tests.elastic_ep.test_v1_low_latency_cpu import (Checks, Ctx, Round, check_dispatch, ep, one_round, raw_bytes,
                                                      reference_dispatch)
from tests.elastic_ep.test_v1_low_latency_faults_cpu import WORLD, assert_checks, call, caught, expect, refuse

pytestmark = pytest.mark.fault

DEADLINE_S = 3  # num_gpu_timeout_secs of the buffers
SLACK_S = 15    # a timeout is raised within DEADLINE_S + this
SEED = 900


# ------------------------------------------------------------------------------------------ set-up
def setup(rank: int, world: int, rdzv: str) -> Ctx:
    from tests.elastic_ep._common import init_ep_group

    group = init_ep_group(rank, world, rdzv, "ipc")
    device = torch.device("cuda", torch.cuda.current_device())
    return Ctx(rank, world, group, dict(backend="native", window="ipc"), device)


def new_buffer(c: Ctx, shrink: bool = False, hint: int = 0):
    return ep.Buffer(c.group, 0, hint or c.hint, low_latency_mode=True, enable_shrink=shrink, explicitly_destroy=True,
                     backend="native", window="ipc", num_gpu_timeout_secs=DEADLINE_S)


def recover(ck: Checks, c: Ctx, buf, seed: int) -> None:
    """Every rank, after a case: destroy the buffer (at once, broken or not), a CUDA op, and a new buffer
    whose round is bitwise right."""
    dist.barrier(group=c.group)  # no rank frees its window while a peer's kernel may still use it
    t0 = time.monotonic()
    buf.destroy()
    took = time.monotonic() - t0
    ck(took < DEADLINE_S + 5, f"destroy() took {took:.1f} s")
    total = torch.ones(1024, device=c.device).sum()
    torch.cuda.synchronize()
    ck(float(total.item()) == 1024.0, "a CUDA op after the fault")
    fresh = new_buffer(c)
    one_round(ck, fresh, Round(c, seed, "bf16"), "sync", "plain", label="a new buffer: ")
    fresh.destroy()


def next_call_raises(ck: Checks, buf, r: Round, typ: type, *phrases: str) -> Exception:
    """This rank's next call raises ``typ`` with ``phrases`` (before launching anything), and the call
    after it ``CommError``: the buffer is unusable."""
    def dispatch() -> None:
        buf.low_latency_dispatch(r.x, r.idx, r.c.M, r.c.E, use_fp8=False)
    err = caught(dispatch)
    expect(ck, err, typ, *phrases)
    expect(ck, caught(dispatch), ep.CommError, "this elastic buffer is unusable", "destroy it and create a new one")
    return err


def names_timeout(ck: Checks, buf, r: Round, op: str, rank: int, peer: int, t0: float) -> None:
    """The next call raises ``CommTimeoutError`` naming ``low_latency_<op>``'s receive, ``rank`` and ``peer``,
    about ``DEADLINE_S`` after ``t0``."""
    torch.cuda.synchronize()
    err = next_call_raises(ck, buf, r, ep.CommTimeoutError,
                           f"elastic_ep low_latency_{op} (receive: waiting for a peer's", f"[rank {rank}, peer {peer}]",
                           "the CUDA context is usable")
    fields = (str(getattr(err, "operation", "")), getattr(err, "rank", None), getattr(err, "peer", None))
    ck(fields[0].startswith(f"elastic_ep low_latency_{op}") and fields[1:] == (rank, peer),
       f"CommTimeoutError (operation, rank, peer) = {fields}")
    waited = time.monotonic() - t0
    ck(0.8 * DEADLINE_S <= waited < DEADLINE_S + SLACK_S,
       f"raised {waited:.1f} s after the call (deadline {DEADLINE_S} s)")


def outputs(res) -> List[torch.Tensor]:
    """What a dispatch's receive writes: recv_x (and its scales), recv_count, src_info, layout_range, route."""
    recv_x, handle = res[0], res[2]
    return [*(recv_x if isinstance(recv_x, tuple) else (recv_x,)), res[1], handle[0], handle[1], handle.route]


def poison(res) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Fills a hook-mode dispatch's outputs (before its receive) with bytes no receive writes; returns them
    with their bytes, for ``untouched``."""
    for t in outputs(res):
        (t.view(torch.uint8).fill_(0xA5) if t.element_size() == 1 else t.fill_(-7))
    return [(t, raw_bytes(t.cpu())) for t in outputs(res)]


def untouched(ck: Checks, snap: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    changed = [i for i, (t, before) in enumerate(snap) if not torch.equal(raw_bytes(t.cpu()), before)]
    ck(not changed, f"the failed receive wrote outputs {changed} (recv_x.., recv_count, src_info, layout_range, "
                    "route)")


# ------------------------------------------------------------------------------------------ the window
def message_header(buf, c: Ctx, local_expert: int, src: int, slot: int) -> torch.Tensor:
    """The int32 header {token, lane, 0, 0} of rank ``src``'s message ``slot`` for this rank's ``local_expert``
    in half 0 of a BF16 dispatch: a view of this rank's window."""
    msg = 2 * c.H + 16  # ll_msg_bytes(hidden, use_fp8=false): the header and the row, a multiple of 16
    off = buf._ll.part._half_offset(0) + ((local_expert * c.world + src) * c.M + slot) * msg
    return buf.get_local_buffer_tensor(torch.uint8)[off:off + 16].view(torch.int32)


def count_word(buf, c: Ctx, local_expert: int, src: int) -> torch.Tensor:
    """The count word ``(seq << 32) | tokens`` rank ``src`` sent this rank's ``local_expert`` in half 0, as a
    one-element int64 view of this rank's workspace (see the module docstring for the layout)."""
    from elastic_ep import _C
    from elastic_ep._native_window import _DeviceMemory

    def a(n: int) -> int:
        return -(-n // 128) * 128

    R, X = int(_C.MAX_RANKS), int(_C.MAX_EXPERTS)
    ll_mask = int(buf.runtime.runtime._rt.ll_mask_address)
    ll_count = ll_mask - a(32) - a(64) - a(64 * R) - a(16 * R) - a(16 * X)  # back over ll_grid .. ll_count
    at = ll_count + 8 * (local_expert * c.world + src)
    return torch.as_tensor(_DeviceMemory(at, 8), device=c.device).view(torch.int64)


# ------------------------------------------------------------------------------------------ 1: a refusal
def refused_case(ck: Checks, c: Ctx, op: str, seed: int):
    """A round of both ranks, then rank 1 refuses ``op`` and rank 0 makes it."""
    buf = new_buffer(c)
    r = Round(c, seed, "bf16")
    one_round(ck, buf, r, "sync", "plain", label="both ranks: ")
    ck.where = f"rank 1 refuses its {op}"
    res = buf.low_latency_dispatch(r.x, r.idx, c.M, c.E, use_fp8=False) if op == "combine" else None
    dist.barrier(group=c.group)
    t0 = time.monotonic()
    if c.rank == 1:
        refuse(ck, buf, r, op, res)
    else:
        call(buf, r, op, res)
        names_timeout(ck, buf, r, op, 0, 1, t0)
    return buf


# ------------------------------------------------------------------------------------------ 2: other arguments
# The argument rank 1 changes: (rank 0's value, rank 1's), as ll_geometry_error names them.
OTHER = {"num_max_dispatch_tokens_per_rank": (16, 32), "hidden": (512, 256), "num_topk": (4, 2), "use_fp8": (0, 1),
         "num_experts": (8, 16)}


def other_args_case(ck: Checks, c: Ctx, field: str, seed: int):
    """Both ranks dispatch with a receive hook, rank 1 with another value of ``field``."""
    assert (c.M, c.H, c.K, c.E) == tuple(OTHER[f][0] for f in ("num_max_dispatch_tokens_per_rank", "hidden",
                                                               "num_topk", "num_experts"))
    buf = new_buffer(c, hint=ep.Buffer.get_low_latency_rdma_size_hint(2 * c.M, c.H, c.world, 2 * c.E))
    r = Round(c, seed, "bf16")
    ck.where = f"rank 1 passes another {field}"
    rank = c.rank
    mine, theirs = OTHER[field][rank], OTHER[field][1 - rank]
    kw = dict(x=r.x, topk_idx=r.idx, num_max_dispatch_tokens_per_rank=c.M, num_experts=c.E, use_fp8=False)
    if field == "hidden":
        kw["x"] = r.x[:, :mine].contiguous()
    elif field == "num_topk":
        kw["topk_idx"] = r.idx[:, :mine].contiguous()
    elif field == "use_fp8":
        kw["use_fp8"] = bool(mine)
    else:
        kw[field] = mine
    dist.barrier(group=c.group)
    t0 = time.monotonic()
    res = buf.low_latency_dispatch(**kw, return_recv_hook=True)
    snap = poison(res)
    res[-1]()
    torch.cuda.synchronize()
    untouched(ck, snap)
    ck(time.monotonic() - t0 < DEADLINE_S, f"the refusal took {time.monotonic() - t0:.1f} s, not less than the "
       f"{DEADLINE_S} s deadline: a wait was left to the deadline")
    next_call_raises(ck, buf, r, ep.CommError, f"low-latency call [rank {rank}]: the ranks made a low-latency "
                     f"call with different arguments ({field}: rank {1 - rank} passed {theirs}, this rank "
                     f"{mine})", "nothing was copied from that rank", "destroy it on every rank")
    return buf


# ------------------------------------------------------------------------------------------ 3: corrupted words
def corrupt(ck: Checks, buf, c: Ctx, r: Round, kind: str) -> Tuple[int, Any]:
    """Rank 1, between rank 0's send phase and its own receive: corrupts the count word (``kind ==
    "count"``) or the first message header (``"token"``, ``"lane"``) of rank 0 for the first local expert
    rank 0 sends rows to, after checking that it holds what the send wrote. Returns (that expert, the
    message's reference row (source, token, lane))."""
    want = reference_dispatch(r.all_inp, 1, c.E, r.views)
    l = next(i for i, (rows, _) in enumerate(want) if rows and rows[0][0] == 0)
    first = want[l][0][0]
    if kind == "count":
        word = count_word(buf, c, l, 0)
        n = sum(1 for s, _, _ in want[l][0] if s == 0)
        ck(int(word.item()) == (1 << 32) | n, f"count word {int(word.item()):#x}, the send wrote (1 << 32) | {n}: the "
                                               "workspace layout this test mirrors (WorkspaceLayout ll_*) changed")
        word.fill_((1 << 32) | (c.M + 1))
    else:
        head = message_header(buf, c, l, 0, 0)
        ck(head.tolist() == [first[1], first[2], 0, 0], f"header {head.tolist()}, the send wrote {list(first[1:])}"
                                                          " + [0, 0]: the message layout this test mirrors changed")
        head[0 if kind == "token" else 1] = BAD[kind](c)
    return l, first


# The values a corrupted header names, by kind: a token past M, a lane past K.
BAD = {"token": lambda c: c.M + 5, "lane": lambda c: c.K + 3}


def check_bad_record(ck: Checks, r: Round, res, l: int, first) -> None:
    """Rank 1's receive of a message with a bad header: the rows are where the counts put them, the bad
    row's src_info and route -1, every other row as the reference."""
    want = reference_dispatch(r.all_inp, 1, r.c.E, r.views)
    src_info, route = res[2][0].cpu(), res[2].route.cpu()
    ck(res[1].cpu().tolist() == [len(rows) for rows, _ in want], f"recv_count {res[1].cpu().tolist()}")
    ck(int(src_info[l, 0]) == -1 and int(route[l, 0]) == -1,
       f"the bad row's src_info / route: {int(src_info[l, 0])} / {int(route[l, 0])}, not -1")
    for i, (rows, _) in enumerate(want):
        skip = 1 if i == l else 0
        ck(src_info[i, skip:len(rows)].tolist() == [t for _, t, _ in rows[skip:]], f"src_info[{i}]")
    ck.same(res[0][l, :1].cpu(), r.all_inp[0]["x"][first[1]:first[1] + 1], "the bad row's data, placed by the counts")


def corrupt_case(ck: Checks, c: Ctx, kind: str, seed: int):
    """Both ranks dispatch with a receive hook; rank 1 corrupts a word of rank 0's before its hook."""
    buf = new_buffer(c)
    r = Round(c, seed, "bf16")
    ck.where = f"a corrupted {kind}"
    dist.barrier(group=c.group)
    res = buf.low_latency_dispatch(r.x, r.idx, c.M, c.E, use_fp8=False, return_recv_hook=True)  # half 0, call 1
    torch.cuda.synchronize()
    dist.barrier(group=c.group)  # rank 0's send phase landed in rank 1's window
    if c.rank == 1:
        l, first = corrupt(ck, buf, c, r, kind)
        snap = poison(res) if kind == "count" else None
    res[-1]()
    torch.cuda.synchronize()
    if c.rank == 0:
        check_dispatch(ck, r, res)  # rank 1's words to rank 0 are whole
    elif kind == "count":
        untouched(ck, snap)
        next_call_raises(ck, buf, r, ep.CommError, "low-latency call [rank 1]: protocol error: rank 0 sent a "
                         f"low-latency count of {c.M + 1} tokens, outside [0, num_max_dispatch_tokens_per_rank={c.M}]",
                         "nothing was written where it points", "destroy it on every rank")
    else:
        check_bad_record(ck, r, res, l, first)
        bound = c.M if kind == "token" else c.K
        next_call_raises(ck, buf, r, ep.CommError, "low-latency call [rank 1]: protocol error: a low-latency "
                         f"message or handle row from rank 0 names a token, lane or rank out of range ({BAD[kind](c)}, "
                         f"bound {bound};", "nothing was written where it points")
    return buf


# ------------------------------------------------------------------------------------------ 4: out of step
def extra_dispatches(buf, c: Ctx, r: Round) -> None:
    """Rank 1's three dispatches rank 0 does not make (send phases; their hooks are never called): in half 0
    its signal is then at call 3 where rank 0's next dispatch expects call 2."""
    for _ in range(3):
        buf.low_latency_dispatch(r.x, r.idx, c.M, c.E, use_fp8=False, return_recv_hook=True)
    torch.cuda.synchronize()


def out_of_step_case(ck: Checks, c: Ctx, case: str, seed: int):
    """A round of both ranks, then rank 1's extra dispatches; ``"error"``: rank 0's next dispatch, ``"clean"``:
    a clean on every rank and two rounds."""
    buf = new_buffer(c)
    r = Round(c, seed, "bf16")
    one_round(ck, buf, r, "sync", "plain", label="in step: ")  # dispatch in half 0, combine in half 1
    ck.where = f"rank 1 made three dispatches more ({case})"
    if c.rank == 1:
        extra_dispatches(buf, c, r)
    dist.barrier(group=c.group)
    if case == "clean":
        buf.clean_low_latency_buffer(c.M, c.H, c.E)
        one_round(ck, buf, Round(c, seed + 1, "bf16"), "hook", "hook", label="after the clean: ")
        one_round(ck, buf, Round(c, seed + 2, "bf16"), "sync", "plain", label="after the clean: ")
    elif c.rank == 0:
        res = buf.low_latency_dispatch(r.x, r.idx, c.M, c.E, use_fp8=False, return_recv_hook=True)
        snap = poison(res)
        res[-1]()
        torch.cuda.synchronize()
        untouched(ck, snap)
        next_call_raises(ck, buf, r, ep.CommError, "low-latency call [rank 0]: protocol error: rank 1's low-latency "
                         "signal is from call 3, this rank is at call 2: the ranks' low-latency calls are out of step",
                         "nothing was written where it points")
    return buf


# ------------------------------------------------------------------------------------------ 5: an absent peer
def absent_case(ck: Checks, c: Ctx, case: str, seed: int):
    """A round of both ranks, then rank 1 skips the dispatch, the combine, or (shrink mode) the dispatch and
    combine of two rounds, which rank 0 makes."""
    shrink = case == "shrink"
    buf = new_buffer(c, shrink=shrink)
    r = Round(c, seed, "bf16")
    one_round(ck, buf, r, "sync", "plain", label="both ranks: ")
    ck.where = f"rank 1 skips a {case}"
    views = [{1}, set()]  # rank 0 masks rank 1 (shrink)
    masked = [Round(c, seed + 1 + i, "bf16", views) for i in range(2)] if shrink else []
    res = buf.low_latency_dispatch(r.x, r.idx, c.M, c.E, use_fp8=False) if case == "combine" else None
    dist.barrier(group=c.group)
    t0 = time.monotonic()
    if c.rank == 0 and not shrink:
        call(buf, r, case, res)
        names_timeout(ck, buf, r, case, 0, 1, t0)
    elif c.rank == 0:
        one_round(ck, buf, masked[0], "sync", "plain", label="rank 1 absent: ")
        waited = time.monotonic() - t0
        ck(0.8 * DEADLINE_S <= waited < DEADLINE_S + SLACK_S, f"the masking round took {waited:.1f} s")
        status = torch.full((c.world,), 7, dtype=torch.int32, device=c.device)
        buf.low_latency_query_mask_buffer(status)
        ck(status.cpu().tolist() == [0, 1], f"mask after the deadline {status.cpu().tolist()}")
        t1 = time.monotonic()
        one_round(ck, buf, masked[1], "sync", "plain", label="rank 1 masked: ")
        took = time.monotonic() - t1
        ck(took < 0.8 * DEADLINE_S, f"a round with rank 1 masked took {took:.1f} s: it waited for rank 1")
    return buf


# ------------------------------------------------------------------------------------------ the tests
# name: (case function (ck, ctx, case, seed) -> the buffer to recover from, its cases)
CASES = {"refused": (refused_case, ["dispatch", "combine"]), "other_arguments": (other_args_case, list(OTHER)),
         "corrupted": (corrupt_case, ["count", "token", "lane"]), "out_of_step": (out_of_step_case, ["error", "clean"]),
         "absent": (absent_case, ["dispatch", "combine", "shrink"])}


def pair_worker(rank: int, world: int, rdzv: str, name: str):
    """The cases of ``CASES[name]`` one after the other, each followed by ``recover``."""
    c = setup(rank, world, rdzv)
    ck = Checks(rank, name)
    fn, cases = CASES[name]
    for n, case in enumerate(cases):
        seed = SEED + 100 * list(CASES).index(name) + 10 * n
        recover(ck, c, fn(ck, c, case, seed), seed + 9)
    dist.destroy_process_group()
    return ck.count, ck.failures


@pytest.mark.multigpu(2, shared_ok=True)  # the CUDA-IPC window needs no NCCL: the ranks may share a GPU
@pytest.mark.parametrize("name", list(CASES))
def test_low_latency_fault(tmp_path, name):
    with no_shm_leftovers(f"low-latency faults: {name}"):
        assert_checks(run_workers(pair_worker, WORLD, name, tmp_path=tmp_path, timeout=150))
