"""The native allocator's model against a plain reference of torch's rules, block by block, over any
max_split_size (a property test: it needs hypothesis; tests/boundary/test_boundary_native.py has the rest)."""

import pytest

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # a venv made with `pip install . pytest`
    pytest.skip("these property tests need hypothesis", allow_module_level=True)

from test_boundary_native import MiB, differential

OPS = st.lists(
    st.tuples(
        st.sampled_from(["malloc", "malloc", "malloc", "free", "free", "empty"]),
        st.one_of(
            st.integers(0, 64 * MiB),
            st.integers(0, 44).map(lambda k: k * MiB + 512 * (k % 5) - 512 * (k % 3)),
        ),
        st.integers(0, 2),
    ),
    max_size=120,
)


@settings(max_examples=300)
@given(
    capacity=st.sampled_from([22 * MiB, 24 * MiB, 40 * MiB, 64 * MiB, 1 << 62]),
    max_split=st.one_of(
        st.none(),
        st.integers(20 * MiB + 1, 48 * MiB),
        st.sampled_from([21 * MiB - 512, 21 * MiB + 512, 23 * MiB - 1, 25 * MiB - 4096, 21 * MiB]),
    ),
    ops=OPS,
)
def test_native_model_matches_the_reference_for_any_max_split_size(capacity, max_split, ops):
    differential(capacity, max_split, ops)
