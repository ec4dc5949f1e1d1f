"""The forecast against the truth on a GPU: for four models of different kinds, the largest batch
(or sequence length, or resolution) that fits, forecast from small recorded steps, against the real
largest value found by binary search with real steps, under torch's native allocator and under gpumem.

    python benchmarks/gpu_forecast.py [--out FILE.json] [--budget-s 400] [--cap-gib 8] [--models a,b]
                                      [--jobs N] [--grace-s 90] [--resume EARLIER.json]
                                      [--dump-traces DIR]   # histories of probes and recordings, for study
    python benchmarks/gpu_forecast.py --forecast-only --models zoo-all [--out FILE.json] [--child-timeout 150]
    python benchmarks/gpu_forecast.py --check [--models zoo-all]   # the plan only, no GPU

The models, built from configs with random weights (nothing downloaded):

    llama_lora   a decoder LLM (Llama, 8 layers, bf16) with LoRA and activation checkpointing;
                 knob: batch at 512 tokens
    vit          ViT-B/16 training (bf16 autocast) at growing resolution; knob: patches per image
                 side (16 px each), batch 16
    gpt2_seq     GPT-2 (124M, eager attention: scores grow with the square of the length) training;
                 knob: sequence length, batch 4
    llama_kv     generation with a KV cache (Llama 1.1B, bf16, 192-token prompt, 64 new tokens);
                 knob: batch
    resnet50     (only with --models) ResNet-50 training at growing resolution; knob: image side / 32 px

`--models zoo` runs seven more, of the zoo's families (docs/zoo.md), none of which the forecast was
tuned to: mistral_gqa (grouped-query attention, bf16, knob batch at 512 tokens), mixtral_moe (mixture
of experts, bf16, batch at 256 tokens), bert_mlm_seq (masked LM, fp16 autocast, sequence length at
batch 16), t5_batch (encoder-decoder, fp32, batch), whisper_batch (speech, bf16 autocast, batch),
convnext_res (ConvNeXt, channels-last, resolution / 32 px at batch 16), unet_res (a diffusion UNet,
latent side / 8 at batch 8).  `--models zoo-all` runs a spec for every zoo member the forecast applies
to, at the knob its users turn (benchmarks/forecast_zoo.py, which lists the members it does not apply
to and why), and those seven.

`--forecast-only` runs the forecasts alone, at most 8 processes at once, each stopped after
--child-timeout seconds, the JSON written as each ends, and prints a table: the zoo member, the knob,
the values recorded, whether the recordings lined up, the answer for each allocator, the forecast's
time, its caveats and any error.

The device is shrunk to --cap-gib for every process (torch.cuda.set_per_process_memory_fraction
under the native allocator, gpumem.install(cap=...) under gpumem), which keeps the largest values
small and the searches quick, and lets several searches share the GPU: as many processes at once as
its free memory holds at the cap (1.5 GiB more each), at most two fewer than the CPUs (--jobs sets it).

1. Forecast: one process per model (at most 8 at once), under the native allocator, runs gpumem.forecast(step,
   knob=[...], refine=True) with a warm-up step (at the first value, and at any other whose recording
   does not make the first one's events; training: then the optimizer state is dropped and two steps
   are recorded, as a fresh run makes them), and finds the largest value for
   each allocator.  Where that lies more than 8x past the largest recorded value, the forecast records
   again at half of it, and at a quarter too where that recording disagrees with the first forecast
   (its "recorded" and "first_largest" say so).
   Its time counts from its first step (warm-ups included) to both answers (the model is already
   built: a user asking has it in hand).
2. Truth: for each model and allocator, the largest value that runs (two training steps, or one
   generation) without OOM, by doubling from twice the largest recorded value and then bisecting,
   each probe a fresh process (an OOM leaves state behind).  A search's time is the sum of its
   probes' wall times: what a user searching one crash at a time waits.  All searches run at once,
   --jobs probes at a time; a free slot goes to the search that has used the least probe time so far
   (benchmarks/forecast_search.py), so every search progresses.  No probe starts after --budget-s; one
   running then may take --grace-s more.  A probe that ran out of memory because the device itself was
   full (under 1 GiB free), not its cap, runs again.  --resume takes an earlier run's probes (same
   device and cap) as the answers at their values, their wall times counted, so a search the budget
   cut short goes on where it stopped.
3. Compared: forecast vs truth (within 3%, or 1 when the value is under 33), the forecast's peak
   allocated bytes (blocks as each allocator rounds them) vs torch.cuda.max_memory_allocated() at
   the true largest value, and the forecast's time vs the search's.  Then every native probe beside
   the model of torch's allocator replaying the forecast's trace at its value under the same cap
   (ran or not, peak reserved, peak allocated); with --dump-traces, also the model replaying the
   probe's own recorded history, which tells a wrong model from a wrong trace.
"""

