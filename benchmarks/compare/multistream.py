"""Training workloads that use several CUDA streams, for benchmarks/capture_trace.py (random
weights, nothing downloaded).  Each hands tensors between streams the way real code does: the
consumer waits on the producer (an event or wait_stream) and the tensor gets
``record_stream(consumer)``, so the caching allocator frees it only once the consumer's work is
done.  In a trace that shows as a ``free_requested`` followed later by its ``free_completed``.

* prefetch_loader: ResNet-50 training (workloads.py's model, optimizer and shape draws); a side
  stream copies the next batch (uint8 images, labels) from pinned host memory with
  non_blocking copies and normalises it while the main stream trains on the current one.
* overlap_comm: GPT-2 small training (workloads.py's); as backward makes gradients, a
  communication stream copies them into 25 MiB flat buckets (reverse parameter order, as DDP
  buckets them) and reduces each bucket (a peer's copy summed in and averaged, standing in for a
  two-rank all-reduce); the optimizer waits for that stream and steps on gradients that are
  views of the buckets, as DDP's gradient_as_bucket_view gives.
* two_stream_pipeline: a 16-layer transformer encoder split in two stages; stage 1 runs on
  stream A, stage 2 on stream B, four micro-batches per step flow A -> B (forward) and
  B -> A (gradient of the boundary activation), all of them in flight before stage 1's backward.

``tiny=True`` swaps in small torch-only models so that the same code runs on the CPU in tests;
there the stream calls only log what they would do, and ``Streams.trace_lines()`` gives a
synthetic trace of the weights and of the tensors the workload allocates on side streams or hands
between streams (sizes scaled by SYNTHETIC_SCALE).
"""

from __future__ import annotations

import contextlib
import random
import weakref
from typing import Callable, Dict, List, Optional

MiB = 1 << 20
MAIN = 0  # the default stream's handle, in traces and on the CPU stand-in
MULTISTREAM = ["prefetch_loader", "overlap_comm", "two_stream_pipeline"]
# The synthetic trace's blocks are the CPU tensors' sizes times this, so that its peak live is a few
# hundred MiB, as a small GPU workload's would be, not a few hundred KiB.
SYNTHETIC_SCALE = 4096


class CpuStream:
    """What the workloads need of a torch.cuda.Stream, on the CPU (nothing to wait for)."""

    def __init__(self, handle: int):
        self.cuda_stream = handle

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass


