"""The byte-level GPT: shapes, init, names, causality, learning, sampling, registry."""

import time

import pytest
import torch
import torch.nn.functional as F

from raytrain_sys.errors import SpecError
from raytrain_sys.models import MODEL_BUILDERS, build_model, model_flops_per_token
from raytrain_sys.models.gpt import GPT, GPTConfig, flops_per_token, generate, num_params
from raytrain_sys.spec import ModelSpec

TINY = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture(autouse=True)
def one_thread():
    # intra-op threads only slow a model this small, and collapse when other tests load the cores
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make(config=TINY, seed=0):
    torch.manual_seed(seed)
    return GPT(config)


def test_forward_returns_logits_per_position():
    model = make()
    idx = torch.randint(0, 256, (3, 17))
    assert model(idx).shape == (3, 17, 256)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, TINY.block_size + 1, dtype=torch.long))


def test_default_config_matches_the_job_defaults():
    cfg = GPTConfig()
    assert (cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd) == (256, 128, 4, 4, 128)
    assert cfg.dropout == 0.0 and cfg.bias is False


def test_init_is_a_function_of_the_seed():
    a, b, c = make(seed=7).state_dict(), make(seed=7).state_dict(), make(seed=8).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["transformer.h.0.attn.c_attn.weight"], c["transformer.h.0.attn.c_attn.weight"])


def test_meta_build_then_init_equals_eager_build():
    # torchtitan's order: build on meta, (parallelize), materialize, init.
    eager = make(seed=3)
    with torch.device("meta"):
        lazy = GPT(TINY)
    lazy.to_empty(device="cpu")
    torch.manual_seed(3)
    lazy.init_weights()
    assert lazy.lm_head.weight is lazy.transformer.wte.weight
    for (name, p), (_, q) in zip(eager.state_dict().items(), lazy.state_dict().items()):
        assert torch.equal(p, q), name


def test_gpt2_init_scales_residual_projections():
    model = make(GPTConfig(n_layer=8, n_embd=256, n_head=4))
    assert model.transformer.h["0"].attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    want = 0.02 / (2 * 8) ** 0.5
    assert model.transformer.h["0"].attn.c_proj.weight.std().item() == pytest.approx(want, rel=0.05)
    assert model.transformer.h["7"].mlp.c_proj.weight.std().item() == pytest.approx(want, rel=0.05)


def test_parameter_names_are_stable_when_layers_are_dropped():
    model = make(GPTConfig(block_size=16, n_layer=3, n_head=2, n_embd=16))
    names = dict(model.named_parameters())
    assert "transformer.h.0.attn.c_attn.weight" in names
    assert "transformer.h.2.mlp.c_proj.weight" in names
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    assert {"transformer.wte.weight", "lm_head.weight"} <= model.state_dict().keys()
    # a pipeline stage holding layers 1 and 2 keeps their checkpoint keys
    del model.transformer.h["0"]
    stage_names = set(dict(model.named_parameters()))
    assert {n for n in names if ".h.1." in n or ".h.2." in n} <= stage_names
    assert not any(".h.0." in n for n in stage_names)
    assert model(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 256)


def test_earlier_logits_do_not_see_later_tokens():
    model = make()
    idx = torch.randint(0, 256, (2, 24))
    logits = model(idx)
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    logits2 = model(changed)
    assert torch.allclose(logits[:, :10], logits2[:, :10], atol=1e-6)
    assert not torch.allclose(logits[:, 10:], logits2[:, 10:])


def test_num_params_and_flops_follow_the_config():
    for cfg in (GPTConfig(), TINY, GPTConfig(bias=True, n_layer=3, n_embd=48, n_head=3)):
        model = GPT(cfg)
        assert model.num_params() == num_params(cfg)
        assert model.num_params(non_embedding=False) == num_params(cfg, non_embedding=False)
        assert model.num_params(non_embedding=False) == sum(p.numel() for p in model.parameters())
    cfg = GPTConfig()
    L, H, Q, T = 4, 4, 32, 128
    assert flops_per_token(cfg) == 6 * GPT(cfg).num_params() + 12 * L * H * Q * T


def test_tiny_model_memorizes_a_repeated_string_quickly():
    torch.manual_seed(0)
    model = GPT(TINY)
    data = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 8), dtype=torch.long)
    rows = torch.stack([data[i:i + TINY.block_size + 1] for i in range(0, 64, 4)])  # (16, 33)
    x, y = rows[:, :-1], rows[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start = time.perf_counter()
    for _ in range(100):
        loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    assert loss.item() < 0.5
    assert time.perf_counter() - start < 10
    # and it has learned the string: greedy continuation reproduces it
    prompt = torch.tensor([list(b"the quick brown ")])
    out = generate(model, prompt, 10, temperature=0)
    assert bytes(out[0, -10:].tolist()) == b"fox jumps "


def test_generate_appends_tokens_and_crops_the_context():
    model = make()
    model.train()
    idx = torch.randint(0, 256, (2, 5))
    out = generate(model, idx, TINY.block_size + 8, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 5 + TINY.block_size + 8)
    assert torch.equal(out[:, :5], idx)
    assert model.training  # mode restored
    again = generate(model, idx, TINY.block_size + 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)


def test_registry_builds_from_the_spec():
    assert "gpt" in MODEL_BUILDERS
    spec = ModelSpec(block_size=64, n_layer=2, n_head=2, n_embd=32)
    model = build_model(spec)
    assert isinstance(model, GPT)
    assert (model.config.block_size, model.config.n_layer, model.config.n_embd) == (64, 2, 32)
    assert model_flops_per_token(spec) == flops_per_token(model.config)
    with pytest.raises(SpecError, match="model.name"):
        build_model(ModelSpec(name="llama"))
    with pytest.raises(SpecError, match="model.n_embd"):
        build_model(ModelSpec(n_embd=30, n_head=4))
