"""The job spec as a user writes it: YAML files and --set overrides."""

from __future__ import annotations

import pytest

from raytrain_sys.errors import SpecError
from raytrain_sys.spec import apply_overrides, from_dict, load_spec


@pytest.mark.parametrize("text,value", [("6e-3", 6e-3), ("1E-4", 1e-4), ("+2.5e-1", 0.25), (".5e1", 5.0)])
def test_numbers_in_exponent_form_are_numbers(text, value):
    # PyYAML (YAML 1.1) reads `6e-3` as a string; a user means a number.
    raw = apply_overrides({}, [f"optim.lr={text}"])
    assert from_dict(raw).optim.lr == value


def test_yaml_file_with_exponent_lr(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("optim:\n  lr: 3e-4\n")
    assert load_spec(path).optim.lr == 3e-4


@pytest.mark.parametrize("text", ["fast", "1e", "e5", "0x10", ""])
def test_words_are_still_not_numbers(text):
    with pytest.raises(SpecError, match="optim.lr"):
        from_dict({"optim": {"lr": text}})


def test_override_of_a_non_section_names_it():
    with pytest.raises(SpecError, match="'name' is not a section"):
        apply_overrides({"name": "x"}, ["name.sub=1"])


def test_lr_scaling_rules():
    from raytrain_sys.train.optim import lr_at, peak_lr

    base = {"lr": 1e-3, "lr_base_batch_size": 256, "warmup_steps": 10}
    linear = from_dict({"optim": {**base, "lr_scaling": "linear"}}).optim
    sqrt = from_dict({"optim": {**base, "lr_scaling": "sqrt"}}).optim
    assert peak_lr(linear, 1024) == pytest.approx(4e-3)
    assert peak_lr(sqrt, 1024) == pytest.approx(2e-3)
    assert peak_lr(from_dict({"optim": base}).optim, 1024) == 1e-3  # scaling off by default
    # Warmup climbs to the scaled peak, then the cosine decays from it.
    assert lr_at(4, linear, 100, 1024) == pytest.approx(4e-3 * 5 / 10)
    assert lr_at(10, linear, 100, 1024) == pytest.approx(4e-3)


def test_lr_scaling_needs_the_base_batch():
    with pytest.raises(SpecError, match="optim.lr_base_batch_size"):
        from_dict({"optim": {"lr_scaling": "sqrt"}})


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_large_batch_optimizers_train_a_regression(name):
    """A least-squares fit converges with each optimizer (their math, apart from the layouts)."""
    import torch

    from raytrain_sys.train.optim import build_optimizer

    torch.manual_seed(0)
    x = torch.randn(256, 8)
    w_true = torch.randn(8, 4)
    y = x @ w_true
    model = torch.nn.Linear(8, 4, bias=True)
    spec = from_dict({"optim": {"name": name, "lr": 0.05 if name == "lamb" else 5.0,
                                "weight_decay": 0.0, "warmup_steps": 0}}).optim
    opt = build_optimizer(model, spec)
    first = None
    for _ in range(200):
        loss = ((model(x) - y) ** 2).mean()
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05 * first
    assert set(opt.state[model.weight]) == set(opt.state_keys)
