"""Bad arguments to the public Python API: a ValueError naming the argument, raised before anything
is created, exchanged or poisoned, after which a correct call still works (CPU backend, TP 1).

Each case here got something else before: a TypeError or AttributeError from inside the binding,
torch or json; a wait until an exchange's timeout; a poisoned transport; or a silently wrong result
(a shifted shard, an empty reference, a poison code taken from a float)."""
import json
import os
import threading
import time

import pytest
import torch

import fp8_layerwise as F
from tests.fp8_layerwise import _reference as R
from tests.fp8_layerwise import _shm

NB = [256, 64, 128, 32]


def one_rank(obj):
    return [obj]


def make(num_experts=4, nb=NB, **kw):
    kw.setdefault("timeout_ms", 5000)
    return F.Transport(0, 1, num_experts, nb, num_slots=2, backend="cpu", exchange=one_rank, **kw)


def fill(value):
    return lambda e, slots: [v.fill_((value + e) % 251) for row in slots for v in row]


def delivers(t, epoch, n=4):
    """A correct layer after the refused call: every expert's bytes arrive."""
    with t.layer(epoch, 0, n) as layer:
        layer.run(fill(epoch))
    return all(bool((t.expert_view(k, e) == (epoch + e) % 251).all()) for k in range(4) for e in range(n))


# ---- Transport constructor ----------------------------------------------------------------------
@pytest.mark.parametrize("kw,name", [
    (dict(expert_nbytes=[2 ** 58] * 4, num_slots=16), r"expert_nbytes \[288230376151711744, .* num_slots 16"),
    (dict(expert_nbytes=[2 ** 62, 1, 1, 1], num_slots=2), r"expert_nbytes \[4611686018427387904, .* num_slots 2"),
    (dict(group=5), "^group must be a torch.distributed ProcessGroup"),
    (dict(group="tp"), "^group must be a torch.distributed ProcessGroup"),
    (dict(exchange=lambda o: [{"tp_rank": 0, "tp_size": 1}]), "entry 0 lacks what TP rank 0 passed to it"),
], ids=["slots_2**64", "slots_2**63", "group_int", "group_str", "exchange_drops_entry"])
def test_transport_constructor_refuses(kw, name):
    # Slots past 2**63-1 bytes were the shm binding's "incompatible function arguments"; a group that
    # is not a ProcessGroup an AttributeError inside torch.distributed; an exchange whose entries
    # are not the ranks' objects a KeyError.
    args = dict(rank=0, tp_size=1, num_experts=1, expert_nbytes=NB, num_slots=2, backend="cpu", exchange=one_rank)
    args.update(kw)
    if "group" in kw:
        args["exchange"] = None
    with _shm.tagged_segments() as shm:
        with pytest.raises(ValueError, match=name):
            F.Transport(**args)
    assert shm.created == []
    with make() as t:
        assert delivers(t, 1)


def test_transport_refuses_a_file_exchange_of_another_world_size_at_once(tmp_path):
    # A FileExchange for 2 ranks given to a TP-1 transport waited in its first round for a rank 1
    # that never comes, until its timeout, then raised TimeoutError; now nothing is even written.
    ex = F.FileExchange(tmp_path / "x", 0, 2, timeout_s=3)
    t0 = time.monotonic()
    with _shm.tagged_segments() as shm:
        with pytest.raises(ValueError, match="exchange is a FileExchange of world_size 2 but tp_size is 1"):
            F.Transport(0, 1, 4, NB, num_slots=2, backend="cpu", exchange=ex)
    assert time.monotonic() - t0 < 2.0 and shm.created == []
    assert ex.session is None and list((tmp_path / "x").iterdir()) == []
    with F.Transport(0, 1, 4, NB, num_slots=2, backend="cpu", exchange=F.FileExchange(tmp_path / "y", 0, 1)) as t:
        assert delivers(t, 1)


# ---- per-layer calls ------------------------------------------------------------------------------
@pytest.mark.parametrize("code", [None, 1.0, 2.5, float("nan"), "5", True, 99, 2 ** 31, 2 ** 64],
                         ids=lambda c: repr(c))
def test_poison_code_must_be_an_error_code(code):
    # int(code) took 2.5 for TIMEOUT (every rank then raised TransportTimeout), "5" for WRITER and
    # 99 for a code no exception maps; 2**31 was the binding's TypeError.
    np = pytest.importorskip("numpy")
    with make() as t:
        with pytest.raises(ValueError, match="^code must be"):
            t.poison(code, "bad code")
        assert not t.poisoned
        assert delivers(t, 1)
        assert t.poison(np.int64(int(F.ErrorCode.USER)), "a good claim") is True
        assert t.native.last_poison()["error_code"] == F.ErrorCode.USER
        assert t.reset() == 1


