"""A pool's free memory grows in place: a pool's request extends its free block into unmapped space,
keeps to its pool and stream rules, and leaves the pages beside general memory alone (and the general
heap leaves a pool's pages alone); the pool keeps its free memory in one piece at its edge, so that
graphs recorded at growing shapes reserve about what they use at once."""

import random

import pytest

from helpers import GiB, MiB, PAGE, assert_ok
from test_pools import P, Q, S1, S2, _reserved, blocks, overlaps, pool_blocks, random_traffic


# ---- a pool's free memory grows in place ----------------------------------------------------


def test_pool_request_extends_the_pools_free_block_into_unmapped_space(make_heap):
    """A pool request larger than the pool's last free block, next to unmapped
    space, is placed over that block and needs only the missing pages."""
    h = make_heap()
    h.pool_retain(P)
    a = h.malloc(4 * MiB, pool=P)  # pages 0-1, unmapped space after
    h.free(a)
    before = _reserved(h)
    b = h.malloc(10 * MiB, pool=P)
    assert b == a, "the pool's free block was not extended"
    assert _reserved(h) - before == 3 * PAGE  # pages 2-4 only
    info = h.pool_info(P)
    assert (info["live_bytes"], info["free_bytes"], info["free_blocks"]) == (10 * MiB, 0, 0)
    assert pool_blocks(h, P) == [(a, 10 * MiB, "live")]
    assert_ok(h)
    h.free(b)
    assert pool_blocks(h, P) == [(a, 10 * MiB, "free")]
    h.empty_cache()
    assert _reserved(h) == 5 * PAGE, "the extended block's pages are the pool's, kept"
    h.pool_release(P)
    assert_ok(h)


def test_pool_extension_spans_pool_general_and_unmapped_space(make_heap):
    """[pool free][general free][unmapped]: one placement over all three."""
    h = make_heap()
    h.pool_retain(P)
    w = h.malloc(2 * MiB)  # general, page 0
    s = h.malloc(2 * MiB)  # general, page 1
    h.free(w)
    a = h.malloc(MiB, pool=P)  # the pool takes w's page, all of it
    h.free(s)
    h.free(a)
    assert [(b["addr"], b["size"], b["pool"]) for b in blocks(h) if b["state"] == "free"] == [
        (a, 2 * MiB, P),
        (a + 2 * MiB, 2 * MiB, None),
    ]
    before = _reserved(h)
    b = h.malloc(7 * MiB, pool=P)
    assert b == a
    assert _reserved(h) - before == 2 * PAGE  # pages 2-3
    assert pool_blocks(h, P) == [(a, 7 * MiB, "live"), (a + 7 * MiB, MiB, "free")]  # the rest of page 3 too
    assert_ok(h)
    h.free(b)
    h.pool_release(P)
    assert_ok(h)


