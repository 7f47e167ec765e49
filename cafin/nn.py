"""Modules whose weights every hooked member can take curvature of.

`torch.nn.MultiheadAttention` applies its projections functionally (one packed `in_proj_weight`,
and `out_proj`'s weight passed to `F.multi_head_attention_forward`): no Linear forward runs, so no
member's hooks see them and they train without curvature. `MultiheadAttention` here is a drop-in
with the same constructor, forward and results whose four projections are `nn.Linear` modules;
`replace_multihead_attention` swaps it into a model, weights included. A state_dict saved with
torch's module loads into the drop-in (`load_state_dict` converts it);
`convert_multihead_attention_state_dict` converts one explicitly.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

__all__ = ["MultiheadAttention", "convert_multihead_attention_state_dict", "replace_multihead_attention"]


class MultiheadAttention(nn.Module):
    r"""Multi-head attention as `torch.nn.MultiheadAttention` computes it, with its four
    projections as `nn.Linear` modules (`q_proj`, `k_proj`, `v_proj`, `out_proj`), so that
    AdaFisher, K-FAC, two-level K-FAC and SINGD hook them and precondition their weights.

    Args:
        embed_dim (int): total dimension of the model (E).
        num_heads (int): number of heads; must divide `embed_dim`.
        dropout (float, optional): dropout probability on the attention weights (default: 0.0).
        bias (bool, optional): add a bias to the four projections (default: True).
        add_bias_kv (bool, optional): append a learned key and value (`bias_k`, `bias_v`) to the
            key and value sequences (default: False).
        add_zero_attn (bool, optional): append a zero key and value to each head (default: False).
        kdim (int, optional): features of `key` (default: `embed_dim`).
        vdim (int, optional): features of `value` (default: `embed_dim`).
        batch_first (bool, optional): inputs and outputs are (batch, seq, feature) rather than
            (seq, batch, feature) (default: False).
        device, dtype: of the parameters.

    The parameters are initialised as torch initialises its module, from the same random numbers:
    under the same seed both modules start from the same weights (`in_proj_weight`'s rows are
    `q_proj`, `k_proj`, `v_proj`'s weights).

    `forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False)` takes and returns what torch's does: the output,
    and the attention weights ([N, L, S] averaged over the heads, [N, H, L, S] with
    `average_attn_weights=False`; without the batch dimension for unbatched inputs) or None when
    `need_weights=False`. Masks: `key_padding_mask` [N, S] (or [S]) and `attn_mask` [L, S] or
    [N * H, L, S] (or [H, L, S]), boolean (True = not attended) or float (added to the scores).
    `is_causal` is a hint that `attn_mask` is the causal mask, as for torch: it needs `attn_mask`.
    With `need_weights=False` the attention runs in `F.scaled_dot_product_attention`.

    What differs from torch: no fast inference path (torch's native kernel and nested tensors
    for padded inputs in eval mode); `in_proj_weight` and `in_proj_bias` are None (the projections
    are the Linear modules), which makes `nn.TransformerEncoderLayer` take its ordinary path.
    `load_state_dict` takes torch's layout too (`in_proj_weight`, ...): a checkpoint saved before
    `replace_multihead_attention` loads after it.

    Example:
        >>> attention = cafin.nn.MultiheadAttention(128, 4, batch_first=True)
        >>> out, weights = attention(x, x, x, need_weights=False)
    """

    # torch's TransformerEncoderLayer reads these to decide on its fused inference kernel, which
    # needs the packed projection: None and False make it call this module instead.
    in_proj_weight = None
    in_proj_bias = None
    _qkv_same_embed_dim = False

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name, value in (("kdim", kdim), ("vdim", vdim)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or a positive int, got {value!r}")
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout <= 1.0:
            raise ValueError(f"dropout must be a number in [0, 1], got {dropout!r}")
        factory = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.head_dim = embed_dim // num_heads
        self.dropout, self.batch_first, self.add_zero_attn = float(dropout), bool(batch_first), bool(add_zero_attn)
        # uninitialised: torch's module draws the output projection's initial weights first and
        # the input projections' after, and so does _reset_parameters here
        self.q_proj = _uninitialised_linear(embed_dim, embed_dim, bias, device, dtype)
        self.k_proj = _uninitialised_linear(self.kdim, embed_dim, bias, device, dtype)
        self.v_proj = _uninitialised_linear(self.vdim, embed_dim, bias, device, dtype)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
        else:
            self.bias_k = self.bias_v = None
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        projections = (self.q_proj, self.k_proj, self.v_proj)
        with torch.no_grad():
            if self.kdim == self.embed_dim and self.vdim == self.embed_dim:
                packed = torch.empty(3 * self.embed_dim, self.embed_dim, device=self.q_proj.weight.device,
                                     dtype=self.q_proj.weight.dtype)
                nn.init.xavier_uniform_(packed)  # torch's fan of the packed [3E, E] matrix
                for linear, rows in zip(projections, packed.chunk(3)):
                    linear.weight.copy_(rows)
            else:
                for linear in projections:
                    nn.init.xavier_uniform_(linear.weight)
            for linear in projections + (self.out_proj,):
                if linear.bias is not None:
                    linear.bias.zero_()
            if self.bias_k is not None:
                nn.init.xavier_normal_(self.bias_k)
                nn.init.xavier_normal_(self.bias_v)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        batched = self._check(query, key, value, key_padding_mask, attn_mask, is_causal)
        if not batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        n, length, heads, hd = query.shape[0], query.shape[1], self.num_heads, self.head_dim

        q, k, v = self.q_proj(query), self.k_proj(key), self.v_proj(value)  # [N, L|S, E]
        mask = self._mask(key_padding_mask, attn_mask, q.dtype, n, length)  # broadcasts to [N, H, L, S]
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(n, 1, -1)], 1)
            v = torch.cat([v, self.bias_v.expand(n, 1, -1)], 1)
            mask = None if mask is None else F.pad(mask, (0, 1))
        q, k, v = (t.view(n, t.shape[1], heads, hd).transpose(1, 2) for t in (q, k, v))  # [N, H, *, hd]
        if self.add_zero_attn:
            k, v = (torch.cat([t, t.new_zeros(n, heads, 1, hd)], 2) for t in (k, v))
            mask = None if mask is None else F.pad(mask, (0, 1))
        p = self.dropout if self.training else 0.0

        if need_weights:
            scores = (q * math.sqrt(1.0 / hd)) @ k.transpose(-2, -1)
            if mask is not None:
                scores = scores + mask
            weights = scores.softmax(-1)
            if p > 0.0:
                weights = F.dropout(weights, p=p)
            out = weights @ v
        else:
            # torch's rule: the hint alone (no mask tensor) when nothing else is masked
            causal = (is_causal and key_padding_mask is None and self.bias_k is None
                      and not self.add_zero_attn)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if causal else mask,
                                                 dropout_p=p, is_causal=causal)
            weights = None
        out = self.out_proj(out.transpose(1, 2).reshape(n, length, self.embed_dim))

        if weights is not None and average_attn_weights:
            weights = weights.mean(1)
        if not batched:
            return out.squeeze(0), None if weights is None else weights.squeeze(0)
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def _check(self, query, key, value, key_padding_mask, attn_mask, is_causal) -> bool:
        """Whether the input is batched; a ValueError naming the first argument whose shape or
        dtype torch's module would refuse."""
        if query.dim() not in (2, 3):
            raise ValueError(f"query must be 2-D (unbatched) or 3-D (batched), got shape {tuple(query.shape)}")
        batched = query.dim() == 3
        for name, t, features in (("query", query, self.embed_dim), ("key", key, self.kdim),
                                  ("value", value, self.vdim)):
            if t.dim() != query.dim():
                raise ValueError(f"{name} must be {query.dim()}-D like query, got shape {tuple(t.shape)}")
            if t.shape[-1] != features:
                raise ValueError(f"{name} must have {features} features, got shape {tuple(t.shape)}")
        seq, batch = (1, 0) if self.batch_first else (0, 1)
        if not batched:
            seq = 0
        if key.shape[seq] != value.shape[seq] or (batched and not key.shape[batch] == value.shape[batch] ==
                                                  query.shape[batch]):
            raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same "
                             f"sequence length and the batch size of query {tuple(query.shape)}")
        n = query.shape[batch] if batched else 1
        length, source = query.shape[seq], key.shape[seq]
        for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if mask is not None and mask.dtype != torch.bool and not mask.is_floating_point():
                raise TypeError(f"{name} must be bool or floating point, got {mask.dtype}")
        if key_padding_mask is not None:
            want = (n, source) if batched else (source,)
            if tuple(key_padding_mask.shape) != want:
                raise ValueError(f"key_padding_mask must have shape {want}, got {tuple(key_padding_mask.shape)}")
        if attn_mask is not None:
            allowed = ((length, source), (n * self.num_heads, length, source))
            if tuple(attn_mask.shape) not in allowed:
                raise ValueError(f"attn_mask must have shape {allowed[0]} or {allowed[1]}, got "
                                 f"{tuple(attn_mask.shape)}")
        if is_causal and attn_mask is None:
            raise ValueError("is_causal=True is a hint that attn_mask is the causal mask: pass attn_mask too "
                             "(as for torch.nn.MultiheadAttention)")
        return batched

    def _mask(self, key_padding_mask, attn_mask, dtype, n, length) -> torch.Tensor | None:
        """Both masks as one additive float mask that broadcasts to [N, H, L, S] (a boolean True
        becomes -inf)."""
        mask = None
        if attn_mask is not None:
            mask = _additive(attn_mask, dtype)
            mask = mask.view(n, self.num_heads, length, -1) if mask.dim() == 3 else mask
        if key_padding_mask is not None:
            padding = _additive(key_padding_mask, dtype).view(n, 1, 1, -1)
            mask = padding if mask is None else mask + padding
        return mask

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, "
                f"batch_first={self.batch_first}")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # Entries saved by torch's module are put in this module's layout first; load_state_dict
        # hands each module a copy of the caller's dict, and loads the projections after this.
        for key, value in _linear_layout(prefix, state_dict):
            state_dict[key] = value
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> "MultiheadAttention":
        """A drop-in with `module`'s settings, weights (copied), device, dtype, training mode and
        requires_grad flags."""
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"module must be a torch.nn.MultiheadAttention, got {type(module).__name__}")
        weight = module.in_proj_weight if module._qkv_same_embed_dim else module.q_proj_weight
        new = skip_init(cls, module.embed_dim, module.num_heads, dropout=module.dropout,
                        bias=module.in_proj_bias is not None, add_bias_kv=module.bias_k is not None,
                        add_zero_attn=module.add_zero_attn, kdim=module.kdim, vdim=module.vdim,
                        batch_first=module.batch_first, device=weight.device, dtype=weight.dtype)
        if module._qkv_same_embed_dim:
            weights = module.in_proj_weight.chunk(3)
        else:
            weights = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
        biases = module.in_proj_bias.chunk(3) if module.in_proj_bias is not None else (None,) * 3
        pairs = [(new.out_proj.weight, module.out_proj.weight), (new.out_proj.bias, module.out_proj.bias),
                 (new.bias_k, module.bias_k), (new.bias_v, module.bias_v)]
        for linear, w, b in zip((new.q_proj, new.k_proj, new.v_proj), weights, biases):
            pairs += [(linear.weight, w), (linear.bias, b)]
        requires = {name: p.requires_grad for name, p in module.named_parameters()}
        with torch.no_grad():
            for mine, theirs in pairs:
                if mine is not None:
                    mine.copy_(theirs)
        for linear, name in ((new.q_proj, "q_proj_weight"), (new.k_proj, "k_proj_weight"),
                             (new.v_proj, "v_proj_weight")):
            linear.weight.requires_grad_(requires.get("in_proj_weight", requires.get(name, True)))
            if linear.bias is not None:
                linear.bias.requires_grad_(requires["in_proj_bias"])
        for name, p in new.named_parameters():
            if name.startswith(("out_proj.", "bias_")):
                p.requires_grad_(requires[name])
        return new.train(module.training)

    def to_torch(self) -> nn.MultiheadAttention:
        """A `torch.nn.MultiheadAttention` with this module's settings and weights (copied)."""
        weight = self.q_proj.weight
        module = skip_init(nn.MultiheadAttention, self.embed_dim, self.num_heads, dropout=self.dropout,
                           bias=self.q_proj.bias is not None, add_bias_kv=self.bias_k is not None,
                           add_zero_attn=self.add_zero_attn, kdim=self.kdim, vdim=self.vdim,
                           batch_first=self.batch_first, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            if module._qkv_same_embed_dim:
                module.in_proj_weight.copy_(torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]))
            else:
                module.q_proj_weight.copy_(self.q_proj.weight)
                module.k_proj_weight.copy_(self.k_proj.weight)
                module.v_proj_weight.copy_(self.v_proj.weight)
            if module.in_proj_bias is not None:
                module.in_proj_bias.copy_(torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]))
                module.out_proj.bias.copy_(self.out_proj.bias)
            module.out_proj.weight.copy_(self.out_proj.weight)
            if module.bias_k is not None:
                module.bias_k.copy_(self.bias_k)
                module.bias_v.copy_(self.bias_v)
        return module.train(self.training)


