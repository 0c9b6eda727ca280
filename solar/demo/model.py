"""The demo's surrogate: a PtychoNN-like network from a diffraction pattern (1xSxS) to the object's
amplitude and phase (2xSxS).

A convolutional encoder (three stride-2 convolutions) sees the whole pattern; a dense bottleneck
maps its features to the targets on a grid a quarter of the field's edge, upsampled bilinearly (the
targets are smooth). Input and output are normalized with the raw training set's statistics
(``solar.demo.data.statistics``), held as buffers, so the network learns the deviations from the
mean target: without that, the demo's few dozen steps went to learning the mean itself.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn


class Surrogate(nn.Module):
    def __init__(self, stats: dict[str, np.ndarray], width: int = 16, hidden: int = 64) -> None:
        super().__init__()
        size = int(stats["x_mean"].shape[-1])
        self.out = max(1, size // 4)
        for name in ("x_mean", "x_scale", "y_mean", "y_scale"):
            self.register_buffer(name, torch.as_tensor(np.asarray(stats[name], np.float32)))
        self.net = nn.Sequential(  # the encoder (``net``: its parameters' names in the checkpoints)
            nn.Conv2d(1, width, 5, stride=2, padding=2), nn.ReLU(),
            nn.Conv2d(width, width, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(width, width, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten())
        with torch.no_grad():
            features = self.net(torch.zeros(1, 1, size, size)).shape[1]
        self.head = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 2 * self.out * self.out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = x.shape[-2:]
        z = self.head(self.net((x - self.x_mean) / self.x_scale)).view(-1, 2, self.out, self.out)
        z = nn.functional.interpolate(z, size=size, mode="bilinear", align_corners=False)
        return self.y_mean + self.y_scale * z
