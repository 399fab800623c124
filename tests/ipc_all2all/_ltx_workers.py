"""GPU workers of the LTX drop-in tests (test_ltx_api_gpu.py): the code is written as LTX's model code
calls LTX's ``All2All`` (the constructor with a group, ``copy_out=``, ``runtime``, the methods under
``torch.compile``), and every result is compared bitwise with the plain torch path (permute ->
all_to_all_single -> permute, all_gather) of tests/ipc_all2all/_references.py.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tests.ipc_all2all._references import (
    _assert_same,
    _count_sets,
    _rand,
    _setup,
    _stable_seed,
    ref_allgather,
    ref_gather_heads,
    ref_send_recv_heads,
)


def _in_buffer(a2a, t) -> bool:
    lo = a2a._core.buffer_ptr
    return lo <= t.data_ptr() < lo + a2a._core.buffer_bytes


def worker_ltx_api(rank, world, rdzv):
    """LTX's constructor with a group (collective, ready at once), the three methods with ``copy_out``
    both ways (views in the buffer, copies outside it), the ``copy_output`` spelling and ``runtime``,
    even and uneven counts (a rank with no tokens), bf16 and e4m3."""
    import ipc_all2all

    dev = _setup(rank, world, rdzv)
    H, D = 8 * world, 128
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    seqlen = 2 * (13 + 29 * world) * 2  # batch 2 of the largest count, for every op's output
    checked = 0
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        # LTX's model code: All2All(rank, world_size, seqlen, hidden_dim, num_sms, dtype, group=...)
        a2a = ipc_all2all.All2All(rank, world, seqlen, H * D, sms, dtype, group=dist.group.WORLD, timeout_seconds=30)
        assert a2a.collective and a2a.device == dev
        assert a2a.buffer_size == seqlen * H * D * torch.empty((), dtype=dtype).element_size()
        for b in (1, 2):
            for name, counts in _count_sets(world).items():
                a2a.runtime.set_rank_tokens(counts)
                for copy_out in (False, True):
                    seed = _stable_seed("ltx", str(dtype), b, name, copy_out)
                    what = f"{dtype} b={b} {name} copy_out={copy_out} seed={seed}+rank {rank}"
                    x = _rand((b, counts[rank], H, D), dtype, dev, seed + rank)
                    y = a2a.send_recv_heads(x, copy_out=copy_out)
                    assert _in_buffer(a2a, y) == (not copy_out) or y.numel() == 0, what
                    _assert_same(y, ref_send_recv_heads(x, counts, world, rank), "send_recv_heads " + what)
                    z = a2a.gather_heads(y, copy_out=copy_out)
                    _assert_same(z, x, "round trip " + what)
                    y2 = _rand((b, sum(counts), H // world, D), dtype, dev, seed + 1000 + rank)
                    g = a2a.gather_heads(y2, copy_out=copy_out)
                    assert _in_buffer(a2a, g) == (not copy_out) or g.numel() == 0, what
                    _assert_same(g, ref_gather_heads(y2, counts, world, rank), "gather_heads " + what)
                    xa = _rand((b, counts[rank], 4, D), dtype, dev, seed + 2000 + rank)
                    ag = a2a.allgather(xa, copy_out=copy_out)
                    assert _in_buffer(a2a, ag) == (not copy_out), what
                    _assert_same(ag, ref_allgather(xa, counts, world, rank), "allgather " + what)
                    checked += 1
                # the older spelling and LTX's native runtime (copy_out positional) give the same bytes
                x = _rand((b, counts[rank], H, D), dtype, dev, 77 + rank)
                want = ref_send_recv_heads(x, counts, world, rank)
                _assert_same(a2a.send_recv_heads(x, copy_output=True), want, "copy_output=True " + name)
                _assert_same(a2a.runtime.send_recv_heads(x, True), want, "runtime.send_recv_heads " + name)
        a2a.synchronize()
        a2a.destroy()  # collective, as from_group's
    return checked


def worker_ltx_compile(rank, world, rdzv):
    """The methods under ``torch.compile(fullgraph=True)``, uneven counts with a rank of no tokens: the
    compiled graph holds the package's custom ops (one per call), the communication is bitwise the
    torch path's, and an LTX-style attention block compiled equals its eager run."""
    import torch.nn.functional as F

    import ipc_all2all

    dev = _setup(rank, world, rdzv)
    H, D = 4 * world, 64
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    sets = _count_sets(world)
    seqlen = 2 * sum(sets["uneven"]) + 2 * sum(sets["even"])
    # A long deadline: ranks compile at different speeds before their first collective call.
    a2a = ipc_all2all.All2All(rank, world, seqlen, H * D, sms, torch.bfloat16, group=dist.group.WORLD,
                              timeout_seconds=300)
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm.code)
        return torch._dynamo.backends.registry.lookup_backend("inductor")(gm, example_inputs)

    def block(q, k, v):  # as LTX's All2AllAttention calls it
        qh = a2a.send_recv_heads(q)
        kh = a2a.send_recv_heads(k, copy_out=True)
        vh = a2a.send_recv_heads(v)
        o = F.scaled_dot_product_attention(qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2))
        return a2a.gather_heads(o.transpose(1, 2).contiguous())

    def comm(x, y, xa):  # every method once, and a round trip
        return (a2a.send_recv_heads(x), a2a.gather_heads(y, copy_out=False),
                a2a.gather_heads(a2a.send_recv_heads(x, copy_out=True) * 1), a2a.allgather(xa))

    compiled_block = torch.compile(block, fullgraph=True, backend=recording)
    compiled_comm = torch.compile(comm, fullgraph=True)
    done = 0
    for name in ("uneven", "even"):  # uneven: rank 0 has no tokens
        counts = sets[name]
        a2a.set_rank_tokens(counts)
        n, T = counts[rank], sum(counts)
        g = torch.Generator(device=dev).manual_seed(_stable_seed("compile", name) + rank)
        # finite values: the round trip multiplies by 1, which would quiet a signalling NaN's bits
        x = torch.randn(1, n, H, D, dtype=torch.bfloat16, device=dev, generator=g)
        y = _rand((1, T, H // world, D), torch.bfloat16, dev, _stable_seed("compile-y", name) + rank)
        xa = _rand((1, n, 2, D), torch.bfloat16, dev, _stable_seed("compile-a", name) + rank)
        sent, gathered, back, everyone = compiled_comm(x, y, xa)
        _assert_same(sent, ref_send_recv_heads(x, counts, world, rank), f"compiled send_recv_heads {name}")
        _assert_same(gathered, ref_gather_heads(y, counts, world, rank), f"compiled gather_heads {name}")
        _assert_same(back, x, f"compiled round trip {name}")
        _assert_same(everyone, ref_allgather(xa, counts, world, rank), f"compiled allgather {name}")
        g = torch.Generator(device=dev).manual_seed(_stable_seed("qkv", name) + rank)
        q, k, v = (torch.randn(1, n, H, D, dtype=torch.bfloat16, device=dev, generator=g) for _ in range(3))
        eager = block(q, k, v)
        got = compiled_block(q, k, v)
        assert got.shape == (1, n, H, D) and eager.shape == got.shape
        torch.testing.assert_close(got, eager, atol=2e-2, rtol=2e-2)
        done += 1
    for code in graphs:  # one graph per count set (the counts are guarded constants)
        assert code.count("ipc_all2all.send_recv_heads") == 3 and code.count("ipc_all2all.gather_heads") == 1, code
    assert len(graphs) >= 1
    a2a.synchronize()
    a2a.destroy()
    return done
