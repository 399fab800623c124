"""Zero-copy dispatch (``dispatch(zero_copy=True)``): its sizing by hand, and the validity rules of its
views on the torch runtime over gloo (CPU, CI): a combine or cached dispatch given a handle whose views
a later dispatch overwrote is refused, the combine itself keeps them, and the bad inputs are refused
before anything runs. The native path's bytes are checked by the dispatch/combine matrices (zero-copy
cases on the GPU, ``_common.case_matrix``), which also check that ``recv_x`` lies inside the buffer.
"""
import torch

from tests._dist import init_gloo, run_workers
from tests.elastic_ep._common import import_elastic_ep, native_module_or_skip, refusal_checker

ep = import_elastic_ep()
_C = native_module_or_skip()

MiB2 = 2 << 20
H, K, E, M = 64, 4, 8, 16


def test_zero_copy_layout_by_hand():
    # DeepSeek-V3 at EP 2, bf16, top-8, multiple reduction. Records without the hidden bytes:
    # topk idx 32 B + weights 32 B + source 8 B (-> 16) = 80 B. Combine receive area: 2 slots x 4096 tokens
    # x (7168 * 2 + 32) B = 117,702,656 B (above the records' 655,360). Dense area: 2 x 4096 x 14,336 B =
    # 117,440,512 B. Together 235,143,168 B -> 113 x 2 MiB = 236,978,176 B.
    need = 113 * MiB2
    assert _C.zero_copy_layout(need, 2, 4096, 7168, 2, 0, 8, True) == (need - 117_440_512, need)
    assert _C.zero_copy_layout(need - MiB2, 2, 4096, 7168, 2, 0, 8, True) == (-1, need)
    # FP8 at EP 8 without multiple reduction: 224 scale packs (896 B) per record ->
    # 896 + 32 + 32 + 16 = 976 B x 8 x 1024 = 7,995,392 B; combine: 8 slots x 1024 x 14,368 B = 117,702,656 B;
    # dense: 8 x 1024 x 7168 B = 58,720,256 B; 176,422,912 B -> 85 x 2 MiB.
    assert _C.zero_copy_layout(0, 8, 1024, 7168, 1, 224, 8, False) == (-1, 85 * MiB2)
    assert _C.zero_copy_layout(85 * MiB2, 8, 1024, 7168, 1, 224, 8, False)[0] == 85 * MiB2 - 58_720_256
    # The buffer-size hint with zero_copy=True is that size (here above DeepEP's own formula's).
    assert ep.calculate_elastic_buffer_size(2, 4096, 7168, 8, zero_copy=True) == need
    assert ep.calculate_elastic_buffer_size(2, 4096, 7168, 8) < need


def _worker(rank, world, rdzv):
    group = init_gloo(rank, world, rdzv)
    nbytes = ep.ElasticBuffer.get_buffer_size_hint(group, M, H, K, zero_copy=True)
    buf = ep.ElasticBuffer(group, nbytes, num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend="torch")
    g = torch.Generator().manual_seed(rank)
    x = torch.randn((M, H), generator=g).to(torch.bfloat16)
    topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)])
    w = torch.rand((M, K), generator=g)
    seen = []
    bad = refusal_checker(seen)

    def dispatch(**kw):
        out = buf.dispatch(x, topk_idx=topk, topk_weights=w, num_experts=E, **kw)
        out[4].current_stream_wait()
        return out

    plain = dispatch()
    zc = dispatch(zero_copy=True)
    assert torch.equal(zc[0].view(torch.int16), plain[0].view(torch.int16))
    assert zc[3].views_serial == buf._dispatch_serial and plain[3].views_serial == 0
    # The combine keeps the views valid: a second combine and a cached dispatch with the handle work.
    y = zc[0].clone()
    c1 = buf.combine(y, zc[3])[0]
    c2 = buf.combine(y, zc[3])[0]
    assert torch.equal(c1.view(torch.int16), c2.view(torch.int16))
    cached = buf.dispatch(x, handle=zc[3], zero_copy=True)
    assert cached[3] is zc[3] and torch.equal(cached[0].view(torch.int16), plain[0].view(torch.int16))
    # A later dispatch (any kind) overwrites the views: the handle is refused from then on.
    dispatch()
    bad("later dispatch(es) on this buffer overwrote them", lambda: buf.combine(y, zc[3]))
    bad("later dispatch(es) on this buffer overwrote them", lambda: buf.dispatch(x, handle=zc[3], zero_copy=True))
    bad("later dispatch(es) on this buffer overwrote them", lambda: buf.dispatch(x, handle=zc[3]))
    # A plain handle is never refused for that.
    buf.combine(plain[0], plain[3])
    # Bad inputs, before anything runs.
    bad("zero_copy: only the non-expanded layout", lambda: dispatch(zero_copy=True, do_expand=True))
    bad("zero_copy: expected a bool", lambda: dispatch(zero_copy=1))
    bad("comes from a dispatch without zero_copy", lambda: buf.dispatch(x, handle=plain[3], zero_copy=True))
    small = ep.ElasticBuffer(group, MiB2, num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend="torch")
    big_x = torch.zeros((M, 24576), dtype=torch.bfloat16)  # fits a 2 MiB buffer, not with zero_copy
    bad("get_buffer_size_hint(..., zero_copy=True)",
        lambda: small.dispatch(big_x, topk_idx=topk, topk_weights=w, num_experts=E, zero_copy=True))
    small.destroy()
    buf.destroy()
    return len(seen)


def test_zero_copy_rules_torch_runtime(tmp_path):
    assert run_workers(_worker, 2, tmp_path=tmp_path, timeout=120) == [7, 7]
