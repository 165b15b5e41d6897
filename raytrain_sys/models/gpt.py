"""A small byte-level GPT: architecture only.

Follows GPT-2 (Radford et al., 2019) by way of nanoGPT: pre-norm blocks of causal self-attention
and an MLP, learned position embeddings, the token embedding tied to the output head. Nothing here
knows about distribution, data or tracking; the parallelize function and the trainer wrap it.

Parameter names are a contract with checkpoints: blocks live in ``transformer.h``, an
``nn.ModuleDict`` keyed by the layer index, so ``transformer.h.3.attn.c_attn.weight`` keeps its
name when a pipeline stage holds only some of the layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 256  # byte-level: every byte is a token, no tokenizer to ship
    block_size: int = 128  # context length in tokens
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0  # 0 keeps runs bitwise reproducible without saving dropout masks
    bias: bool = False  # GPT-2 has biases; without them it trains as well and a bit faster

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        # query, key and value projections for all heads in one matmul
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """attn_mask: None for plain causal attention, else a boolean (B, 1, T, T), True = attend."""
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=attn_mask is None,  # an explicit mask already holds the causal triangle
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attn_mask=attn_mask)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        # The default PyTorch inits below are all overwritten by init_weights(). Restoring the RNG
        # before it makes the weights a function of the seed alone, so a model built on the meta
        # device and then materialized (to_empty + init_weights) equals one built here.
        rng_state = torch.get_rng_state()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            # keyed by index, not an nn.ModuleList: names survive dropping layers (pipeline stages)
            h=nn.ModuleDict({str(i): Block(config) for i in range(config.n_layer)}),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.tie_weights()
        if not any(p.is_meta for p in self.parameters()):
            torch.set_rng_state(rng_state)
            self.init_weights()

    def tie_weights(self) -> None:
        # Weight tying (Press & Wolf, 2017), as in GPT-2. Called again by init_weights() because
        # to_empty() after a meta-device build gives the two modules separate tensors.
        self.transformer.wte.weight = self.lm_head.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02) everywhere, residual projections scaled by 1/sqrt(2 * n_layer).

        Draws from the global torch RNG in module order, so torch.manual_seed decides the result.
        """
        self.tie_weights()
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        # Each block adds two residual branches; scaling their output projections keeps the
        # residual stream's variance from growing with depth (GPT-2 paper, section 2.3).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count, tied weights once. non_embedding leaves out the position embeddings
        (the token embedding stays: it is also the output head's weight), as nanoGPT counts."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """idx: (B, T) token ids, T <= block_size. Returns logits (B, T, vocab_size).

        For rows that hold several documents (packing), both optional (B, T) tensors:
        position_ids, each token's position in its document (default 0..T-1), so a document sees
        the positions it would see alone; document_ids, so a token attends only to earlier tokens
        of its own document (a block-diagonal causal mask) and never to another document's.
        """
        B, T = idx.size()
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size {self.config.block_size}")
        if position_ids is None:
            position_ids = torch.arange(0, T, dtype=torch.long, device=idx.device)
        attn_mask = None
        if document_ids is not None:
            causal = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
            same_doc = document_ids[:, :, None] == document_ids[:, None, :]
            attn_mask = (same_doc & causal)[:, None]  # (B, 1, T, T): the same for every head
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(position_ids))
        for block in self.transformer.h.values():
            x = block(x, attn_mask=attn_mask)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)


def num_params(config: GPTConfig, non_embedding: bool = True) -> int:
    """GPT.num_params() from the config alone, without building the model."""
    d, L = config.n_embd, config.n_layer
    ln = d * (2 if config.bias else 1)
    per_layer = 12 * d * d + 2 * ln + (9 * d if config.bias else 0)  # attn 4d², mlp 8d², biases
    n = L * per_layer + ln + config.vocab_size * d  # + ln_f + wte (tied with lm_head)
    if not non_embedding:
        n += config.block_size * d
    return n


def flops_per_token(config: GPTConfig) -> int:
    """Training FLOPs (forward + backward) per token at full context.

    6N for the matmuls against the N non-embedding parameters (2 forward, 4 backward) plus
    12·L·H·Q·T for attention's scores and weighted values, H heads of size Q over T = block_size:
    PaLM (Chowdhery et al., 2022), appendix B; the same estimate as nanoGPT's estimate_mfu.
    """
    L, H, Q, T = config.n_layer, config.n_head, config.n_embd // config.n_head, config.block_size
    return 6 * num_params(config) + 12 * L * H * Q * T


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 40,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample max_new_tokens after idx (B, T); returns (B, T + max_new_tokens).

    temperature <= 0 picks the most likely token; top_k None or 0 samples from all tokens.
    """
    was_training = model.training
    model.eval()
    block_size = model.config.block_size
    for _ in range(max_new_tokens):
        # the model has seen positions up to block_size only: keep the newest block_size tokens
        idx_cond = idx if idx.size(1) <= block_size else idx[:, -block_size:]
        logits = model(idx_cond)[:, -1, :]
        if temperature <= 0:
            idx_next = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1, generator=generator)
        idx = torch.cat((idx, idx_next), dim=1)
    model.train(was_training)
    return idx
