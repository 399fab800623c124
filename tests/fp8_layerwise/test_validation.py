"""Argument validation, control-region ABI checks and shared-memory hygiene (in-process, CPU)."""
import os
import re
import stat

import pytest
import torch

import fp8_layerwise as F
from fp8_layerwise import _C
from tests.fp8_layerwise import _shm

NB = [1024, 128, 512, 64]


@pytest.fixture
def region():
    seg = _C.ShmSegment.create("fp8lw_test", F.CONTROL_BYTES)
    yield seg
    seg.close()


def _ctor(ctl, size, rank=0, tp=1, host=None, dst=None, all_=None, nb=None, n=4, **kw):
    keep = [torch.zeros(4096, dtype=torch.uint8) for _ in range(4)]
    host = host if host is not None else [keep[k].data_ptr() for _ in range(2) for k in range(4)]
    dst = dst if dst is not None else [keep[k].data_ptr() for k in range(4)]
    all_ = all_ if all_ is not None else (host if rank == 0 else [])
    return _C.FP8LayerwiseTransport(ctl, size, rank, tp, -1, host, dst, all_, nb or NB, n, 1000, backend="cpu", **kw)


def test_constants():
    assert F.FP8_LAYERWISE_CONTROL_BYTES == 8192 and F.FP8_LAYERWISE_MAX_TP_SIZE == 8
    assert _C.CONTROL_STRUCT_BYTES <= 8192
    assert isinstance(F.built_with_cuda(), bool)


def test_initialize_validation(region):
    p = region.ptr
    with pytest.raises(ValueError, match="null"):
        _C.initialize_fp8_layerwise_control(0, 8192, 2)
    with pytest.raises(ValueError, match="64-byte aligned"):
        _C.initialize_fp8_layerwise_control(p + 8, 8184, 2)
    with pytest.raises(ValueError, match="at least 8192"):
        _C.initialize_fp8_layerwise_control(p, 4096, 2)
    for tp in (0, 9):
        with pytest.raises(ValueError, match="tp_size must be in 1..8"):
            _C.initialize_fp8_layerwise_control(p, 8192, tp)
    for slots in (1, 17):
        with pytest.raises(ValueError, match="num_slots must be in 2..16"):
            _C.initialize_fp8_layerwise_control(p, 8192, 2, slots)


@pytest.mark.fault
def test_attach_checks_magic_size_and_tp(region):
    with pytest.raises(ValueError, match="not initialized"):
        _ctor(region.ptr, 8192)
    _C.initialize_fp8_layerwise_control(region.ptr, 8192, 2, 2)
    with pytest.raises(ValueError, match="initialized for tp_size 2"):
        _ctor(region.ptr, 8192, tp=1)
    with pytest.raises(ValueError, match="at least 8192"):
        _ctor(region.ptr, 100, tp=2)
    with pytest.raises(ValueError, match="64-byte aligned"):
        _ctor(region.ptr + 1, 8192, tp=2)
    with pytest.raises(ValueError, match="null"):
        _ctor(0, 8192, tp=2)


def test_constructor_argument_errors(region):
    _C.initialize_fp8_layerwise_control(region.ptr, 8192, 1, 2)
    p = region.ptr
    with pytest.raises(ValueError, match="rank must be in 0..0"):
        _ctor(p, 8192, rank=1)
    with pytest.raises(ValueError, match="num_slots\\*4 = 8"):
        _ctor(p, 8192, host=[1] * 7)
    with pytest.raises(ValueError, match="local_host_ptrs\\[3\\] is null"):
        _ctor(p, 8192, host=[1, 2, 3, 0, 5, 6, 7, 8])
    with pytest.raises(ValueError, match="local_gpu_ptrs\\[0\\] is null"):
        _ctor(p, 8192, dst=[0, 1, 2, 3])
    with pytest.raises(ValueError, match="expert_nbytes\\[2\\] must be positive"):
        _ctor(p, 8192, nb=[1, 1, 0, 1])
    with pytest.raises(ValueError, match="num_experts must be positive"):
        _ctor(p, 8192, n=0)
    with pytest.raises(ValueError, match="num_slots\\*tp\\*4"):
        _ctor(p, 8192, all_=[1] * 4)
    with pytest.raises(ValueError, match="backend must be"):
        _ctor(p, 8192, backend_="x") if False else _C.FP8LayerwiseTransport(
            p, 8192, 0, 1, -1, [1] * 8, [1] * 4, [1] * 8, NB, 4, 1000, backend="tpu")
    for streams in (0, F.MAX_COPY_STREAMS + 1):
        with pytest.raises(ValueError, match=f"copy_streams must be in 1..{F.MAX_COPY_STREAMS}, got {streams}"):
            _ctor(p, 8192, copy_streams=streams)


