"""PP transfers and AGRS gathers whose ranks disagree on the tensors: refused by name, the buffer usable.

One rank passes another dtype, element count, shape or (AGRS) number of tensors than its peers:

* PP: the receiver copies nothing (its ``t`` stays bitwise as it was) and raises ``ValueError`` naming
  ``pp_recv``, the field and both ranks' values; the sender raises at its next ``pp_set_config``,
  naming ``pp_send``, the field and both values, and every other rank learns of it there
  (``pp_set_config failed on rank ...``); ``pp_set_config`` called again works, and the next transfer
  equals, bitwise, the same tensor moved by ``torch.distributed`` send / recv.
* AGRS: every rank raises ``ValueError`` naming ``all_gather``, the field, the lowest differing peer
  and both values; the session's earlier result is intact, and a gather in a new session equals,
  bitwise, ``torch.distributed``'s all-gather of the same bytes.

Torch runtime over gloo at 2 and 3 ranks (the receiver and every gathering rank raise at once); the
same workers run on the native runtime in test_pp_agrs_mismatch_gpu.py, where the reports come from
the kernels and raise at each rank's next call. Also here: the text both runtimes share
(``_peer_calls``), its constants against csrc's, and ranks configured differently.
"""
import pathlib
import re

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_workers
from tests.elastic_ep._common import import_elastic_ep, ops_buffer

MiB2 = 2 << 20
MAX_BYTES, INFLIGHT = 4096, 2
SESSION_BYTES, MAX_GATHERS = 64 << 10, 6

# field: (the peers' tensor, the odd rank's, the field's name in the message, the two values as shown)
PP_CASES = {
    "dtype": (((4, 8), torch.float32), ((4, 8), torch.int32), "dtype", "torch.float32", "torch.int32"),
    "numel": (((4, 8), torch.float32), ((4, 6), torch.float32), "numel", "32", "24"),
    "shape": (((4, 8), torch.float32), ((8, 4), torch.float32), "shape", "(4, 8)", "(8, 4)"),
    "empty": (((4, 8), torch.float32), ((0, 8), torch.float32), "numel", "32", "0"),
}
# field: (the peers' tensors, the odd rank's, the field's words in the message, the two values as shown)
AGRS_CASES = {
    "dtype": ([((3, 5), torch.bfloat16)], [((3, 5), torch.float16)], "tensor 0's dtype", "torch.bfloat16",
              "torch.float16"),
    "numel": ([((3, 5), torch.bfloat16)], [((3, 7), torch.bfloat16)], "tensor 0's numel", "15", "21"),
    "shape": ([((3, 5), torch.bfloat16)], [((5, 3), torch.bfloat16)], "tensor 0's shape", "(3, 5)", "(5, 3)"),
    "count": ([((3, 5), torch.bfloat16)], [((3, 5), torch.bfloat16), ((2,), torch.int64)],
              "the number of tensors", "1", "2"),
    "second": ([((3, 5), torch.bfloat16), ((2, 2), torch.int32)], [((3, 5), torch.bfloat16), ((2, 2), torch.float32)],
               "tensor 1's dtype", "torch.int32", "torch.float32"),
}


def _tensor(shape, dtype, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel() * dtype.itemsize
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).view(shape).to(device)


def _host(t: torch.Tensor) -> torch.Tensor:
    """What the test's group moves: host tensors over gloo, device tensors over NCCL."""
    return t.cpu() if dist.get_backend() == "gloo" else t


def _expect(fn, *needles) -> str:
    """fn() must raise ValueError containing every needle; returns the message."""
    with pytest.raises(ValueError) as info:
        fn()
    msg = str(info.value)
    for n in needles:
        assert n in msg, f"expected {n!r} in {msg!r}"
    return msg


def _sync(buf) -> None:
    if buf.device.type == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------- PP
