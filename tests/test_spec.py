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