def test_pool_extension_keeps_to_its_pool_and_stream_rules(make_heap):
    """Another pool's free block, and a free block of the pool that the
    requesting stream may not use yet, are never extended."""
    h = make_heap()
    h.pool_retain(P)
    h.pool_retain(Q)
    q = h.malloc(4 * MiB, stream=S1, pool=Q)  # pages 0-1
    h.free(q)
    before = _reserved(h)
    x = h.malloc(10 * MiB, stream=S1, pool=P)
    assert not overlaps(x, 10 * MiB, [(q, 4 * MiB)]), "a pool request took another pool's free memory"
    assert _reserved(h) - before == 5 * PAGE
    h.free(x)  # P's, owned by S1, unmapped space beside it
    before = _reserved(h)
    z = h.malloc(12 * MiB, stream=S1, pool=P)  # S1 may use it: its block grows by one page
    assert z <= x and x + 10 * MiB <= z + 12 * MiB and _reserved(h) - before == PAGE
    h.free(z)
    h.sim_hold_stream(S1, True)  # S1's work still runs: S2 may not use z's memory
    y = h.malloc(20 * MiB, stream=S2, pool=P)
    assert not overlaps(y, 20 * MiB, [(z, 12 * MiB)])
    assert h.sim_capture_violations() == 0
    h.sim_hold_stream(S1, False)
    assert_ok(h)
    h.free(y)
    h.pool_release(P)
    h.pool_release(Q)
    assert_ok(h)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_pools_growing_among_general_traffic_keep_every_invariant(make_heap, seed):
    """Pool requests a little larger than a free block of their pool, among
    general traffic, streams, empty_cache and a cap: invariants hold after
    every step, no pool gets another's memory, and extensions do happen."""
    rng = random.Random(seed)
    h = make_heap(capacity=256 * MiB)
    pools = (P, Q)
    for pid in pools:
        h.pool_retain(pid)
    live = {P: [], Q: [], None: []}
    extended = 0

    def step(i, r):
        nonlocal extended
        if r < 0.5:
            pid = rng.choice((P, Q, None))
            frees = [(a, n) for a, n, st in pool_blocks(h, pid) if st == "free"] if pid else []
            if frees and rng.random() < 0.7:
                size = rng.choice(frees)[1] + rng.randrange(1, 3 * PAGE)
            else:
                size = rng.randrange(512, 6 * MiB)
            others = [(a, n) for q in pools if q != pid for a, n, st in pool_blocks(h, q) if st == "free"]
            p = h.malloc(size, stream=rng.choice((S1, S2)), pool=pid)
            n = h.block_size(p)
            assert not overlaps(p, n, others), f"step {i}: a block of {pid} took another pool's memory"
            extended += any(p <= a and a + m <= p + n and m < n for a, m in frees)
            live[pid].append(p)
        else:
            lst = live[rng.choice((P, Q, None))]
            if lst:
                h.free(lst.pop(rng.randrange(len(lst))))

    random_traffic(h, rng, 500, step, caps=(128 * MiB, 192 * MiB, 0))
    assert extended > 0, "no pool request extended a free block of its pool"
    for lst in live.values():
        for p in lst:
            h.free(p)
    for pid in pools:
        h.pool_release(pid)
    h.empty_cache()
    assert_ok(h)
    assert h.stats()["reserved_bytes.all.current"] == 0


def test_pool_request_prefers_the_pools_free_memory_on_a_tie(make_heap):
    """Two places need the same new pages: a short run of general memory, and
    the pool's free block before unmapped space.  The pool's request takes the
    pool's memory, which serves nothing else, and leaves the general memory."""
    h = make_heap()
    h.pool_retain(P)
    g = h.malloc(4 * MiB)  # pages 0-1
    h1 = h.malloc(4 * MiB)  # pages 2-3
    h.malloc(2 * MiB)  # page 4, stays live
    a = h.malloc(4 * MiB, pool=P)  # pages 5-6
    h.free(h1)
    h.empty_cache()  # pages 2-3 unmapped
    h.free(g)  # [0, 4) MiB general free, mapped
    h.free(a)  # the pool's, unmapped space after it
    before = _reserved(h)
    b = h.malloc(8 * MiB, pool=P)  # here or at g: two new pages either way
    assert b == a
    assert _reserved(h) - before == 2 * PAGE
    assert [(x["addr"], x["size"]) for x in blocks(h) if x["state"] == "free" and x["pool"] is None][0] == (g, 4 * MiB)
    assert_ok(h)