def pp_worker(rank, world, rdzv, backend, odd_side, fields=tuple(PP_CASES)):
    """For each field: sender i % world sends receiver (i + 1) % world a tensor, the `odd_side`'s unlike
    the other's. The receiver raises (torch at once; native: the refusal comes from its kernel and
    raises at its next call, pp_set_config here), nothing copied; pp_set_config raises on every rank
    (the sender: its own error), then works; a good transfer is bitwise the torch send / recv's."""
    native = backend == "native"
    _, buf = ops_buffer(rank, world, rdzv, backend, num_bytes=MiB2, explicitly_destroy=True,
                        num_cpu_timeout_secs=30, num_gpu_timeout_secs=30)
    buf.pp_set_config(MAX_BYTES, INFLIGHT)
    checked = 0
    for i, field in enumerate(fields):
        normal, odd, name, normal_text, odd_text = PP_CASES[field]
        src, dst = i % world, (i + 1) % world
        send_spec = odd if odd_side == "sender" else normal
        recv_spec = odd if odd_side == "receiver" else normal
        sent_text, recv_text = (odd_text, normal_text) if odd_side == "sender" else (normal_text, odd_text)
        if rank == src:
            buf.pp_send(_tensor(*send_spec, 100 + i, buf.device), dst)
        if rank == dst:
            y = _tensor(*recv_spec, 200 + i, buf.device)
            before = y.clone()
            said = f"{name}: rank {src} passed {sent_text}, rank {dst} (this one) {recv_text}"
            k = f"its pp_send #{2 * (i // world)} to this rank"  # each case moves two tensors of its pair
            if native:
                buf.pp_recv(y, src)  # the kernel refuses it; the next call raises
                _sync(buf)
            else:
                _expect(lambda: buf.pp_recv(y, src), f"pp_recv [rank {dst}]", said, k, "Nothing was copied")
            assert torch.equal(y.view(torch.uint8), before.view(torch.uint8)), "a refused receive wrote into t"
        _sync(buf)
        dist.barrier()
        # Every rank meets in pp_set_config: the sender hears of the refusal there, the native receiver
        # raises its own, and every rank refuses the call.
        if rank == src:
            needles = [f"pp_send [rank {src}]", f"rank {dst} refused", f"pp_send #{2 * (i // world)}",
                       f"{name}: rank {src} (this one) passed {sent_text}, rank {dst} {recv_text}"]
        elif rank == dst and native:
            needles = [f"pp_recv [rank {dst}]", f"{name}: rank {src} passed {sent_text}, rank {dst} (this one) "
                                                f"{recv_text}"]
        else:
            needles = ["pp_set_config failed on rank", f"rank {dst} refused"]
        _expect(lambda: buf.pp_set_config(MAX_BYTES, INFLIGHT), *needles)
        buf.pp_set_config(MAX_BYTES, INFLIGHT)
        # the next transfer of the pair: bitwise torch's send / recv of the same tensor
        if rank == src:
            x = _tensor(*normal, 300 + i, buf.device)
            buf.pp_send(x, dst)
            dist.send(_host(x), dst)
        if rank == dst:
            y = torch.empty(normal[0], dtype=normal[1], device=buf.device)
            buf.pp_recv(y, src)
            ref = _host(torch.empty_like(y))
            dist.recv(ref, src)
            _sync(buf)
            assert torch.equal(y.view(torch.uint8).cpu(), ref.view(torch.uint8).cpu()), f"{field}: the next transfer"
        checked += 1
    _sync(buf)
    buf.barrier(with_cpu_sync=True)
    buf.destroy()
    return checked