class Streams:
    """Streams, events and record_stream on the GPU.  On the CPU the same calls log what they
    would do (`log`) and build a synthetic trace of the tensors passed to `track`."""

    def __init__(self, dev):
        import torch

        self.torch = torch
        self.dev = torch.device(dev)
        self.cuda = self.dev.type == "cuda"
        self.log: List[tuple] = []
        self._main = torch.cuda.current_stream(self.dev) if self.cuda else CpuStream(MAIN)
        self._cur = self._main
        self._n = 0
        # CPU only: the synthetic trace
        self._lines: List[str] = []
        self._addr = 1 << 32
        self._tracked: Dict[int, dict] = {}  # id(tensor) -> {"addr", "size", "stream", "handed"}
        self._deferred: List[dict] = []  # freed while handed to another stream: completes later

    # -- streams ---------------------------------------------------------------------------------
    def main(self):
        return self._main

    def new(self):
        if self.cuda:
            return self.torch.cuda.Stream(self.dev)
        self._n += 1
        return CpuStream(0x7F0000000000 + self._n * 0x1000)

    def current(self):
        return self.torch.cuda.current_stream(self.dev) if self.cuda else self._cur

    @contextlib.contextmanager
    def on(self, stream):
        """Work issued inside runs on `stream` (torch.cuda.stream)."""
        if self.cuda:
            with self.torch.cuda.stream(stream):
                yield
            return
        prev, self._cur = self._cur, stream
        try:
            yield
        finally:
            self._cur = prev

    def wait(self, waiter, producer) -> None:
        """`waiter`'s later work waits for all work issued so far on `producer`."""
        self.log.append(("wait", waiter.cuda_stream, producer.cuda_stream))
        waiter.wait_stream(producer)

    def event(self, stream):
        """An event recorded on `stream` now."""
        self.log.append(("event", stream.cuda_stream))
        if not self.cuda:
            return ("event", stream.cuda_stream)
        e = self.torch.cuda.Event()
        e.record(stream)
        return e

    def wait_event(self, stream, event) -> None:
        self.log.append(("wait_event", stream.cuda_stream))
        stream.wait_event(event)

    def hand(self, t, stream) -> None:
        """`t` is used on `stream` from now on: record_stream, so that its memory is not reused
        before `stream`'s work on it is done."""
        self.log.append(("record_stream", tuple(t.shape), stream.cuda_stream))
        if self.cuda:
            t.record_stream(stream)
            return
        e = self._tracked.get(id(t))
        if e is not None and stream.cuda_stream != e["stream"]:
            e["handed"] = True

    def track_all(self, tensors) -> None:
        """track() each of `tensors` (a model's weights: they live on the current stream)."""
        if not self.cuda:
            for t in tensors:
                self.track(t)

    def pinned(self, t):
        return t.pin_memory() if self.cuda else t

    # -- the synthetic trace (CPU) ---------------------------------------------------------------
    def track(self, t):
        """Record `t`'s allocation on the current stream in the synthetic trace (CPU only; on a
        GPU the allocator's own history has every allocation)."""
        if self.cuda:
            return t
        self._complete_deferred()
        size = max(512, -(-t.numel() * t.element_size() * SYNTHETIC_SCALE // 512) * 512)
        e = {"addr": self._addr, "size": size, "stream": self._cur.cuda_stream, "handed": False}
        self._addr += size
        self._tracked[id(t)] = e
        self._lines.append(f"alloc {e['addr']} {size} {e['stream']}")
        weakref.finalize(t, self._freed, id(t))
        return t

    def _freed(self, key: int) -> None:
        e = self._tracked.pop(key, None)
        if e is None:
            return
        self._lines.append(f"free_requested {e['addr']} {e['size']} {e['stream']}")
        if e["handed"]:
            self._deferred.append(e)  # as a caching allocator does: completes at a later allocation
        else:
            self._lines.append(f"free_completed {e['addr']} {e['size']} {e['stream']}")

    def _complete_deferred(self) -> None:
        for e in self._deferred:
            self._lines.append(f"free_completed {e['addr']} {e['size']} {e['stream']}")
        self._deferred = []

    def trace_lines(self) -> List[str]:
        return list(self._lines)


# ---- prefetch_loader ---------------------------------------------------------------------------------


def _tiny_convnet():
    import torch.nn as nn

    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


class Prefetcher:
    """Batches copied from pinned host memory on a side stream, one batch ahead of the consumer."""

    def __init__(self, streams: Streams, host_batches, channels_last: bool):
        self.s = streams
        self.side = streams.new()
        self.host = list(host_batches)
        self.channels_last = channels_last
        self.next = None
        self.i = 0

    def _load(self):
        import torch

        if self.i >= len(self.host):
            return None
        img_h, lab_h = self.host[self.i]
        self.i += 1
        s = self.s
        # every host batch has pinned memory of its own, so no copy waits for an earlier one
        with s.on(self.side):
            img = s.track(img_h.to(s.dev, non_blocking=True))
            lab = s.track(lab_h.to(s.dev, non_blocking=True))
            x = s.track(img.float())
            del img
            x.div_(255.0).sub_(0.45).div_(0.225)
            if self.channels_last:
                x = s.track(x.contiguous(memory_format=torch.channels_last))
            ready = s.event(self.side)
        return x, lab, ready

    def __iter__(self):
        self.next = self._load()
        while self.next is not None:
            x, lab, ready = self.next
            self.next = self._load()  # the copy of batch i+1 overlaps step i
            main = self.s.current()
            self.s.wait_event(main, ready)
            self.s.hand(x, main)
            self.s.hand(lab, main)
            yield x, lab
            del x, lab


def prefetch_loader(dev, rng: random.Random, steps: int, tiny: bool = False) -> Streams:
    import torch

    s = Streams(dev)
    if tiny:
        model = _tiny_convnet().to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        shapes = [(rng.choice([2, 3, 4]), rng.choice([16, 24, 32])) for _ in range(steps)]
        classes = 10
    else:
        from . import workloads

        w = workloads.build("resnet50_multires", dev, seed=None, on_device=False)
        model, opt = w.model, w.opt
        shapes = [w.draw(rng) for _ in range(steps)]
        classes = 1000
    s.track_all(model.parameters())
    host = [
        (
            s.pinned(torch.randint(0, 256, (b, 3, n, n), dtype=torch.uint8)),
            s.pinned(torch.randint(0, classes, (b,))),
        )
        for b, n in shapes
    ]
    for x, y in Prefetcher(s, host, channels_last=not tiny):
        with torch.autocast("cuda", dtype=torch.bfloat16) if s.cuda else contextlib.nullcontext():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x, y, loss
    return s


# ---- overlap_comm ------------------------------------------------------------------------------------


class BucketedComm:
    """Gradient buckets reduced on a communication stream while backward goes on (DDP's pattern,
    in one process).  Buckets fill in reverse parameter order; when a bucket's last gradient has
    been accumulated, the comm stream waits for the current stream, copies the gradients into a
    flat buffer it allocates and reduces it.  finish() makes the current stream wait for the
    comm stream and points each parameter's .grad at its slice of the bucket."""

    def __init__(self, streams: Streams, params, bucket_bytes: int = 25 * MiB):
        self.s = streams
        self.comm = streams.new()
        self.buckets: List[list] = []
        cur, cur_bytes = [], 0
        for p in reversed([p for p in params if p.requires_grad]):
            nbytes = p.numel() * p.element_size()
            if cur and (cur_bytes + nbytes > bucket_bytes or p.dtype != cur[0].dtype):
                self.buckets.append(cur)
                cur, cur_bytes = [], 0
            cur.append(p)
            cur_bytes += nbytes
        if cur:
            self.buckets.append(cur)
        self.where = {id(p): k for k, b in enumerate(self.buckets) for p in b}
        self.handles = [p.register_post_accumulate_grad_hook(self._ready) for b in self.buckets for p in b]
        self.reset()

    def reset(self) -> None:
        self.ready = [0] * len(self.buckets)
        self.flats: Dict[int, object] = {}
        self.launched: List[int] = []

    def _ready(self, p) -> None:
        k = self.where[id(p)]
        self.ready[k] += 1
        if self.ready[k] == len(self.buckets[k]):
            self._launch(k)

    def _launch(self, k: int) -> None:
        import torch

        s, comm = self.s, self.comm
        grads = [p.grad for p in self.buckets[k]]
        s.wait(comm, s.current())  # the gradients are written on the current (backward) stream
        with s.on(comm):
            flat = s.track(torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype, device=grads[0].device))
            for g, v in zip(grads, flat.split([g.numel() for g in grads])):
                v.copy_(g.reshape(-1))
                s.hand(g, comm)
            # a peer's copy of the bucket summed in and averaged: a two-rank all-reduce
            peer = s.track(flat.clone())
            flat.add_(peer).mul_(0.5)
            del peer
        self.flats[k] = flat
        self.launched.append(k)

    def finish(self) -> None:
        s = self.s
        main = s.current()
        s.wait(main, self.comm)
        for k, flat in self.flats.items():
            s.hand(flat, main)
            ps = self.buckets[k]
            for p, v in zip(ps, flat.split([p.numel() for p in ps])):
                p.grad = v.view_as(p)
        self.flats = {}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _tiny_lm(vocab: int = 97, d: int = 32):
    import torch.nn as nn

    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.body = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.LayerNorm(d))
            self.head = nn.Linear(d, vocab)

        def forward(self, x):
            import torch.nn.functional as F

            logits = self.head(self.body(self.emb(x)))
            return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), x[:, 1:].reshape(-1))

    return TinyLM()


