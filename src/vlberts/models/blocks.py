"""Exact-BERT building blocks shared by every architecture (SPEC §1).

Parameter names follow BERT's (`attention.self.query`, `attention.output.LayerNorm`, `intermediate`,
`output`), so BERT checkpoints map onto any architecture with a declarative key map.

Attention has two paths that compute the same function:
- the fast path, `torch.nn.functional.scaled_dot_product_attention` (flash / memory-efficient kernels);
- the explicit path, softmax(QK^T / sqrt(d) + mask) V, which also returns the probabilities.
The explicit path runs only when attention maps are asked for (analysis, tests). A run may hold the fast
path to one of PyTorch's kernels (`use_attention_kernel`, the recipes' `--attention_kernel`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from vlberts.config import check_values
from vlberts.data.batch import TokenSelection, as_selection
from vlberts.errors import VlbertsError

ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),  # BERT's exact erf GELU
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; valid: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


@dataclass(frozen=True)
class BlockConfig:
    """The width/depth-free part of a Transformer layer, shared by every architecture's config."""

    hidden_size: int
    num_heads: int
    intermediate_size: int
    hidden_act: str = "gelu"
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layer_norm_eps: float = 1e-12

    @classmethod
    def of(cls, cfg: object) -> "BlockConfig":
        """The text-stream block of any architecture config that carries BERT's field names."""
        return cls(*(getattr(cfg, f) for f in (
            "hidden_size", "num_heads", "intermediate_size", "hidden_act", "hidden_dropout",
            "attention_dropout", "layer_norm_eps",
        )))


