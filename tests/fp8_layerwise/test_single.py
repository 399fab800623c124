"""TP 1 in one process: the full protocol (producer + consumer thread) on the CPU backend: delivery
for any slot and expert count and odd sizes, the native shard writer against torch, the host slots'
layout, and the argument forms the transport takes. Failures: test_single_failures.py."""
import pytest
import torch

import fp8_layerwise as F
from tests.fp8_layerwise import _reference as R
from tests.fp8_layerwise._one_process import expect, low_level_transports, make, pattern_writer


@pytest.mark.parametrize("slots", [2, 3, 4, 8])
@pytest.mark.parametrize("nb", [[4096, 512, 2048, 256], [1, 3, 7, 4099]])  # aligned and odd sizes
def test_delivery_slots_counts_odd_sizes(slots, nb):
    E = 9
    with make(E, nb, slots) as t:
        for epoch, n in enumerate([1, 2, slots, slots + 1, E], start=1):
            for b in t.buffers:
                b.fill_(0)
            with t.layer(epoch, epoch, n) as layer:
                layer.run(pattern_writer(epoch))
            for e in range(n):
                for k in range(4):
                    assert torch.equal(t.expert_view(k, e), expect(epoch, e, k, nb[k])), (n, e, k)
            for k in range(4):
                assert int(t.buffers[k][n * nb[k]:].count_nonzero()) == 0
            st = layer.stats
            assert st.bytes == n * sum(nb) and st.expert_count == n and st.layer_id == epoch and st.epoch == epoch
            assert not st.poisoned and st.total_ms >= st.writer_ms


@pytest.mark.parametrize("threads", [1, 3])
def test_native_shard_writer_matches_torch_reference(threads):
    E, H, I = 5, 512, 768
    src = F.make_block_fp8_sources(E, H, I, generator=torch.Generator().manual_seed(7))
    nb = F.block_fp8_expert_nbytes(H, I, 1)
    w = F.make_shard_writer(src, 1, threads=threads)
    with make(E, nb, 3) as t:
        with t.layer(1, 0, E) as layer:
            layer.run(w)
        for e in range(E):
            ref = R.expert_shard(src, 1, 0, e)
            for k in range(4):
                assert torch.equal(t.expert_view(k, e), ref[k])


@pytest.mark.parametrize("threads,hint", [(1, "none"), (4, "none"), (4, "demote"), (1, "writeback"), (4, "flush")])
@pytest.mark.parametrize("misalign", [0, 8, 3], ids=["aligned", "dst_off_by_8", "dst_off_by_3"])
def test_native_writer_splits_ranks_like_reference(threads, hint, misalign):
    # The native writer's per-rank cut (gate/up halves, w2 columns, block scales) against torch,
    # into destinations at any byte offset; the bytes after each shard stay untouched. Every cache
    # hint must leave the bytes as plain stores do (hints on lines shared with a neighbour included).
    if not F._C.cache_hint_supported(hint):
        pytest.skip(f"this CPU lacks the instruction of cache hint {hint!r}")
    E, H, I = 2, 1024, 768  # 2.4 MB per expert: above the 1 MB threshold of the threaded path
    src = F.make_block_fp8_sources(E, H, I, generator=torch.Generator().manual_seed(3))
    for tp in (2, 3, 6):
        nb = F.block_fp8_expert_nbytes(H, I, tp)
        w = F.make_shard_writer(src, tp, threads=threads, cache_hint=hint)
        assert w.cache_hint == hint
        for e in range(E):
            backing = [[torch.zeros(nb[k] + 64, dtype=torch.uint8) for _ in range(tp)] for k in range(4)]
            base = [[b[(-b.data_ptr()) % 16 + misalign:] for b in row] for row in backing]
            out = [[b[:nb[k]] for b in base[k]] for k in range(4)]
            w.write(e, [[t.data_ptr() for t in out[k]] for k in range(4)])
            for k in range(4):
                for b in base[k]:
                    assert int(b[nb[k]:].count_nonzero()) == 0, "the writer wrote past a shard"
            for r in range(tp):
                ref = R.expert_shard(src, tp, r, e)
                for k in range(4):
                    assert torch.equal(out[k][r], ref[k]), (tp, e, r, k)


