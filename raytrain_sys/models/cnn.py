"""A small convolutional classifier for low-resolution images (8x8 digits by default).

Architecture only: conv blocks (3x3 convolution, ReLU) at full resolution, an adaptive average
pool to a fixed 4x4 grid, and a linear head. No batch norm: its batch statistics would depend on
how a global batch is split across ranks, and the data-parallel result must not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass
class CNNConfig:
    in_channels: int = 1
    num_classes: int = 10
    width: int = 32  # channels of every conv layer
    n_layer: int = 2  # conv layers
    pool_size: int = 4  # spatial grid the features are pooled to before the head
    dropout: float = 0.0


class CNN(nn.Module):
    def __init__(self, config: CNNConfig):
        super().__init__()
        self.config = config
        # ModuleDict keyed by index: stable parameter names if layers are ever dropped or staged.
        self.convs = nn.ModuleDict({
            str(i): nn.Conv2d(config.in_channels if i == 0 else config.width, config.width, 3,
                              padding=1)
            for i in range(config.n_layer)
        })
        self.pool = nn.AdaptiveAvgPool2d(config.pool_size)
        self.drop = nn.Dropout(config.dropout)
        self.head = nn.Linear(config.width * config.pool_size ** 2, config.num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) images -> (N, num_classes) logits."""
        x = images
        for conv in self.convs.values():
            x = torch.relu(conv(x))
        x = self.pool(x).flatten(1)
        return self.head(self.drop(x))


def flops_per_sample(config: CNNConfig, height: int = 8, width: int = 8) -> int:
    """Training FLOPs per image: 6 x multiply-accumulates (forward 2, backward 4; Kaplan et al.)."""
    macs, c_in = 0, config.in_channels
    for _ in range(config.n_layer):
        macs += height * width * config.width * c_in * 9
        c_in = config.width
    macs += config.width * config.pool_size ** 2 * config.num_classes
    return 6 * macs
