"""What the single-process tests share: a Transport of TP 1 on the CPU backend, low-level transports
of a whole TP group on one control region in this process, and the byte pattern the tests write and
check."""
import pytest
import torch

import fp8_layerwise as F


def make(num_experts, nb, slots=2, **kw):
    kw.setdefault("timeout_ms", 5000)
    return F.Transport(0, 1, num_experts, nb, num_slots=slots, backend="cpu", exchange=lambda o: [o], **kw)


def pattern_writer(layer):
    def w(e, slots):
        for r, views in enumerate(slots):
            for k, v in enumerate(views):
                v.copy_(torch.arange(v.numel(), dtype=torch.int64).add_(layer * 131 + e * 7 + k).remainder_(251)
                        .to(torch.uint8))
    return w


def expect(layer, e, k, n):
    return torch.arange(n, dtype=torch.int64).add_(layer * 131 + e * 7 + k).remainder_(251).to(torch.uint8)


def poison_of(fn):
    """The TransportPoisoned that ``fn()`` raises (pytest fails the test when it raises none)."""
    with pytest.raises(F.TransportPoisoned) as info:
        fn()
    return info.value


def low_level_transports(tp, nb=16, experts=4, slots=2, timeout_ms=5000):
    """tp low-level transports (CPU backend) on one control region in this process; the tensors they
    point into are returned too and must outlive them."""
    from fp8_layerwise import _C

    seg = _C.ShmSegment.create("fp8lw_test", 8192)
    seg.unlink()
    _C.initialize_fp8_layerwise_control(seg.ptr, 8192, tp, slots)
    keep = [seg]
    ts = []
    nbs = list(nb) if isinstance(nb, (list, tuple)) else [nb] * 4
    for rank in range(tp):
        k = [torch.zeros(max(4096, n), dtype=torch.uint8) for n in nbs]
        dst = [torch.zeros(experts * n, dtype=torch.uint8) for n in nbs]
        keep += k + dst
        host = [k[i].data_ptr() for _ in range(slots) for i in range(4)]
        all_ = [k[i].data_ptr() for _ in range(slots) for _ in range(tp) for i in range(4)] if rank == 0 else []
        ts.append(_C.FP8LayerwiseTransport(seg.ptr, 8192, rank, tp, -1, host, [d.data_ptr() for d in dst], all_,
                                           nbs, experts, timeout_ms, backend="cpu"))
    return ts, keep
