"""The figures of gpu_compare.py, each a stage of the run (compare/runner.py's Run, which this
mixin is part of): figure 6 (allocation sizes), figures 2 and 3 (uncapped replays), figure 1 (the
smallest cap each contender replays each trace in), figure 5 (the largest batch under a cap) and
figure 4 (training step times).  Each fills its figure's rows and notes in the run's results.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional

from . import report
from .search import MinPassSearch, align_up, seeds_around

MiB = 1 << 20
GiB = 1 << 30
ALIGN = 2 * MiB

# Search seeds for figure 1, not results: min capacity ÷ peak live that gpumem/data/traces/README.md
# reports for the native variants on an H100 with torch 2.11 (to 32 MiB).  RMM's pool has no
# published figure; native's is its seed.  gpumem's seed is its simulated figure.
README_PRIORS = {
    "seed_fragmentation": {"native": 1.097, "expandable": 1.116, "async": 1.217},
    "gpt2_varlen": {"native": 1.033, "expandable": 1.004, "async": 1.008},
    "bert_varlen": {"native": 1.044, "expandable": 1.010, "async": 1.039},
    "resnet50_multires": {"native": 1.039, "expandable": 1.010, "async": 1.020},
    "gpt2_generate": {"native": 1.049, "expandable": 1.020, "async": 1.034},
    "llama_lora_ckpt": {"native": 1.111, "expandable": 1.020, "async": 1.039},
}

FIG6_SIZES = [512, 4 << 10, 64 << 10, 1 << 20, 2 << 20, 16 << 20, 128 << 20, 1 << 30]


def _skipped(key: str, value, contender: str) -> dict:
    """The row of a figure for a point the time budget left no room for."""
    return {key: value, "contender": contender, "status": "skipped", "reason": "time budget"}


class Figures:
    """The figure stages of Run (compare/runner.py)."""

    def figure(self, k: str) -> dict:
        """Figure k's part of the results document, made (not run yet) on first use."""
        return self.doc["figures"].setdefault(k, {"status": "not run", "rows": [], "notes": []})

    def fig6(self, deadline: float) -> None:
        f = self.figure("6")
        sizes = FIG6_SIZES
        for c in self.available:
            if time.monotonic() > deadline:
                f["rows"] += [_skipped("size", s, c) for s in sizes]
                continue
            r = self.servers[c].call(
                {
                    "task": "microbench",
                    "sizes": sizes,
                    "iters": 300 if self.args.quick else 1000,
                    "repeats": 5,
                    "options": self.options(c, "6"),
                    "timeout_s": 60,
                }
            )
            if r.get("status") == "ok":
                f["rows"] += [
                    {"size": x["size"], "contender": c, "status": "ok", "us": x["us"], "us_min": x["us_min"]}
                    for x in r["rows"]
                ]
            else:
                f["rows"] += [
                    {"size": s, "contender": c, "status": "failed", "reason": r.get("reason") or r.get("status")}
                    for s in sizes
                ]
            self.log(f"fig6 {c}: {r.get('status')} in {r.get('elapsed_s')} s")
        f["rows"] += self.unavailable_rows("size", sizes)
        f["status"] = "done"
        f["notes"].append(
            "Each cell: median of 5 repeats of N back-to-back torch.empty(size, uint8) + del on the "
            "default stream, after 20 warm-up pairs; no cap."
        )

    def _replay_row_common(self, t: str, c: str, r: dict) -> dict:
        return {"trace": t, "contender": c}

    def fig23(self, deadline: float) -> None:
        want2, want3 = "2" in self.args.figures, "3" in self.args.figures
        f2 = self.figure("2") if want2 else None
        f3 = self.figure("3") if want3 else None
        names = list(self.packed)
        est: Dict[str, float] = {}
        for t in names:
            peak = self.packed[t].peak_live
            for c in self.available:
                if time.monotonic() + est.get(t, 3.0) > deadline:
                    for f in (f2, f3):
                        if f is not None:
                            f["rows"].append(_skipped("trace", t, c))
                    continue
                r = self._replay(c, t, None, passes=2, stage="23", s_per_event=40e-6)
                est[t] = max(est.get(t, 0), float(r.get("elapsed_s") or 0))
                ok = r.get("status") == "ok"
                p = r.get("passes") or [{}]
                if f2 is not None:
                    if ok:
                        st = p[0].get("allocator_stats") or {}
                        sampled = p[0].get("peak_used_sampled")
                        reserved, source = (
                            (st["reserved_peak"], "stats") if st.get("reserved_peak") else (sampled, "sampled")
                        )
                        f2["rows"].append(
                            {
                                "trace": t,
                                "contender": c,
                                "status": "ok",
                                "reserved": reserved,
                                "source": source,
                                "ratio": reserved / peak if reserved else None,
                                "stats_reserved_peak": st.get("reserved_peak"),
                                "sampled_peak": sampled,
                                "sampled_ratio": sampled / peak if sampled else None,
                            }
                        )
                    else:
                        f2["rows"].append(self._failed_row("trace", t, c, r))
                if f3 is not None:
                    if ok:
                        f3["rows"].append(
                            {
                                "trace": t,
                                "contender": c,
                                "status": "ok",
                                "uncapped_wall_s": p[0].get("wall_s"),
                                "uncapped_warm_wall_s": p[1].get("wall_s") if len(p) > 1 else None,
                            }
                        )
                    else:
                        f3["rows"].append(self._failed_row("trace", t, c, r))
                    if ok and "1" not in self.args.figures:
                        self._capped_probe(f3["rows"][-1], t, c, peak)
                self.log(f"fig2/3 {t} {c}: {r.get('status')} in {r.get('elapsed_s')} s")
            self.checkpoint()
        for f, key in ((f2, "2"), (f3, "3")):
            if f is not None:
                f["rows"] += self.unavailable_rows("trace", names)
                f["status"] = "partial" if any(x["status"] == "skipped" for x in f["rows"]) else "done"
        if f2 is not None:
            f2["notes"].append(
                "Peak reserved during one replay from a fresh process: the allocator's own figure "
                "(torch's reserved_bytes.all.peak; RMM: pool size) where it keeps one; * marks the "
                "allocator-neutral figure instead (device memory in use, sampled every 64 allocations "
                "with cudaMemGetInfo, minus what was in use before the allocator started)."
            )
        if f3 is not None:
            f3["notes"].append(
                "Cells: uncapped wall time / wall time capped at 1.05 × peak live (× its ratio to "
                "uncapped). Both are the first replay in a fresh process (cold: growing the pool "
                "counts); the JSON also holds a second, warm, uncapped pass."
            )

    def _capped_probe(self, row: dict, t: str, c: str, peak: int) -> None:
        """Figure 3's capped run when figure 1 (whose searches probe 1.05 × peak live) is not made."""
        cap = align_up(int(peak * 1.05), ALIGN)
        r = self._replay(c, t, cap, passes=1, stage="1", s_per_event=60e-6)
        p0 = (r.get("passes") or [{}])[0]
        row.update(
            capped_cap=cap,
            capped_cap_effective=(r.get("device") or {}).get("cap_effective"),
            capped_status=r.get("status"),
        )
        if r.get("status") == "ok" and p0.get("wall_s") is not None:
            row["capped_wall_s"] = p0["wall_s"]
            if row.get("uncapped_wall_s"):
                row["slowdown"] = p0["wall_s"] / row["uncapped_wall_s"]
        elif r.get("status") != "oom":
            row["capped_reason"] = r.get("reason")

    def _failed_row(self, key, v, c, r) -> dict:
        st = r.get("status")
        row = {
            key: v,
            "contender": c,
            "status": "oom" if st == "oom" else "failed",
            "reason": (r.get("reason") or st or "?"),
        }
        if r.get("log_tail"):
            row["log_tail"] = r["log_tail"][-600:]
        return row

    def fig1(self, deadline: float) -> None:
        f = self.figure("1")
        f["resolution"] = self.args.resolution
        want3 = "3" in self.args.figures
        sim = (
            self.sim_results(wait=min(60.0, max(1.0, deadline - time.monotonic() - 30)))
            if "gpumem" in self.available
            else {}
        )
        searches = self._fig1_searches(sim, want3)
        active = list(searches)
        last_ckpt = time.monotonic()
        rounds = 0
        while active:
            rounds += 1
            for e in list(active):
                going = self._fig1_probe(e, deadline)
                if not going:
                    active.remove(e)
                if going is None:
                    continue
                if time.monotonic() - last_ckpt > 30:
                    self._fig1_rows(f, searches, sim, want3)
                    self.checkpoint()
                    last_ckpt = time.monotonic()
        f["rounds"] = rounds
        self._fig1_rows(f, searches, sim, want3)

    def _fig1_searches(self, sim: dict, want3: bool) -> List[dict]:
        """One search per (trace, contender), seeded by the simulated figure or the README's prior."""
        res = self.args.resolution
        ceiling = self.ceiling()
        searches = []
        for t in self.packed:
            peak = self.packed[t].peak_live
            for c in self.available:
                if c == "gpumem" and t in sim:
                    guess_ratio = sim[t]["min_capacity"] / peak
                else:
                    prior = README_PRIORS.get(t, {})
                    guess_ratio = prior.get(c, prior.get("native", 1.05))
                guess = int(peak * guess_ratio)
                margin = max(2 * res, int(guess * 0.002), 16 * MiB)
                seeds = ([align_up(int(peak * 1.05), ALIGN)] if want3 else []) + seeds_around(guess, margin)
                s = MinPassSearch(peak, ceiling, res, ALIGN, seeds=seeds, margin=margin)
                searches.append(
                    {
                        "trace": t,
                        "contender": c,
                        "search": s,
                        "probes": [],
                        "est": 3.0,
                        "c105": align_up(int(peak * 1.05), ALIGN),
                        "error": None,
                        "stopped": None,
                        "any_ok": False,
                    }
                )
        return searches

    def _fig1_probe(self, e: dict, deadline: float) -> Optional[bool]:
        """One probe of search e: True to go on, False when it failed (the search is over), None
        when there was nothing to probe (the search is done, or out of time)."""
        s = e["search"]
        v = s.next()
        if v is None:
            return None
        if time.monotonic() + e["est"] > deadline:
            e["stopped"] = "time budget"
            return None
        t, c = e["trace"], e["contender"]
        r = self._replay(c, t, v, passes=1, stage="1", s_per_event=60e-6)
        st = r.get("status")
        p0 = (r.get("passes") or [{}])[0]
        eff = (r.get("device") or {}).get("cap_effective")
        e["probes"].append(
            {
                "cap": v,
                "cap_effective": eff,
                "status": st,
                "wall_s": p0.get("wall_s"),
                "elapsed_s": r.get("elapsed_s"),
                "reason": r.get("reason"),
                "live_at_failure": p0.get("live_at_failure"),
            }
        )
        if c == "rmm":  # the pool it got under this cap
            e["probes"][-1]["allocator"] = (r.get("device") or {}).get("allocator")
        e["est"] = float(r.get("elapsed_s") or e["est"]) * 1.2 + 0.5
        going = True
        if st == "ok":
            e["any_ok"] = True
            s.record(v, True)
        elif st in ("oom", "timeout") or (st == "crashed" and e["any_ok"]):
            s.record(v, False)
        else:
            e["error"] = r.get("reason") or st
            if r.get("log_tail"):
                e["log_tail"] = r["log_tail"][-600:]
            going = False
        self.log(
            f"fig1 {t} {c}: cap {report.fmt_bytes(v)} ({v / self.packed[t].peak_live:.4f}) -> {st}"
            f" in {r.get('elapsed_s')} s"
        )
        return going

    def _fig1_rows(self, f: dict, searches: List[dict], sim: dict, want3: bool) -> None:
        rows, rows3 = [], []
        sim_cmp = {}
        for e in searches:
            t, c = e["trace"], e["contender"]
            peak = self.packed[t].peak_live
            row = self._fig1_row(e, peak)
            rows.append(row)
            if c == "gpumem" and t in sim:
                sc = sim[t]["min_capacity"]
                sim_cmp[t] = {
                    "sim_min_capacity": sc,
                    "sim_ratio": sc / peak,
                    "gpu_min_cap": row.get("min_cap"),
                    "gpu_status": row["status"],
                    "resolution": f.get("resolution"),
                    "fake": bool(sim[t].get("fake")),
                }
                if row.get("min_cap"):
                    sim_cmp[t].update(
                        gpu_over_sim=row["min_cap"] / sc, within_1pct=abs(row["min_cap"] / sc - 1) <= 0.01
                    )
            if want3:
                p = next((p for p in e["probes"] if p["cap"] == e["c105"]), None)
                rows3.append({"trace": t, "contender": c, "cap": e["c105"], "probe": p})
        f["rows"] = rows + self.unavailable_rows("trace", list(self.packed))
        f["gpumem_sim"] = sim_cmp
        done = all(x["status"] in ("ok", "unavailable", "failed") for x in f["rows"])
        f["status"] = "done" if done else "partial"
        f["notes"] = [
            f"Smallest cap (free memory left by one raw cudaMalloc of the rest, measured after it) in which a fresh "
            f"process replays the trace with torch.empty/del, ÷ peak live; binary search to "
            f"{report.fmt_bytes(f.get('resolution'))} unless marked ≤ (bracket not closed in the time budget; "
            f"(>x) is the largest failing cap).",
            "RMM's pool is created with all the free memory under the cap (initial_pool_size), as RMM users size pools.",  # noqa: E501
        ]
        if sim_cmp:
            f["notes"].append(
                "gpumem sim: `python -m gpumem replay --min-capacity` on the simulated device (1 MiB "
                "search); GPU ÷ sim should be within 1% (✗ marks a miss)."
            )
        if want3:
            self._capped_into_fig3(rows3)

    def _fig1_row(self, e: dict, peak: int) -> dict:
        """The row of one (trace, contender) search of figure 1."""
        t, c, s = e["trace"], e["contender"], e["search"]
        eff = {p["cap"]: p["cap_effective"] or p["cap"] for p in e["probes"]}
        r = s.result()
        row = {
            "trace": t,
            "contender": c,
            "peak_live": peak,
            "probes": e["probes"],
            "search": {
                k: r[k] for k in ("min_pass", "max_fail", "resolution_reached", "converged", "exhausted", "nonmonotone")
            },
        }
        hi = r["min_pass"]
        if e["error"]:
            row.update(status="failed", reason=e["error"])
            if e.get("log_tail"):
                row["log_tail"] = e["log_tail"]
        elif hi is None:
            why = (
                "nothing up to the device's free memory passed"
                if r["exhausted"]
                else f"no passing cap found before the search stopped ({e['stopped'] or 'unfinished'})"
            )
            row.update(status="failed", reason=why)
        else:
            row["min_cap"] = eff.get(hi, hi)
            row["ratio"] = row["min_cap"] / peak
            if r["max_fail"] is not None:
                row["ratio_max_fail"] = eff.get(r["max_fail"], r["max_fail"]) / peak
            if r["converged"]:
                row["status"] = "ok"
            else:
                row["status"] = "partial"
                row["reason"] = (
                    f"stopped at a {report.fmt_bytes(r['resolution_reached'])} bracket ({e['stopped'] or 'unfinished'})"
                    if r["resolution_reached"]
                    else "unfinished"
                )
        if r["nonmonotone"]:
            row["note"] = "a probe contradicted monotonicity (passed below a failure or failed above a pass)"
        return row

    def _capped_into_fig3(self, rows3: List[dict]) -> None:
        f3 = self.figure("3")
        idx = {(r["trace"], r["contender"]): r for r in f3["rows"]}
        for x in rows3:
            r = idx.get((x["trace"], x["contender"]))
            if r is None:
                r = {
                    "trace": x["trace"],
                    "contender": x["contender"],
                    "status": "failed",
                    "reason": "no uncapped run (figure 2/3 stage not run)",
                }
                f3["rows"].append(r)
                idx[(x["trace"], x["contender"])] = r
            p = x["probe"]
            r["capped_cap"] = x["cap"]
            if p is None:
                r["capped_status"] = "not probed"
                continue
            r["capped_cap_effective"] = p["cap_effective"]
            r["capped_status"] = p["status"]
            if p["status"] == "ok" and p.get("wall_s") is not None:
                r["capped_wall_s"] = p["wall_s"]
                if r.get("uncapped_wall_s"):
                    r["slowdown"] = p["wall_s"] / r["uncapped_wall_s"]

    def fig5(self, deadline: float) -> None:
        f = self.figure("5")
        lengths = self.args.fig5_lengths
        cap = self.args.fig5_cap
        guess: Dict[int, int] = {}
        self._preload()
        for i, c in enumerate(self.available):
            left = deadline - time.monotonic()
            per = left / max(1, len(self.available) - i)
            if left < 10:
                f["rows"] += [_skipped("length", n, c) for n in lengths]
                continue
            specs = []
            for n in lengths:
                g = guess.get(n) or max(1, int((cap - 2.4 * GiB) / (n * 400_000)))
                specs.append({"length": n, "seeds": [g, g + 1], "ceiling": 512})
            budget = max(10.0, per - 6)  # the rest is for the fresh-process check below
            r = self.servers[c].call(
                {
                    "task": "max_batch",
                    "cap": cap,
                    "lengths": specs,
                    "steps_per_try": 2,
                    "budget_s": budget,
                    "options": self.options(c, "5"),
                    "timeout_s": budget + 120,
                }
            )
            self.log(f"fig5 {c}: {r.get('status')} in {r.get('elapsed_s')} s")
            if r.get("status") != "ok":
                f["rows"] += [self._failed_row("length", n, c, r) for n in lengths]
                continue
            f["rows"] += [_fig5_row(x, c, r, guess) for x in r["results"]]
            # The search ran in one process; check in a fresh one that the next batch up really fails
            # at the main length (the figure's headline), so in-process state cannot understate it.
            main = next((row for row in f["rows"] if row["contender"] == c and row["length"] == lengths[0]), None)
            if main and main["status"] == "ok" and main.get("max_batch") and time.monotonic() + 8 < deadline:
                self._fig5_verify(main, c, cap, lengths[0])
        f["rows"] += self.unavailable_rows("length", lengths)
        f["status"] = "partial" if any(x["status"] in ("skipped", "partial") for x in f["rows"]) else "done"
        f["notes"] = [
            f"llama_lora_ckpt (1B Llama, bf16, LoRA r=16 on q/v, gradient checkpointing), fixed length, cap "
            f"{report.fmt_bytes(cap)} imposed like figure 1 (one raw cudaMalloc of the rest); a batch 'trains' when "
            f"2 optimizer steps complete. The search runs in one fresh process per contender (model built once; "
            f"between tries every tensor of the try is freed and the cache emptied); at length {lengths[0]} the "
            f"next batch up is re-tried in a fresh process.",
            "RMM's pool grows on demand here (kernels loaded lazily and cuBLAS need memory outside the pool).",
        ]

    def _fig5_verify(self, main: dict, c: str, cap: int, length: int) -> None:
        """Try main's batch + 1 at `length` in a fresh process of contender c: it should fail."""
        b = main["max_batch"] + 1
        v = self.servers[c].call(
            {
                "task": "max_batch",
                "cap": cap,
                "steps_per_try": 2,
                "budget_s": 60,
                "lengths": [{"length": length, "only": b}],
                "options": self.options(c, "5"),
                "timeout_s": 150,
            }
        )
        vr = (v.get("results") or [{}])[0] if v.get("status") == "ok" else {}
        if v.get("status") == "ok" and vr.get("max_pass") == b:
            main["verified"] = False
            main["max_batch"] = b
            main["note"] = f"batch {b} failed in the search's process but trains in a fresh one"
        elif v.get("status") == "ok":
            main["verified"] = True
        else:
            main["verify_error"] = v.get("reason") or v.get("status")

    def _preload(self) -> None:
        mods = ["transformers", "peft", "torchvision"] if not self.args.dry_run else []
        if getattr(self, "_preloaded", False) or not mods:
            return
        self._preloaded = True
        t0 = time.perf_counter()
        for c in self.available:
            self.servers[c].send({"task": "preload", "modules": mods})
        for c in self.available:
            r = self.servers[c].receive(180)
            if r.get("failed"):
                self.log(f"{c}: preload failed for {r['failed']}")
        self.log(f"preloaded {', '.join(mods)} in the servers in {time.perf_counter() - t0:.1f} s")

    def fig4(self, deadline: float) -> None:
        from .workloads import WORKLOADS

        f = self.figure("4")
        self._preload()
        steps = self.args.fig4_steps
        est: Dict[str, float] = {}
        for w in WORKLOADS:
            for c in self.available:
                if time.monotonic() + est.get(w, 15.0) > deadline:
                    f["rows"].append(_skipped("workload", w, c))
                    continue
                r = self.servers[c].call(
                    {
                        "task": "train",
                        "workload": w,
                        "steps": steps,
                        "median_from": 5,
                        "options": self.options(c, "4"),
                        "timeout_s": 240,
                    }
                )
                est[w] = max(est.get(w, 0.0), float(r.get("elapsed_s") or 0))
                self.log(f"fig4 {w} {c}: {r.get('status')} median {r.get('median_s')} in {r.get('elapsed_s')} s")
                if r.get("status") == "ok" and r.get("median_s"):
                    f["rows"].append(
                        {
                            "workload": w,
                            "contender": c,
                            "status": "ok",
                            "median_s": r["median_s"],
                            "steps": r["steps"],
                            "build_s": r.get("build_s"),
                            "allocator_stats": r.get("allocator_stats"),
                        }
                    )
                else:
                    f["rows"].append(self._failed_row("workload", w, c, r))
            self.checkpoint()
        base = {r["workload"]: r["median_s"] for r in f["rows"] if r["contender"] == "native" and r["status"] == "ok"}
        for r in f["rows"]:
            if r["status"] == "ok" and r["workload"] in base:
                r["rel_to_native"] = r["median_s"] / base[r["workload"]]
        f["rows"] += self.unavailable_rows("workload", WORKLOADS)
        f["status"] = "partial" if any(x["status"] == "skipped" for x in f["rows"]) else "done"
        f["notes"] = [
            f"{steps} steps from a fresh process with capture.py's shape draws (same seed for all); "
            f"median of steps 5..{steps}, each timed between torch.cuda.synchronize() calls; no cap."
        ]


def _fig5_row(x: dict, c: str, r: dict, guess: Dict[int, int]) -> dict:
    """Figure 5's row of one length's search result x (contender c's answer r); a converged
    search's batch becomes the next contender's guess."""
    n = x["length"]
    row = {
        "length": n,
        "contender": c,
        "max_batch": x.get("max_pass"),
        "min_fail": x.get("min_fail"),
        "tries": x.get("tries"),
        "cap_effective": (r.get("device") or {}).get("cap_effective"),
    }
    if x.get("stopped") and not x.get("stopped").startswith("time"):
        row.update(status="failed", reason=x["stopped"])
    elif x.get("converged"):
        row["status"] = "ok"
        if x.get("max_pass"):
            guess[n] = x["max_pass"]
    else:
        row.update(status="partial", reason=f"search stopped ({x.get('stopped') or 'unfinished'})")
    return row
