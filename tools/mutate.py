#!/usr/bin/env python3
"""Mutation testing of the core: plant one bug at a time in csrc/core,
build a copy of the repository with it, run the C fuzz driver and the tests,
and report which of them caught it.

    python3 tools/mutate.py                 # every mutation, default tests
    python3 tools/mutate.py -m growth_limit_removed -m stream_reuse_early
    python3 tools/mutate.py --tests tests/unit/test_core.py --json out.json
    python3 tools/mutate.py --list

Each run copies the tracked files into a temporary folder, so the working
tree is never modified and nothing needs reverting.  The tests run with CI=1 and
the "mutate" hypothesis profile (the CI profile's derandomized examples, no
shrinking; see tests/conftest.py), so the table is the same on every run.  A mutation is "caught" when the fuzz
driver or at least one test
fails; the baseline (no mutation) must pass everything, or the table means
nothing and the script says so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAP = "csrc/core/heap.c"


@dataclass
class Mutation:
    name: str
    bug: str
    old: str
    new: str
    path: str = HEAP


MUTATIONS = [
    Mutation(
        "growth_limit_removed",
        "growth limit removed: the heap grows freely to the cap",
        "    size_t limit = growth_limit(h, size);\n",
        "    size_t limit = ((void)growth_limit(h, size), h->cap_pages);\n",
        path="csrc/core/policy.c",
    ),
    Mutation(
        "stream_reuse_early",
        "stream owner: blocks freed after the release event are handed to every stream",
        "moved += release_blocks(&c, o, o->release_seq);",
        "moved += release_blocks(&c, o, h->free_seq);",
        path="csrc/core/stream.c",
    ),
    Mutation(
        "release_without_event",
        "stream owner: memory handed to every stream without waiting for the event",
        "if (event_done(h, o->release_event)) {",
        "if (1) {",
        path="csrc/core/stream.c",
    ),
    Mutation(
        "merge_different_owners",
        "free blocks of two different streams merge",
        "    else if (a == ANY)\n        *out = b;\n    else\n        return 0;",
        "    else if (a == ANY)\n        *out = b;\n    else\n        *out = a;",
        path="csrc/core/block.c",
    ),
    Mutation(
        "handoff_without_wait",
        "hand-off: a stream takes memory another freed without waiting for that stream's work",
        "    if (h->dev->ops->stream_wait(h->dev, s, ev) == GM_OK) return 1;",
        "    if (s != ANY && ev) return 1;",
        path="csrc/core/stream.c",
    ),
    Mutation(
        "pending_ignores_events",
        "record_stream: a pending block is freed before its events complete",
        "if (synced || event_done(h, b->events[i])) {",
        "if (1) {",
        path="csrc/core/stream.c",
    ),
    Mutation(
        "record_stream_ignored",
        "record_stream records nothing",
        "    if (s == b->stream) goto done;\n    for (uint32_t i = 0; i < b->n_uses; i++)",
        "    goto done;\n    for (uint32_t i = 0; i < b->n_uses; i++)",
        path="csrc/core/heap.c",
    ),
    Mutation(
        "unmap_shared_page",
        "defragmentation unmaps pages a free block shares with a live neighbour",
        "size_t p0 = h_page_ceil(h, b->addr), p1 = h_page_floor(h, b->addr + b->size);\n"
        "        if (p0 >= p1) continue;",
        "size_t p0 = h_page_floor(h, b->addr), p1 = h_page_ceil(h, b->addr + b->size);\n"
        "        if (p0 >= p1) continue;",
        path="csrc/core/page.c",
    ),
    Mutation(
        "stat_requested_off_by_one",
        "stats: requested_bytes off by one at free",
        "h_stat_down(h->st.requested_bytes, pool, (int64_t)b->requested);",
        "h_stat_down(h->st.requested_bytes, pool, (int64_t)b->requested + 1);",
        path="csrc/core/heap.c",
    ),
    Mutation(
        "stat_ooms_uncounted", "stats: num_ooms not counted", "    h->st.num_ooms++;\n", "\n", path="csrc/core/slow.c"
    ),
    Mutation(
        "no_merge_with_next",
        "a freed block does not merge with its upper free neighbour",
        "    if (n && h_may_merge_free(h, b, n, &o)) {",
        "    if (0 && n && h_may_merge_free(h, b, n, &o)) {",
        path="csrc/core/block.c",
    ),
    Mutation(
        "cap_off_by_one_page",
        "growth stops one page under the cap (OOM too early)",
        "h_grow(h, lacking(h, pl, *a->grant), h->cap_pages, a->g, a->dev_err);\n    if (pl->ok && !lacking",
        "h_grow(h, lacking(h, pl, *a->grant), h->cap_pages - 1, a->g, a->dev_err);\n    if (pl->ok && !lacking",
        path="csrc/core/slow.c",
    ),
    Mutation(
        "empty_cache_keeps_a_page",
        "empty_cache keeps one spare page",
        "    /* What cannot go backs live blocks (or an unmap failed). */\n    return h_release_spares(h, target);",
        "    /* What cannot go backs live blocks (or an unmap failed). */\n    return h_release_spares(h, target + 1);",
        path="csrc/core/heap.c",
    ),
    Mutation(
        "peak_live_not_tracked",
        "the growth limit forgets the peak of live memory",
        "        h->peak_live = (size_t)h->st.active_bytes[GM_POOL_ALL].current;",
        "        (void)0;",
        path="csrc/core/heap.c",
    ),
    Mutation(
        "placement_ignores_shared_pages",
        "carving ignores which end shares a page with a live neighbour",
        "    if (f_hi != f_lo) return f_hi < f_lo ? hi : b->addr;",
        "    if (0 && f_hi != f_lo) return f_hi < f_lo ? hi : b->addr;",
        path="csrc/core/heap.c",
    ),
    Mutation(
        "free_history_dropped",
        "history: frees are not recorded",
        "    h_hist_block(h, GM_H_FREE_REQUESTED, b->addr, b->size, b->requested, b->stream, b->context);\n",
        "\n",
        path="csrc/core/heap.c",
    ),
    Mutation(
        "pause_releases_shared_chunk",
        "pause: the pool's pages of a chunk it shares with other blocks are released too (the chunk in part)",
        "        for (; i < n && l[i].page < e; i++) (*shared)++;\n",
        "        (void)shared;\n        for (; i < n && l[i].page < e; i++, k++) l[k] = (gm_paused_page){l[i].page, k};\n",  # noqa: E501
        path="csrc/core/pause.c",
    ),
    Mutation(
        "resume_skips_backup",
        "resume: the backup is not copied back",
        "for (size_t i = 0, j; p->backup && i < n; i = j) {",
        "for (size_t i = 0, j; 0 && p->backup && i < n; i = j) {",
        path="csrc/core/pause.c",
    ),
    Mutation(
        "paused_pool_allocates",
        "an allocation in a paused pool is served",
        "if (pool && pool->paused) {",
        "if (pool && pool->paused && 0) {",
        path="csrc/core/heap.c",
    ),
    Mutation(
        "hand_over_merge_stays_everyones",
        "a free merged with a block a device wait handed to every stream is handed over too, unproven",
        "    a->epoch = ea > eb ? ea : eb;",
        "    a->epoch = ea < eb ? ea : eb;",
        path="csrc/core/block.c",
    ),
    Mutation(
        "chunk_unmapped_in_part",
        "chunks: recycling takes the free pages of a chunk that a live block still uses (unmaps it in part)",
        "            whole_chunks(h, &parts[k][0], &parts[k][1]);\n",
        "            (void)whole_chunks;\n",
        path="csrc/core/page.c",
    ),
    Mutation(
        "locked_pages_counted_cached",
        "chunks: free pages of a partly used chunk count as cached (and no OOM report names them)",
        "    if (!h->multi_chunks) return 0;\n    size_t locked = 0, g0 = 0;",
        "    if (1) return 0;\n    size_t locked = 0, g0 = 0;",
        path="csrc/core/page.c",
    ),
    Mutation(
        "inaccessible_pages_freed",
        "pages whose access grant keeps failing, and which may not be unmapped (a capture), become free space",
        "    if (!granted && *p1 > p0) {",
        "    if (0 && !granted && *p1 > p0) {",
        path="csrc/core/place.c",
    ),
    Mutation(
        "pool_page_rest_left_general",
        "pools: the rest of a pool's last page stays general, so general memory shares the pool's page",
        "!b->next->pool) claim_pool_pages(h, b, pool",
        "!b->next->pool && !b->size) claim_pool_pages(h, b, pool",
        path="csrc/core/heap.c",
    ),
    Mutation(
        "pool_edge_ignored",
        "pools: a pool's request starts a second region elsewhere to save one page",
        "c.best.new_pages + POOL_EDGE_PAGES) return c.best_pooled;",
        "c.best.new_pages + POOL_EDGE_PAGES) return c.best;",
        path="csrc/core/place.c",
    ),
    Mutation(
        "growth_beside_pool",
        "pools: the general heap's new memory may start right after a living pool's block",
        "    p.beside = x == first->addr && first->prev",
        "    p.beside = 0 && x == first->addr && first->prev",
        path="csrc/core/place.c",
    ),
    Mutation(
        "hand_over_left_in_place",
        "another stream allocates while a device wait's hand-over still sits in one stream's index",
        "    if (h->lazy_stream != ANY && s != h->lazy_stream) h_settle_release(h);",
        "    if (0) h_settle_release(h);",
        path="csrc/core/heap.c",
    ),
    Mutation(
        "torch_page_size_ignored",
        "torch: the heaps torch's allocations get ignore the page_size option",
        "    args.page_size = o.page_size;",
        "    args.page_size = 0;",
        path="csrc/runtime/heap_registry.c",
    ),
]

DEFAULT_TESTS = ["tests"]
FUZZ_RUNS = [["200000", "1"], ["--threads", "4", "100000", "2"]]


_PRISTINE = None


def copy_tree(dst: str) -> None:
    """The tracked files as they were when the run started (edits made while
    it runs do not leak into later mutants)."""
    global _PRISTINE
    if _PRISTINE is None:
        _PRISTINE = tempfile.mkdtemp(prefix="gpumem-pristine-")
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
        for rel in files.decode().split("\0"):
            src = os.path.join(ROOT, rel)
            if rel and os.path.isfile(src):
                os.makedirs(os.path.join(_PRISTINE, os.path.dirname(rel)), exist_ok=True)
                shutil.copy2(src, os.path.join(_PRISTINE, rel))
    shutil.copytree(_PRISTINE, dst, dirs_exist_ok=True)


def apply(tree: str, m: Mutation) -> None:
    path = os.path.join(tree, m.path)
    text = open(path).read()
    n = text.count(m.old)
    if n != 1:
        raise SystemExit(f"mutation {m.name}: the text to replace occurs {n} times in {m.path} (want 1)")
    open(path, "w").write(text.replace(m.old, m.new))


def run(cmd, cwd, env, timeout):
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout + p.stderr, time.time() - t0
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return "timeout", out, time.time() - t0


def evaluate(m: Mutation | None, tests, python, timeout, keep=False) -> dict:
    tree = tempfile.mkdtemp(prefix="gpumem-mutant-")
    res = {"mutation": m.name if m else "none", "bug": m.bug if m else "(no mutation)", "caught_by": []}
    try:
        copy_tree(tree)
        if m:
            apply(tree, m)
        env = dict(
            os.environ, CI="1", PYTHONDONTWRITEBYTECODE="1", GPUMEM_HYPOTHESIS_PROFILE="mutate", GPUMEM_TEST_HOOKS="1"
        )
        env.setdefault("GPUMEM_SHARED", os.path.join(os.path.dirname(ROOT), "shared"))
        rc, out, _ = run([python, "setup.py", "-q", "build_ext", "--inplace"], tree, env, 600)
        if rc != 0:
            res["caught_by"].append("build failed")
            res["build_log"] = out[-2000:]
            return res
        rc, out, _ = run(["make", "-s", "fuzz"], tree, env, 600)
        if rc != 0:
            res["caught_by"].append("fuzz build failed")
            res["build_log"] = out[-2000:]
            return res
        for args in FUZZ_RUNS:
            rc, out, secs = run(["./csrc/tests/fuzz"] + args, tree, env, timeout)
            if rc != 0:
                first = next((ln for ln in out.splitlines() if "FAIL" in ln or "fail" in ln), out.strip()[-200:])
                res["caught_by"].append(f"fuzz {' '.join(args)}: {first[:160]}")
        # tests/repo/test_mutate.py checks that each bug's text stands in the unmutated
        # tree: in a mutant it fails by construction, which would catch nothing.
        pytest = [python, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", "--ignore=tests/repo/test_mutate.py"]
        rc, out, secs = run([*pytest, *tests], tree, env, timeout)
        res["pytest_seconds"] = round(secs, 1)
        failed = sorted(set(re.findall(r"^FAILED (\S+?)(?: - |$)", out, re.M)))
        failed += sorted(set(re.findall(r"^ERROR (\S+?)(?: - |$)", out, re.M)))
        res["pytest_failed"] = failed
        if rc == "timeout":
            res["caught_by"].append("pytest timed out (hang)")
        elif rc not in (0, 1, 5) or (rc == 1 and not failed):
            res["caught_by"].append(f"pytest died (exit {rc})")
        res["caught_by"] += [f"pytest {t}" for t in failed]
        res["pytest_summary"] = (out.strip().splitlines() or [""])[-1]
        return res
    finally:
        if keep:
            print(f"  kept {tree}", file=sys.stderr)
        else:
            shutil.rmtree(tree, ignore_errors=True)


def short(caught: list[str], limit: int = 4) -> str:
    if not caught:
        return "**not caught**"
    names = []
    for c in caught:
        if c.startswith("fuzz "):
            c = "C fuzz driver (" + c.split(":", 1)[0][5:] + ")"
        names.append(re.sub(r"\[.*\]$", "[...]", re.sub(r"^pytest (tests/\w+/)?", "", c)))
    names = list(dict.fromkeys(names))
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return "; ".join(names[:limit]) + more


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--mutation", action="append", help="run only these (repeatable)")
    ap.add_argument("--tests", nargs="+", default=DEFAULT_TESTS, help="pytest arguments (default: tests)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per fuzz or pytest run")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    ap.add_argument("--keep", action="store_true", help="keep the mutated trees")
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args(argv)
    if a.list:
        for m in MUTATIONS:
            print(f"{m.name:32s} {m.bug}")
        return 0
    chosen = [m for m in MUTATIONS if not a.mutation or m.name in a.mutation]
    unknown = set(a.mutation or []) - {m.name for m in MUTATIONS}
    if unknown:
        raise SystemExit(f"unknown mutation(s): {', '.join(sorted(unknown))}")
    results = []
    if not a.no_baseline:
        base = evaluate(None, a.tests, a.python, a.timeout, a.keep)
        print(f"baseline: {base.get('pytest_summary', '')}", flush=True)
        if base["caught_by"]:
            print("the unmutated tree fails; fix that first:\n  " + "\n  ".join(base["caught_by"]), file=sys.stderr)
            return 2
        results.append(base)
    for m in chosen:
        r = evaluate(m, a.tests, a.python, a.timeout, a.keep)
        results.append(r)
        print(f"{m.name}: {short(r['caught_by'])}", flush=True)
    print("\n| bug planted in the core | caught by |\n|---|---|")
    for r in results:
        if r["mutation"] != "none":
            print(f"| {r['bug']} (`{r['mutation']}`) | {short(r['caught_by'])} |")
    caught = sum(1 for r in results if r["mutation"] != "none" and r["caught_by"])
    print(f"\n{caught} of {len(chosen)} planted bugs caught")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if _PRISTINE:
        shutil.rmtree(_PRISTINE, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