def test_a_general_block_never_lands_in_a_pools_last_page(make_heap):
    """The rest of the last page of a pool's new block, before unmapped space,
    becomes the pool's: a small general tensor allocated between two
    recordings goes elsewhere, and the next, larger recording extends the
    pool's free memory instead of leaving it stranded behind that tensor."""
    h = make_heap()
    h.pool_retain(P)
    h.malloc(3 * MiB)  # general, pages 0-1
    a = h.malloc(10 * PAGE - MiB, pool=P)  # [4, 23) MiB: pages 2-11, page 11 the pool's last
    assert pool_blocks(h, P) == [(a, 10 * PAGE - MiB, "live"), (a + 10 * PAGE - MiB, MiB, "free")]
    h.free(a)
    g = h.malloc(128 << 10)  # general, between recordings
    assert not (a <= g < a + 11 * PAGE)
    before = _reserved(h)
    b = h.malloc(20 * PAGE, pool=P)
    assert b == a, "the pool's free memory was left behind"
    assert _reserved(h) - before == 10 * PAGE
    assert_ok(h)
    h.free(b)
    h.pool_release(P)
    assert_ok(h)


def test_general_growth_leaves_the_space_after_a_pool_to_it(make_heap):
    """A pool whose last block ends on a page boundary: the general heap's
    next new page goes elsewhere than right after it, so the pool extends in
    place; once the pool ends, that space is everyone's again."""
    h = make_heap()
    h.pool_retain(P)
    w = h.malloc(2 * PAGE)  # general, pages 0-1 whole: no general space left on them
    a = h.malloc(10 * PAGE, pool=P)  # pages 2-11: ends at page 12's start
    h.free(a)
    g = h.malloc(128 << 10)  # needs a new page
    assert g != a + 10 * PAGE, "general growth started right after the pool"
    b = h.malloc(20 * PAGE, pool=P)
    assert b == a
    assert_ok(h)
    h.free(b)
    h.pool_release(P)
    h.free(g)
    h.free(w)
    h.empty_cache()
    assert _reserved(h) == 0
    x = h.malloc(MiB)
    assert x == w, "with no pool living, growth starts at the lowest address again"
    assert_ok(h)


def test_a_pool_grows_at_its_edge_rather_than_take_cached_pages_elsewhere(make_heap):
    """A pool's request that one new page at the pool's free edge serves, and
    cached general pages elsewhere would serve with none, still extends the
    pool's own free memory: the pool stays one region, as its later, larger
    graphs need."""
    h = make_heap()
    h.pool_retain(P)
    h.malloc(2 * PAGE)  # general, pages 0-1
    a = h.malloc(2 * PAGE, pool=P)  # pages 2-3
    top = h.malloc(PAGE, pool=P)  # page 4, the pool's edge
    g = h.malloc(2 * PAGE)  # general, away from the pool
    assert g > top + 2 * PAGE
    h.free(g)  # two cached general pages
    h.free(top)
    before = _reserved(h)
    b = h.malloc(2 * PAGE, pool=P)
    assert b == top, "the pool started a second region"
    assert _reserved(h) - before == PAGE
    assert_ok(h)
    h.free(b)
    h.free(a)
    h.pool_release(P)
    assert_ok(h)


def test_a_pool_request_never_takes_the_rest_of_a_general_page(make_heap):
    """A pool's block never shares a page with general memory, even where that
    would save a page: the pool's pages are its own while it lives, as a
    native segment is, and the page a general block holds stays general."""
    h = make_heap()
    h.pool_retain(P)
    g = h.malloc(3 * MiB)  # general, pages 0-1: 1 MiB of page 1 free
    before = _reserved(h)
    a = h.malloc(512, pool=P)
    assert a == g + 2 * PAGE, "the pool's block landed on a page general memory uses"
    assert _reserved(h) - before == PAGE
    assert pool_blocks(h, P) == [(a, 512, "live"), (a + 512, PAGE - 512, "free")]  # the rest of its page
    x = h.malloc(MiB)  # general: the rest of page 1, never the pool's page
    assert x == g + 3 * MiB
    b = h.malloc(8 * MiB, pool=P)  # neither the general page's rest: pages of its own
    assert b % PAGE == a % PAGE and not (g <= b < g + 2 * PAGE)
    assert_ok(h)
    h.free(b)
    h.free(a)
    h.pool_release(P)
    assert_ok(h)


