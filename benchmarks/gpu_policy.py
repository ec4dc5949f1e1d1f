"""Room vs pressure on one GPU: step time, whole run, peak reserved and gpumem's device calls after warm-up.

    python benchmarks/gpu_policy.py --out results/policy.json [--rounds 3] [--budget 450]
        [--workloads llama_varlen,llama_varlen_cap,gpt2_varlen,resnet50_multires,llama_lora_ckpt]
        [--allocators native,expandable,gpumem,gpumem:GPUMEM_CONF=pressure:0]

Allocators: `native`, `expandable` (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), `gpumem` (the
default policy: room until 7/8 of the limit), and `NAME:VAR=VALUE` for a variant (gpumem with
GPUMEM_CONF=pressure:0 is the heap tight everywhere, the policy before room was measured;
`gpumem:PYTHONPATH=DIR` runs the gpumem built in DIR, to set two builds side by side).  Each
(allocator, round) is a fresh process that runs every workload in the order given; each round runs
every allocator once, round r starting with the r-th allocator given (native, expandable, gpumem; then
expandable, gpumem, native; ...), so processes of different allocators alternate and none always runs
first.

Workloads (random weights, nothing downloaded; all allocators see the same shapes in the same order):
  llama_varlen       an HF transformers Llama built from a config (12 layers, hidden 1024, fp32
                     weights, bf16 autocast, AdamW), batch 8, lengths drawn from 128-2048 per step
  llama_varlen_cap   the same steps again in the same process, the allocator capped at 1.05 x the
                     peak live memory the uncapped run measured (torch.cuda.set_per_process_memory_fraction):
                     near the device's capacity, where gpumem must still defragment
  gpt2_varlen, resnet50_multires, llama_lora_ckpt   benchmarks/compare/workloads.py, as gpu_train.py runs them

Per run: the median step after the first WARMUP steps (steady state); paired with native's run of
the same round, the median over those steps of each step's time over native's same step (the same
shapes: every process draws them from one seed), which does not mix steps of different lengths; the
whole run (every step
summed, warm-up included), peak reserved and peak live, OOMs, and the allocator's device calls after
warm-up: gpumem's page creations (num_device_alloc), maps, defragmentations (num_remaps), pages
remapped and device-wide synchronisations; native's segment allocations (num_device_alloc).  A step is
timed from a device synchronisation to the next.  --budget (seconds) stops starting rounds that would
not finish in time (the first round measures how long one takes); the JSON says how many ran.
It writes JSON to --out and prints a table; without CUDA it says so, writes {"skipped": ...} and exits 0.

--trace DIR: after the rounds, one more process under torch's allocator (not counted in the table)
records each workload's allocations and writes DIR/WORKLOAD.trace.gz (llama_varlen_cap is left out:
the same steps again, capped).  The same requests come in the same order under every allocator, so
replaying that trace on the simulated device shows where gpumem's peak reserved comes from, e.g.
`python -m gpumem replay DIR/llama_varlen.trace.gz --capacity 149.3GB` (the device's memory less
CUDA's context) gives the peak reserved of the run on that device.
"""

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    markdown_head,
    markdown_row,
    start_torch_history,
    stop_torch_history,
    with_checkout_path,
    write_torch_trace,
)
from compare.workloads import LLAMA_CONFIG  # noqa: E402

WORKLOADS = ["llama_varlen", "llama_varlen_cap", "gpt2_varlen", "resnet50_multires", "llama_lora_ckpt"]
ALLOCATORS = "native,expandable,gpumem,gpumem:GPUMEM_CONF=pressure:0"
STEPS = {"llama_varlen": 50, "gpt2_varlen": 16, "resnet50_multires": 16, "llama_lora_ckpt": 12}
WARMUP = {"llama_varlen": 15, "gpt2_varlen": 3, "resnet50_multires": 3, "llama_lora_ckpt": 3}
CAP_OVER_LIVE = 1.05
# The Llama of the other GPU benchmarks (compare.workloads), smaller: 12 layers of hidden 1024.
LLAMA = dict(LLAMA_CONFIG, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, max_position_embeddings=2048)
CALLS = ("num_device_alloc", "num_maps", "num_remaps", "num_pages_remapped", "num_sync_all_streams")