@pytest.mark.parametrize("message", [None, 5, b"bytes"], ids=["None", "int", "bytes"])
def test_poison_message_must_be_a_str(message):
    with make() as t:
        with pytest.raises(ValueError, match="^message must be a str"):
            t.poison(F.ErrorCode.USER, message)
        assert not t.poisoned
        assert delivers(t, 1)


@pytest.mark.parametrize("writer", [lambda e: None, lambda e, slots, extra: None, lambda e, *, slots: None],
                         ids=["one_arg", "three_args", "kw_only_slots"])
def test_run_refuses_a_writer_it_cannot_call_before_the_layer_starts(writer):
    # Such a writer failed at expert 0 inside run() and poisoned every rank (code WRITER).
    with make() as t:
        t.join(1, 0, 4)
        with pytest.raises(ValueError, match=r"^writer must be callable as writer\(expert, slots\)"):
            t.run(1, 0, 4, writer)
        assert not t.poisoned
        t.run(1, 0, 4, fill(1))  # the same layer: the refused call did not start it
        assert not t.wait(1).poisoned
        assert delivers(t, 2)


@pytest.mark.parametrize("sync_stream", [None, 1, "no"], ids=["None", "int", "str"])
def test_layer_sync_stream_must_be_a_bool(sync_stream):
    # A truthy "no" meant True (a stream sync on the CUDA backend).
    with make() as t:
        with pytest.raises(ValueError, match="^sync_stream must be a bool"):
            with t.layer(1, 0, 4, sync_stream=sync_stream):
                pass
        assert not t.poisoned
        assert delivers(t, 1)  # epoch 1 was not joined


# ---- writers ---------------------------------------------------------------------------------------
def _src(E=3, H=256, I=256, seed=1):
    return F.make_block_fp8_sources(E, H, I, generator=torch.Generator().manual_seed(seed))


def _bad_sources():
    src = _src()
    return {
        "None": (None, "^sources must hold 4 tensors"),
        "str": ("abcd", "^sources must hold 4 tensors"),
        "generator": ((x for x in src), "^sources must hold 4 tensors"),
        "ints": ([1, 2, 3, 4], r"^sources\[0\] \(w13_weight\) must be a torch.Tensor, got int"),
        "None_entry": ([src[0], None, src[2], src[3]], r"^sources\[1\] \(w13_weight_scale_inv\) must be a torch.Tensor"),
        "numpy": ([s.numpy() for s in src], r"^sources\[0\] \(w13_weight\) must be a torch.Tensor, got ndarray"),
        # 2I+1 rows: every expert after the first was read one row off (a silently wrong shard)
        "w13_odd_rows": ([torch.zeros(3, 513, 256, dtype=torch.uint8)] + src[1:],
                         r"^sources\[0\] \(w13_weight\) must be \[E >= 1, 2I, H\]"),
        # no expert: "source pointer is null" from the native writer
        "no_experts": ([s[:0] for s in src], r"^sources\[0\] \(w13_weight\) must be \[E >= 1, 2I, H\]"),
    }


@pytest.mark.parametrize("case", list(_bad_sources()))
def test_make_shard_writer_refuses_sources(case):
    sources, match = _bad_sources()[case]
    with pytest.raises(ValueError, match=match):
        F.make_shard_writer(sources, 1, threads=1)
    _writer_delivers(F.make_shard_writer(_src(), 1, threads=1))


def test_make_shard_writer_threads_are_integers():
    # True was taken for 1 thread, numpy.int64(2) refused while every other argument takes it.
    np = pytest.importorskip("numpy")
    with pytest.raises(ValueError, match="^threads must be an integer"):
        F.make_shard_writer(_src(), 1, threads=True)
    w = F.make_shard_writer(_src(), 1, threads=np.int64(2))
    assert w.threads == 2
    _writer_delivers(w)


def _writer_delivers(writer, E=3):
    src = _src()
    with make(E, F.block_fp8_expert_nbytes(256, 256, 1)) as t:
        with t.layer(1, 0, E) as layer:
            layer.run(writer)
        for e in range(E):
            ref = R.expert_shard(src, 1, 0, e)
            assert all(torch.equal(t.expert_view(k, e), ref[k]) for k in range(4)), e