def test_a_page_with_another_streams_free_block_is_not_the_pools(make_heap):
    """A pool takes a page whole, the rest of it included, only if the requesting
    stream may use that rest: a page where another stream's free block waits
    for that stream's work stays general, and the pool takes a page of its own."""
    h = make_heap()
    h.pool_retain(P)
    u = h.malloc(MiB, stream=S1)  # [0, 1) MiB; the rest of page 0 is S1's
    v = h.malloc(MiB, stream=S2)  # S1's rest handed over: [1, 2) MiB
    assert v == u + MiB
    h.sim_hold_stream(S2, True)
    h.free(v)  # S2's, while S2's work runs
    h.free(u)
    b = h.malloc(MiB, stream=S1, pool=P)
    assert b == u + PAGE, "the pool took a page whose rest another stream's work may still use"
    free = [(x["addr"], x["size"], x["stream"], x["pool"]) for x in blocks(h) if x["state"] == "free"]
    assert free == [(u, MiB, S1, None), (v, MiB, S2, None), (b + MiB, MiB, S1, P)]
    assert_ok(h)
    h.sim_hold_stream(S2, False)
    h.free(b)
    h.pool_release(P)
    assert_ok(h)


# ---- the free memory at a pool's edge stays in one piece ---------------------------------------


def test_a_pool_carves_from_the_top_of_its_free_block_at_its_lower_edge(make_heap):
    """A pool that grows downwards (unmapped space below its lowest block): a
    small request takes the top of the free block there, so that the free rest
    stays at the edge and the next larger request extends it by the pages it
    lacks, as an expandable segment keeps its free tail at its growing end."""
    h = make_heap()
    h.pool_retain(P)
    g = h.malloc(20 * MiB)  # general, pages 0-9
    a = h.malloc(4 * MiB, pool=P)  # pages 10-11
    b = h.malloc(4 * MiB, pool=P)  # pages 12-13, live above
    assert a == g + 20 * MiB and b == a + 4 * MiB
    h.free(g)
    h.empty_cache()  # pages 0-9 unmapped: the pool's lower edge
    h.free(a)
    x = h.malloc(2 * MiB, pool=P)
    assert x == a + 2 * MiB, "the small request did not take the top of the free block"
    before = _reserved(h)
    y = h.malloc(8 * MiB, pool=P)
    assert y == a - 6 * MiB, "the larger request did not extend the free rest at the edge"
    assert _reserved(h) - before == 3 * PAGE
    assert_ok(h)
    for p in (x, y, b):
        h.free(p)
    h.pool_release(P)
    assert_ok(h)


def test_a_pools_free_neighbours_merge_across_growths(make_heap):
    """Two neighbouring growths of a pool, both freed, are one free block: a
    request of their joint size takes it on the fast path.  A no_split pool's
    blocks are whole growths, and stay apart."""
    for no_split in (False, True):
        h = make_heap()
        h.pool_retain(P)
        h.pool_set_no_split(P, no_split)
        a = h.malloc(4 * MiB, pool=P)
        b = h.malloc(6 * MiB, pool=P)  # another growth, right after a
        assert b == a + 4 * MiB
        h.free(a)
        h.free(b)
        assert_ok(h)
        if no_split:
            assert pool_blocks(h, P) == [(a, 4 * MiB, "free"), (b, 6 * MiB, "free")]
            continue
        assert pool_blocks(h, P) == [(a, 10 * MiB, "free")]
        slow, before = h.stats()["num_slow_allocs"], _reserved(h)
        c = h.malloc(10 * MiB, pool=P)
        assert (c, h.stats()["num_slow_allocs"], _reserved(h)) == (a, slow, before)
        h.free(c)
        h.pool_release(P)
        assert_ok(h)


