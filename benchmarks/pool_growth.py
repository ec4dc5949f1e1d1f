"""Graph-pool memory at growing shapes, on the simulated device.

What torch.compile(mode="reduce-overhead") does to one cudagraph-trees pool,
as allocations: general memory holds the weights; then, for each shape in turn
(growing), a warm-up pass and a recorded pass of a transformer forward run in
the pool (torch routes them there between begin/endAllocateToPool, which gpumem
treats as a capture under way).  Within a pass, intermediates are allocated and
freed layer by layer; the recorded pass's output (the logits) stays live, as a
CUDA graph's static output does.  After each shape's recording a small tensor
of the general heap is allocated and kept (--between bytes; cudagraph trees
keeps a few such between recordings): it must not stand in the way of the
pool's next growth.  The sizes follow a Llama-style model: hidden
2048, 16 heads, MLP 5504, vocabulary 32000, 4 layers, bf16 (--hidden etc.).

--model encoder runs a compiled BERT-style encoder with its language-model
head instead (BERT-base: 12 layers, hidden 768, 12 heads, MLP 3072,
vocabulary 30522, shapes 8x512,32x512,64x256), its passes as the allocation
history of torch.compile's graphs of a BERT-base shows them: inductor reuses
its buffers, so a few live across the layers while each layer allocates and
frees its attention scores and its MLP's intermediate, and the head's copied
weight and the logits come last.

Printed: peak live and peak reserved memory, and reserved / live, for gpumem
(also with no capture under way, where the growth limit and defragmentation
apply, as they would to a MemPool used without a graph) and for a model of one contiguous growable segment per
pool (expandable
segments: best fit among its free ranges, else the segment grows at its end by
what its free tail lacks, in 2 MiB pages), which is the figure to approach.

Usage: python benchmarks/pool_growth.py [--model llama|encoder] [--shapes 2x256,8x512,16x1024] [--drop-outputs]
       [--between BYTES] [--label NAME] [--out benchmarks/results/pool_growth.json]
"""

import argparse
import os
import platform
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import gpumem  # noqa: E402
from common import write_json  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
PAGE = 2 * MiB
POOL = (1, 1)
STREAM = 0x5EED  # cudagraph trees record and warm up on one side stream


def weights(a):
    """Sizes of a Llama-style model's weights, one allocation per tensor."""
    h, i, v = a.hidden, a.mlp, a.vocab
    per_layer = [h * h] * 4 + [h * i] * 3 + [h, h]
    return [2 * n for n in [v * h] + per_layer * a.layers + [h, v * h]]


def encoder_weights(a):
    """Sizes of a BERT-style encoder's weights with its language-model head
    (the decoder's matrix tied to the embedding), one allocation per tensor."""
    h, i, v = a.hidden, a.mlp, a.vocab
    layer = [h * h, h] * 4 + [h, h] + [i * h, i, h * i, h] + [h, h]
    return [2 * n for n in [v * h, 512 * h, 2 * h, h, h] + layer * a.layers + [h * h, h, h * h, h, h, h, v]]