def test_run_refuses_a_writer_cut_for_more_ranks():
    # A TP-2 cut of a layer twice as wide has the per-rank sizes of this TP-1 layer: run() delivered
    # rank 0's half of each expert as if it were the whole. (Fewer ranks: test_single.py.)
    wide = F.make_shard_writer(_src(I=512), 2, threads=1)
    assert wide.tp_size == 2
    nb = F.block_fp8_expert_nbytes(256, 256, 1)
    assert nb == F.block_fp8_expert_nbytes(256, 512, 2)
    with make(3, nb) as t:
        t.join(1, 0, 3)
        with pytest.raises(ValueError, match="ShardWriter was cut for tp_size 2 but the transport has 1 ranks"):
            t.run(1, 0, 3, wide)
        assert not t.poisoned
        t.run(1, 0, 3, F.make_shard_writer(_src(), 1, threads=1))
        t.wait(1)
        assert torch.equal(t.expert_view(0, 2), R.expert_shard(_src(), 1, 0, 2)[0])
    with pytest.raises(ValueError, match="ShardWriter tp_size must be in 0..8"):
        F._C.ShardWriter([F._C.ShardSpec(1, 16, 16, 1, 16, num_experts=1)] * 4, 1, tp_size=9)


# ---- helpers -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,kw,name", [
    ((None, 256, 256), {}, "^num_experts must be"), ((0, 256, 256), {}, "^num_experts must be"),
    ((2.0, 256, 256), {}, "^num_experts must be"), ((2, 200, 256), {}, "^hidden must be a positive multiple"),
    ((2, 256, 100), {}, "intermediate"), ((2, 256.0, 256), {}, "^hidden must be"),
    ((2, 256, 256), dict(generator=5), "^generator must be"),
    ((2 ** 40, 2 ** 20, 2 ** 20), {}, "^num_experts .* exceed"),
], ids=["E_None", "E_0", "E_float", "H_200", "I_100", "H_float", "generator_int", "too_large"])
def test_make_block_fp8_sources_refuses(args, kw, name):
    # Sizes off the 128-grid gave truncated (even empty) scale shapes, the rest torch's own errors.
    with pytest.raises(ValueError, match=name):
        F.make_block_fp8_sources(*args, **kw)
    assert [tuple(x.shape) for x in F.make_block_fp8_sources(2, 256, 128)] == \
        [(2, 256, 256), (2, 2, 2), (2, 256, 128), (2, 2, 1)]


@pytest.mark.parametrize("tp,rank,expert,name", [
    (2, 2, 0, "^rank must be in 0..1"), (2, -1, 0, "^rank must be in 0..1"), (0, 0, 0, "^tp_size must be"),
    (2, 0, -1, "^expert must be in 0..2"), (2, 0, 3, "^expert must be in 0..2"), (1.0, 0, 0, "^tp_size must be"),
    (3, 0, 0, "divisible by tp_size 3"),
])
def test_reference_shard_refuses(tp, rank, expert, name):
    # A rank past tp_size, a negative one or a tp that does not cut I into 128-blocks gave empty or
    # shifted slices: a reference that silently disagrees with what a rank receives.
    src = _src()
    with pytest.raises(ValueError, match=name):
        F.reference_shard(src, tp, rank, expert)
    for k, (got, want) in enumerate(zip(F.reference_shard(src, 2, 1, 2), R.expert_shard(src, 2, 1, 2))):
        assert torch.equal(got, want), k
    with pytest.raises(ValueError, match="^sources must hold 4 tensors"):
        F.reference_shard(None, 1, 0, 0)


@pytest.mark.parametrize("args,name", [((0,), "^tp_size must be"), ((1.0,), "^tp_size must be"),
                                       ((None,), "^tp_size must be"), ((9,), "^tp_size must be"),
                                       ((1, 0), "^cpus must be"), ((1, 1.5), "^cpus must be")], ids=repr)
def test_default_writer_threads_refuses(args, name):
    # A float came back as a float thread count, 0 and negatives as 1.
    with pytest.raises(ValueError, match=name):
        F.default_writer_threads(*args)
    assert F.default_writer_threads(2, cpus=16) == 12


@pytest.mark.parametrize("nb", [None, 5, [1, 2, 3], [1.5] * 4, ["5"] * 4, [-1, 0, 0, 0]], ids=repr)
def test_default_num_slots_refuses(nb):
    with pytest.raises(ValueError, match="^expert_nbytes"):
        F.default_num_slots(nb)
    assert F.default_num_slots([F.SMALL_EXPERT_BYTES, 0, 0, 0]) == F.DEFAULT_SLOTS


# ---- shared-memory building blocks ---------------------------------------------------------------------
@pytest.mark.parametrize("call,name", [
    (lambda: F.ControlRegion.create(1.5), "^tp_size must be"),
    (lambda: F.ControlRegion.create(1, None), "^num_slots must be"),
    (lambda: F.ControlRegion.attach(None), "^name must be"),
    (lambda: F.HostSlots.create([1, 2, 3], 2), "^expert_nbytes must be 4"),
    (lambda: F.HostSlots.create([-4096] * 4, 2), r"^expert_nbytes\[0\] must be"),
    (lambda: F.HostSlots.create(NB, 2.5), "^num_slots must be"),
    (lambda: F.HostSlots.attach(None, NB, 2), "^name must be"),
    (lambda: F.HostSlots.layout([2 ** 58] * 4, 16), "the host slots would take"),
], ids=["ctl_tp_float", "ctl_slots_None", "ctl_name_None", "slots_3_sizes", "slots_negative", "slots_count_float",
        "slots_name_None", "slots_too_large"])