def test_high_level_argument_errors():
    ex = lambda o: [o]  # noqa: E731
    with pytest.raises(ValueError, match="tp_size must be in 1..8"):
        F.Transport(0, 9, 4, NB, exchange=ex, backend="cpu")
    with pytest.raises(ValueError, match="num_slots must be in 2..16"):
        F.Transport(0, 1, 4, NB, num_slots=1, exchange=ex, backend="cpu")
    with pytest.raises(ValueError, match="expert_nbytes must be 4 positive"):
        F.Transport(0, 1, 4, [1, 2, 3], exchange=ex, backend="cpu")
    with pytest.raises(ValueError, match="backend must be"):
        F.Transport(0, 1, 4, NB, exchange=ex, backend="gpu")
    with pytest.raises(ValueError, match="copy_streams must be in 1..4, got 0"):
        F.Transport(0, 1, 4, NB, exchange=ex, backend="cpu", copy_streams=0)


def test_block_fp8_sizes_and_128_multiple():
    # DeepSeek-V3: 44.05 MB per expert at TP1, 5.5 MB per rank at TP8.
    tp1 = F.block_fp8_expert_nbytes(7168, 2048, 1)
    assert tp1 == [2 * 2048 * 7168, 4 * 2 * 16 * 56, 7168 * 2048, 4 * 56 * 16]
    assert sum(F.block_fp8_expert_nbytes(7168, 2048, 8)) * 8 == sum(tp1)
    with pytest.raises(ValueError, match="not a multiple of 128"):
        F.block_fp8_expert_nbytes(4096, 1536, 8)  # Qwen3-235B at TP8: 192
    with pytest.raises(ValueError, match="multiple of 128"):
        F.block_fp8_expert_nbytes(1000, 1024, 1)
    src = F.make_block_fp8_sources(2, 256, 384)
    with pytest.raises(ValueError, match="not a multiple of 128"):
        F.make_shard_writer(src, 2)


def test_default_writer_threads():
    # 8 per rank, two CPUs left per rank, at least 1, at most 64.
    assert F.default_writer_threads(1, cpus=16) == 8
    assert F.default_writer_threads(2, cpus=16) == 12
    assert F.default_writer_threads(8, cpus=16) == 1
    assert F.default_writer_threads(2, cpus=10) == 6
    assert F.default_writer_threads(1, cpus=2) == 1
    assert F.default_writer_threads(8, cpus=192) == 64
    assert 1 <= F.default_writer_threads(2) <= 16
    src = F.make_block_fp8_sources(2, 256, 256)
    with pytest.raises(ValueError, match="threads must be in 1..64"):
        F.make_shard_writer(src, 2, threads=0)