import argparse
import json
import math
import os
import pathlib
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import forecast_only
from common import last_json_line, markdown_head, markdown_row
from forecast_models import DEFAULT_MODELS, MODELS, ZOO_ALL, ZOO_MODELS
from forecast_search import OutOfBudget, Slots, default_jobs, known_probes, load_earlier, search
from forecast_zoo import NOT_APPLICABLE, ZOO_MEMBERS

REPO = pathlib.Path(__file__).resolve().parent.parent
GiB = 1 << 30
FAILED_ADDR = 1 << 60  # where a probe's dump puts the request torch could not serve
ALLOCATORS = ("native", "gpumem")


# ---- child processes ------------------------------------------------------------------------


def _fresh_device(torch):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # what building left cached (e.g. fp32 weights before a cast)
    torch.cuda.reset_peak_memory_stats()


def write_recording(rec, path):
    """A recording as a gpumem text trace (addresses stand for its slots), for study on any machine:
    python -m gpumem forecast A.trace.gz B.trace.gz --knob a,b."""
    import gzip

    with gzip.open(path, "wt") as f:
        f.write(f"# action addr size stream (recorded at knob value {rec.knob})\n")
        for op, slot, size, stream in rec.trace.decode():
            f.write(f"{'alloc' if op == 0 else 'free_completed'} {(slot + 1) << 12} {size} {stream}\n")


def child_forecast(name, cap, out_dir, dump_dir=None):
    t_start = time.perf_counter()
    import torch

    sys.path.insert(0, str(REPO))
    import gpumem

    spec = MODELS[name]
    step, reset = spec.build("cuda")
    _fresh_device(torch)
    t0 = time.perf_counter()
    fc = gpumem.forecast(
        step,
        knob=spec.recorded,
        name=spec.knob,
        capacity=cap,
        warmup=1,
        steps=spec.steps,
        reset=reset,
        multiple=spec.multiple,
        refine=True,
    )
    t_rec = time.perf_counter()
    largest = {a: fc.largest(allocator=a) for a in (ALLOCATORS if fc.aligned else ("gpumem",))}
    t1 = time.perf_counter()
    with open(os.path.join(out_dir, f"{name}.recordings.pickle"), "wb") as f:
        pickle.dump(fc.recordings, f, protocol=4)
    if dump_dir:
        for rec in fc.recordings:
            write_recording(rec, os.path.join(dump_dir, f"{name}.forecast.{rec.knob}.trace.gz"))
    print(
        json.dumps(
            {
                "model": name,
                "aligned": fc.aligned,
                "alignment": fc.alignment.message,
                "set_aside": {str(k): v for k, v in fc.alignment.set_aside.items()},
                "caveats": fc.caveats(),
                "misalignment": None if fc.aligned else misalignment_context(fc),
                "fit": fc.model.kinds if fc.model else None,
                "events": fc.alignment.events,
                "largest": {a: (None if v == math.inf else v) for a, v in largest.items()},
                "recorded": fc.recorded,
                "first_largest": None
                if fc.first is None
                else {a: (None if (v := fc.first.largest(allocator=a)) == math.inf else v) for a in ALLOCATORS},
                "record_s": t_rec - t0,
                "model_s": t1 - t_rec,
                "forecast_s": t1 - t0,
                "process_s": time.perf_counter() - t_start,
                "summary": fc.summary_lines(),
            }
        ),
        flush=True,
    )