# torch.nn.MultiheadAttention's parameter names -> (this module's names, chunks)
_TORCH_NAMES = {"in_proj_weight": (("q_proj.weight", "k_proj.weight", "v_proj.weight"), 3),
                "in_proj_bias": (("q_proj.bias", "k_proj.bias", "v_proj.bias"), 3),
                "q_proj_weight": (("q_proj.weight",), 1), "k_proj_weight": (("k_proj.weight",), 1),
                "v_proj_weight": (("v_proj.weight",), 1)}


def _linear_layout(prefix: str, state_dict: dict) -> list[tuple[str, torch.Tensor]]:
    """Pop the entries of torch's layout under `prefix` from `state_dict` and return them in
    this module's (the packed projection split into q, k and v, in that order)."""
    out = []
    for name, (names, chunks) in _TORCH_NAMES.items():
        value = state_dict.pop(prefix + name, None)
        if value is not None:
            parts = value.chunk(chunks) if chunks > 1 else (value,)
            out += [(prefix + new, part.clone()) for new, part in zip(names, parts)]
    return out


def convert_multihead_attention_state_dict(state_dict: Mapping[str, Any]) -> "OrderedDict[str, Any]":
    """A model's state_dict saved with `torch.nn.MultiheadAttention` in the layout of
    `cafin.nn.MultiheadAttention` (after `replace_multihead_attention`): every `in_proj_weight`
    and `in_proj_bias` split into `q_proj`, `k_proj`, `v_proj`'s weight and bias, and every
    `q_proj_weight` (k, v) renamed `q_proj.weight`; other entries, `out_proj` and
    `bias_k`/`bias_v` included, as they are. A new dict (the argument is not changed; tensors
    that are not converted are shared). `load_state_dict` of a model holding the drop-in does
    this by itself; this is for a state_dict handled otherwise (compared, merged, saved again)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
    out: OrderedDict[str, Any] = OrderedDict()
    for key, value in state_dict.items():
        prefix, _, name = key.rpartition(".")
        prefix = prefix + "." if prefix else ""
        if name in _TORCH_NAMES and isinstance(value, torch.Tensor):
            out.update(_linear_layout(prefix, {key: value}))
        else:
            out[key] = value
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        out._metadata = metadata  # type: ignore[attr-defined]
    return out


def _uninitialised_linear(cin: int, cout: int, bias: bool, device, dtype) -> nn.Linear:
    """An nn.Linear whose construction draws no random numbers."""
    device = torch.empty(0, device=device).device if device is not None else torch.empty(0).device
    return nn.Linear(cin, cout, bias=bias, device="meta", dtype=dtype).to_empty(device=device)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def replace_multihead_attention(model: nn.Module) -> nn.Module:
    """Swap every `torch.nn.MultiheadAttention` in `model` for `cafin.nn.MultiheadAttention` with
    the same settings and weights, in place, and return the model (the replacement itself when
    `model` is a `torch.nn.MultiheadAttention`). Build the optimizer after the swap: it hooks the
    new Linear projections.

    A `nn.TransformerEncoder` whose layers were swapped stops using nested tensors in eval mode
    (`use_nested_tensor = False`): that path calls the packed projection, which the drop-in has
    not."""
    if isinstance(model, nn.MultiheadAttention):
        return MultiheadAttention.from_torch(model)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    swapped: dict[nn.Module, MultiheadAttention] = {}  # a module shared by two parents stays shared
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.MultiheadAttention):
                if child not in swapped:
                    swapped[child] = MultiheadAttention.from_torch(child)
                setattr(parent, name, swapped[child])
    if swapped:
        for module in model.modules():
            if isinstance(module, nn.TransformerEncoder):
                module.use_nested_tensor = False
    return model