def forward(a, tokens, alloc, free, batch):
    """One forward pass: intermediates allocated and freed as a transformer's
    are; returns the live output (logits)."""
    act, mlp, bf16 = tokens * a.hidden * 2, tokens * a.mlp * 2, 2

    def residual(x, branch):
        """x + branch, into a new activation; both freed."""
        out = alloc(act)
        free(x), free(branch)
        return out

    x = alloc(act)
    for _ in range(a.layers):
        n = alloc(act)
        q, k, v = alloc(act), alloc(act), alloc(act)
        free(n)
        lse = alloc(batch * a.heads * (tokens // batch) * 4)  # attention's log-sum-exp
        o = alloc(act)
        free(q), free(k), free(v), free(lse)
        proj = alloc(act)
        free(o)
        x = residual(x, proj)
        n = alloc(act)
        gate, up = alloc(mlp), alloc(mlp)
        free(n)
        h_ = alloc(mlp)
        free(gate), free(up)
        down = alloc(act)
        free(h_)
        x = residual(x, down)
    n = alloc(act)
    free(x)
    logits = alloc(tokens * a.vocab * bf16)
    free(n)
    return logits


def forward_encoder(a, tokens, alloc, free, batch):
    """One forward pass of a compiled encoder with its language-model head:
    returns the live output (logits)."""
    seq = tokens // batch
    act, wide, inter = tokens * a.hidden * 2, tokens * a.hidden * 4, tokens * a.mlp * 2
    x, y = alloc(act), alloc(act)
    blas = [alloc(32 * MiB), alloc(MiB)]  # cuBLAS's and cuBLASLt's workspaces, at the first matmul
    z = alloc(act)
    w1, w2 = alloc(wide), alloc(wide)  # fp32 buffers the layers share
    for _ in range(a.layers):
        scores = alloc(batch * a.heads * seq * seq * 4)
        free(scores)
        h_ = alloc(inter)
        free(h_)
    free(w1), free(w2), free(z), free(y)
    h_ = alloc(inter)  # the head's transform
    free(h_)
    weight, bias = alloc(a.vocab * a.hidden * 2), alloc(a.vocab * 2)
    logits = alloc(tokens * a.vocab * 2)
    free(x), free(weight), free(bias), free(blas[0]), free(blas[1])
    return logits


MODELS = {
    "llama": (
        weights,
        forward,
        dict(shapes="2x256,8x512,16x1024", layers=4, hidden=2048, heads=16, mlp=5504, vocab=32000),
    ),
    "encoder": (
        encoder_weights,
        forward_encoder,
        dict(shapes="8x512,32x512,64x256", layers=12, hidden=768, heads=12, mlp=3072, vocab=30522),
    ),
}


def run_gpumem(a, shapes, capture=True):
    peak_live = 0
    with gpumem.Heap(device="sim", capacity=a.capacity) as h:

        def live():
            nonlocal peak_live
            st = h.stats()
            peak_live = max(peak_live, st["allocated_bytes.all.current"])

        w = [h.malloc(n, stream=STREAM) for n in a.weights(a)]
        h.pool_retain(POOL)
        outputs = []

        def alloc(n):
            p = h.malloc(n, stream=STREAM, pool=POOL)
            live()
            return p

        per_shape = []
        for b, t in shapes:
            if capture:
                h.capture_begin()
            out = a.forward(a, b * t, alloc, h.free, b)  # warm-up: its output goes back
            h.free(out)
            outputs.append(a.forward(a, b * t, alloc, h.free, b))  # recorded: its output stays
            if a.drop_outputs:
                h.free(outputs.pop())
            if capture:
                h.capture_end()
            if a.between:
                w.append(h.malloc(a.between, stream=STREAM))
            st = h.stats()
            per_shape.append(
                {
                    "shape": f"{b}x{t}",
                    "reserved": st["reserved_bytes.all.current"],
                    "live": st["allocated_bytes.all.current"],
                    "pool_free_bytes": h.pool_info(POOL)["free_bytes"],
                }
            )
        st = h.stats()
        err = h.check()
        res = {
            "peak_live": peak_live,
            "peak_reserved": st["reserved_bytes.all.peak"],
            "num_device_alloc": st["num_device_alloc"],
            "num_remaps": st["num_remaps"],
            "per_shape": per_shape,
            "check": err or "ok",
        }
        for p in outputs + w:
            h.free(p)
        h.pool_release(POOL)
    return res


class Segment:
    """One growable segment: best fit among free ranges, else grow at the end."""

    def __init__(self):
        self.free = []  # (addr, size), sorted by address
        self.top = 0  # bytes used from the segment's start
        self.mapped = 0
        self.sizes = {}

    def alloc(self, n):
        n = (n + 511) // 512 * 512
        best = None
        for i, (a, s) in enumerate(self.free):
            if s >= n and (best is None or s < self.free[best][1]):
                best = i
        if best is not None:
            a, s = self.free[best]
            if s == n:
                del self.free[best]
            else:
                self.free[best] = (a + n, s - n)
        elif self.free and self.free[-1][0] + self.free[-1][1] == self.top:
            a, s = self.free.pop()  # the free tail, extended
            self.top = a + n
        else:
            a = self.top
            self.top += n
        self.mapped = max(self.mapped, (self.top + PAGE - 1) // PAGE * PAGE)
        self.sizes[a] = n
        return a

    def release(self, a):
        n = self.sizes.pop(a)
        self.free.append((a, n))
        self.free.sort()
        merged = []
        for x, s in self.free:
            if merged and merged[-1][0] + merged[-1][1] == x:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((x, s))
        self.free = merged


def run_segment(a, shapes):
    general, pool = Segment(), Segment()
    live = peak = 0
    sizes = {}

    def alloc(seg, n):
        nonlocal live, peak
        p = seg.alloc(n)
        key = (id(seg), p)
        sizes[key] = (n + 511) // 512 * 512
        live += sizes[key]
        peak = max(peak, live)
        return key

    def free(key):
        nonlocal live
        live -= sizes.pop(key)
        (general if key[0] == id(general) else pool).release(key[1])

    for n in a.weights(a):
        alloc(general, n)
    for b, t in shapes:
        free(a.forward(a, b * t, lambda n: alloc(pool, n), free, b))
        out = a.forward(a, b * t, lambda n: alloc(pool, n), free, b)
        if a.drop_outputs:
            free(out)
        if a.between:
            alloc(general, a.between)
    return {"peak_live": peak, "peak_reserved": general.mapped + pool.mapped}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="llama", help="whose passes (default: llama)")
    ap.add_argument("--shapes", help="batch x seq, comma separated (default: the model's)")
    for name in ("layers", "hidden", "heads", "mlp", "vocab"):
        ap.add_argument(f"--{name}", type=int, help="default: the model's")
    ap.add_argument("--capacity", default="80GiB")
    ap.add_argument(
        "--drop-outputs", action="store_true", help="free each recorded pass's output too (the caller drops it)"
    )
    ap.add_argument(
        "--between", type=int, default=128 << 10, help="bytes of general memory kept after each recording (0: none)"
    )
    ap.add_argument("--label", default="", help="a name for this build, kept in the JSON")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "pool_growth.json"))
    a = ap.parse_args(argv)
    a.weights, a.forward, preset = MODELS[a.model]
    for k, v in preset.items():
        setattr(a, k, v if getattr(a, k) is None else getattr(a, k))
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    g = run_gpumem(a, shapes)
    nc = run_gpumem(a, shapes, capture=False)
    s = run_segment(a, shapes)
    print(
        f"one graph pool, {a.model}, shapes {a.shapes}; {a.layers} layers, hidden {a.hidden}, MLP {a.mlp}, "
        f"vocabulary {a.vocab}, bf16 (simulated device)"
    )
    print(f"{'':28s}{'peak live GiB':>15s}{'peak reserved GiB':>19s}{'reserved/live':>15s}")
    for name, r in (("gpumem", g), ("gpumem, no capture", nc), ("one growable segment/pool", s)):
        print(
            f"{name:28s}{r['peak_live'] / GiB:15.3f}{r['peak_reserved'] / GiB:19.3f}"
            f"{r['peak_reserved'] / r['peak_live']:15.3f}"
        )
    for p in g["per_shape"]:
        print(
            f"  gpumem after {p['shape']:>8s}: reserved {p['reserved'] / GiB:.3f} GiB, live "
            f"{p['live'] / GiB:.3f} GiB, pool free {p['pool_free_bytes'] / GiB:.3f} GiB"
        )
    print(f"gpumem / segment model, peak reserved: {g['peak_reserved'] / s['peak_reserved']:.3f}; check: {g['check']}")
    out = {
        "benchmark": "pool_growth",
        "label": a.label,
        "python": platform.python_version(),
        "args": {k: v for k, v in vars(a).items() if k not in ("out", "weights", "forward")},
        "gpumem": g,
        "gpumem_no_capture": nc,
        "segment_model": s,
    }
    write_json(a.out, out)
    return 0 if g["check"] == nc["check"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