def misalignment_context(fc, before=12, after=24):
    """The events around where the recordings stopped lining up, in each recording."""
    from gpumem.forecast.align import _Events

    i = max(fc.alignment.first_difference, 0)
    out = {}
    for r in fc.recordings:
        ev = _Events(r.trace)
        lo, hi = max(0, i - before), min(ev.n, i + after)
        out[str(r.knob)] = [
            f"{q} {'alloc' if ev.is_alloc[q] else 'free'} #{ev.ordinal[q]} {ev.size[q]} s{ev.stream[q]}"
            for q in range(lo, hi)
        ]
    return out


def _live_blocks(torch):
    """(addr, size, stream) of every allocated block, as torch's snapshot lists them."""
    out = []
    for seg in torch.cuda.memory._snapshot()["segments"]:
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] in ("active_allocated", "active_pending_free"):
                out.append((addr, b["size"], seg["stream"]))
            addr += b["size"]
    return out


def _write_dump(torch, path, live):
    """The probe's allocator history as a gpumem text trace: the blocks live before its steps as
    allocations first, then every event torch recorded (segment events included).  The request
    torch could not serve (its "oom" entry, which has no address) is written as a last allocation at
    an address no block has, so a replay of the trace ends with it."""
    import gzip

    events = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    with gzip.open(path, "wt") as f:
        f.write("# action addr size stream\n")
        for addr, size, stream in live:
            f.write(f"alloc {addr} {size} {stream}\n")
        for e in events:
            if e["action"] == "oom":
                f.write(f"alloc {FAILED_ADDR} {e['size']} {e['stream']}\n")
                break
            f.write(f"{e['action']} {e['addr']} {e['size']} {e['stream']}\n")


def _device_free(torch):
    try:
        return torch.cuda.mem_get_info()[0]
    except RuntimeError:
        return None


def child_probe(name, allocator, k, cap, dump=None):
    t_start = time.perf_counter()
    import torch

    if allocator == "gpumem":
        # before anything touches CUDA (get_device_properties does): the cap in bytes
        sys.path.insert(0, str(REPO))
        import gpumem

        gpumem.install(cap=int(cap))
    else:
        # torch allows fraction x cudaMemGetInfo's total (not get_device_properties' total_memory) to its
        # segments; CUDA's context and anything outside the allocator do not count
        torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.mem_get_info()[1])
    spec = MODELS[name]
    step, _ = spec.build("cuda")
    _fresh_device(torch)
    live = None
    if dump:
        live = _live_blocks(torch)
        torch.cuda.memory._record_memory_history(max_entries=1 << 21, context=None)
    t0 = time.perf_counter()
    ok, error = True, None
    try:
        for _ in range(spec.steps):
            step(k)
        torch.cuda.synchronize()
    except torch.OutOfMemoryError as e:
        ok, error = False, str(e).splitlines()[0][:600]
    except RuntimeError as e:  # a library's own allocation failing for want of memory
        if "out of memory" not in str(e) and "ALLOC_FAILED" not in str(e):
            raise
        ok, error = False, str(e).splitlines()[0][:600]
    if dump:
        _write_dump(torch, dump, live)
    # the device itself full (other processes' memory), not this process's cap: the search runs it again
    free = None if ok else _device_free(torch)
    print(
        json.dumps(
            {
                "k": k,
                "ok": ok,
                "error": error,
                "device_free_at_oom": free,
                "device_full": free is not None and free < GiB,
                "peak_allocated": torch.cuda.max_memory_allocated(),
                "peak_reserved": torch.cuda.max_memory_reserved(),
                "steps_s": time.perf_counter() - t0,
                "process_s": time.perf_counter() - t_start,
            }
        ),
        flush=True,
    )


# ---- the parent -----------------------------------------------------------------------------


def _run_child(args, timeout, threads=None):
    """Run this script's child `args` in a fresh interpreter (with `threads` CPU threads for torch, where
    given) and return the JSON it printed last, with its wall time; TimeoutExpired past `timeout`."""
    t0 = time.perf_counter()
    env = dict(os.environ)
    if threads:
        env.setdefault("OMP_NUM_THREADS", str(threads))
    p = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=max(1.0, timeout),
        cwd=str(REPO),
        env=env,
    )
    wall = time.perf_counter() - t0
    out = last_json_line(p.stdout)
    if p.returncode or out is None:
        raise RuntimeError(f"child {' '.join(map(str, args))} failed (rc {p.returncode}):\n{p.stderr[-2500:]}")
    out["wall_s"] = wall
    return out


