"""The dispatch-mode checks both low-level backends share (elastic_ep._checks)."""
import pytest

from tests.elastic_ep._common import import_elastic_ep


def _checks():
    import_elastic_ep()
    from elastic_ep import _checks

    return _checks


def test_zero_padding_needs_expand():
    with pytest.raises(ValueError, match="do_zero_padding: only valid with do_expand=True"):
        _checks().check_dispatch_modes(False, True, False, None)
    _checks().check_dispatch_modes(True, True, True, None)


def test_cached_mode_names_every_missing_field_and_forbids_cpu_sync():
    full = {"cached_a": 1, "cached_b": [0]}
    _checks().check_dispatch_modes(False, False, False, full)
    with pytest.raises(ValueError, match="missing cached_b, cached_c"):
        _checks().check_dispatch_modes(False, False, False, {"cached_a": 1, "cached_b": None, "cached_c": None})
    with pytest.raises(ValueError, match="cannot do a CPU sync"):
        _checks().check_dispatch_modes(False, False, True, full)


def test_expert_id_count_and_example(monkeypatch):
    import torch

    c = _checks()
    idx = torch.tensor([[0, 1, -1], [7, 3, 2]], dtype=torch.int64)
    assert c.count_bad_expert_ids(idx, 8) == (0, 0)  # -1 (masked) and 0..7 are fine
    bad = idx.clone()
    bad[1, 0], bad[0, 2] = 8, -2
    n, example = c.count_bad_expert_ids(bad, 8)
    assert n == 2 and example in (8, -2)
    assert c.count_bad_expert_ids(torch.empty((0, 3), dtype=torch.int64), 8) == (0, 0)
    with pytest.raises(ValueError, match=r"expert ids must be in \[-1, 8\), got 2 outside it \(e\.g\. 8\)"):
        raise c.expert_ids_error(2, 8, 8)
    assert c.index_check_enabled()
    monkeypatch.setenv("EP_SKIP_INDEX_CHECK", "1")
    assert not c.index_check_enabled()  # the documented escape hatch
