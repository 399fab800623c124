"""The DeepEP-compatible front end refuses tensors on another device than the buffer's, naming the
argument and both devices, and checks a handle's top-k before combine (torch backend, gloo, CPU).

Meta tensors stand in for "another device" here (the buffer is on the CPU); the CUDA form of the same
check (another GPU's index) is covered with a stand-in tensor in test_lowlevel_host_cpu.py.
"""
from dataclasses import replace

from tests._dist import run_workers


def devices_worker(rank, world, rdzv):
    import torch

    from tests._dist import init_gloo
    from tests.elastic_ep._common import import_elastic_ep, make_inputs, refusal_checker

    ep = import_elastic_ep()
    group = init_gloo(rank, world, rdzv)
    H, K, E, M = 256, 4, 8, 32
    buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend="torch")
    inp = make_inputs(rank, 16, H, K, E, "bf16", 0, "cpu")
    fp8 = make_inputs(rank, 16, H, K, E, "fp8", 0, "cpu")
    x, idx, w = inp["x"], inp["topk_idx"], inp["topk_weights"]
    meta = lambda t: t.to("meta")  # noqa: E731
    seen = []
    bad = refusal_checker(seen)

    where = "a tensor on cpu (the buffer's device), got meta"
    d = buf.dispatch
    bad(f"x: expected {where}", lambda: d(meta(x), topk_idx=idx, num_experts=E))
    bad(f"sf: expected {where}", lambda: d((fp8["x"], meta(fp8["sf"])), topk_idx=idx, num_experts=E))
    bad(f"topk_idx: expected {where}", lambda: d(x, topk_idx=meta(idx), num_experts=E))
    bad(f"topk_weights: expected {where}", lambda: d(x, topk_idx=idx, topk_weights=meta(w), num_experts=E))
    stats = torch.zeros(E // world, dtype=torch.int32)
    bad(f"cumulative_local_expert_recv_stats: expected {where}",
        lambda: d(x, topk_idx=idx, num_experts=E, cumulative_local_expert_recv_stats=meta(stats)))

    recv, _, rw, h, _ = d(x, topk_idx=idx, topk_weights=w, num_experts=E)
    for field in ("psum_num_recv_tokens_per_scaleup_rank", "dst_buffer_slot_idx", "recv_src_metadata"):
        moved = replace(h, **{field: meta(getattr(h, field))})
        bad(f"handle.{field}: expected {where}", lambda: d(x, handle=moved))
    # Event arguments of another kind would fail only after the first kernels were queued.
    ev = "expected None, an EventHandle (ElasticBuffer.capture()) or the EventOverlap"
    bad(f"previous_event_before_epilogue: {ev}", lambda: d(x, topk_idx=idx, num_experts=E,
                                                            previous_event_before_epilogue=object()))
    bad(f"previous_event: {ev}", lambda: d(x, topk_idx=idx, num_experts=E, previous_event=object(),
                                           allocate_on_comm_stream=True))
    bad(f"previous_event_before_epilogue: {ev}", lambda: buf.combine(recv, h, previous_event_before_epilogue=1))
    c = buf.combine
    bad(f"x: expected {where}", lambda: c(meta(recv), h))
    bad(f"topk_weights: expected {where}", lambda: c(recv, h, topk_weights=meta(rw)))
    bias = torch.zeros(16, H, dtype=torch.bfloat16)
    bad(f"bias[1]: expected {where}", lambda: c(recv, h, bias=(bias, meta(bias))))
    for field in ("topk_idx", "psum_num_recv_tokens_per_scaleup_rank", "recv_src_metadata"):
        moved = replace(h, **{field: meta(getattr(h, field))})
        bad(f"handle.{field}: expected {where}", lambda: c(recv, moved))
    # A handle whose top-k is out of the kernels' range, or whose tensors disagree with it.
    bad("handle.num_topk: expected 1..32, got 0",
        lambda: c(recv, replace(h, topk_idx=torch.zeros(16, 0, dtype=torch.int64))))
    wide = replace(h, topk_idx=torch.zeros(16, 33, dtype=torch.int64))
    bad("handle.num_topk: expected 1..32, got 33", lambda: c(recv, wide))
    bad("handle.topk_idx: expected a 2-D tensor", lambda: c(recv, replace(h, topk_idx=h.topk_idx.view(-1))))
    bad("handle.recv_src_metadata: expected shape (*, 6)",
        lambda: c(recv, replace(h, recv_src_metadata=h.recv_src_metadata[:, :5])))
    # The buffer is still usable after every refusal.
    out, _, _ = c(recv, h)
    assert out.shape == (16, H)
    buf.destroy()
    return len(seen)


def test_tensors_on_another_device_are_refused(tmp_path):
    n = run_workers(devices_worker, 1, tmp_path=tmp_path, timeout=120)
    assert n == [21]