def _load_forecast(name, out_dir, cap):
    sys.path.insert(0, str(REPO))
    from gpumem.forecast import Forecast

    spec = MODELS[name]
    with open(os.path.join(out_dir, f"{name}.recordings.pickle"), "rb") as f:
        recs = pickle.load(f)
    return Forecast(recs, name=spec.knob, capacity=cap, multiple=spec.multiple)


def forecast_peaks(fc, cap, k):
    """The forecast's peak live and peak allocated (each allocator) at knob value k."""
    from gpumem.native_model import replay_native
    from gpumem.replay import replay

    if not fc.aligned or not k:
        return {"peak_live": fc.peak_live(k) if k else None}
    t = fc.synthesise(k)
    return {
        "peak_live": t.peak_live_bytes,
        "native": replay_native(t).peak_allocated_bytes,
        "gpumem": replay(t, max(4 * t.peak_live_bytes, GiB), timing=False).peak_allocated_bytes,
    }


def probe_checks(fc, cap, probes):
    """Each native probe beside the model's replay of the forecast's trace at its value under the same
    cap: did it fit, and its peak reserved and allocated (what torch.cuda.max_memory_* measured)."""
    from gpumem.native_model import replay_native
    from gpumem.trace import load_trace

    out = []
    for p in probes:
        if p.get("crashed") or not fc.aligned:
            continue
        t = fc.synthesise(p["k"])
        r = replay_native(t, cap)
        c = {
            "k": p["k"],
            "measured_ok": p["ok"],
            "model_ok": r.ooms == 0,
            "measured_peak_reserved": p.get("peak_reserved"),
            "model_peak_reserved": r.peak_reserved_bytes,
            "measured_peak_allocated": p.get("peak_allocated"),
            "model_peak_allocated": r.peak_allocated_bytes,
            "forecast_events": t.n_events,
        }
        if p.get("dump") and os.path.exists(p["dump"]):
            # the model on the probe's own trace: off here too means the model, not the forecast, is off
            real = load_trace(p["dump"])
            rr = replay_native(real, cap)
            c.update(
                probe_events=real.n_events,
                probe_peak_live=real.peak_live_bytes,
                forecast_peak_live=t.peak_live_bytes,
                model_on_probe_trace_ok=rr.ooms == 0,
                model_on_probe_trace_peak_reserved=rr.peak_reserved_bytes,
            )
        out.append(c)
    return sorted(out, key=lambda c: c["k"])


def within(forecast, truth):
    if forecast is None or truth is None:
        return False
    return abs(forecast - truth) <= (1 if truth < 33 else 0.03 * truth)


def _pct(a, b):
    return f"{100.0 * (a - b) / b:+.2f}%" if a is not None and b else "-"


SEARCH_HEAD = (
    "model | knob | allocator | forecast | truth | within | peak alloc forecast GiB | measured GiB | diff "
    "| forecast s | search s | ratio"
)
PROBE_HEAD = (
    "model | knob | runs (GPU / model) | peak reserved GPU GiB | model GiB | diff | peak allocated diff "
    "| model on the probe's trace: runs, reserved diff | events forecast / probe"
)
_YN = {True: "yes", False: "OOM", None: "-"}


def _gib(b):
    return f"{b / GiB if b else 0:.3f}"


def _search_cells(w):
    """One row of the forecast-versus-search table."""
    fp, mp = w["forecast_peak_allocated"], w["measured_peak_allocated"]
    truth = f"{w['truth']}{'' if w['truth_complete'] else ' (incomplete)'}"
    if w.get("bisected") not in (None, w["truth"]):
        truth += f" (bisection: {w['bisected']})"
    ratio = w["time_ratio"] if w["time_ratio"] is None else round(w["time_ratio"], 3)
    times = [f"{w[k] or 0:.1f}" for k in ("forecast_s", "search_s")]
    head = [w["model"], w["knob"], w["allocator"], w["forecast"], truth, "yes" if w["within"] else "NO"]
    return [*head, _gib(fp), _gib(mp), _pct(fp, mp), *times, ratio]


