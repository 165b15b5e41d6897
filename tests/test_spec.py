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


# ----------------------------------------------------------------------------- any value, anywhere


def _field_paths(cls=None, prefix=""):
    import dataclasses
    import typing

    from raytrain_sys.spec import JobSpec

    cls = cls or JobSpec
    for f in dataclasses.fields(cls):
        tp, path = typing.get_type_hints(cls)[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            yield from _field_paths(tp, f"{path}.")
        yield path


def test_any_json_value_in_any_field_is_a_spec_error_naming_a_field_or_a_valid_spec():
    """What the job service receives is arbitrary JSON: a value of any type, size or nesting in
    any field (several at once) is refused with a SpecError naming a field, never another
    exception (the API would answer it 500)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    paths = sorted(_field_paths())
    scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=2 ** 62, max_value=2 ** 200)
               | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)

    @settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.tuples(st.sampled_from(paths), values), min_size=1, max_size=3))
    def check(assignments):
        raw: dict = {}
        for path, value in assignments:
            *sections, name = path.split(".")
            node = raw
            for section in sections:
                node = node.setdefault(section, {})
                if not isinstance(node, dict):
                    return
            node[name] = value
        try:
            from_dict(raw)
        except SpecError as exc:
            assert exc.field and len(str(exc)) < 1000, str(exc)[:300]

    check()


@pytest.mark.parametrize("raw, field, words", [
    ({"resources": {"num_workers": 10 ** 30}}, "resources.num_workers", "an integer of 64 bits"),
    ({"optim": {"lr": 10 ** 400}}, "optim.lr", "a finite number"),
    ({"optim": {"lr": float("inf")}}, "optim.lr", "a finite number"),
    ({"model": {"factory": {"module": "x"}}}, "model.factory", "an import path"),
    ({"train": {"task": [1, 2]}}, "train.task", "an import path"),
    ({"name": "two\nlines"}, "name", "without spaces or slashes"),
    ({"x" * 10_000: 1}, "'xxxx", "(10000 characters)': unknown field"),
    ({"resources": {"market": "preemptible"}}, "resources.market", "allowed: any, spot, on-demand"),
    ({"resources": {"accelerator_type": "A10G"}}, "resources.accelerator_type", "a GPU type needs GPUs"),
    ({"resources": {"accelerator_type": "A 10", "gpus_per_worker": 1}}, "resources.accelerator_type",
     "Ray's accelerator type"),
    ({"resources": {"memory_per_worker_gb": -1}}, "resources.memory_per_worker_gb", "must be 0 or more"),
    ({"checkpoint": {"resume_changes": ["optim.weight_decay"]}}, "checkpoint.resume_changes",
     "a resume takes only optim.lr"),
], ids=["an integer past 64 bits", "a number past a float", "infinity", "data where an import path goes",
        "a list where a task goes", "a name on two lines", "a 10,000-character unknown key, quoted short",
        "a market Ray's labels do not name", "a GPU type without GPUs", "a GPU type no label could carry",
        "negative memory", "a resume change the checkpoint's optimizer state would undo"])
def test_values_no_run_could_use_are_refused_naming_the_field(raw, field, words):
    with pytest.raises(SpecError) as err:
        from_dict(raw)
    assert err.value.field.startswith(field) and words in str(err.value) and len(str(err.value)) < 400


@pytest.mark.parametrize("text, words", [
    ("train: {max_steps: " + "9" * 5000 + "}\n", "is not valid YAML: Exceeds the limit (4300 digits)"),
    ("[" * 5000, "is not valid YAML"),
    ("name: x\ntrain: {max_steps: [\n", "is not valid YAML at line 3"),
], ids=["a number of 5,000 digits", "nesting past Python's recursion", "text that does not parse"])
def test_yaml_that_python_cannot_read_is_a_spec_error_naming_the_file(tmp_path, text, words):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert err.value.field == "SPEC" and words in str(err.value), str(err.value)[:300]


# ----------------------------------------------------------------------------- the model pydantic checks


@pytest.mark.parametrize("raw, message", [
    ({"train": {"max_steps": 1.5}}, "spec field 'train.max_steps': got 1.5 (float); expected an integer"),
    ({"train": {"max_steps": "185"}}, "spec field 'train.max_steps': got '185' (str); expected an integer"),
    ({"train": {"max_steps": True}}, "spec field 'train.max_steps': got True; expected an integer"),
    ({"parallel": {"dp": 2.5}}, "spec field 'parallel.dp': got 2.5 (float); expected an integer"),
    ({"optim": {"lr": True}}, "spec field 'optim.lr': got True (bool); expected a number"),
    ({"optim": {"lr": "1e400"}}, "spec field 'optim.lr': got '1e400'; expected a finite number"),
    ({"model": {"bias": "yes"}}, "spec field 'model.bias': got 'yes' (str); expected true or false"),
    ({"model": {"name": 5}}, "spec field 'model.name': got 5 (int); expected a string"),
    ({"model": {"args": [1]}}, "spec field 'model.args': got [1] (list); expected a mapping"),
    ({"data": {"columns": [1, 2]}}, "spec field 'data.columns': got [1, 2]; expected a list of names, e.g. [a, b]"),
    ({"train": [1]}, "spec field 'train': expected a mapping of fields, got list [1]"),
    ({"train": {"early_stop": 3}}, "spec field 'train.early_stop': expected a mapping of fields, got int 3"),
], ids=["a fraction for an integer", "an integer as text", "true for an integer", "a fraction for a degree",
        "true for a number", "text past a float", "a word for true/false", "a number for a name",
        "a list for a mapping", "numbers for names", "a list for a section", "a number for a nested section"])
def test_a_value_of_the_wrong_type_is_refused_in_the_words_it_always_was(raw, message):
    with pytest.raises(SpecError) as err:
        from_dict(raw)
    assert str(err.value) == message


@pytest.mark.parametrize("raw, field, suggestion", [
    ({"train": {"max_stepz": 10}}, "train.max_stepz", "(did you mean 'max_steps'?)"),
    ({"trian": {}}, "trian", "(did you mean 'train'?)"),
    ({"train": {"early_stop": {"patiense": 2}}}, "train.early_stop.patiense", "(did you mean 'patience'?)"),
], ids=["a field", "a section", "a field of a nested section"])
def test_an_unknown_key_is_refused_with_the_field_it_is_closest_to(raw, field, suggestion):
    with pytest.raises(SpecError) as err:
        from_dict(raw)
    assert err.value.field == field and f"unknown field {suggestion}; allowed: " in str(err.value)


def test_the_first_refusal_is_the_first_in_the_spec_as_written():
    """Pydantic finds every wrong field at once; the one reported is the one a reader meets first."""
    for raw, field in [({"train": {"max_steps": "x"}, "model": {"n_layer": "y"}}, "train.max_steps"),
                       ({"model": {"n_layer": "y"}, "train": {"max_steps": "x"}}, "model.n_layer"),
                       ({"train": {"early_stop": {"patience": "x"}, "max_steps": "y"}}, "train.early_stop.patience"),
                       ({"train": {"max_stepz": 1, "seed": "y"}}, "train.max_stepz")]:
        with pytest.raises(SpecError) as err:
            from_dict(raw)
        assert err.value.field == field, raw


@pytest.mark.parametrize("raw, read", [
    ({"optim": {"lr": 1}}, ("optim", "lr", 1.0)),
    ({"optim": {"lr": " 2.5e-1 "}}, ("optim", "lr", 0.25)),
    ({"data": {"columns": "x, y,"}}, ("data", "columns", ["x", "y"])),
    ({"data": {"columns": ("x",)}}, ("data", "columns", ["x"])),
    ({"parallel": {"dp": None}}, ("parallel", "dp", None)),
    ({"train": None}, ("train", "max_steps", 300)),
], ids=["an integer for a number", "a number as text", "names separated by commas", "a tuple of names",
        "null for a degree that follows the world", "an empty section"])
def test_what_a_user_writes_for_a_type_is_read_as_it_always_was(raw, read):
    section, name, value = read
    got = getattr(getattr(from_dict(raw), section), name)
    assert got == value and type(got) is type(value)


def test_a_spec_made_in_python_is_a_dataclass_like_any_other():
    """Sections are plain dataclasses: made, copied and compared without pydantic, hashed as before."""
    import dataclasses

    from raytrain_sys.spec import JobSpec, ParallelSpec

    spec = from_dict({"parallel": {"strategy": "fsdp"}})
    assert dataclasses.replace(spec, parallel=ParallelSpec(strategy="fsdp")) == spec
    assert JobSpec().spec_hash() == from_dict({}).spec_hash() == from_dict(None).spec_hash()
    assert from_dict(spec.to_dict()) == spec


def test_the_json_schema_names_every_field_with_its_type_default_and_description():
    import dataclasses

    import jsonschema

    from raytrain_sys.spec import JobSpec, json_schema

    schema = json_schema()
    train = schema["properties"]["train"]["anyOf"][0]
    assert set(train["properties"]) == {f.name for f in dataclasses.fields(JobSpec().train)}
    steps = train["properties"]["max_steps"]
    assert (steps["type"], steps["default"], steps["exclusiveMinimum"]) == ("integer", 300, 0)
    assert steps["description"].startswith("optimizer steps of the whole run")
    assert train["properties"]["precision"]["enum"] == ["fp32", "bf16", "fp64"]
    jsonschema.validate({"train": {"max_steps": 10}, "optim": {"lr": "3e-4"}, "eval": None}, schema)
    for wrong in ({"train": {"max_stepz": 10}}, {"train": {"max_steps": "ten"}}, {"train": {"precision": "fp8"}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


@pytest.mark.parametrize("raw, section, name, value", [
    ({"train": {"max_steps": 185.0}}, "train", "max_steps", 185),
    ({"parallel": {"dp": 2.0}}, "parallel", "dp", 2),
    ({"resources": {"worker_niceness": -5.0}}, "resources", "worker_niceness", -5),
], ids=["a count", "a degree that may be null", "a negative one"])
def test_an_integral_number_is_its_int_in_every_integer_field(raw, section, name, value):
    """JSON Schema's integer (the API's schema) is any number without a fraction: 185.0 is 185, as
    the API's other integer fields take it, and the spec is the one 185 gives (the same hash)."""
    spec = from_dict(raw)
    got = getattr(getattr(spec, section), name)
    assert got == value and type(got) is int
    assert spec.spec_hash() == from_dict({section: {name: value}}).spec_hash()