@dataclass(frozen=True)
class BertTextConfig:
    """BERT's text-side hyper-parameters, with BERT-base defaults; every architecture config extends it.

    The depth and the padding id are left to the subclasses: LXMERT splits its depth over three encoders
    (`num_layers` is a derived property there) and has no `pad_token_id` field.
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        check_values(self)  # types and ranges, as a config.json read through `from_dict` gets them
        if self.num_heads < 1 or self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        pad = getattr(self, "pad_token_id", 0)  # the subclasses that have one (not LXMERT)
        if isinstance(pad, int) and not 0 <= pad < self.vocab_size:
            raise ValueError(f"pad_token_id {pad} is not a token of the {self.vocab_size}-token vocabulary")
        for name in ("hidden_act", "v_hidden_act"):  # the visual stream's own, where there is one (ViLBERT)
            if hasattr(self, name):
                activation(getattr(self, name))  # an unknown name fails here, not when the model is built

    @property
    def block(self) -> BlockConfig:
        """The text stream's layers (BERT's)."""
        return BlockConfig.of(self)


def mask_bias(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, S) bool key mask -> (B, 1, 1, S) additive bias: 0 where attended, dtype-min where masked."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    bias = bias.masked_fill(~mask.bool(), torch.finfo(dtype).min)
    return bias[:, None, None, :]


def key_bias(mask: Tensor, dtype: torch.dtype, complete: bool | None) -> Tensor | None:
    """`mask_bias`, or None when the host knows that every key is real (`complete`, e.g.
    `VLInputs.regions_complete`: LXMERT's images all have 36 regions). Without a mask, attention computes the
    same values and SDPA may run the flash kernel, which takes none (`--attention_kernel`)."""
    return None if complete else mask_bias(mask, dtype)


# The kernels `--attention_kernel` may hold the fast path to, one or several in the order tried; auto: PyTorch
# picks per call.
AttentionKernel = Literal["auto", "efficient", "flash", "cudnn", "math"]
ATTENTION_KERNELS: tuple[str, ...] = AttentionKernel.__args__
SDPA_KERNELS = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}  # name -> PyTorch's backend
# The fast path's kernels for this process (None: PyTorch's choice). A module global, read inside `forward`,
# so that a compiled graph calls the kernel held when it was traced (dynamo records `sdpa_kernel` in the graph
# and guards on this global); switches set outside the graph would not reach a graph that torch.compile's
# caches already hold (the H200 run of 2026-11-27: the compiled step kept cuDNN's kernel).
_kernels: list[SDPBackend] | None = None
_setting = "auto"  # the names it was set from
# Whether this PyTorch's `sdpa_kernel` takes the list as an order (torch >= 2.5); without, the listed kernels
# are only the ones allowed, and PyTorch's own order picks among them.
_ORDERED = "set_priority" in inspect.signature(sdpa_kernel).parameters
# `--attention_kernel`'s default: the memory-efficient kernel, flash where it is not there (a CPU), math last.
# On the H200 (torch 2.11, 2026-11-27, `benchmarks/results/h200-2026-11-27-run2`) it was the fastest setting for
# every call of these models with a key mask and for their whole steps: LXMERT-base's 34 calls 20.1 ms a step
# against 21.2 ms for PyTorch's own pick (cuDNN's kernel), and the CUDA-graph step of LXMERT-base at batch 512
# 64.1 ms against 70.6 ms (38.2% MFU against 33.5%). A CPU has no efficient kernel: there it runs flash and
# math where PyTorch's pick does, to the bit (`tests/test_models.py`). Without an order (torch < 2.5), auto.
DEFAULT_ATTENTION_KERNEL: tuple[str, ...] = ("efficient", "flash") if _ORDERED else ("auto",)


def use_attention_kernel(names: str | Sequence[str]) -> None:
    """Hold every attention call of the fast path, in this process, to the named kernels, tried in the order
    given, with PyTorch's math path last: `efficient` (memory-efficient), `flash`, `cudnn`, `math`, or several
    ("flash,efficient": flash where it can take the inputs, which is where no key is padded (`key_bias`), the
    memory-efficient kernel elsewhere). Where none can take them, math runs (flash takes no additive mask; a
    CPU has flash and math only). `auto` gives the choice back to PyTorch. The function computed is the same;
    only the kernel (and its rounding) changes."""
    global _kernels, _setting
    listed = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    for name in listed:
        if name not in ATTENTION_KERNELS:
            raise VlbertsError(f"unknown attention kernel {name!r}; valid: {', '.join(ATTENTION_KERNELS)}")
    if not listed or ("auto" in listed and len(listed) > 1):
        raise VlbertsError(f"attention kernels {','.join(listed) or '(none)'}: auto stands alone "
                           "(PyTorch picks), or name the kernels to try in order")
    if len(listed) > 1 and not _ORDERED:
        raise VlbertsError(f"attention kernels {','.join(listed)}: an order of kernels needs torch >= 2.5 "
                           f"(sdpa_kernel's set_priority; this is {torch.__version__}); name one kernel")
    held = [*(SDPA_KERNELS[n] for n in listed if n != "auto"), SDPBackend.MATH]
    _kernels = None if listed == ["auto"] else list(dict.fromkeys(held))
    _setting = ",".join(listed)


def attention_kernel() -> str:
    """The names `use_attention_kernel` was last given, comma-joined ("auto" when none)."""
    return _setting


class MultiHeadAttention(nn.Module):
    """BERT self-attention, also usable as cross-attention (queries from `x`, keys/values from `ctx`).

    `ctx_dim` lets the keys/values come from a stream of another width (ViLBERT co-attention).
    """

    def __init__(self, hidden_size: int, num_heads: int, dropout: float, ctx_dim: int | None = None):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden size {hidden_size} is not a multiple of {num_heads} heads")
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        ctx_dim = ctx_dim or hidden_size
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(ctx_dim, hidden_size)
        self.value = nn.Linear(ctx_dim, hidden_size)
        self.dropout_p = dropout

    def _heads(self, x: Tensor) -> Tensor:
        B, S, _ = x.shape
        return x.view(B, S, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, S, d)

    def forward(
        self, x: Tensor, bias: Tensor | None, ctx: Tensor | None = None, need_weights: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, Sq, D), ctx (B, Sk, Dc) or None for self-attention, bias (B, 1, 1|Sq, Sk) additive.

        Returns the context (B, Sq, D) and, if asked, the probabilities (B, H, Sq, Sk).
        """
        ctx = x if ctx is None else ctx
        q, k, v = self._heads(self.query(x)), self._heads(self.key(ctx)), self._heads(self.value(ctx))
        p_drop = self.dropout_p if self.training else 0.0
        if need_weights:
            probs = self._softmax(q, k, bias)  # (B, H, Sq, Sk)
            out = F.dropout(probs, p_drop, self.training) @ v  # (B, H, Sq, d)
        elif _kernels is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p_drop)
            probs = None
        else:
            with sdpa_kernel(_kernels, **({"set_priority": True} if _ORDERED else {})):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p_drop)
            probs = None
        B, H, S, d = out.shape
        return out.transpose(1, 2).reshape(B, S, H * d), probs

    def probs(self, x: Tensor, bias: Tensor | None, ctx: Tensor | None = None) -> Tensor:
        """The attention probabilities (B, H, Sq, Sk) alone, as `forward` computes them: queries and keys
        only, no values (for callers that read the maps and not what the layer outputs)."""
        ctx = x if ctx is None else ctx
        return self._softmax(self._heads(self.query(x)), self._heads(self.key(ctx)), bias)

    def _softmax(self, q: Tensor, k: Tensor, bias: Tensor | None) -> Tensor:
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)  # (B, H, Sq, Sk)
        if bias is not None:
            scores = scores + bias
        return scores.softmax(dim=-1)