def _probe_cells(c):
    """One row of the model-versus-probes table."""
    mr, fr = c["measured_peak_reserved"], c["model_peak_reserved"]
    ma, fa = c["measured_peak_allocated"], c["model_peak_allocated"]
    pr = c.get("model_on_probe_trace_peak_reserved")
    runs = f"{_YN[c['measured_ok']]} / {_YN[c['model_ok']]}"
    on_probe = f"{_YN[c.get('model_on_probe_trace_ok')]}, {_pct(pr, mr)}"
    events = f"{c['forecast_events']} / {c.get('probe_events', '-')}"
    return [c["model"], c["k"], runs, _gib(mr), f"{fr / GiB:.3f}", _pct(fr, mr), _pct(fa, ma), on_probe, events]


def _parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", metavar="FILE.json", help="write the results as JSON (--forecast-only: as each ends)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=400.0,
        help="start no probe after this (default 400; with --grace-s, all within 9 min)",
    )
    ap.add_argument(
        "--grace-s", type=float, default=90.0, help="how long past the budget a probe already running may take"
    )
    ap.add_argument("--cap-gib", type=float, default=8.0, help="the device as each process sees it (default 8)")
    ap.add_argument(
        "--models",
        default=",".join(DEFAULT_MODELS),
        help=f"models to run (default {','.join(DEFAULT_MODELS)}; also: resnet50; zoo: {','.join(ZOO_MODELS)}; "
        "zoo-all: a spec for every zoo member it applies to, and zoo's)",
    )
    ap.add_argument("--jobs", type=int, default=0, help="processes at once (default: as many as fit)")
    ap.add_argument("--forecast-only", action="store_true", help="the forecasts alone, no searches: a table")
    ap.add_argument(
        "--child-timeout", type=float, default=150.0, help="--forecast-only: the most a forecast may take (default 150)"
    )
    ap.add_argument(
        "--resume",
        metavar="EARLIER.json",
        help="an earlier run's --out (same device and cap): its probes answer their values without a run",
    )
    ap.add_argument(
        "--dump-traces",
        metavar="DIR",
        help="native probes write their allocator history there (DIR/MODEL.native.K.trace.gz), and the model "
        "of torch's allocator replays each: is the model or the forecast's trace off? The forecast's recordings "
        "go there too (DIR/MODEL.forecast.K.trace.gz)",
    )
    ap.add_argument("--check", action="store_true", help="print the plan and exit (no GPU needed)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    return ap


def _models(ap, a):
    """The models --models names (zoo: the zoo's seven; zoo-all: every zoo spec), checked."""
    models = []
    for m in (m for m in a.models.split(",") if m):
        for name in {"zoo": ZOO_MODELS, "zoo-all": ZOO_ALL}.get(m, [m]):
            if name not in models:
                models.append(name)
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)} (known: {', '.join(MODELS)}, zoo, zoo-all)")
    return models


MEMBER_OF = {spec: member for member, spec in ZOO_MEMBERS.items()}


def _plan(models, a):
    """--check: what a run would do, without a GPU."""
    for name in models:
        s = MODELS[name]
        member = MEMBER_OF.get(name, "-")
        print(
            f"{name}: zoo member {member}; {s.knob} recorded at {s.recorded}, multiples of {s.multiple}, "
            f"{s.steps} step(s) a probe"
        )
    if any(m in MEMBER_OF for m in models):
        for member, why in NOT_APPLICABLE.items():
            print(f"{member}: not forecast ({why})")
    if a.forecast_only:
        print(f"forecasts only: at most 8 processes at once, each stopped after {a.child_timeout:.0f} s")
    else:
        print(f"cap {a.cap_gib} GiB a process, budget {a.budget_s:.0f} s (+{a.grace_s:.0f} s for probes running)")


