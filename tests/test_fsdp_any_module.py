"""DDP and FSDP for a model raytrain-sys does not ship (``model.factory``), FSDP wrapping the
blocks ``parallel.fsdp_wrap`` names: the same parameters as one worker's run."""

from __future__ import annotations

import torch
import torch.nn as nn

from raytrain_sys.control.supervisor import run_job
from tests.helpers import assert_params_close, final_params, tiny_spec


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.mlp(self.norm(x)))


class ByteLM(nn.Module):
    """Next byte from the current one, through residual blocks: not a transformer."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 256)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(model):
    return ByteLM(model.args["width"], model.args["depth"])


def test_fsdp_wraps_the_named_blocks_of_any_model(ray_cluster, tiny_dataset, tmp_path):
    def spec(name: str, workers: int, **parallel):
        return tiny_spec(tmp_path / name, tiny_dataset,
                         model={"name": "byte-lm", "factory": "tests.test_fsdp_any_module:build",
                                "args": {"width": 16, "depth": 2}},
                         train={"task": "raytrain_sys.train.tasks:NextToken", "precision": "fp64",
                                "max_steps": 6},
                         parallel=parallel, resources={"num_workers": workers},
                         tracking={"enabled": False})

    from raytrain_sys.parallel.parallelize import wrap_blocks

    units = wrap_blocks(build(spec("one", 1).model), spec("fsdp", 2, strategy="fsdp", fsdp_wrap=["Block"]).parallel)
    assert [type(u).__name__ for u in units] == ["Block", "Block"]
    one = run_job(spec("one", 1))
    fsdp = run_job(spec("fsdp", 2, strategy="fsdp", fsdp_wrap=["Block"]))
    ddp = run_job(spec("ddp", 2))
    assert one.status == fsdp.status == ddp.status == "finished"
    reference = final_params(one.newest_checkpoint)
    assert_params_close(final_params(fsdp.newest_checkpoint), reference, rtol=1e-6)
    assert_params_close(final_params(ddp.newest_checkpoint), reference, rtol=1e-6)
