"""The benchmark's models: a ResNet-18-style CNN and a small ViT, in plain torch (no downloads).

* :func:`resnet18` — ResNet-18's topology (He et al. 2016): a stem, four stages of two basic
  blocks (3x3 conv, BatchNorm, ReLU, residual addition, 1x1 projection when the shape changes),
  adaptive average pooling and a linear head. ``width=64`` is ResNet-18 itself (11.2 M
  parameters at 10 classes); narrower widths keep the topology at a fraction of the cost (the
  suite runs ``width=8``). ``stem="imagenet"`` (7x7 stride-2 conv + max pooling, for 224x224) or
  ``"cifar"`` (3x3 stride-1 conv, for 32x32).
* :func:`vit` — a ViT-style encoder (Dosovitskiy et al. 2021): patch embedding by a strided
  conv, a class token and learned position embeddings, pre-norm blocks of LayerNorm, multi-head
  self-attention with softmax, and a GELU MLP, then LayerNorm and a linear head on the class token.
* :func:`detector` — a one-object detector on the same ResNet-18-style backbone (:class:`ResNet`'s
  stem and stages, shared code): the class head is the ResNet's ``fc`` on the pooled features; the
  box head is a 1x1 conv on the last stage's map (7x7 at 224x224) giving each cell a centre logit, an
  offset within the cell and a size: the centre is the softmax-weighted mean of the cells' centres
  plus offsets, the size the weighted mean of the cells' sizes, all normalised (cx, cy, w, h) and
  turned into pixels. One detection per image: box, score = the class softmax's maximum, label = its
  arg-max, in torchvision's format (a list of one dict per image). Deterministic in eval mode.

Layer names follow the modules (``layer4.1.relu2``, ``blocks.3.mlp.act``): the gates' ``layer=``
keyword takes them, for the eager model and for its ``torch.export`` program alike.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["BasicBlock", "ResNet", "resnet18", "Attention", "Block", "ViT", "vit", "Detector", "detector"]


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN, plus the input (projected by a 1x1 conv + BN when the shape changes), ReLU."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
        self.relu2 = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        out = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))
        return self.relu2(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, width: int = 64, classes: int = 10, stem: str = "imagenet", blocks: tuple[int, ...] = (2, 2, 2, 2)
                 ) -> None:
        super().__init__()
        if stem == "imagenet":
            self.stem = nn.Sequential(nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(width),
                                      nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))
        elif stem == "cifar":
            self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        else:
            raise ValueError(f"stem={stem!r}: use 'imagenet' or 'cifar'")
        layers, cin = [], width
        for i, n in enumerate(blocks):
            cout = width * 2 ** i
            stage = [BasicBlock(cin, cout, stride=1 if i == 0 else 2)] + [BasicBlock(cout, cout) for _ in range(n - 1)]
            layers.append(nn.Sequential(*stage))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(cin, classes)

    def feature_map(self, x: Tensor) -> Tensor:
        """The last stage's output ``(batch, 8 * width, H / 32, W / 32)`` (ImageNet stem)."""
        return self.layer4(self.layer3(self.layer2(self.layer1(self.stem(x)))))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.flatten(self.pool(self.feature_map(x))))


def resnet18(width: int = 64, classes: int = 10, stem: str = "imagenet", seed: int = 0) -> ResNet:
    """A ResNet-18-style model in eval mode, weights drawn from ``seed`` (BatchNorm statistics non-trivial)."""
    torch.manual_seed(seed)
    model = ResNet(width, classes, stem)
    gen = torch.Generator().manual_seed(seed + 1)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):  # running statistics as after training, not the identity
            module.running_mean.copy_(0.1 * torch.randn(module.num_features, generator=gen))
            module.running_var.copy_(0.5 + torch.rand(module.num_features, generator=gen))
    return model.eval()


class Attention(nn.Module):
    """Multi-head self-attention: qkv projection, softmax(q k^T / sqrt(d)) v, output projection."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} is not divisible by heads={heads}")
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.softmax = nn.Softmax(dim=-1)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = self.softmax((q @ k.transpose(-2, -1)) * self.scale)
        return self.proj((att @ v).transpose(1, 2).reshape(b, n, d))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(LN(x)), then x + mlp(LN(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2, self.mlp = nn.LayerNorm(dim), Mlp(dim, mlp_ratio * dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, image: int = 224, patch: int = 16, dim: int = 192, depth: int = 4, heads: int = 3,
                 classes: int = 10) -> None:
        super().__init__()
        if image % patch:
            raise ValueError(f"image={image} is not divisible by patch={patch}")
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, (image // patch) ** 2 + 1, dim))
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def vit(image: int = 224, patch: int = 16, dim: int = 192, depth: int = 4, heads: int = 3, classes: int = 10,
        seed: int = 0) -> ViT:
    """A ViT-style model in eval mode, weights drawn from ``seed`` (position and class embeddings non-zero)."""
    torch.manual_seed(seed)
    model = ViT(image, patch, dim, depth, heads, classes)
    with torch.no_grad():
        model.cls_token.normal_(std=0.02)
        model.pos_embed.normal_(std=0.02)
    return model.eval()


class Detector(nn.Module):
    """One detection per image on a :class:`ResNet` backbone (see the module docstring).

    :meth:`heads` gives the training signals (class logits, normalised ``(cx, cy, w, h)``);
    :meth:`forward` the torchvision-style list of ``{"boxes": (1, 4), "scores": (1,), "labels": (1,)}``.
    """

    def __init__(self, width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.backbone = ResNet(width, classes)
        self.box = nn.Conv2d(8 * width, 5, 1)  # per cell: centre logit, offset x, offset y, width, height

    def heads(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Class logits ``(batch, classes)`` and boxes ``(batch, 4)`` as (cx, cy, w, h) in [0, 1]."""
        f = self.backbone.feature_map(x)
        logits = self.backbone.fc(self.backbone.flatten(self.backbone.pool(f)))
        b, _, h, w = f.shape
        cells = self.box(f).flatten(2)  # (batch, 5, h * w)
        p = torch.softmax(cells[:, 0], dim=1)  # where the centre is
        gy, gx = torch.meshgrid(torch.arange(h, device=x.device, dtype=f.dtype),
                                torch.arange(w, device=x.device, dtype=f.dtype), indexing="ij")
        cx = (gx.reshape(1, -1) + 0.5 + 0.5 * torch.tanh(cells[:, 1])) / w
        cy = (gy.reshape(1, -1) + 0.5 + 0.5 * torch.tanh(cells[:, 2])) / h
        size = torch.sigmoid(cells[:, 3:5])  # (batch, 2, h * w)
        box = torch.stack([(p * cx).sum(1), (p * cy).sum(1), (p * size[:, 0]).sum(1), (p * size[:, 1]).sum(1)], 1)
        return logits, box

    def forward(self, x: Tensor) -> list[dict[str, Tensor]]:
        logits, box = self.heads(x)
        scale = torch.tensor([x.shape[-1], x.shape[-2]], device=x.device, dtype=box.dtype).repeat(2)
        pixels = torch.cat([box[:, :2] - box[:, 2:] / 2, box[:, :2] + box[:, 2:] / 2], 1) * scale
        scores, labels = torch.softmax(logits, dim=1).max(dim=1)
        return [{"boxes": pixels[i:i + 1], "scores": scores[i:i + 1], "labels": labels[i:i + 1]}
                for i in range(x.shape[0])]


def detector(width: int = 8, classes: int = 10, seed: int = 0) -> Detector:
    """A :class:`Detector` in eval mode, weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return Detector(width, classes).eval()