def test_cache_hint_choice(monkeypatch):
    src = F.make_block_fp8_sources(2, 256, 256)
    with pytest.raises(ValueError, match="cache_hint must be one of"):
        F.make_shard_writer(src, 1, cache_hint="evict")
    with pytest.raises(ValueError, match="cache_hint must be one of"):
        _C.ShardWriter([_C.ShardSpec(1, 0, 16, 1, 16, num_experts=1)] * 4, 1, "evict")
    monkeypatch.setenv("FP8_LAYERWISE_WRITER_HINT", "bogus")
    with pytest.raises(ValueError, match="FP8_LAYERWISE_WRITER_HINT must be one of"):
        F.default_cache_hint()
    for name in F.CACHE_HINTS:
        monkeypatch.setenv("FP8_LAYERWISE_WRITER_HINT", name)
        want = name if _C.cache_hint_supported(name) else "none"
        assert F.default_cache_hint() == want
        assert F.make_shard_writer(src, 1).cache_hint == want
    # The former name is still read (deprecated) when the new one is not set, and only then.
    hint = next((h for h in F.CACHE_HINTS if h != "none" and _C.cache_hint_supported(h)), "none")
    monkeypatch.setenv("FP8LW_WRITER_HINT", hint)
    monkeypatch.setenv("FP8_LAYERWISE_WRITER_HINT", "none")
    assert F.default_cache_hint() == "none"
    monkeypatch.delenv("FP8_LAYERWISE_WRITER_HINT")
    with pytest.warns(DeprecationWarning, match="FP8LW_WRITER_HINT is deprecated; set FP8_LAYERWISE_WRITER_HINT"):
        assert F.default_cache_hint() == hint
    monkeypatch.setenv("FP8LW_WRITER_HINT", "bogus")
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="FP8LW_WRITER_HINT must be one of"):
        F.default_cache_hint()
    monkeypatch.delenv("FP8LW_WRITER_HINT")
    assert F.default_cache_hint() in (F.DEFAULT_CACHE_HINT, "none")
    assert _C.cache_hint_supported("none")
    unsupported = [h for h in F.CACHE_HINTS if not _C.cache_hint_supported(h)]
    for h in unsupported:  # a CPU without the instruction refuses it instead of faulting
        with pytest.raises(ValueError, match="instruction"):
            F.make_shard_writer(src, 1, cache_hint=h)


def test_shard_writer_validation():
    with pytest.raises(ValueError, match="exactly 4"):
        _C.ShardWriter([], 1)
    spec = _C.ShardSpec(1, 0, 16, 1, 16, num_experts=1)
    with pytest.raises(ValueError, match="threads must be in 1..64"):
        _C.ShardWriter([spec] * 4, 0)
    with pytest.raises(ValueError, match="source pointer is null"):
        _C.ShardWriter([_C.ShardSpec(0, 0, 16, 1, 16, num_experts=1)] * 4, 1)
    # The expert count of the sources is the writer's only bound: required, positive, one for all kinds.
    with pytest.raises(TypeError):
        _C.ShardSpec(1, 0, 16, 1, 16)
    with pytest.raises(ValueError, match="num_experts .* must be in 1.."):
        _C.ShardWriter([_C.ShardSpec(1, 16, 16, 1, 16, num_experts=0)] * 4, 1)
    with pytest.raises(ValueError, match="kind 2: num_experts 3 differs from kind 0's 2"):
        _C.ShardWriter([_C.ShardSpec(1, 16, 16, 1, 16, num_experts=n) for n in (2, 2, 3, 2)], 1)


@pytest.mark.fault
def test_shm_owner_only_unguessable_and_size_checked():
    a = _C.ShmSegment.create("fp8lw_test", 4096)
    b = _C.ShmSegment.create("fp8lw_test", 4096)
    try:
        path = "/dev/shm" + a.name
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        suffix = a.name.rsplit("_", 1)[1]
        assert len(suffix) == 32 and int(suffix, 16) >= 0 and a.name != b.name
        c = _C.ShmSegment.attach(a.name, 4096)
        with pytest.raises(ValueError, match="expected at least"):
            _C.ShmSegment.attach(a.name, 8192)
        c.close()
        assert os.path.exists(path)  # an attacher's close never unlinks
    finally:
        a.close()
        b.close()
    assert not os.path.exists(path)  # the creator's close unlinks
    with pytest.raises(ValueError, match="shared memory too small"):
        _C.ShmSegment.create("fp8lw_test", 1 << 60)


