"""Any segments in a snapshot load, or get one error line (a property test: it needs hypothesis;
tests/unit/test_late_history.py has the rest)."""

import contextlib
import io
import os
import pickle
import tempfile

import pytest

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # a venv made with `pip install . pytest`
    pytest.skip("these property tests need hypothesis", allow_module_level=True)

from gpumem.__main__ import main
from gpumem.trace import TraceError, load_trace
from test_late_history import FRAME, entry

# ---- hostile segments ------------------------------------------------------------------

_anything = st.one_of(
    st.none(), st.booleans(), st.integers(-2, 1 << 65), st.text(max_size=3), st.lists(st.integers(), max_size=2)
)
_small = st.integers(0, 4).map(lambda i: (1 << 40) + i * 512)
_block = st.fixed_dictionaries(
    {},
    optional={
        "size": st.one_of(st.sampled_from([512, 1024, 4096]), _anything),
        "requested_size": st.one_of(st.integers(0, 4096), _anything),
        "state": st.one_of(st.sampled_from(["active_allocated", "active_pending_free", "inactive"]), _anything),
        "frames": st.one_of(st.lists(st.one_of(st.just(FRAME), _anything), max_size=2), _anything),
    },
)
_segment = st.fixed_dictionaries(
    {},
    optional={
        "device": st.one_of(st.integers(0, 1), _anything),
        "address": st.one_of(_small, _anything),
        "total_size": st.one_of(st.sampled_from([4096, 1 << 20]), _anything),
        "stream": st.one_of(st.integers(0, 3), _anything),
        "blocks": st.one_of(st.lists(st.one_of(_block, _anything), max_size=4), _anything),
    },
)
_event = st.builds(
    lambda a, addr, size: entry(a, addr, size),
    st.sampled_from(["alloc", "free_completed", "free_requested", "segment_map", "oom"]),
    _small,
    st.sampled_from([512, 1024]),
)


@settings(max_examples=300, deadline=None)
@given(
    segments=st.one_of(st.lists(st.one_of(_segment, _anything), max_size=3), _anything),
    events=st.lists(st.lists(_event, max_size=6), min_size=1, max_size=2),
    settings_=st.one_of(st.just({"allocator": "gpumem"}), _anything),
)
def test_any_segments_load_or_get_one_error_line(segments, events, settings_):
    snap = {"segments": segments, "device_traces": events, "allocator_settings": settings_}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "s.pickle")
        with open(path, "wb") as f:
            pickle.dump(snap, f)
        for device in range(len(events)):
            try:
                t = load_trace(path, device=device)
            except TraceError as e:
                assert "\n" not in str(e) and str(e).startswith(path)
                continue
            assert t.live_before_bytes <= t.peak_live_bytes
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                rc = main(["explain", path, "--device", str(device), "--capacity", "1GiB"])
            assert rc == 0 or (rc == 2 and err.getvalue().count("\n") == 1), err.getvalue()