@pytest.mark.parametrize("odd_side", ["sender", "receiver"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.fault
def test_pp_refuses_a_peer_with_another_tensor(tmp_path, world, odd_side):
    assert run_workers(pp_worker, world, "torch", odd_side, tmp_path=tmp_path, timeout=180) == [len(PP_CASES)] * world


# ------------------------------------------------------------------------------------------- AGRS
def _gather_ref(x: torch.Tensor, world: int) -> torch.Tensor:
    """``[R, nbytes]`` uint8: every rank's bytes of ``x`` by torch's all-gather over the test's group."""
    src = _host(x.reshape(-1).view(torch.uint8).contiguous())
    out = torch.empty(world * src.numel(), dtype=torch.uint8, device=src.device)
    dist.all_gather_into_tensor(out, src)
    return out.view(world, -1).cpu()


def agrs_worker(rank, world, rdzv, backend, fields=tuple(AGRS_CASES)):
    """For each field: in a session, a good gather, then one where the last rank's tensors differ. Every
    rank raises (torch: that all_gather, nothing posted; native: its next call, destroy_agrs_session
    here, which still ends the session), the first gather's result intact; a new session's gather is
    bitwise torch's all-gather."""
    native = backend == "native"
    _, buf = ops_buffer(rank, world, rdzv, backend, num_bytes=MiB2, explicitly_destroy=True,
                        num_cpu_timeout_secs=30, num_gpu_timeout_secs=30)
    buf.agrs_set_config(SESSION_BYTES, MAX_GATHERS)
    odd_rank = world - 1
    checked = 0
    for i, field in enumerate(fields):
        normal, odd, what, normal_text, odd_text = AGRS_CASES[field]
        mine = odd if rank == odd_rank else normal
        peer = 0 if rank == odd_rank else odd_rank  # the lowest rank whose tensors differ from this one's
        a, b = (normal_text, odd_text) if rank == odd_rank else (odd_text, normal_text)
        said = f"{what}: rank {peer} passed {a}, rank {rank} (this one) {b}"
        first = _tensor((64,), torch.int32, 1000 * i + rank, buf.device)
        buf.create_agrs_session()
        g0, w0 = buf.all_gather(first)
        w0()
        ref0 = _gather_ref(first, world)
        xs = [_tensor(s, dt, 1000 * i + 10 * rank + j, buf.device) for j, (s, dt) in enumerate(mine)]
        if native:
            *_, w1 = buf.all_gather(xs)  # the kernels refuse it; every rank's next call raises
            w1()
        else:
            _expect(lambda: buf.all_gather(xs), f"all_gather [rank {rank}]", said, "Every rank refused")
        _sync(buf)
        assert torch.equal(g0.view(torch.uint8).reshape(world, -1).cpu(), ref0), f"{field}: the earlier result"
        dist.barrier()
        if native:
            _expect(buf.destroy_agrs_session, f"all_gather [rank {rank}]", said)
        else:
            # the refused gather took nothing: the session goes on
            xs = [_tensor(s, dt, 5000 + j, buf.device) for j, (s, dt) in enumerate(normal)]
            *got, w = buf.all_gather(xs)
            w()
            for gt, x in zip(got, xs):
                assert torch.equal(gt.reshape(world, -1).view(torch.uint8).cpu(), _gather_ref(x, world))
            buf.destroy_agrs_session()
        with buf.agrs_new_session():
            xs = [_tensor(s, dt, 2000 * i + 10 * rank + j, buf.device) for j, (s, dt) in enumerate(normal)]
            *got, w = buf.all_gather(xs)
            w()
            for gt, x in zip(got, xs):
                assert torch.equal(gt.reshape(world, -1).view(torch.uint8).cpu(), _gather_ref(x, world)), field
        checked += 1
    _sync(buf)
    buf.barrier(with_cpu_sync=True)
    buf.destroy()
    return checked


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.fault
def test_agrs_refuses_ranks_with_other_tensors(tmp_path, world):
    assert run_workers(agrs_worker, world, "torch", tmp_path=tmp_path, timeout=180) == [len(AGRS_CASES)] * world


# ------------------------------------------------------------------------------------ configuration
def _config_worker(rank, world, rdzv):
    _, buf = ops_buffer(rank, world, rdzv, "torch", num_bytes=MiB2)
    _expect(lambda: buf.pp_set_config(4096 if rank else 8192, 2), "num_max_tensor_bytes must be the same",
            "rank 0: 8192", "rank 1: 4096")
    _expect(lambda: buf.agrs_set_config(1024, 2 + rank), "num_max_all_gathers_per_session must be the same")
    buf.pp_set_config(4096, 2)
    buf.agrs_set_config(1024, 2)
    buf.destroy()
    return "ok"


@pytest.mark.fault
def test_pp_and_agrs_configurations_must_agree(tmp_path):
    assert run_workers(_config_worker, 2, tmp_path=tmp_path, timeout=120) == ["ok", "ok"]


# ----------------------------------------------------------------------------- the shared text
def test_native_reports_read_as_the_torch_runtimes_errors():
    """A kernel's report (what, peer word, values) becomes the torch runtime's message, word for word."""
    ep = import_elastic_ep()
    from elastic_ep import _peer_calls as pc

    d32, dbf = pc.pp_descriptor(torch.zeros(4, 8)), pc.pp_descriptor(torch.zeros(4, 8, dtype=torch.bfloat16))
    f = pc.pp_difference(d32, dbf)
    want = pc.pp_recv_error(1, 0, 5, f, d32[f], dbf[f])
    got = pc.native_report_error(1, (6 << 8) | 0, pc.REPORT_PP_FIELD + f, d32[f], dbf[f])
    assert type(got) is ValueError and str(got) == str(want) and "torch.float32" in str(got)
    ra, rb = pc.agrs_record([torch.zeros(3, 5)], 64), pc.agrs_record([torch.zeros(5, 3)], 64)
    w = pc.agrs_difference(ra, rb)
    got = pc.native_report_error(0, 2, pc.REPORT_AGRS_WORD + w, ra[w], rb[w])
    assert w == 4 and str(got) == str(pc.agrs_gather_error(0, 2, w, ra[w], rb[w])) and "(3, 5)" in str(got)
    # the C++ report's values are int64: a word with the top bit set arrives negative
    big = pc.shape_word((1, 2, 3, 4, 5))
    assert str(pc.native_report_error(0, 2, pc.REPORT_AGRS_WORD + 4, big - (1 << 64), rb[4])) == \
        str(pc.agrs_gather_error(0, 2, 4, big, rb[4]))
    assert isinstance(pc.native_report_error(0, 1, pc.REPORT_PP_TAG, 3, 4), ep.CommError)
    # shapes: packed when small, else a digest naming the dims; dtypes by name, others by code
    for shape in [(), (0,), (7,), (1, 2, 3, 4), (32767, 1)]:
        assert pc.shape_text(pc.shape_word(shape)) == str(tuple(shape))
    assert "5 dims" in pc.shape_text(pc.shape_word((1, 2, 3, 4, 5))) and pc.shape_word((1 << 15,)) >> 60 == 0xF
    assert pc.shape_word((2, 3, 4, 5, 6)) != pc.shape_word((2, 3, 4, 5, 7))
    assert pc.dtype_text(pc.dtype_code(torch.float8_e4m3fn)) == "torch.float8_e4m3fn"
    assert len({pc.dtype_code(t) for t in (torch.float32, torch.int32, torch.bool, torch.uint8)}) == 4
    wide = pc.agrs_record([torch.zeros(2)] * 5, 0), pc.agrs_record([torch.zeros(2)] * 4 + [torch.zeros(3)], 0)
    assert pc.agrs_difference(*wide) == 11 and "tensors 4 and after" in str(pc.agrs_gather_error(0, 1, 11, 1, 2))


def test_report_codes_and_record_size_match_the_kernels():
    from elastic_ep import _peer_calls as pc

    csrc = pathlib.Path(__file__).resolve().parents[2] / "packages" / "elastic_ep" / "csrc" / "kernels"
    launch, sizing = (csrc / "launch.hpp").read_text(), (csrc / "sizing.hpp").read_text()
    codes = dict(re.findall(r"(kReport\w+) = (\d+)", launch))
    assert {k: int(v) for k, v in codes.items()} == {"kReportPpField": pc.REPORT_PP_FIELD,
                                                     "kReportPpTag": pc.REPORT_PP_TAG,
                                                     "kReportAgrsTag": pc.REPORT_AGRS_TAG,
                                                     "kReportAgrsWord": pc.REPORT_AGRS_WORD}
    assert int(re.search(r"kAgrsRecordWords = (\d+);", sizing).group(1)) == pc.AGRS_RECORD_WORDS
    fields = re.search(r"enum PpField : int \{([^}]*)\}", launch).group(1)
    assert [n.split("=")[0].strip()[len("kPpField"):].lower() for n in fields.split(",")] == list(pc.PP_FIELDS)
    # the protocol codes of the dispatch and low-latency kernels stay below PP's and AGRS's
    assert max(int(v) for v in re.findall(r"kProtocol\w+ = (\d+)", sizing)) < pc.REPORT_FIRST
