"""A soak of gpumem under a training loop whose conditions keep changing.

    python benchmarks/gpu_soak.py [--minutes 10] [--json FILE] [--phase both|gpumem|native]

(With --phase both, the default, the native replay runs in a second process
beside the soak, following the steps as the soak writes them to
FILE.steps.jsonl, so the whole takes about --minutes; --phase gpumem then
--phase native, with the same --json, runs them one after the other instead.)

One process trains a GPT-2 (random weights from a config, nothing downloaded;
torch's TransformerEncoder when transformers is missing) with gpumem installed:

  * sequence lengths vary every step, activation checkpointing is on;
  * a side stream copies and reduces tensors the main stream made, handed over
    with record_stream;
  * the memory cap moves every few steps (set_per_process_memory_fraction);
    an OOM is caught, the batch halved and the step retried, and the batch
    regrows after a run of good steps;
  * empty_cache() is called at random, and history with Python stacks is
    switched on and off;
  * long-lived tensors carry checksums, verified every step.

At the end everything but the long-lived tensors is dropped and the cache
emptied: reserved memory must equal the pages those tensors touch (no leak),
and the invariant checker must pass.  Then a second process replays the same
executed schedule (same shapes, same seeds, no cap) on torch's native
allocator, and the losses are compared step by step.

Reports: minutes, steps, OOMs survived, checksum failures, leaked bytes, the
largest loss difference, and reserved / live over time.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import time

SEED = 1234


def build(torch, dev, attention):
    try:
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=8, n_embd=768, n_head=12, n_positions=1024)
        cfg._attn_implementation = attention
        m = GPT2LMHeadModel(cfg).to(dev)
        m.gradient_checkpointing_enable()
        m.config.use_cache = False

        def loss_of(x):
            return m(input_ids=x, labels=x).loss

        vocab = m.config.vocab_size
    except ImportError:
        from torch.utils.checkpoint import checkpoint

        vocab = 32000
        emb = torch.nn.Embedding(vocab, 768).to(dev)
        layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(768, 12, 3072, batch_first=True) for _ in range(8)
        ).to(dev)
        head = torch.nn.Linear(768, vocab).to(dev)
        m = torch.nn.ModuleList([emb, layers, head])

        def loss_of(x):
            h = emb(x)
            for layer in layers:
                h = checkpoint(layer, h, use_reentrant=False)
            return torch.nn.functional.cross_entropy(head(h).flatten(0, 1), x.flatten())

    return m, loss_of, vocab


def checksum(torch, t):
    return int(t.view(torch.int32).sum(dtype=torch.int64))


def follow(path):
    """The steps the soak writes to `path`, one JSON line each, as they come;
    the soak ends the file with a line "end"."""
    with open(path) as f:
        buf = ""
        while True:
            part = f.readline()
            if not part:
                time.sleep(0.02)
                continue
            buf += part
            if not buf.endswith("\n"):
                continue  # a line still being written
            line, buf = buf.strip(), ""
            if line == "end":
                return
            yield json.loads(line)


def train(args, schedule=None, log=None):
    """The gpumem run (schedule None: make one, writing each executed step to
    the file `log` as it goes) or the native replay of the steps `follow`
    reads from such a file."""
    import torch

    use_gpumem = schedule is None
    if use_gpumem:
        import gpumem

        gpumem.install()
    torch.use_deterministic_algorithms(True, warn_only=True)
    random.seed(SEED)
    torch.manual_seed(SEED)
    dev = "cuda"
    total = torch.cuda.get_device_properties(0).total_memory
    model, loss_of, vocab = build(torch, dev, args.attention)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    side = torch.cuda.Stream()
    keep, sums = _long_lived(torch, dev)
    rng = random.Random(SEED + 1)
    out = _results(use_gpumem)
    batch, max_batch, good = 8, 8, 0
    t_end = time.time() + 60 * args.minutes
    history_on = False
    base = None
    cap = [1.0]  # the fraction the schedule set

    one_step = _stepper(torch, loss_of, opt, side, vocab, dev, use_gpumem, cap)
    plan = iter(schedule if schedule is not None else [])
    while True:
        if schedule is None:
            if time.time() > t_end:
                break
            L = rng.choice([128, 192, 256, 384, 512, 768, 1024])
            step_seed = rng.randrange(1 << 30)
            if use_gpumem:
                history_on = _turn_knobs(torch, gpumem, rng, out, base, cap, history_on)
            while True:
                try:
                    loss, s = one_step(batch, L, step_seed)
                    break
                except torch.OutOfMemoryError:
                    out["ooms"] += 1
                    opt.zero_grad(set_to_none=True)
                    if batch == 1:  # even one sequence does not fit under this cap: lift it
                        cap[0] = 1.0
                        torch.cuda.set_per_process_memory_fraction(1.0)
                    batch = max(1, batch // 2)
                    good = 0
            out["schedule"].append([batch, L, step_seed])
            if log is not None:
                log.write(json.dumps([batch, L, step_seed]) + "\n")
                log.flush()
            good += 1
            if good >= 10 and batch < max_batch:
                batch *= 2
                good = 0
        else:
            item = next(plan, None)
            if item is None:
                break
            b, L, step_seed = item
            loss, s = one_step(b, L, step_seed)
        torch.cuda.synchronize()
        out["losses"].append(loss)
        out["steps"] += 1
        if base is None:
            base = torch.cuda.memory_reserved() / total
        _check_step(torch, out, keep, sums)
    if use_gpumem:
        gpumem.record_history(False)
        torch.cuda.set_per_process_memory_fraction(1.0)
    model = opt = loss_of = one_step = None  # free them before the next phase (one_step holds them)
    _after_run(torch, out, keep, sums, t_end, args.minutes, use_gpumem)
    return out


def _stepper(torch, loss_of, opt, side, vocab, dev, use_gpumem, cap):
    """one_step(b, L, step_seed): a training step of batch b, length L -> (loss, the side stream's sum)."""

    def one_step(b, L, step_seed):
        torch.manual_seed(step_seed)
        x = torch.randint(0, vocab, (b, L), device=dev)
        loss = loss_of(x)
        loss.backward()
        # The side stream reduces a copy of the batch the main stream made.
        y = x.float()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            s = y.sum()
        y.record_stream(side)
        del y
        if use_gpumem:
            # optimizer state and updates run uncapped, so that an OOM never
            # leaves a half-updated model behind
            torch.cuda.set_per_process_memory_fraction(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if use_gpumem:
            torch.cuda.set_per_process_memory_fraction(cap[0])
        torch.cuda.current_stream().wait_stream(side)
        return float(loss), float(s)

    return one_step


def _long_lived(torch, dev):
    """Long-lived tensors of assorted sizes, with their checksums."""
    keep = [
        torch.randint(-(2**31), 2**31 - 1, (random.randint(1 << 10, 16 << 20),), dtype=torch.int32, device=dev)
        for _ in range(12)
    ]
    return keep, [checksum(torch, t) for t in keep]


def _results(use_gpumem):
    return {
        "allocator": "gpumem" if use_gpumem else "native",
        "steps": 0,
        "ooms": 0,
        "checksum_failures": 0,
        "losses": [],
        "schedule": [],
        "ratio": [],
        "empty_cache_calls": 0,
        "history_toggles": 0,
        "cap_changes": 0,
    }


def _turn_knobs(torch, gpumem, rng, out, base, cap, history_on):
    """Before a gpumem step: every 5th a new cap (a fraction of the device, cap[0]), now and then
    empty_cache, every 7th history toggled; returns whether history is on."""
    step_i = out["steps"]
    if step_i % 5 == 0 and base is not None:
        cap[0] = 1.0 if rng.random() < 0.3 else min(1.0, base * rng.uniform(1.05, 2.5))
        torch.cuda.set_per_process_memory_fraction(cap[0])
        out["cap_changes"] += 1
    if rng.random() < 0.1:
        torch.cuda.empty_cache()
        out["empty_cache_calls"] += 1
    if step_i % 7 == 0:
        history_on = not history_on
        gpumem.record_history(history_on, stacks="python")
        out["history_toggles"] += 1
    return history_on


def _check_step(torch, out, keep, sums):
    """After a step: the long-lived tensors' checksums, and reserved / live every 10 steps."""
    bad = sum(checksum(torch, t) != c for t, c in zip(keep, sums))
    out["checksum_failures"] += bad
    if out["steps"] % 10 == 0:
        live = torch.cuda.memory_allocated()
        out["ratio"].append([out["steps"], round(torch.cuda.memory_reserved() / max(live, 1), 4)])


def _after_run(torch, out, keep, sums, t_end, minutes, use_gpumem):
    """Once the model is freed: the cache emptied, what gpumem still holds, the invariants, the checksums."""
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    out["minutes"] = round((time.time() - (t_end - 60 * minutes)) / 60, 2)
    if use_gpumem:
        import gpumem

        snap = gpumem.snapshot()
        s = snap.summary
        out["reserved_after_empty_cache"] = s.reserved_bytes
        out["pages_live_tensors_touch"] = s.used_page_bytes
        out["leaked_bytes"] = s.reserved_bytes - s.used_page_bytes
        gpumem._C.registry_heap(0).check()  # raises on a broken invariant
        out["checker"] = "passed"
    out["checksum_failures"] += sum(checksum(torch, t) != c for t, c in zip(keep, sums))


def native_replay(steps_path, attention):
    """Start the native replay of the steps the soak writes to `steps_path` in
    a second process, which follows the file as it grows (or reads a finished
    one); `finish` waits for it and returns its results, or None."""
    # Its warnings go to a file: a full pipe would stall it behind the soak.
    err = open(steps_path + ".native.log", "w+")
    p = subprocess.Popen(
        [sys.executable, __file__, "--follow", steps_path, "--attention", attention],
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        env=dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8"),
    )
    p.err_file = err
    return p


def finish(p):
    out, _ = p.communicate()
    p.err_file.seek(0)
    err = p.err_file.read()
    p.err_file.close()
    line = [ln for ln in out.splitlines() if ln.startswith("{")]
    if p.returncode or not line:
        print(f"native replay failed:\n{err[-3000:]}", file=sys.stderr)
        return None
    return json.loads(line[-1])


def _report(g, n):
    """The soak's figures beside the native replay's (n, None if it failed), printed as a table."""
    diffs = [abs(x - y) for x, y in zip(g["losses"], n["losses"])] if n else []
    report = {
        k: g[k]
        for k in (
            "minutes",
            "steps",
            "ooms",
            "checksum_failures",
            "leaked_bytes",
            "checker",
            "reserved_after_empty_cache",
            "pages_live_tensors_touch",
            "cap_changes",
            "empty_cache_calls",
            "history_toggles",
            "ratio",
        )
    }
    report["native_steps"] = n["steps"] if n else None
    report["max_loss_diff"] = max(diffs) if diffs else None
    report["max_relative_loss_diff"] = max((d / abs(x) for d, x in zip(diffs, g["losses"]) if x), default=None)
    report["steps_with_loss_diff"] = sum(d != 0 for d in diffs)
    g["losses_native"] = n["losses"] if n else None
    report["losses_equal"] = bool(n) and n["steps"] == g["steps"] and all(d == 0 for d in diffs)
    print("| minutes | steps | OOMs survived | checksum failures | leaked bytes | checker | max |loss - native| |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {report['minutes']} | {report['steps']} | {report['ooms']} | {report['checksum_failures']} | "
        f"{report['leaked_bytes']} | {report['checker']} | {report['max_loss_diff']} |"
    )
    print("reserved / live every 10 steps:", " ".join(f"{s}:{r}" for s, r in report["ratio"]))
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--json", default="gpu_soak.json", help="results (and, with --phase, the hand-over file)")
    ap.add_argument(
        "--phase",
        choices=["both", "gpumem", "native"],
        default="both",
        help="gpumem: the soak only (writes --json and its .steps.jsonl); native: the native replay of "
        "those steps, compared with the losses in --json; both: the two side by side",
    )
    ap.add_argument(
        "--attention",
        default="sdpa",
        choices=["sdpa", "eager"],
        help="GPT-2's attention: sdpa (transformers' default; its memory-efficient backward is not deterministic, "
        "so losses may differ from native's in the last bits) or eager (deterministic, more memory)",
    )
    ap.add_argument("--follow", help=argparse.SUPPRESS)  # internal: native replay of the soak's steps file
    a = ap.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if a.follow:
        print(json.dumps(train(a, follow(a.follow))), flush=True)
        return
    native = None
    steps_path = a.json + ".steps.jsonl"
    if a.phase in ("both", "gpumem"):
        with open(steps_path, "w") as log:
            if a.phase == "both":
                # The native replay runs beside the soak, a step behind it.
                native = native_replay(steps_path, a.attention)
            try:
                g = train(a, log=log)
            finally:
                log.write("end\n")
                log.flush()
        with open(a.json, "w") as f:
            json.dump(g, f)
    else:
        with open(a.json) as f:
            g = json.load(f)
    if a.phase == "gpumem":
        print(f"soak done: {g['steps']} steps, {g['ooms']} OOMs survived; run --phase native --json {a.json} next")
        return
    if native is None:
        native = native_replay(steps_path, a.attention)  # the soak's finished steps file
    n = finish(native)
    report = _report(g, n)
    g["report"] = report
    with open(a.json, "w") as f:
        json.dump(g, f, indent=1)
    sys.exit(0 if report["checksum_failures"] == 0 and report["leaked_bytes"] == 0 else 1)


if __name__ == "__main__":
    main()