def test_transport_leaves_no_shm_names():
    # Only the names this test's transport creates are looked at (tagged, see _shm.py): other
    # processes may create and remove fp8lw_* names meanwhile.
    with _shm.tagged_segments() as shm:
        with F.Transport(0, 1, 4, NB, num_slots=2, backend="cpu", exchange=lambda o: [o]) as t:
            names = [t._control.name, t._slots.name]
            assert sorted(shm.created) == sorted(names), (shm.created, names)  # the control region and the slots
            assert shm.linked() == []  # unlinked as soon as everyone mapped
            assert t.native.backend == "cpu"
            with t.layer(1, 0, 4) as layer:  # and the mappings still work
                layer.run(lambda e, slots: [v.fill_(e + 1) for views in slots for v in views])
            assert all(int(t.expert_view(k, 3).min()) == 4 for k in range(4))
        assert shm.linked() == []


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("fail_at", [1, 2, 3, 4])
@pytest.mark.fault
def test_setup_failure_cleans_up(rank, fail_at):
    # One rank of TP 2, its peer played by the test's exchange: the exchange fails at its round
    # fail_at (1: before anything exists; 2: the names; 3: "mapped"; 4: "ready"). Every name this rank
    # created must be gone afterwards, and so must the peer's segment once this rank had mapped it
    # (rank 0 maps rank 1's slots, rank 1 maps rank 0's control region).
    calls = []
    with _shm.tagged_segments() as shm:
        peer = F.ControlRegion.create(2, 2) if rank == 1 else F.HostSlots.create(NB, 2)
        peer_name = peer.name

        def exchange(obj):
            calls.append(obj)
            if len(calls) == fail_at:
                raise RuntimeError(f"exchange failed at round {fail_at}")
            other = {1: {"pid": os.getpid(), "tp_rank": 1 - rank, "tp_size": 2, "geometry": calls[0]["geometry"]},
                     2: {"control": peer_name if rank == 1 else None, "slots": peer_name if rank == 0 else None},
                     }.get(len(calls), obj)
            return [obj, other] if rank == 0 else [other, obj]

        with pytest.raises(RuntimeError, match=f"exchange failed at round {fail_at}"):
            F.Transport(rank, 2, 4, NB, num_slots=2, backend="cpu", exchange=exchange)
        own = [n for n in shm.created if n != peer_name]
        # rank 0 creates the control region and its slots, rank 1 its slots; both only after round 1
        assert len(own) == (0 if fail_at == 1 else 2 - rank), shm.created
        assert shm.linked() == ([peer_name[1:]] if fail_at <= 2 else []), (shm.linked(), peer_name)
        peer.close()


def _low_level(region, rank, nb=NB, n=4, timeout_ms=1000, tp=2):
    """A low-level transport of `rank` on `region` (the ranks of one region may share a process)."""
    keep = [torch.zeros(4096, dtype=torch.uint8) for _ in range(4)]
    host = [keep[k].data_ptr() for _ in range(2) for k in range(4)]
    all_ = [keep[k].data_ptr() for _ in range(2) for _ in range(tp) for k in range(4)] if rank == 0 else []
    t = _C.FP8LayerwiseTransport(region.ptr, 8192, rank, tp, -1, host, [keep[k].data_ptr() for k in range(4)], all_,
                                 nb, n, timeout_ms, backend="cpu")
    return t, keep


@pytest.mark.parametrize("rank0_first", [True, False])
@pytest.mark.parametrize("field", ["expert_nbytes", "num_experts"])
@pytest.mark.fault
def test_native_attach_checks_geometry_against_rank_0(region, rank0_first, field):
    # Ranks that disagree with rank 0 would read the slots at other offsets than rank 0 writes them:
    # the second of the two to attach sees it, poisons (PROTOCOL, naming the rank that differs), and
    # every rank raises ProtocolError (the low-level path; Transport checks on its first exchange).
    _C.initialize_fp8_layerwise_control(region.ptr, 8192, 2, 2)
    other = dict(nb=[1024, 128, 512, 128]) if field == "expert_nbytes" else dict(n=5)
    keep = []
    try:
        if rank0_first:
            t0, k0 = _low_level(region, 0)
            keep += [t0, k0]
            with pytest.raises(F.ProtocolError, match=f"rank 1 attached with .* but rank 0 with .*every rank must "
                                                      f"pass the same expert_nbytes and num_experts"):
                _low_level(region, 1, **other)
            peers = [t0]
        else:
            t1, k1 = _low_level(region, 1, **other)
            t0, k0 = _low_level(region, 0)  # rank 0 is not the one that differs: it records it, then raises
            keep += [t0, k0, t1, k1]
            peers = [t0, t1]
        for t in peers:
            with pytest.raises(F.ProtocolError) as info:
                t.join(1, 0, 1)
            assert info.value.rank == 1 and info.value.code == F.ErrorCode.PROTOCOL
            assert ("expert_nbytes [1024, 128, 512, 128]" if field == "expert_nbytes" else "num_experts 5") \
                in info.value.message
    finally:
        for t in keep[::2]:
            t.close()