def test_a_fraction_or_an_integral_number_past_64_bits_is_still_refused_for_an_integer():
    with pytest.raises(SpecError) as err:
        from_dict({"train": {"max_steps": 1.5}})
    assert str(err.value) == "spec field 'train.max_steps': got 1.5 (float); expected an integer"
    with pytest.raises(SpecError) as err:
        from_dict({"train": {"max_steps": 1e30}})
    assert str(err.value) == ("spec field 'train.max_steps': got 1e+30; expected an integer of 64 bits "
                              "(-2**63 .. 2**63-1)")


def test_an_integral_number_in_a_yaml_file_is_its_int(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("train:\n  max_steps: 185.0\n")
    assert load_spec(path).train.max_steps == 185


def test_a_process_that_waits_for_a_job_has_the_spec_checker_built():
    """A warm spare and a spare runner warm up (``train.check.warm_up``) before a job comes; the
    spec's checker is part of it, or the first spec checked after a claim pays pydantic's build
    on the job's start path (a cancel to the next job's first step went 1.1 s -> 1.8 s with it
    left out: benchmarks/scheduler.py --sections handover)."""
    import subprocess
    import sys

    code = ("from raytrain_sys import spec\nfrom raytrain_sys.train.check import warm_up\n"
            "assert spec._adapter.cache_info().currsize == 0\nwarm_up()\n"
            "print(spec._adapter.cache_info().currsize)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "1", out.stderr[-2000:]