def main():
    ap = _parser()
    a = ap.parse_args()
    if a.child:
        kind, rest = a.child[0], a.child[1:]
        if kind == "forecast":
            child_forecast(rest[0], int(rest[1]), rest[2], rest[3] if len(rest) > 3 else None)
        else:
            child_probe(rest[0], rest[1], int(rest[2]), int(rest[3]), rest[4] if len(rest) > 4 else None)
        return
    models = _models(ap, a)
    if a.budget_s <= 0 or a.cap_gib <= 0 or a.child_timeout <= 0 or a.grace_s < 0 or a.jobs < 0:
        ap.error("--budget-s, --cap-gib and --child-timeout must be positive, --grace-s and --jobs not negative")
    try:
        earlier = load_earlier(a.resume) if a.resume else None
    except ValueError as e:
        ap.error(str(e))
    if a.dump_traces:
        os.makedirs(a.dump_traces, exist_ok=True)
        a.dump_traces = os.path.abspath(a.dump_traces)
    cap = int(a.cap_gib * GiB)
    if a.check:
        _plan(models, a)
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_forecast.py needs a CUDA GPU (--check prints the plan without one)")
    start = time.monotonic()
    free, total = torch.cuda.mem_get_info()
    jobs = a.jobs or default_jobs(free, cap, os.cpu_count() or 1)
    lock = threading.Lock()

    def log(msg):
        with lock:
            print(f"[{time.monotonic() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    log(f"{torch.cuda.get_device_name(0)}, {total / GiB:.1f} GiB; cap {a.cap_gib} GiB a process, {jobs} at once")
    out_dir = tempfile.mkdtemp(prefix="gpumem-forecast-")
    results = {"device": torch.cuda.get_device_name(0), "cap_bytes": cap, "jobs": jobs, "models": {}}
    if a.forecast_only:
        _forecast_only(results, models, cap, out_dir, a, min(8, jobs), log, start)
        return
    threads = max(1, (os.cpu_count() or 1) // jobs)
    run_one = _forecaster(cap, out_dir, a.dump_traces, threads)
    forecast_only.run_forecasts(models, run_one, min(8, jobs), a.budget_s, results, log=log)
    _truths(results, models, cap, start + a.budget_s, a.grace_s, jobs, log, a.dump_traces, earlier)
    rows, checks = _compare(results, models, out_dir, cap)
    results["rows"] = rows
    results["wall_s"] = time.monotonic() - start
    _print_tables(results, rows, checks, a.cap_gib, jobs)
    results["model_vs_probes"] = checks
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


def _forecaster(cap, out_dir, dump_dir, threads):
    """run_one(name, timeout): one forecast child's dict."""

    def run_one(name, timeout):
        return _run_child(["forecast", name, cap, out_dir] + ([dump_dir] if dump_dir else []), timeout, threads)

    return run_one


def _forecast_only(results, models, cap, out_dir, a, jobs, log, start):
    """--forecast-only: the forecasts, `jobs` at once, the JSON written as each ends, then the table."""
    results["mode"] = "forecast-only"
    results["forecast_jobs"] = jobs
    save = forecast_only.saver(a.out)
    run_one = _forecaster(cap, out_dir, a.dump_traces, max(1, (os.cpu_count() or 1) // jobs))
    forecast_only.run_forecasts(models, run_one, jobs, a.child_timeout, results, save, log)
    rows = [forecast_only.row(n, MODELS[n], MEMBER_OF.get(n, "-"), results["models"][n]["forecast"]) for n in models]
    results["rows"] = rows
    results["not_applicable"] = NOT_APPLICABLE
    results["wall_s"] = time.monotonic() - start
    if save:
        save(results)
    forecast_only.print_table(rows)
    print(f"(device {results['device']}, {jobs} forecasts at once, {results['wall_s']:.0f} s in all)")


def _prober(name, allocator, cap, deadline, grace, dump_dir, threads):
    """run_probe(k) for one search: a fresh process, allowed until `grace` past the deadline."""

    def run_probe(k):
        t0 = time.perf_counter()
        args = ["probe", name, allocator, k, cap]
        if dump_dir:
            args.append(os.path.join(dump_dir, f"{name}.{allocator}.{k}.trace.gz"))
        try:
            r = _run_child(args, deadline + grace - time.monotonic(), threads)
        except subprocess.TimeoutExpired:
            raise OutOfBudget from None
        except RuntimeError as e:  # the probe crashed: counted as not running, and reported
            return {"k": k, "ok": False, "error": str(e)[-2000:], "wall_s": time.perf_counter() - t0, "crashed": True}
        if dump_dir:
            r["dump"] = args[-1]
        return r

    return run_probe


def _truths(results, models, cap, deadline, grace, jobs, log, dump_dir, earlier):
    """2. the truth: every (model, allocator) search at once, `jobs` probes at a time, the search that
    has used the least probe time first"""
    slots = Slots(jobs)
    threads = max(1, (os.cpu_count() or 1) // jobs)
    if earlier:
        try:
            known_probes(earlier, "", "", results["device"], cap)
        except ValueError as e:
            raise SystemExit(f"gpu_forecast.py --resume: {e}") from None

    def one(name, alloc):
        spec = MODELS[name]
        known = known_probes(earlier, name, alloc, results["device"], cap) if earlier else None
        run_probe = _prober(name, alloc, cap, deadline, grace, dump_dir if alloc == "native" else None, threads)
        say = lambda msg: log(f"{name:10s} {alloc:6s} {spec.knob} {msg}")  # noqa: E731
        return search(spec.recorded, spec.multiple, run_probe, slots, deadline, say, known)

    with ThreadPoolExecutor(len(models) * len(ALLOCATORS)) as ex:
        futs = {(name, alloc): ex.submit(one, name, alloc) for name in models for alloc in ALLOCATORS}
        for (name, alloc), fut in futs.items():
            try:
                results["models"][name].setdefault("truth", {})[alloc] = fut.result()
            except Exception as e:  # noqa: BLE001
                results["models"][name].setdefault("truth", {})[alloc] = {"error": str(e)}
                log(f"{name} {alloc}: search failed: {e}")
    results["most_probes_at_once"] = slots.most


def _compare(results, models, out_dir, cap):
    """3. compare: (a row per model and allocator, the native probes beside the model)"""
    rows = []
    checks = []
    for name in models:
        r = results["models"][name]
        f = r["forecast"]
        fc = None
        if "error" not in f:
            try:
                fc = _load_forecast(name, out_dir, cap)
            except Exception as e:  # noqa: BLE001
                f["reload_error"] = str(e)
        for alloc in ALLOCATORS:
            t = r.get("truth", {}).get(alloc, {})
            tv = t.get("largest")
            peaks = {}
            if fc is not None and tv:
                try:
                    peaks = forecast_peaks(fc, cap, tv)
                    if alloc == "native":
                        t["model_vs_probes"] = probe_checks(fc, cap, t.get("probes", []))
                        checks += [dict(model=name, **c) for c in t["model_vs_probes"]]
                except Exception as e:  # noqa: BLE001
                    peaks = {"error": str(e)}
            t["forecast_peaks_at_truth"] = peaks
            rows.append(_compare_row(name, alloc, f, t, peaks))
    return rows, checks


def _compare_row(name, alloc, f, t, peaks):
    fv = (f.get("largest") or {}).get(alloc)
    tv = t.get("largest")
    measured = t.get("measured_peak_allocated")
    fpeak = peaks.get(alloc)
    row = {
        "model": name,
        "knob": MODELS[name].knob,
        "allocator": alloc,
        "forecast": fv,
        "truth": tv,
        "bisected": t.get("bisected"),
        "truth_complete": t.get("complete"),
        "within": within(fv, tv),
        "forecast_peak_allocated": fpeak,
        "measured_peak_allocated": measured,
        "peak_within_2pct": bool(fpeak and measured and abs(fpeak - measured) <= 0.02 * measured),
        "forecast_s": f.get("forecast_s"),
        "search_s": t.get("search_s"),
        "settle_s": t.get("settle_s"),
        "aligned": f.get("aligned"),
    }
    row["time_ratio"] = row["forecast_s"] / row["search_s"] if row["forecast_s"] and row["search_s"] else None
    return row


def _print_tables(results, rows, checks, cap_gib, jobs):
    print(markdown_head(SEARCH_HEAD))
    for w in rows:
        print(markdown_row(_search_cells(w)))
    print(
        f"(device {results['device']}, cap {cap_gib} GiB a process, {jobs} probes at once, "
        f"{results['wall_s']:.0f} s in all)"
    )
    print()
    print(markdown_head(PROBE_HEAD))
    for c in checks:
        print(markdown_row(_probe_cells(c)))
    print("(native probes: the model of torch's allocator replaying the forecast's trace under the same cap)")


if __name__ == "__main__":
    main()
