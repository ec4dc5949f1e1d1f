"""Spill to host memory on one GPU: training past the device, a KV cache past the device, and what
spill costs when there is room.

    python benchmarks/gpu_spill.py --out benchmarks/results/gpu_spill.json [--quick] [--budget 270] [--limit 75]

Three parts, every run a fresh process (an allocator is chosen once a process):

  a. training past the device: an HF transformers Llama built from a config (random weights, fp32
     weights, bf16 autocast, AdamW), the same batches every run (fixed seed, deterministic algorithms).
     gpumem uncapped measures the peak live memory and the losses; the cap is that peak / --over
     (1.3).  Under that cap torch's native allocator and expandable segments (the cap as
     set_per_process_memory_fraction) must run out of memory, and gpumem with spill on (each choice)
     must run every step.  Reported: the step where each ran out, the losses' largest difference
     from the uncapped run, the median steady step against the uncapped run, the peak of spilled
     bytes, and the spills and returns counted.
  b. generation past the device: HF generate (greedy, a fixed number of new tokens) on a bf16 Llama
     whose KV cache is most of the memory; uncapped, then capped at its peak / --gen-over with spill
     on.  Reported: tokens equal to the uncapped run's, time per token against it.
  c. with room, spill costs nothing: the training of part a uncapped, spill off vs on (spill on through
     GPUMEM_CONF), --rounds interleaved rounds; the median of the rounds' on / off step ratios (goal:
     within 2%).  The uncapped run of part a is round 1's spill-off run.

Time: --budget (270 s; 150 with --quick) bounds the whole run.  A run stops starting steps (tokens)
after --limit (75 s, imports included; 45 with --quick) or where the budget ends, and the table says
"time limit"; a run that would start with less than 20 s left is skipped.  The order is part a, part
b's uncapped and first spill run, part c's later rounds, part b's other choice: what a short budget
cuts comes last.

It prints the tables as Markdown rows for docs/spill.md, then its checks: a FAIL (a run that should have
run out of memory did not, a spill run that failed or spilled nothing, statistics not found) makes the
exit status 1; goals (losses and tokens equal, the 2%) are reported as met or missed.  The names the
spill mechanism uses (option, statistics) are in NAMES below.  Without the spill option it exits 2 at
once; without CUDA it says so, writes {"skipped": ...} and exits 0.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_T0 = time.monotonic()  # a child's time limit counts from its start, imports included
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_head, markdown_row, with_checkout_path, write_json  # noqa: E402
from compare.contenders import variant_env  # noqa: E402

# The spill mechanism's names, in one place.  Statistics are tuples: the first key present is read.
NAMES = {
    "option": "spill",  # install(spill="24GiB"), GPUMEM_CONF="spill:24GiB"; 0 or absent: off
    "choice_option": "spill_choice",
    "choices": ("old", "new", "lasting"),
    "spilled_peak": ("spilled_bytes.all.peak", "spilled_bytes.peak", "spilled_bytes_peak"),
    "spilled_current": ("spilled_bytes.all.current", "spilled_bytes.current", "spilled_bytes"),
    "spills": ("num_spills",),
    "returns": ("num_unspills",),
    "unspill": "unspill",  # gpumem.unspill(), else gpumem._C.unspill(), else the heap's method
}

GiB = 1 << 30
LLAMA = dict(num_attention_heads=16, num_key_value_heads=16, vocab_size=32000, max_position_embeddings=4096)
SIZES = {
    "full": dict(
        layers=12, hidden=1024, inter=2816, batch=8, seq=512, steps=24, warmup=4, rounds=3,
        gen_layers=8, gen_batch=96, gen_prompt=256, gen_new=256, gen_choices="new,lasting",
    ),
    "quick": dict(
        layers=4, hidden=1024, inter=2816, batch=8, seq=512, steps=10, warmup=3, rounds=1,
        gen_layers=4, gen_batch=32, gen_prompt=128, gen_new=64, gen_choices="new",
    ),
}  # fmt: skip


def _stat(st, key):
    """The first of NAMES[key]'s statistics present in st, else None."""
    return next((st[k] for k in NAMES[key] if k in st), None)