def overlap_comm(dev, rng: random.Random, steps: int, tiny: bool = False) -> Streams:
    import torch

    s = Streams(dev)
    if tiny:
        model = _tiny_lm().to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        vocab, draw, bucket = 97, (lambda r: (2, r.choice([8, 12, 16]))), 8 << 10
        loss_of = model
    else:
        from . import workloads

        w = workloads.build("gpt2_varlen", dev, seed=None, on_device=False)
        model, opt = w.model, w.opt
        vocab, draw, bucket = 50257, w.draw, 25 * MiB
        loss_of = lambda x: model(input_ids=x, labels=x).loss  # noqa: E731
    s.track_all(model.parameters())
    comm = BucketedComm(s, model.parameters(), bucket)
    for _ in range(steps):
        b, n = draw(rng)
        x = torch.randint(0, vocab, (b, n), device=dev)
        loss = loss_of(x)
        loss.backward()
        comm.finish()
        opt.step()
        opt.zero_grad(set_to_none=True)
        comm.reset()
        del x, loss
    comm.remove()
    return s


# ---- two_stream_pipeline -----------------------------------------------------------------------------


class TwoStagePipeline:
    """Stage 1 on stream A, stage 2 on stream B.  step() runs every micro-batch's stage-1 forward
    on A; each activation goes to B (event, record_stream), where stage 2's forward and backward
    run at once; the boundary gradient comes back to A (event, record_stream) and stage 1's
    backwards run last, so every micro-batch's stage-1 activations are live together.  The
    current stream waits for both before the optimizer, and takes over the gradients."""

    def __init__(self, streams: Streams, stage1, stage2):
        self.s = streams
        self.stage1, self.stage2 = stage1, stage2
        self.a = streams.new()
        self.b = streams.new()

    def step(self, make_input: Callable[[int], object], micro: int) -> float:
        """One step's forward and backward over `micro` micro-batches (make_input(i) makes the
        i-th on stream A); returns the loss on the CPU (0.0 on a GPU, where reading it would
        synchronise)."""
        s = self.s
        main = s.current()
        s.wait(self.a, main)  # the previous optimizer step updated the weights on main
        s.wait(self.b, main)
        pending = []
        total = 0.0
        for i in range(micro):
            with s.on(self.a):
                x = s.track(make_input(i))
                act = self.stage1(x)
                fwd_done = s.event(self.a)
            with s.on(self.b):
                s.wait_event(self.b, fwd_done)
                s.hand(act, self.b)
                h = act.detach().requires_grad_()
                loss = self.stage2(h).float().pow(2).mean() / micro
                loss.backward()
                g = s.track(h.grad)
                total += float(loss.detach()) if not s.cuda else 0.0
                bwd_done = s.event(self.b)
                del h, loss
            pending.append((x, act, g, bwd_done))
        for x, act, g, bwd_done in pending:
            with s.on(self.a):
                s.wait_event(self.a, bwd_done)
                s.hand(g, self.a)
                act.backward(g)
        del pending, x, act, g
        s.wait(main, self.a)
        s.wait(main, self.b)
        for m in (self.stage1, self.stage2):
            for p in m.parameters():
                if p.grad is not None:
                    s.hand(p.grad, main)
        return total