def _llama_varlen(torch, dev):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    m = LlamaForCausalLM(LlamaConfig(**LLAMA)).to(dev)
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

    def step(b, n):
        x = torch.randint(0, LLAMA["vocab_size"], (b, n), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, lambda rng: (8, rng.randint(128, 2048)), opt


def _calls(torch):
    st = torch.cuda.memory_stats()
    return {k: st.get(k) for k in CALLS}


def _run_steps(torch, name, step, draw, steps, warmup, opt):
    """Run `steps` steps; step times, OOMs, and the device calls after warm-up."""
    rng = random.Random(1234)
    times, ooms, at_warm = [], 0, None
    torch.cuda.reset_peak_memory_stats()
    start = _calls(torch)
    for i in range(steps):
        b, n = draw(rng)
        if i == warmup:
            at_warm = _calls(torch)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            step(b, n)
            torch.cuda.synchronize()
        except torch.OutOfMemoryError:
            ooms += 1
            opt.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    end = _calls(torch)
    st = torch.cuda.memory_stats()

    def diff(a):
        return {k: (end[k] - a[k]) if end[k] is not None and a[k] is not None else None for k in CALLS}

    body = times[warmup:]
    return dict(
        workload=name,
        median_ms=statistics.median(body) * 1e3,
        total_ms=sum(times) * 1e3,
        step_ms=[round(t * 1e3, 3) for t in times],
        warmup=warmup,
        ooms=ooms,
        peak_reserved=st["reserved_bytes.all.peak"],
        peak_live=st["allocated_bytes.all.peak"],
        calls_after_warmup=diff(at_warm),
        calls_whole_run=diff(start),
    )


def _trace_write(torch, trace_dir, name):
    """The history since start_torch_history as trace_dir/name.trace.gz; the history off."""
    torch.cuda.synchronize()
    entries = stop_torch_history(torch)["device_traces"][0]
    os.makedirs(trace_dir, exist_ok=True)
    path = os.path.join(trace_dir, f"{name}.trace.gz")
    n = write_torch_trace(path, entries, f"{name} of benchmarks/gpu_policy.py under torch's allocator")
    print(f"gpu_policy.py: wrote {path} ({n} events)", file=sys.stderr)


def child(use, names, trace_dir=None):
    """One process: every workload in `names` under allocator `use`; one JSON line per workload.  With
    trace_dir (torch's allocator only), each workload's allocations as a trace there instead (--trace)."""
    import torch

    built = None
    if use.split(":")[0] == "gpumem":
        import gpumem

        gpumem.install()
        built = os.path.dirname(os.path.dirname(os.path.abspath(gpumem.__file__)))  # which build ran
    dev = "cuda"
    total = torch.cuda.get_device_properties(0).total_memory
    llama = step = draw = opt = live = None
    for name in names:
        if trace_dir and name == "llama_varlen_cap":
            continue
        if trace_dir:
            torch.cuda.empty_cache()
            start_torch_history(torch)
        if name in ("llama_varlen", "llama_varlen_cap"):
            if llama is None:
                llama = _llama_varlen(torch, dev)
            step, draw, opt = llama
            cap = None
            if name == "llama_varlen_cap":
                cap = int(live * CAP_OVER_LIVE)
                torch.cuda.empty_cache()
                torch.cuda.set_per_process_memory_fraction(cap / total)
            r = _run_steps(torch, name, step, draw, STEPS["llama_varlen"], WARMUP["llama_varlen"], opt)
            if cap is None:
                live = r["peak_live"]
            else:
                r["cap"] = cap
                torch.cuda.set_per_process_memory_fraction(1.0)
        else:
            llama = step = draw = opt = None  # the Llama and its optimizer go before the next model comes
            gc.collect()
            from compare import workloads

            torch.cuda.empty_cache()
            w = workloads.build(name, dev, seed=1234, on_device=True)
            r = _run_steps(torch, name, w.step, w.draw, STEPS[name], WARMUP[name], w.opt)
            del w
            gc.collect()
        if trace_dir:
            _trace_write(torch, trace_dir, name)
            if name == "llama_varlen":
                llama = step = draw = opt = None  # the next workload's trace starts from nothing of it
                gc.collect()
        torch.cuda.empty_cache()
        r["allocator"] = use
        if built:
            r["gpumem_from"] = built
        r["device"] = torch.cuda.get_device_name(0)
        print(json.dumps(r), flush=True)


def _paired(rows, name, use, base):
    """Per round, the median over the steady steps of this run's step over `base`'s same step in the same
    round; None for a round where either run failed or took OOMs (a step that failed is not a step)."""
    out = []
    for r in rows:
        if r["workload"] != name or r["allocator"] != use or "step_ms" not in r:
            continue
        rnd = r.get("round")
        same = [x for x in rows if x["workload"] == name and x["allocator"] == base and x.get("round") == rnd]
        b = same[0] if same else None
        if b is None or "step_ms" not in b or r["ooms"] or b["ooms"] or len(b["step_ms"]) != len(r["step_ms"]):
            out.append(None)
            continue
        w = r["warmup"]
        out.append(statistics.median(t / n for t, n in zip(r["step_ms"][w:], b["step_ms"][w:]) if n > 0))
    return out


def _table(rows, names, allocators):
    head = (
        "workload | allocator | median step ms | ÷ native | paired ÷ native (per round) | whole run ms | ÷ native "
        "| peak reserved GiB "
        "| peak live GiB | OOMs | after warm-up: creates / maps / remaps (pages) / syncs"
    )
    lines = [markdown_head(head)]
    for name in names:
        base = None
        for use in allocators:
            g = [r for r in rows if r["workload"] == name and r["allocator"] == use and "median_ms" in r]
            if not g:
                lines.append(f"| {name} | {use} | failed | | | | | | | | |")
                continue
            med = statistics.median(r["median_ms"] for r in g)
            tot = statistics.median(r["total_ms"] for r in g)
            if use == allocators[0]:
                base = (med, tot)
            rel = (f"{med / base[0]:.3f}", f"{tot / base[1]:.3f}") if base else ("", "")
            res = max(r["peak_reserved"] for r in g) / 2**30
            live = max(r["peak_live"] for r in g) / 2**30
            ooms = max(r["ooms"] for r in g)

            def most(k):
                v = [r["calls_after_warmup"][k] for r in g if r["calls_after_warmup"][k] is not None]
                return str(max(v)) if v else "-"

            calls = f"{most('num_device_alloc')} / {most('num_maps')} / {most('num_remaps')} "
            calls += f"({most('num_pages_remapped')}) / {most('num_sync_all_streams')}"
            pr = [x for x in _paired(rows, name, use, allocators[0]) if x is not None] if base else []
            paired = f"{statistics.median(pr):.3f} ({', '.join(f'{x:.3f}' for x in pr)})" if pr else ""
            cells = [name, use, f"{med:.2f}", rel[0], paired, f"{tot:.1f}", rel[1], f"{res:.2f}", f"{live:.2f}", ooms]
            cells.append(calls)
            lines.append(markdown_row(cells))
    return "\n".join(lines)


def _child_cmd(a, names, use, *more):
    """The command of one process of this script: every workload in `names` under allocator `use`."""
    cmd = [sys.executable, __file__, "--out", os.devnull, "--workloads", ",".join(names)]
    return cmd + ["--allocators", a.allocators, "--child", use, *more]


def _rounds(a, names, allocators, envs, t_start):
    """Run every allocator's process, round after round within the budget: (rows, rounds done)."""
    rows, rounds_done, per_process = [], 0, 0.0
    for rnd in range(a.rounds):
        # A round starts only if all of it fits: rounds stay whole, so every allocator has as many runs.
        if rnd and time.monotonic() - t_start + per_process * len(allocators) > a.budget:
            print(f"gpu_policy.py: round {rnd + 1} would pass the {a.budget:.0f} s budget; stopping", file=sys.stderr)
            break
        # Each round starts one allocator later, so that no allocator always runs first (or last) in a
        # round: a device whose speed drifts over a round would otherwise favour one allocator every time.
        k = rnd % len(allocators)
        for use in allocators[k:] + allocators[:k]:
            t_proc = time.monotonic()
            try:
                p = subprocess.run(
                    _child_cmd(a, names, use), capture_output=True, text=True, env=envs[use], timeout=a.timeout
                )
                out, err, rc = p.stdout, p.stderr, p.returncode
            except subprocess.TimeoutExpired as e:
                out, err, rc = (e.stdout or b"").decode(), (e.stderr or b"").decode(), "timeout"
            got = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            for r in got:
                r["round"] = rnd
            rows.extend(got)
            if rc or len(got) < len(names):
                print(f"{use} (round {rnd + 1}) failed ({rc}):\n{err[-3000:]}", file=sys.stderr)
            per_process = max(per_process, time.monotonic() - t_proc)
        rounds_done += 1
        print(f"round {rounds_done} done at {time.monotonic() - t_start:.0f} s", file=sys.stderr, flush=True)
    return rows, rounds_done


def _child_env(use, env):
    """The children import the gpumem of this checkout (built in place) unless one is installed, or
    unless the allocator names its own: `gpumem:PYTHONPATH=DIR` puts DIR (another build, say) first."""
    own = env["PYTHONPATH"] if any(kv.startswith("PYTHONPATH=") for kv in use.partition(":")[2].split(",")) else None
    return with_checkout_path(dict(env, PYTHONPATH=os.environ.get("PYTHONPATH", "")), first=own)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, metavar="PATH", help="write the results as JSON to PATH")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=450.0, help="seconds; no round starts that would pass it")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument(
        "--allocators",
        default=ALLOCATORS,
        help="native first, separated by ',' (or ';' when one carries several VAR=VALUE)",
    )
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds one process may take")
    ap.add_argument("--trace", metavar="DIR", help="also write each workload's allocations as a trace there")
    ap.add_argument("--child", metavar="ALLOCATOR", help=argparse.SUPPRESS)
    a = ap.parse_args()
    names = [n for n in a.workloads.split(",") if n]
    for n in names:
        if n not in WORKLOADS:
            ap.error(f"unknown workload {n!r} (choose from {', '.join(WORKLOADS)})")
    if "llama_varlen_cap" in names and "llama_varlen" not in names[: names.index("llama_varlen_cap")]:
        ap.error("llama_varlen_cap needs llama_varlen before it (its cap is 1.05 x that run's peak live)")
    allocators = a.allocators.split(";") if ";" in a.allocators else a.allocators.split(",")
    if allocators[0] != "native":
        ap.error("the first allocator is the baseline and must be native")
    from compare.contenders import variant_env

    try:
        envs = {use: _child_env(use, variant_env(use)) for use in allocators}
    except ValueError as e:
        ap.error(str(e))
    if a.child:
        child(a.child, names, a.trace)
        return
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # this process must leave CUDA alone: no context here
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        print("gpu_policy.py: no CUDA device here; skipped")
        with open(a.out, "w") as f:
            json.dump({"skipped": "no CUDA device"}, f)
        return
    t_start = time.monotonic()
    rows, rounds_done = _rounds(a, names, allocators, envs, t_start)
    table = _table(rows, names, allocators)
    print(table)
    meta = dict(
        rounds=rounds_done,
        seconds=time.monotonic() - t_start,
        device=next((r["device"] for r in rows if "device" in r), None),
        torch=torch.__version__,
        allocators=allocators,
        workloads=names,
        llama=LLAMA,
        steps=STEPS,
        warmup=WARMUP,
        cap_over_live=CAP_OVER_LIVE,
    )
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "rows": rows, "table": table}, f, indent=1)
    print(f"wrote {a.out}")
    if a.trace:
        _traces(a, names, envs)


def _traces(a, names, envs):
    """--trace: one more process under torch's allocator, recording each workload's allocations."""
    cmd = _child_cmd(a, names, "native", "--trace", os.path.abspath(a.trace))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=envs["native"], timeout=a.timeout)
        if p.returncode:
            print(f"gpu_policy.py: recording the traces failed ({p.returncode}):\n{p.stderr[-3000:]}", file=sys.stderr)
        else:
            print(p.stderr.strip(), file=sys.stderr)
    except subprocess.TimeoutExpired:
        print(f"gpu_policy.py: recording the traces passed {a.timeout:.0f} s; stopped", file=sys.stderr)


if __name__ == "__main__":
    main()
