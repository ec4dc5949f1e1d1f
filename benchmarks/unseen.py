"""Workloads outside the zoo, recorded as traces the same way (zoo.record_one), and kept apart from it:
the placement and policy rules are measured on the zoo, and these check them on traces they were not
made on (benchmarks/results/unseen/, docs/benchmarks.md).

    python3 benchmarks/unseen.py NAME OUTDIR     # on a GPU: OUTDIR/NAME.trace.gz
    python3 benchmarks/unseen.py tiny NAME       # at toy size on the CPU (needs torchvision for some)

NAME: maskrcnn_train, deeplab_train, lstm_varlen, retinanet_train, r3d_train, encoder_infer.
"""

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zoo  # noqa: E402
from zoo_registry import vision_train, workload  # noqa: E402


def detection_train(S, m, batches, sizes, most, classes, masks):
    """Train a torchvision detector with SGD: each step a batch of images whose height and width are
    drawn from `sizes`, each with 1 to `most` boxes (and their masks) of classes 1 to classes - 1."""
    import torch

    opt = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)
    for _ in range(S.steps(10)):
        imgs, tgts = [], []
        for _ in range(random.choice(batches)):
            H, W = random.choice(sizes), random.choice(sizes)
            imgs.append(torch.rand(3, H, W, device=S.dev))
            n = random.randint(1, most)
            x0 = torch.rand(n, device=S.dev) * (W / 2)
            y0 = torch.rand(n, device=S.dev) * (H / 2)
            if masks:  # whole pixels: each box is its mask's rectangle
                x0, y0, w, h = x0.floor(), y0.floor(), W // 4, H // 4
            else:
                w, h = W / 5, H / 5
            t = dict(boxes=torch.stack([x0, y0, x0 + w, y0 + h], 1))
            if masks:
                t["masks"] = torch.zeros(n, H, W, dtype=torch.uint8, device=S.dev)
                for i in range(n):
                    a, b = int(y0[i]), int(x0[i])
                    t["masks"][i, a : a + h, b : b + w] = 1
            t["labels"] = torch.randint(1, classes, (n,), device=S.dev)
            tgts.append(t)
        losses = m(imgs, tgts)
        loss = sum(losses.values())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss, losses, imgs, tgts


@workload(
    "maskrcnn",
    "train SGD fp32 (torchvision detection)",
    "image sizes and instance counts drawn each step",
    "resolution",
)
def wl_maskrcnn_train(S):
    import torchvision

    m = torchvision.models.detection.maskrcnn_resnet50_fpn(weights=None, weights_backbone=None, num_classes=5)
    detection_train(S, m.to(S.dev).train(), [2, 3, 4], [480, 608, 736, 800], 8, 5, masks=True)


@workload(
    "deeplabv3",
    "train AdamW, bf16 autocast (torchvision segmentation)",
    "resolution and batch drawn each step",
    "resolution",
)
def wl_deeplab_train(S):
    import torch
    import torchvision

    m = torchvision.models.segmentation.deeplabv3_resnet50(
        weights=None, weights_backbone=None, num_classes=21, aux_loss=True
    )
    m = m.to(S.dev).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    ce = torch.nn.CrossEntropyLoss()
    for _ in range(S.steps(12)):
        B, R = random.choice([4, 6, 8]), random.choice([384, 448, 512, 576, 640])
        x = torch.randn(B, 3, R, R, device=S.dev)
        y = torch.randint(0, 21, (B, R, R), device=S.dev)
        with torch.autocast(S.dev, dtype=torch.bfloat16):
            out = m(x)
            loss = ce(out["out"].float(), y) + 0.4 * ce(out["aux"].float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x, y, out, loss


@workload(
    "lstm",
    "train AdamW fp32 (cuDNN LSTM, packed sequences)",
    "batch and sequence lengths drawn each step",
    "sequence length",
)
def wl_lstm_varlen(S):
    import torch
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    hid = S(1024, 32)
    emb = torch.nn.Embedding(S(32000, 100), S(512, 16)).to(S.dev)
    rnn = torch.nn.LSTM(S(512, 16), hid, num_layers=3, batch_first=True).to(S.dev)
    head = torch.nn.Linear(hid, S(32000, 100)).to(S.dev)
    params = list(emb.parameters()) + list(rnn.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)
    for _ in range(S.steps(16)):
        B, L = random.choice([16, 32, 48, 64]), random.choice([64, 128, 256, 512, 768, 1024])
        lens = torch.randint(max(1, L // 4), L + 1, (B,))
        lens[0] = L
        x = torch.randint(0, S(32000, 100), (B, L), device=S.dev)
        packed = pack_padded_sequence(emb(x), lens, batch_first=True, enforce_sorted=False)
        out, _ = rnn(packed)
        out, _ = pad_packed_sequence(out, batch_first=True)
        loss = torch.nn.functional.cross_entropy(head(out).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x, packed, out, loss


@workload(
    "retinanet", "train SGD fp32 (torchvision detection)", "image sizes and box counts drawn each step", "resolution"
)
def wl_retinanet_train(S):
    import torchvision

    m = torchvision.models.detection.retinanet_resnet50_fpn(weights=None, weights_backbone=None, num_classes=8)
    detection_train(S, m.to(S.dev).train(), [2, 4], [512, 640, 800], 12, 8, masks=False)


@workload(
    "r3d", "train AdamW, bf16 autocast (torchvision video)", "clip length and batch drawn each step", "clip length"
)
def wl_r3d_train(S):
    import torchvision

    m = torchvision.models.video.r3d_18(weights=None, num_classes=50).to(S.dev)
    vision_train(S, m, 12, [8, 12, 16], [8, 16, 24, 32], classes=50, shape=lambda B, T: (B, 3, T, 112, 112))


@workload(
    "encoder",
    "inference fp16 (nn.TransformerEncoder fast path, padding masks)",
    "batch and lengths drawn each call",
    "sequence length",
)
def wl_encoder_infer(S):
    import torch

    d = S(1024, 32)
    layer = torch.nn.TransformerEncoderLayer(d, S(16, 2), 4 * d, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, S(12, 2), enable_nested_tensor=True).to(S.dev).eval()
    if S.dev == "cuda":
        enc = enc.half()
    dt = torch.float16 if S.dev == "cuda" else torch.float32
    with torch.inference_mode():
        for _ in range(S.steps(40)):
            B, L = random.choice([8, 16, 32, 64]), random.choice([128, 256, 384, 512, 1024])
            x = torch.randn(B, L, d, device=S.dev, dtype=dt)
            lens = torch.randint(L // 4, L + 1, (B,), device=S.dev)
            mask = torch.arange(L, device=S.dev)[None, :] >= lens[:, None]
            out = enc(x, src_key_padding_mask=mask)
            del x, mask, out


if __name__ == "__main__":
    if sys.argv[1] == "tiny":
        from zoo_registry import ZOO, Scale

        ZOO[sys.argv[2]]["fn"](Scale(True))
        print("tiny ok", sys.argv[2])
    else:
        zoo.record_one(sys.argv[1], sys.argv[2])