def _spill_stats(torch):
    st = torch.cuda.memory_stats()
    out = {k: _stat(st, k) for k in ("spilled_peak", "spilled_current", "spills", "returns")}
    out["peak_live"] = st.get("allocated_bytes.all.peak")
    out["peak_reserved"] = st.get("reserved_bytes.all.peak")
    out["spill_keys"] = sorted(k for k in st if "spill" in k)  # what the statistics call it, to adjust NAMES
    out.update(device=torch.cuda.get_device_name(0), torch=torch.__version__)
    out["transformers"] = __import__("transformers").__version__
    return out


# ---- the child: one run in a fresh process --------------------------------------------------------


def _setup(spec):
    """Put the allocator of spec in place (before any CUDA allocation) and make torch deterministic."""
    import torch

    if spec["alloc"] == "gpumem":  # first: gpumem must be in place before CUDA starts
        import gpumem

        opts = {}
        if spec.get("cap"):
            opts["cap"] = spec["cap"]
        if spec.get("spill") and not spec.get("spill_by_conf"):
            opts[NAMES["option"]] = spec["spill"]
        if spec.get("choice"):
            opts[NAMES["choice_option"]] = spec["choice"]
        gpumem.install(**opts)
    elif spec.get("cap"):
        torch.cuda.set_per_process_memory_fraction(spec["cap"] / torch.cuda.get_device_properties(0).total_memory)
    torch.manual_seed(1234)
    torch.use_deterministic_algorithms(True, warn_only=True)
    if hasattr(torch.utils, "deterministic"):
        torch.utils.deterministic.fill_uninitialized_memory = False  # no NaN fill: steps as usual
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    return torch