def test_1000_layers_no_stale_data():
    nb = [64, 8, 32, 4]
    E = 4
    with make(E, nb, 2) as t:
        for epoch in range(1, 1001):
            n = 1 + epoch % E
            with t.layer(epoch, epoch % 61, n) as layer:
                layer.run(pattern_writer(epoch))
            for k in range(4):
                buf = t.buffers[k][: n * nb[k]].view(n, nb[k])
                want = torch.stack([expect(epoch, e, k, nb[k]) for e in range(n)])
                assert torch.equal(buf, want), (epoch, k)
            assert layer.stats.bytes == n * sum(nb)


def test_ktransformers_design_uses_four_copies_per_expert():
    nb = [4096, 512, 2048, 256]
    with make(8, nb, 2, max_inflight=1, coalesce=False, batch_small_kinds=False) as t:
        with t.layer(1, 0, 8) as layer:
            layer.run(pattern_writer(1))
        assert layer.stats.copies == 4 * 8
    with make(8, nb, 4) as t:  # coalescing and the batched small kinds can only reduce the count
        with t.layer(1, 0, 8) as layer:
            layer.run(pattern_writer(1))
        assert layer.stats.copies <= 2 * 8 + 2  # all four kinds are <= 64 KiB here: batched


@pytest.mark.parametrize("slots", [2, 3, 16])
def test_host_slot_layout_contiguous_aligned_disjoint(slots):
    nb = [1, 4099, 7, 8192]
    offsets, total = F.HostSlots.layout(nb, slots)
    regions = []
    for k in range(4):
        assert offsets[k] % 4096 == 0  # every kind starts page-aligned
        # slot s+1 of a kind directly follows slot s: what lets the consumer merge copies
        regions.append((offsets[k], offsets[k] + slots * nb[k]))
    regions.sort()
    for (a0, a1), (b0, b1) in zip(regions, regions[1:]):
        assert a1 <= b0
    assert regions[-1][1] <= total and total % 4096 == 0


def test_every_expert_count_from_1_to_num_experts():
    nb = [40, 8, 24, 4]
    E = 11
    with make(E, nb, 3) as t:
        for n in range(1, E + 1):
            for b in t.buffers:
                b.fill_(0)
            with t.layer(n, 0, n) as layer:
                layer.run(pattern_writer(n))
            for k in range(4):
                want = torch.stack([expect(n, e, k, nb[k]) for e in range(n)])
                assert torch.equal(t.buffers[k][: n * nb[k]].view(n, nb[k]), want), (n, k)
                assert int(t.buffers[k][n * nb[k]:].count_nonzero()) == 0
            assert layer.stats.bytes == n * sum(nb)


def test_default_slot_count_follows_expert_size():
    # DeepSeek-V3 block-FP8 shards: TP1/TP2 experts (44 / 22 MB per rank) get 2 slots, TP4/TP8 (11 / 5.5 MB) get 4.
    sizes = {tp: F.block_fp8_expert_nbytes(7168, 2048, tp) for tp in (1, 2, 4, 8)}
    assert [F.default_num_slots(sizes[tp]) for tp in (1, 2, 4, 8)] == [2, 2, 4, 4]
    assert F.default_num_slots([F.SMALL_EXPERT_BYTES, 0, 0, 0]) == F.DEFAULT_SLOTS
    assert F.default_num_slots([F.SMALL_EXPERT_BYTES - 1, 0, 0, 0]) == F.SMALL_EXPERT_SLOTS
    small = [4096, 512, 4096, 512]
    t = F.Transport(0, 1, 3, small, backend="cpu", exchange=lambda o: [o])  # num_slots omitted
    try:
        assert t.num_slots == F.SMALL_EXPERT_SLOTS
        with t.layer(1, 0, 3) as layer:
            layer.run(pattern_writer(0))
        for e in range(3):
            for k in range(4):
                assert torch.equal(t.expert_view(k, e), expect(0, e, k, small[k]))
    finally:
        t.close()