class AddNorm(nn.Module):
    """BERT's post-LN residual: LayerNorm(dropout(dense(h)) + residual)."""

    def __init__(self, in_size: int, hidden_size: int, dropout: float, eps: float):
        super().__init__()
        self.dense = nn.Linear(in_size, hidden_size)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=eps)
        self.dropout = nn.Dropout(dropout)

    def forward(self, h: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dropout(self.dense(h)) + residual)


class AttentionBlock(nn.Module):
    """Attention + output projection with residual (BERT's `attention.{self,output}`)."""

    def __init__(self, cfg: BlockConfig, ctx_dim: int | None = None):
        super().__init__()
        self.self = MultiHeadAttention(cfg.hidden_size, cfg.num_heads, cfg.attention_dropout, ctx_dim)
        self.output = AddNorm(cfg.hidden_size, cfg.hidden_size, cfg.hidden_dropout, cfg.layer_norm_eps)

    def forward(
        self, x: Tensor, bias: Tensor | None, ctx: Tensor | None = None, need_weights: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        h, probs = self.self(x, bias, ctx, need_weights)
        return self.output(h, x), probs


class Intermediate(nn.Module):
    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.dense(x))


class FeedForward(nn.Module):
    """BERT's `intermediate` + `output` (dense-act-dense, residual, LayerNorm)."""

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.intermediate = Intermediate(cfg)
        self.output = AddNorm(cfg.intermediate_size, cfg.hidden_size, cfg.hidden_dropout, cfg.layer_norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        return self.output(self.intermediate(x), x)


class TransformerLayer(nn.Module):
    """One BERT layer: self-attention block then feed-forward block.

    The feed-forward sub-modules sit directly on the layer (`layer.intermediate`, `layer.output`) as in
    BERT, so checkpoints map by name.
    """

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.attention = AttentionBlock(cfg)
        ff = FeedForward(cfg)
        self.intermediate, self.output = ff.intermediate, ff.output

    def forward(
        self, x: Tensor, bias: Tensor | None, need_weights: bool = False, ctx: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, Sq, D); `ctx` (B, S, D), when given, is the whole sequence and x a subset of its rows:
        the layer then attends from those rows over the whole sequence and outputs only them."""
        h, probs = self.attention(x, bias, ctx, need_weights=need_weights)
        return self.output(self.intermediate(h), h), probs


class Encoder(nn.Module):
    """A stack of BERT layers (`encoder.layer.N`)."""

    def __init__(self, cfg: BlockConfig, num_layers: int):
        super().__init__()
        self.layer = nn.ModuleList([TransformerLayer(cfg) for _ in range(num_layers)])

    def forward(
        self, x: Tensor, bias: Tensor | None, need_weights: bool = False, rows: Tensor | None = None, start: int = 0,
        maps_only: bool = False,
    ) -> tuple[Tensor | None, list[Tensor]]:
        """Runs layers `start`.. on x (B, S, D). Returns the last hidden state and, if asked, one
        (B, H, S, S) probability map per layer.

        `rows` (B, M) long: the only positions whose last hidden state the caller reads (pre-training
        heads read [CLS] and the masked words). The last layer then computes queries, feed-forward and
        output for those rows only, over keys and values of the whole sequence: the same values at those
        rows, for about 1/num_layers less work. The result is (B, M, D).

        `maps_only` (with `need_weights`): the caller reads the maps and nothing else (the attention
        analyses). The last layer then computes its attention probabilities and stops there: no values,
        output projection or feed-forward, which are most of a layer's work (12-layer base: 7% of the
        pass). The maps are the same; the hidden state returned is None."""
        if maps_only and not need_weights:
            raise ValueError("maps_only reads the attention maps: pass need_weights=True")
        maps = []
        layers = self.layer[start:]
        for i, layer in enumerate(layers):
            if maps_only and i == len(layers) - 1:
                maps.append(layer.attention.self.probs(x, bias))  # (B, H, S, S)
                return None, maps
            if rows is not None and i == len(layers) - 1:
                x, probs = layer(gather_rows(x, rows), bias, need_weights, ctx=x)
            else:
                x, probs = layer(x, bias, need_weights)
            if need_weights:
                maps.append(probs)
        if rows is not None and not len(layers):
            x = gather_rows(x, rows)
        return (None if maps_only else x), maps


def first_row(input_ids: Tensor) -> Tensor:
    """(B, 1) long zeros: position 0 ([CLS]) of each example, as `rows` for the heads that read it alone."""
    return input_ids.new_zeros(input_ids.shape[0], 1)


def gather_rows(x: Tensor, rows: Tensor) -> Tensor:
    """x (B, S, D), rows (B, M) long -> (B, M, D)."""
    return x.gather(1, rows.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def selected_text(text: Tensor, positions: Tensor | TokenSelection | None) -> Tensor:
    """text (B, T, D) -> (N, D), the selected tokens' states in row-major order; all of it when None."""
    if positions is None:
        return text
    sel = as_selection(positions)
    return text[sel.example, sel.position]


