"""A test model whose compute is device time: the tiny GPT, plus a wait per token in forward.

On a real cluster each rank computes on its own device, so a slow rank does not slow its
peers' compute, and moving rows away from it shortens the step. On this shared 2-core machine
the ranks' CPU compute contends for the same cores (and with other jobs), which hides that. The
wait per token stands for the device's time, as the host sees it (it blocks until the kernels
are done), so the ranks' compute scales with their tokens and does not contend. The fault
switch (elastic.fault_slow_rank) then makes one rank's compute take twice as long, as on a
slower node."""

from __future__ import annotations

import time

import torch.nn as nn

from raytrain_sys.models import build_gpt


class DeviceTimed(nn.Module):
    def __init__(self, inner: nn.Module, s_per_token: float):
        super().__init__()
        self.inner, self.s_per_token = inner, s_per_token

    def forward(self, idx, *args, **kwargs):
        time.sleep(self.s_per_token * idx.numel())
        return self.inner(idx, *args, **kwargs)


def build(model_spec) -> nn.Module:
    return DeviceTimed(build_gpt(model_spec), float(model_spec.args.get("s_per_token", 0.0)))