def test_shard_writer_refuses_experts_outside_its_sources():
    E, H, I = 2, 256, 256
    src = F.make_block_fp8_sources(E, H, I, generator=torch.Generator().manual_seed(0))
    nb = F.block_fp8_expert_nbytes(H, I, 1)
    w = F.make_shard_writer(src, 1, threads=1)
    assert w.num_experts == E
    with make(4, nb, 2) as t:
        t.join(1, 0, 4)
        with pytest.raises(ValueError, match=r"expert_count 4 exceeds the experts of the ShardWriter's source "
                                             r"tensors \(2\)"):
            t.run(1, 0, 4, w)  # the layer has room for 4 experts, the sources hold 2
        assert not t.poisoned  # refused before anything was written
        t.poison(F.ErrorCode.USER, "abandon epoch 1")
        t.reset()
        with t.layer(2, 0, E) as layer:
            layer.run(w)
        for e in range(E):
            ref = R.expert_shard(src, 1, 0, e)
            assert all(torch.equal(t.expert_view(k, e), ref[k]) for k in range(4))
    out = [torch.zeros(n, dtype=torch.uint8) for n in nb]
    dst = [[o.data_ptr()] for o in out]
    for bad in (E, -1, -100000):
        with pytest.raises(ValueError, match=rf"expert {bad} is outside the source tensors' experts 0\.\.1"):
            w.write(bad, dst)
    w.write(1, dst)
    assert all(torch.equal(out[k], R.expert_shard(src, 1, 0, 1)[k]) for k in range(4))


def test_shard_writer_keeps_its_sources_alive():
    import gc
    import weakref

    E, H, I = 4, 1024, 1024
    gen = lambda: torch.Generator().manual_seed(11)  # noqa: E731
    src = F.make_block_fp8_sources(E, H, I, generator=gen())
    refs = [weakref.ref(s) for s in src]
    w = F.make_shard_writer(src, 1, threads=1)
    del src
    gc.collect()
    assert all(r() is not None for r in refs), "the writer must hold its source tensors"
    again = F.make_block_fp8_sources(E, H, I, generator=gen())  # same bytes, allocated after the del
    with make(E, F.block_fp8_expert_nbytes(H, I, 1), 2) as t:
        with t.layer(1, 0, E) as layer:
            layer.run(w)
        for e in range(E):
            ref = R.expert_shard(again, 1, 0, e)
            assert all(torch.equal(t.expert_view(k, e), ref[k]) for k in range(4)), e
    del w
    gc.collect()
    assert all(r() is None for r in refs)  # and releases them with the writer


def test_shard_writer_cut_for_fewer_ranks_is_refused():
    # A layer of I=256 cut for TP 1 has the per-rank expert_nbytes of a layer of I=512 at TP 2, so the
    # shard sizes agree; but rank 1's rows would come from past the end of each expert (the next
    # expert, or past the source tensor for the last one).
    E, H, I = 2, 128, 256
    src = F.make_block_fp8_sources(E, H, I, generator=torch.Generator().manual_seed(3))
    nb = F.block_fp8_expert_nbytes(H, I, 1)
    assert nb == F.block_fp8_expert_nbytes(H, 2 * I, 2)
    w1 = F.make_shard_writer(src, 1, threads=1)
    dst = [[torch.zeros(n, dtype=torch.uint8) for _ in range(2)] for n in nb]
    ptrs = [[d.data_ptr() for d in ds] for ds in dst]
    with pytest.raises(ValueError, match="built for fewer ranks"):
        w1.write(0, ptrs)
    w1.write(0, [p[:1] for p in ptrs])  # its own TP size is fine
    F.make_shard_writer(F.make_block_fp8_sources(E, H, 2 * I), 2, threads=1).write(E - 1, ptrs)
    ts, keep = low_level_transports(2, nb=nb, experts=E)
    try:
        ts[0].join(1, 0, E)
        ts[1].join(1, 0, E)
        with pytest.raises(ValueError, match="built for fewer ranks"):
            ts[0].run(1, 0, E, w1)
        assert not ts[0].poisoned  # refused before the layer started
    finally:
        for t in ts:
            t.close()


def test_numpy_integer_arguments_are_accepted(tmp_path):
    np = pytest.importorskip("numpy")
    ex = F.FileExchange(str(tmp_path), 0, 1)
    with F.Transport(np.int64(0), np.int64(1), np.int64(4), [np.int64(16)] * 4, num_slots=np.int64(2), backend="cpu",
                     exchange=ex) as t:
        assert t.num_experts == 4 and t.num_slots == 2 and type(t.num_experts) is int


def test_expert_view_refuses_indices_outside_the_layer():
    # A slice past the layer buffer is an empty tensor, and a negative expert another empty (or
    # wrong) slice: both would pass unnoticed into a kernel. They raise ValueError naming the index.
    with make(3, [16, 8, 4, 2]) as t:
        assert t.expert_view(3, 2).numel() == 2
        for kind, expert, name in [(0, 3, "expert"), (0, -1, "expert"), (4, 0, "kind"), (-1, 0, "kind"),
                                   (0, 1.0, "expert")]:
            with pytest.raises(ValueError, match=name):
                t.expert_view(kind, expert)