def _llama(torch, layers, hidden, inter, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    from compare.workloads import _place

    cfg = LlamaConfig(**LLAMA, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers)
    return _place(lambda: LlamaForCausalLM(cfg), "cuda", on_device=True, dtype=dtype)


def _left(spec):
    """Seconds this child may still start work in (its time_limit counts from the process's start)."""
    return spec.get("time_limit", float("inf")) - (time.monotonic() - _T0)


def _oom_text(e):
    """The error's text on one line, shortened: enough to see what it says about spill."""
    return " ".join(str(e).split())[:800] or type(e).__name__


def child_train(spec):
    """Train spec["steps"] steps; stop at the first out-of-memory error, or at the time limit, and say where."""
    torch = _setup(spec)
    t_start = time.perf_counter()
    m = _llama(torch, spec["layers"], spec["hidden"], spec["inter"], None)
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(4321)
    data = [
        torch.randint(0, LLAMA["vocab_size"], (spec["batch"], spec["seq"]), generator=gen) for _ in range(spec["steps"])
    ]
    losses, times, spilled_after, oom, stopped = [], [], [], None, None
    for i, x in enumerate(data):
        if _left(spec) < 0:
            stopped = f"stopped at the {spec['time_limit']:.0f} s time limit"
            break
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            x = x.to("cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = m(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            torch.cuda.synchronize()
        except torch.OutOfMemoryError as e:
            oom = dict(step=i + 1, text=_oom_text(e))
            break
        times.append(time.perf_counter() - t0)
        del x, loss
        spilled_after.append(_stat(torch.cuda.memory_stats(), "spilled_current"))
    r = dict(spec, steps_done=len(losses), oom=oom, stopped=stopped, losses=losses)
    r["step_ms"] = [round(t * 1e3, 3) for t in times]
    body = times[spec["warmup"] :] if oom is None and stopped is None else []
    r["median_ms"] = statistics.median(body) * 1e3 if body else None
    r.update(_spill_stats(torch), spilled_after_step=spilled_after)
    r.update(_after_return(torch, spec), wall_s=time.perf_counter() - t_start)
    return r


def _after_return(torch, spec):
    """Spilled bytes once the cache is emptied and gpumem asked to move spilled pages back."""
    if spec["alloc"] != "gpumem" or not spec.get("spill"):
        return {}
    import gpumem

    torch.cuda.synchronize()
    r = {}
    try:
        torch.cuda.empty_cache()
        r["spilled_after_empty_cache"] = _stat(torch.cuda.memory_stats(), "spilled_current")
        fn = getattr(gpumem, NAMES["unspill"], None) or getattr(gpumem._C, NAMES["unspill"], None)
        fn = fn or getattr(gpumem._C.registry_heap(0), NAMES["unspill"])
        fn()
        r["spilled_after_unspill"] = _stat(torch.cuda.memory_stats(), "spilled_current")
    except Exception as e:  # reported with the run's figures, which are worth more than this
        r["return_error"] = f"{type(e).__name__}: {e}"[:400]
    return r


def child_generate(spec):
    """Greedy generation of spec["new"] tokens after a spec["prompt"]-token prompt, batch spec["batch"]."""
    torch = _setup(spec)
    t_start = time.perf_counter()
    m = _llama(torch, spec["layers"], spec["hidden"], spec["inter"], torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(4321)
    prompt = torch.randint(3, LLAMA["vocab_size"], (spec["batch"], spec["prompt"]), generator=gen).to("cuda")

    def generate(x, new):
        return m.generate(
            input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
            do_sample=False, pad_token_id=0, use_cache=True, max_time=max(1.0, _left(spec)),
        )  # fmt: skip

    r, oom = dict(spec), None
    with torch.no_grad():
        generate(prompt[:2, :16], 8)  # kernels loaded, cuBLAS set up: not timed
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            out = generate(prompt, spec["new"])
            torch.cuda.synchronize()
        except torch.OutOfMemoryError as e:
            oom = dict(text=_oom_text(e))
        seconds = time.perf_counter() - t0
    r.update(oom=oom, seconds=seconds, stopped=None)
    if oom is None:
        done = out.shape[1] - spec["prompt"]
        r.update(tokens=out[:, spec["prompt"] :].tolist(), generated=done, ms_per_token=seconds * 1e3 / max(done, 1))
        if done < spec["new"]:
            r["stopped"] = f"stopped at the {spec['time_limit']:.0f} s time limit after {done} tokens"
        del out
    r.update(_spill_stats(torch))
    r.update(_after_return(torch, spec), wall_s=time.perf_counter() - t_start)
    return r


# ---- the parent: runs, tables, checks ---------------------------------------------------------------


class Runner:
    """Runs children one at a time within a budget; each result is a dict (with "failed" or "skipped").

    A child stops starting steps (tokens) once it has run `limit` seconds, or fewer where the budget has
    less left, and says so ("stopped"); one that outlives that by MARGIN seconds is killed."""

    MARGIN = 30.0
    LEAST = 20.0  # seconds a run needs at all: with less of the budget left it is skipped

    def __init__(self, budget, limit):
        self.budget, self.limit, self.t0 = budget, limit, time.monotonic()

    def env(self, alloc, conf=None):
        env = with_checkout_path(variant_env(alloc))
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # deterministic cuBLAS
        env.pop("GPUMEM_CONF", None)
        if conf:
            env["GPUMEM_CONF"] = conf
        return env

    def __call__(self, label, spec):
        elapsed = time.monotonic() - self.t0
        limit = min(self.limit, self.budget - elapsed)
        if limit < self.LEAST:
            print(f"[{elapsed:4.0f} s] {label}: skipped (the {self.budget:.0f} s budget)", file=sys.stderr)
            return dict(spec, label=label, skipped=f"budget of {self.budget:.0f} s")
        spec = dict(spec, time_limit=limit)
        conf = f"{NAMES['option']}:{spec['spill']}" if spec.get("spill_by_conf") else None
        cmd, env = [sys.executable, __file__, "--child", json.dumps(spec)], self.env(spec["alloc"], conf)
        t = time.monotonic()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=limit + self.MARGIN)
            out, err, rc = p.stdout, p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            out, err, rc = _text(e.stdout), _text(e.stderr), f"killed after {limit + self.MARGIN:.0f} s"
        took = time.monotonic() - t
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if rc or not lines:
            print(f"[{elapsed:4.0f} s] {label}: FAILED ({rc}) after {took:.0f} s:\n{err[-3000:]}", file=sys.stderr)
            return dict(spec, label=label, failed=f"failed ({rc})", stderr=err[-3000:])
        r = dict(json.loads(lines[-1]), label=label, process_s=took)
        what = f"out of memory at step {r['oom'].get('step', '?')}" if r.get("oom") else r.get("stopped") or "completed"
        print(f"[{elapsed:4.0f} s] {label}: {what} in {took:.0f} s", file=sys.stderr, flush=True)
        return r


def _text(b):
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def _ok(r):
    return r is not None and "failed" not in r and "skipped" not in r


def _gib(x):
    return f"{x / GiB:.2f}" if isinstance(x, (int, float)) else "-"


def _ratio(x, base):
    return f"{x / base:.3f}" if x and base else "-"


def _counts(r):
    """Spills / returns, "-" where the allocator has no such statistic."""
    return " / ".join("-" if r.get(k) is None else str(r[k]) for k in ("spills", "returns"))


def _loss_diff(r, base):
    if not (_ok(r) and _ok(base)) or not r["losses"]:
        return None
    return max(abs(x - y) for x, y in zip(r["losses"], base["losses"]))


def _train_table(rows, base):
    lines = [
        markdown_head(
            "run | cap GiB | steps run | out of memory at step | median step ms | ÷ uncapped "
            "| spilled peak GiB | spills / returns | max loss diff"
        )
    ]
    for r in rows:
        if not _ok(r):
            lines.append(markdown_row([r["label"], _gib(r.get("cap")), r.get("failed") or r.get("skipped")] + [""] * 6))
            continue
        med = r["median_ms"]
        diff = _loss_diff(r, base)
        cells = [
            r["label"], _gib(r.get("cap")) if r.get("cap") else "none", f"{r['steps_done']} / {r['steps']}",
            r["oom"]["step"] if r["oom"] else "time limit" if r.get("stopped") else "-",
            f"{med:.1f}" if med else "-", _ratio(med, base.get("median_ms")),
            _gib(r.get("spilled_peak")), _counts(r),
            f"{diff:.3g}" if diff is not None else "-",
        ]  # fmt: skip
        lines.append(markdown_row(cells))
    return "\n".join(lines)


def _tokens_equal(r, base):
    if not (_ok(r) and _ok(base)) or "tokens" not in r or "tokens" not in base:
        return None
    same = sum(a == b for ra, rb in zip(r["tokens"], base["tokens"]) for a, b in zip(ra, rb))
    return same, sum(len(x) for x in base["tokens"])


def _gen_table(rows, base):
    lines = [
        markdown_head(
            "run | cap GiB | tokens | ms per token | ÷ uncapped | spilled peak GiB | spills / returns | tokens equal"
        )
    ]
    for r in rows:
        if not _ok(r):
            lines.append(markdown_row([r["label"], _gib(r.get("cap")), r.get("failed") or r.get("skipped")] + [""] * 5))
            continue
        eq = _tokens_equal(r, base)
        ms = r.get("ms_per_token")
        tokens = "out of memory" if r["oom"] else f"{r['batch']} x {r['generated']}"
        cells = [
            r["label"], _gib(r.get("cap")) if r.get("cap") else "none",
            tokens + (" (time limit)" if r["stopped"] else ""),
            f"{ms:.2f}" if ms else "-", _ratio(ms, base.get("ms_per_token")), _gib(r.get("spilled_peak")),
            _counts(r), f"{eq[0]} / {eq[1]}" if eq else "-",
        ]  # fmt: skip
        lines.append(markdown_row(cells))
    return "\n".join(lines)


def _what(r):
    """A training run's median step, or why there is none."""
    if not _ok(r):
        return r.get("failed") or r.get("skipped")
    if r.get("stopped"):
        return "time limit"
    return f"{r['median_ms']:.1f}" if r["median_ms"] else "out of memory"


def _room_table(pairs):
    lines = [markdown_head("round | spill off: median step ms | spill on: median step ms | on ÷ off | max loss diff")]
    ratios = []
    for i, (off, on) in enumerate(pairs, 1):
        if not (_ok(off) and _ok(on) and off["median_ms"] and on["median_ms"]):
            lines.append(markdown_row([i, _what(off), _what(on), "", ""]))
            continue
        ratios.append(on["median_ms"] / off["median_ms"])
        diff = _loss_diff(on, off)
        lines.append(
            markdown_row([i, f"{off['median_ms']:.1f}", f"{on['median_ms']:.1f}", f"{ratios[-1]:.4f}", f"{diff:.3g}"])
        )
    med = statistics.median(ratios) if ratios else None
    lines.append(markdown_row(["median", "", "", f"{med:.4f}" if med else "-", ""]))
    return "\n".join(lines), med


def _check_spill_run(r, what, fails):
    """A spill run must complete and must have spilled; FAIL lines otherwise."""
    if not _ok(r):
        fails.append(f"{what}: {r.get('failed') or r.get('skipped')} {r.get('stderr', '')[-300:]}".strip())
    elif r.get("oom"):
        fails.append(f"{what}: out of memory with spill on: {r['oom']['text']}")
    elif r.get("stopped"):
        fails.append(f"{what}: {r['stopped']} (raise --limit and --budget to see it finish)")
    elif r.get("spilled_peak") is None:
        fails.append(f"{what}: no statistic {NAMES['spilled_peak']} (spill statistics here: {r['spill_keys']})")
    elif not r["spilled_peak"] or not r.get("spills"):
        fails.append(
            f"{what}: spilled nothing (spilled peak {r['spilled_peak']}, spills {r.get('spills')}): cap too loose?"
        )


def _checks(base, capped, gen_base, gens, pairs, room_med):
    """(FAIL lines, goal lines): the run's premises and its results."""
    fails, goals = [], []
    if not _ok(base) or base.get("stopped"):
        return [f"the uncapped training run: {base.get('failed') or base.get('skipped') or base['stopped']}"], goals
    for r in capped:
        if r["alloc"] != "gpumem" and _ok(r) and not r.get("oom"):
            fails.append(f"{r['label']} ran every step under the cap: the cap does not bind (raise --over)")
        elif r["alloc"] != "gpumem" and not _ok(r):
            fails.append(f"{r['label']}: {r.get('failed') or r.get('skipped')}")
        elif r["alloc"] == "gpumem":
            _check_spill_run(r, r["label"], fails)
    if not _ok(gen_base) or gen_base.get("oom") or gen_base.get("stopped"):
        why = gen_base.get("failed") or gen_base.get("skipped") or gen_base.get("oom") or gen_base.get("stopped")
        fails.append(f"the uncapped generation: {why}")
    for r in gens:
        _check_spill_run(r, r["label"], fails)
    for i, (off, on) in enumerate(pairs, 1):
        if not (_ok(off) and _ok(on) and off["median_ms"] and on["median_ms"]):
            fails.append(f"room round {i}: spill off: {_what(off)}; spill on: {_what(on)}")
    floor = _loss_diff(pairs[1][0], pairs[0][0]) if len(pairs) > 1 else None
    for r in capped:
        d = _loss_diff(r, base) if r["alloc"] == "gpumem" else None
        if d is not None:
            met = d == 0 or (floor is not None and d <= floor)
            goals.append(f"{'met' if met else 'MISSED'}: {r['label']}: losses differ by at most {d:.3g} (torch's own "
                         f"run-to-run difference: {'-' if floor is None else f'{floor:.3g}'})")  # fmt: skip
    for r in gens:
        eq = _tokens_equal(r, gen_base)
        if eq:
            goals.append(f"{'met' if eq[0] == eq[1] else 'MISSED'}: {r['label']}: {eq[0]} of {eq[1]} tokens equal")
    if room_med is not None:
        goals.append(
            f"{'met' if room_med <= 1.02 else 'MISSED'}: with room, spill on / off = {room_med:.4f} (goal <= 1.02)"
        )
    return fails, goals


def _specs(s, a):
    train = dict(
        kind="train",
        alloc="gpumem",
        **{k: s[k] for k in ("layers", "hidden", "inter", "batch", "seq", "steps", "warmup")},
    )
    gen = dict(kind="generate", alloc="gpumem", hidden=s["hidden"], inter=s["inter"], layers=s["gen_layers"])
    gen.update(batch=s["gen_batch"], prompt=s["gen_prompt"], new=s["gen_new"])
    return train, gen


def run_all(a, s):
    """Every run, in the order that interleaves part c's rounds; the results by part."""
    run = Runner(a.budget, a.limit)
    train, gen = _specs(s, a)
    spill_on = dict(train, spill=a.spill, spill_by_conf=True)
    base = run("uncapped, spill off", train)  # part a's reference and part c's first spill-off run
    pairs = [(base, run("uncapped, spill on (round 1)", spill_on))]
    capped = []
    if _ok(base):
        cap = int(base["peak_live"] / a.over)
        capped.append(run("native", dict(train, alloc="native", cap=cap)))
        capped.append(run("expandable segments", dict(train, alloc="expandable", cap=cap)))
        for choice in NAMES["choices"]:
            capped.append(run(f"gpumem, spill {choice}", dict(train, cap=cap, spill=a.spill, choice=choice)))
    gen_base = run("generate uncapped", gen)
    gens, choices = [], [c for c in a.gen_choices.split(",") if c]

    def gen_spill(choice):
        if _ok(gen_base) and not gen_base.get("oom"):
            cap = int(gen_base["peak_live"] / a.gen_over)
            gens.append(run(f"generate, spill {choice}", dict(gen, cap=cap, spill=a.spill, choice=choice)))

    if choices:
        gen_spill(choices[0])
    for i in range(2, a.rounds + 1):
        pairs.append((run(f"uncapped, spill off (round {i})", train), run(f"uncapped, spill on (round {i})", spill_on)))
    for choice in choices[1:]:
        gen_spill(choice)
    return dict(base=base, capped=capped, gen_base=gen_base, gens=gens, pairs=pairs, seconds=time.monotonic() - run.t0)


def report(a, s, res):
    """Print the tables and the checks, write the JSON; the exit status."""
    base, gen_base = res["base"], res["gen_base"]
    t_train = _train_table([base] + res["capped"], base)
    t_gen = _gen_table([gen_base] + res["gens"], gen_base)
    t_room, room_med = _room_table(res["pairs"])
    fails, goals = _checks(base, res["capped"], gen_base, res["gens"], res["pairs"], room_med)
    device = next((r.get("device") for r in [base, gen_base] if _ok(r) and r.get("device")), None)
    print(f"\n{device}, torch {base.get('torch')}, transformers {base.get('transformers')}; peak live: training "
          f"{_gib(base.get('peak_live'))} GiB, generation {_gib(gen_base.get('peak_live'))} GiB")  # fmt: skip
    print(f"\n## a. training past the device (cap = peak live / {a.over})\n\n{t_train}")
    print(f"\n## b. generation past the device (cap = peak live / {a.gen_over})\n\n{t_gen}")
    n = len(res["pairs"])
    print(f"\n## c. with room: spill off vs on, {n} interleaved round{'s' * (n != 1)}\n\n{t_room}\n")
    for line in goals:
        print("goal", line)
    for line in fails:
        print("FAIL:", line)
    met = sum(g.startswith("met") for g in goals)
    print(f"{len(fails)} FAIL, {met} of {len(goals)} goals met, {res['seconds']:.0f} s")
    equal = [_tokens_equal(r, gen_base) for r in [gen_base] + res["gens"]]
    for r, eq in zip([gen_base] + res["gens"], equal):
        r.pop("tokens", None)  # the JSON keeps how many are equal, not the tokens
        if eq:
            r["tokens_equal"] = list(eq)
    meta = dict(
        device=device, seconds=res["seconds"], sizes=s, over=a.over, gen_over=a.gen_over, spill=a.spill, names=NAMES
    )
    meta.update(torch=base.get("torch"), transformers=base.get("transformers"), llama=LLAMA)
    out = dict(meta=meta, train=[base] + res["capped"], generate=[gen_base] + res["gens"], room=res["pairs"])
    out.update(tables=dict(train=t_train, generate=t_gen, room=t_room), fails=fails, goals=goals)
    write_json(a.out, out)
    return 1 if fails else 0


def _preflight(repo):
    """None when this checkout's gpumem has the spill option and CUDA is here; else (message, exit status)."""
    sys.path.insert(0, repo)
    try:
        import gpumem.torch as gt
    except ImportError as e:
        return f"gpu_spill.py: error: gpumem does not import from {repo} ({e}); build it in place first", 2
    if NAMES["option"] not in gt.OPTION_NAMES:
        return f"gpu_spill.py: error: this gpumem ({gt.__file__}) has no install option {NAMES['option']!r}", 2
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # this process leaves CUDA alone: no context here
    try:
        import torch

        if torch.cuda.is_available():
            return None
    except ImportError:
        pass
    return "gpu_spill.py: no CUDA device here; skipped", 0


def _args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out", metavar="PATH", help="write the results as JSON to PATH (benchmarks/results/gpu_spill.json)"
    )
    ap.add_argument("--quick", action="store_true", help="smaller everything, one round (about 2 minutes)")
    ap.add_argument("--budget", type=float, help="seconds for the whole; runs end by then (270; 150 with --quick)")
    ap.add_argument("--limit", type=float, help="seconds one run may take, imports included (75; 45 with --quick)")
    ap.add_argument("--over", type=float, default=1.3, help="training: the cap is peak live / OVER (1.3)")
    ap.add_argument("--gen-over", type=float, default=1.3, help="generation: the cap is peak live / GEN_OVER (1.3)")
    ap.add_argument("--spill", default="32GiB", help="the host limit of spill runs (32GiB)")
    for k, v in SIZES["full"].items():
        q = SIZES["quick"][k]
        ap.add_argument("--" + k.replace("_", "-"), type=type(v), help=f"default {v} ({q} with --quick)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return a, None
    s = {
        k: getattr(a, k) if getattr(a, k) is not None else SIZES["quick" if a.quick else "full"][k]
        for k in SIZES["full"]
    }
    if not a.out:
        ap.error("--out PATH is required")
    if not 0 <= s["warmup"] < s["steps"] or s["rounds"] < 1 or a.over <= 1 or a.gen_over <= 1:
        ap.error("need 0 <= warmup < steps, rounds >= 1, --over and --gen-over above 1")
    bad = [c for c in s["gen_choices"].split(",") if c and c not in NAMES["choices"]]
    if bad:
        ap.error(f"unknown spill choice(s) {bad} (choose from {', '.join(NAMES['choices'])})")
    a.rounds, a.gen_choices = s["rounds"], s["gen_choices"]
    a.budget = a.budget if a.budget is not None else 150.0 if a.quick else 270.0
    a.limit = a.limit if a.limit is not None else 45.0 if a.quick else 75.0
    return a, s


def main():
    a, s = _args()
    if a.child:
        spec = json.loads(a.child)
        r = (child_train if spec["kind"] == "train" else child_generate)(spec)
        print(json.dumps(r), flush=True)
        return 0
    pre = _preflight(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if pre is not None:
        print(pre[0], file=sys.stderr if pre[1] else sys.stdout)
        if pre[1] == 0:
            write_json(a.out, {"skipped": "no CUDA device"})
        return pre[1]
    return report(a, s, run_all(a, s))


if __name__ == "__main__":
    sys.exit(main())