class Pooler(nn.Module):
    """BERT pooler: tanh(W h_[CLS] + b)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, first: Tensor) -> Tensor:
        return torch.tanh(self.dense(first))


class PredictionHeadTransform(nn.Module):
    """BERT's `cls.predictions.transform`: dense, activation, LayerNorm."""

    def __init__(self, hidden_size: int, act: str, eps: float):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.act = activation(act)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=eps)

    def forward(self, x: Tensor) -> Tensor:
        return self.LayerNorm(self.act(self.dense(x)))


class MLMHead(nn.Module):
    """BERT's masked-LM head; the decoder weight is tied to the word embeddings by the owner."""

    def __init__(self, hidden_size: int, vocab_size: int, act: str, eps: float):
        super().__init__()
        self.transform = PredictionHeadTransform(hidden_size, act, eps)
        self.decoder = nn.Linear(hidden_size, vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, x: Tensor) -> Tensor:
        """x (..., D) -> logits (..., V)."""
        h = self.transform(x)
        flat = h.reshape(-1, h.shape[-1])  # (N, D)
        # W h^T as (V, N), then transposed: the products of `h W^T`. Written this way, backward's gradient for W
        # is a fresh contiguous (V, D) tensor, so autograd adds the tied word embeddings' gradient into it in
        # place; `F.linear`'s is a transposed view, which it copies into a new (V, D) tensor first (on a CPU,
        # 94 MB of fresh pages a base-size step). The bias is added after, as `F.linear` would under autocast.
        logits = (self.decoder.weight @ flat.T).T.contiguous()  # (N, V)
        return logits.view(*h.shape[:-1], logits.shape[-1]) + self.bias  # (..., V)


class AnswerMLP(nn.Module):
    """The answer classifier LXMERT introduced and ViLBERT's multi-task release adopted (`SimpleClassifier`):
    Linear(D_in, 2 D_in), GeLU, LayerNorm, Linear(2 D_in, A), under the released name `logit_fc`."""

    def __init__(self, in_size: int, num_answers: int, eps: float = 1e-12):
        super().__init__()
        self.logit_fc = nn.Sequential(
            nn.Linear(in_size, 2 * in_size), nn.GELU(), nn.LayerNorm(2 * in_size, eps=eps),
            nn.Linear(2 * in_size, num_answers),
        )

    def forward(self, x: Tensor) -> Tensor:
        """x (B, D_in) -> answer logits (B, A)."""
        return self.logit_fc(x)


def init_bert_weights(module: nn.Module, std: float = 0.02) -> None:
    """BERT initialisation: N(0, std) for linear/embedding weights, zero biases, unit LayerNorm."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=std)
            if m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