def test_a_pool_extends_its_free_memory_over_a_chunk_it_holds(make_heap):
    """Far from pressure a pool's large growth is mapped as chunks of many pages.
    A later request may extend the pool's free memory over part of such a
    chunk when the rest of the chunk is the pool's too (a live block of the
    pool lies there): it maps only the pages it lacks, instead of all of them
    elsewhere."""
    h = make_heap(capacity=80 * GiB)
    h.pool_retain(P)
    r = h.malloc(200 * MiB, pool=P)
    h.free(r)
    x = h.malloc(20 * MiB, pool=P)  # at the start, on the chunk's first pages
    assert x == r
    before = _reserved(h)
    y = h.malloc(300 * MiB, pool=P)
    assert y == r + 20 * MiB, "the pool's free memory was not extended"
    assert _reserved(h) - before == 120 * MiB
    assert_ok(h)
    h.free(x)
    h.free(y)
    h.pool_release(P)
    assert_ok(h)


def _encoder_weights():
    """A BERT-base's weights, bf16, one allocation per tensor."""
    hid, inter, vocab = 768, 3072, 30522
    layer = [hid * hid, hid] * 4 + [hid, hid] + [inter * hid, inter, hid * inter, hid] + [hid, hid]
    return [2 * n for n in [vocab * hid, 512 * hid, 2 * hid, hid, hid] + layer * 12 + [hid * hid] + [hid] * 4 + [vocab]]


def _encoder_pass(alloc, free, batch, seq):
    """A compiled BERT-base's forward with its language-model head, as its
    recorded graphs allocate it: buffers the layers share, each layer's
    attention scores (fp32) and MLP intermediate, then the head's weight,
    copied, and the logits, which it returns."""
    tokens, hid, vocab = batch * seq, 768, 30522
    x, y = alloc(tokens * hid * 2), alloc(tokens * hid * 2)
    blas = [alloc(32 * MiB), alloc(MiB)]  # cuBLAS's workspaces
    shared = [alloc(tokens * hid * 2), alloc(tokens * hid * 4), alloc(tokens * hid * 4)]
    for _ in range(12):
        free(alloc(batch * 12 * seq * seq * 4))
        free(alloc(tokens * 3072 * 2))
    for p in shared[::-1] + [y]:
        free(p)
    free(alloc(tokens * 3072 * 2))
    head = [alloc(vocab * hid * 2), alloc(vocab * 2)]
    logits = alloc(tokens * vocab * 2)
    for p in [x] + head + blas:
        free(p)
    return logits


@pytest.mark.parametrize("weights", ["per_tensor", "one_block"])
def test_graphs_of_growing_shapes_reserve_about_their_peak_live(make_heap, weights):
    """torch.compile(mode="reduce-overhead") on an encoder at three shapes:
    one pool, a warm-up and a recorded pass per shape under a capture.  The
    pool reserves at most 3% more than its peak live (a growable segment per
    pool, 2.3% here), whether it grows upwards (the weights in one block) or
    downwards from the top of the address space (a tensor per weight leaves
    the general heap's last pages partly used)."""
    h = make_heap(capacity=80 * GiB)
    sizes = _encoder_weights()
    w = [h.malloc(n, stream=S1) for n in (sizes if weights == "per_tensor" else [sum(sizes)])]
    h.pool_retain(P)
    peak = 0

    def alloc(n):
        nonlocal peak
        p = h.malloc(n, stream=S1, pool=P)
        peak = max(peak, h.pool_info(P)["live_bytes"])
        return p

    for batch, seq in ((8, 512), (32, 512), (64, 256)):
        h.capture_begin()
        for _ in range(2):  # warm-up, then the recording
            h.free(_encoder_pass(alloc, h.free, batch, seq))
        h.capture_end()
    pool = h.pool_info(P)["pinned_pages"] * PAGE
    assert pool <= 1.03 * peak, f"the pool reserves {pool / MiB:.0f} MiB for {peak / MiB:.0f} MiB live at most"
    assert_ok(h)
    for p in w:
        h.free(p)
    h.pool_release(P)
    assert_ok(h)