def _stages(d: int, heads: int, layers: int, dev):
    import torch.nn as nn

    def stage(n):
        return nn.Sequential(
            *[
                nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
                for _ in range(n)
            ]
        ).to(dev)

    return stage(layers), stage(layers)


def two_stream_pipeline(dev, rng: random.Random, steps: int, tiny: bool = False) -> Streams:
    import torch

    s = Streams(dev)
    d, heads, layers, micro, mb = (32, 2, 1, 2, 2) if tiny else (1024, 16, 8, 4, 8)
    lengths = [4, 6, 8] if tiny else [128, 256, 384, 512, 768]
    s1, s2 = _stages(d, heads, layers, dev)
    s.track_all(list(s1.parameters()) + list(s2.parameters()))
    opt = torch.optim.AdamW(list(s1.parameters()) + list(s2.parameters()), lr=1e-4)
    pipe = TwoStagePipeline(s, s1, s2)
    for _ in range(steps):
        n = rng.choice(lengths)
        pipe.step(lambda i: torch.randn(mb, n, d, device=dev), micro)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return s


WORKLOADS: Dict[str, Callable[..., Streams]] = {
    "prefetch_loader": prefetch_loader,
    "overlap_comm": overlap_comm,
    "two_stream_pipeline": two_stream_pipeline,
}


def run(name: str, dev, rng: random.Random, steps: Optional[int] = None, tiny: bool = False) -> Streams:
    """Run workload `name` for `steps` training steps (default: the capture's count)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown multi-stream workload {name!r} (choose from {', '.join(MULTISTREAM)})")
    return WORKLOADS[name](dev, rng, steps if steps is not None else STEPS[name], tiny)


STEPS = {"prefetch_loader": 15, "overlap_comm": 14, "two_stream_pipeline": 12}