def test_native_errors_are_transport_errors(region):
    # The docs promise TransportError as the base of every runtime error, the native ones included.
    _C.initialize_fp8_layerwise_control(region.ptr, 8192, 2, 2)
    t, keep = _low_level(region, 0, timeout_ms=300)  # rank 1 never attaches
    try:
        t.poison(int(F.ErrorCode.USER), "poisoned by the test")
        with pytest.raises(F.TransportTimeout) as info:
            t.reset()  # rank 1 never calls reset()
    finally:
        t.close()  # before the fixture unmaps the region under its consumer
    exc = info.value
    assert isinstance(exc, F.TransportError) and isinstance(exc, TimeoutError) and exc.code == F.ErrorCode.TIMEOUT
    assert "rank 1 has not called reset()" in str(exc) and "every rank to call reset()" in exc.operation
    assert exc.rank == 0 and re.fullmatch(r"transport\w*\.(cpp|hpp):\d+", exc.where), exc.where
    with pytest.raises(F.TransportClosed, match="closed"):
        t.join(1, 0, 1)
    assert t.poisoned  # accessors report what close() kept
    with pytest.raises(F.TransportError, match="shm_open"):
        _C.ShmSegment.attach("/fp8lw_test_does_not_exist", 4096)


@pytest.mark.parametrize("args,name", [((7168.0, 2048, 1), "hidden"), ((7168, 2048.0, 1), "intermediate"),
                                       ((7168, 2048, 2.0), "tp_size"), ((7168, 2048, True), "tp_size")])
def test_block_fp8_sizes_refuse_non_integers(args, name):
    # A float passed the range checks and came back as float sizes, which the Transport then refused
    # as "expert_nbytes[0] must be an integer": the argument at fault is named instead.
    with pytest.raises(ValueError, match=name):
        F.block_fp8_expert_nbytes(*args)


def test_layer_call_arguments_are_integers_named_by_argument():
    """join / run / wait refuse floats, strings, bools and values wider than the protocol's fields
    with a ValueError naming the argument (the binding alone raised TypeError), before anything
    reaches the control block: the transport then still delivers a layer."""
    with F.Transport(0, 1, 4, NB, num_slots=2, backend="cpu", exchange=lambda o: [o]) as t:
        for call, name in [(lambda: t.join(1.0, 0, 4), "epoch"), (lambda: t.join("1", 0, 4), "epoch"),
                           (lambda: t.join(True, 0, 4), "epoch"), (lambda: t.join(-1, 0, 4), "epoch"),
                           (lambda: t.join(2 ** 64, 0, 4), "epoch"), (lambda: t.join(1, 0.5, 4), "layer_id"),
                           (lambda: t.join(1, 2 ** 63, 4), "layer_id"), (lambda: t.join(1, 0, 4.0), "expert_count"),
                           (lambda: t.join(1, 0, 2 ** 31), "expert_count"), (lambda: t.wait(1.5), "epoch"),
                           (lambda: t.run(1, "0", 4, lambda e, s: None), "layer_id")]:
            with pytest.raises(ValueError, match=f"^{name} must be"):
                call()
        assert not t.poisoned
        with t.layer(1, 0, 4) as layer:
            layer.run(lambda e, slots: [v.fill_(e + 1) for row in slots for v in row])
        assert all(bool((t.expert_view(k, e) == e + 1).all()) for k in range(4) for e in range(4))


@pytest.mark.parametrize("slots", [0, 1, 17, 1 << 40])
@pytest.mark.fault
def test_native_attach_refuses_a_corrupted_num_slots(region, slots):
    # The header's num_slots (written once by initialize_control) bounds every slot index into the
    # control block's ready[] and ack[] arrays of 16: a corrupted word is refused on attach, by name,
    # before any index is taken modulo it.
    import ctypes

    _C.initialize_fp8_layerwise_control(region.ptr, 8192, 2, 2)
    ctypes.c_uint64.from_address(region.ptr + 32).value = slots  # Header: magic, version, struct_bytes, tp_size, num_slots
    with pytest.raises(ValueError, match=f"control region's num_slots {slots} is outside 2..16"):
        _low_level(region, 0)
    ctypes.c_uint64.from_address(region.ptr + 32).value = 2
    t, keep = _low_level(region, 0)
    t.close()