def test_segments_refuse_before_creating(call, name):
    with _shm.tagged_segments() as shm:
        with pytest.raises(ValueError, match=name):
            call()
    assert shm.created == []


@pytest.mark.parametrize("slot,kind,name", [(2, 0, "^slot must be in 0..1"), (-1, 0, "^slot must be in 0..1"),
                                            (0, 4, "^kind must be in 0..3"), (0, 1.0, "^kind must be")])
def test_host_slot_indices_are_checked(slot, kind, name):
    # Slot 2 of 2 was the next kind's memory (or past the segment): a view or pointer of the wrong bytes.
    s = F.HostSlots.create(NB, 2)
    try:
        with pytest.raises(ValueError, match=name):
            s.view(slot, kind)
        with pytest.raises(ValueError, match=name):
            s.ptr(slot, kind)
        v = s.view(1, 3)
        assert v.numel() == NB[3] and v.data_ptr() == s.ptr(1, 3)
    finally:
        s.close()


# ---- FileExchange -------------------------------------------------------------------------------------
@pytest.mark.parametrize("directory", [None, 5], ids=repr)
def test_file_exchange_directory_must_be_a_path(directory, tmp_path):
    with pytest.raises(ValueError, match="^directory must be a path"):
        F.FileExchange(directory, 0, 1)
    with F.FileExchange(tmp_path, 0, 1) as ex:
        with pytest.raises(ValueError, match="^timeout_s must be"):
            ex.close(timeout_s="soon")
        assert ex([1]) == [[1]]


def test_file_exchange_object_json_refuses_leaves_the_rounds_in_step(tmp_path):
    # The round count went up before the object was serialised: after the TypeError, rank 0 wrote
    # round 2 while rank 1 waited for rank 0's round 1, until the timeout.
    got, errs = {}, []

    def rank_main(r):
        try:
            ex = F.FileExchange(tmp_path, r, 2, timeout_s=5)
            if r == 0:
                with pytest.raises(TypeError, match="not JSON serializable"):
                    ex(object())
                assert ex.round == 0 and ex.session is None
            got[r] = ex({"r": r})
            ex.close()
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errs.append((r, repr(exc)))

    ths = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(30)
    assert not errs, errs
    assert got == {0: [{"r": 0}, {"r": 1}], 1: [{"r": 0}, {"r": 1}]}


# Another local user must not be able to plant or read the files of a FileExchange (they carry the
# shared-memory names): its folder must be this user's and writable by nobody else, and not a link.
@pytest.mark.fault
def test_file_exchange_refuses_a_folder_others_can_write(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(ValueError, match=r"^directory: .*shared is writable by its group or by others \(mode 0777\)"):
        F.FileExchange(d, 0, 1)
    os.chmod(d, 0o770)
    with pytest.raises(ValueError, match=r"mode 0770"):
        F.FileExchange(d, 0, 1)
    os.chmod(d, 0o755)  # readable, not writable by others: accepted (the files inside are 0600)
    with F.FileExchange(d, 0, 1) as ex:
        assert ex(["ok"]) == [["ok"]]


@pytest.mark.fault
def test_file_exchange_refuses_a_symbolic_link(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(ValueError, match=r"^directory: .*link is a symbolic link"):
        F.FileExchange(link, 0, 1)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
@pytest.mark.fault
def test_file_exchange_refuses_a_folder_of_another_user(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    with pytest.raises(ValueError, match=r"^directory: .*theirs belongs to uid 65534, not to this user"):
        F.FileExchange(d, 0, 1)


@pytest.mark.fault
def test_file_exchange_refuses_a_planted_session_folder(tmp_path):
    """session.json names a session whose folder is a link to someone else's: the joining rank raises
    at once instead of writing its seat there, and rank 0's clean-up does not follow the link."""
    from fp8_layerwise import exchange as X

    d = tmp_path / "x"
    d.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (d / "s.planted").symlink_to(elsewhere)
    me = {"nonce": "planted", "pid": os.getpid(), "start": X._proc_start_time(os.getpid()), "world_size": 2}
    (d / "session.json").write_text(json.dumps(me))
    with pytest.raises(ValueError, match="the session folder s.planted that session.json names is a symbolic link"):
        F.FileExchange(d, 1, 2, timeout_s=5)(["rank 1"])
    assert list(elsewhere.iterdir()) == [], "nothing was written through the link"
    F.FileExchange(d, 0, 1)._remove_dead_sessions()
    assert elsewhere.is_dir() and (d / "s.planted").is_symlink()
