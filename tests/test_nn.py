"""cafin.nn.MultiheadAttention against torch.nn.MultiheadAttention with the same weights (float64
oracle: outputs, attention weights and gradients), replace_multihead_attention, and the hooked
members' curvature of its projections."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cafin
from cafin.nn import MultiheadAttention, replace_multihead_attention
from members import HOOKED, Run

TOL = 1e-12
E, HEADS, N, L, S = 8, 2, 3, 5, 4


def _pair(seed=0, **kwargs):
    torch.manual_seed(seed)
    theirs = nn.MultiheadAttention(E, HEADS, dtype=torch.float64, **kwargs)
    with torch.no_grad():  # torch zeroes the biases: non-zero ones test their copy
        for p in theirs.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return theirs, MultiheadAttention.from_torch(theirs)


def _inputs(batch_first, batched=True, kdim=E, vdim=E, seed=1):
    g = torch.Generator().manual_seed(seed)

    def make(length, features):
        shape = ((N, length) if batch_first else (length, N)) if batched else (length,)
        return torch.randn(*shape, features, generator=g, dtype=torch.float64, requires_grad=True)
    return make(L, E), make(S, kdim), make(S, vdim)


def _masks(kind, batched=True):
    """(key_padding_mask, attn_mask, is_causal) of each kind the module takes."""
    g = torch.Generator().manual_seed(2)
    padding = torch.zeros(N, S, dtype=torch.bool)
    padding[0, -2:] = padding[2, -1] = True  # no row fully masked
    attend = torch.ones(L, S, dtype=torch.bool).triu(1)  # True: not attended
    if not batched:
        padding = padding[0]
    per_head = torch.randn(N * HEADS if batched else HEADS, L, S, generator=g, dtype=torch.float64)
    return {
        "none": (None, None, False),
        "padding bool": (padding, None, False),
        "padding float": (torch.zeros(padding.shape, dtype=torch.float64).masked_fill(padding, -1e9), None, False),
        "attn bool": (None, attend, False),
        "attn float": (None, torch.randn(L, S, generator=g, dtype=torch.float64), False),
        "attn per head": (None, per_head, False),
        "causal hint": (None, attend, True),
        "both": (padding, attend, False),
        "both causal hint": (padding, attend, True),
    }[kind]


MASKS = ["none", "padding bool", "padding float", "attn bool", "attn float", "attn per head", "causal hint",
         "both", "both causal hint"]


def _close(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.allclose(a, b, rtol=0, atol=TOL), (a - b).abs().max()


def _compare(theirs, mine, inputs, need_weights=True, average=True, **masks):
    out_t, w_t = theirs(*inputs, need_weights=need_weights, average_attn_weights=average, **masks)
    grads_t = torch.autograd.grad(out_t.square().sum(), inputs + tuple(theirs.parameters()), allow_unused=True)
    out_m, w_m = mine(*inputs, need_weights=need_weights, average_attn_weights=average, **masks)
    grads_m = torch.autograd.grad(out_m.square().sum(), inputs + tuple(mine.parameters()), allow_unused=True)
    _close(out_m, out_t)
    if need_weights:
        _close(w_m, w_t)
    else:
        assert w_t is None and w_m is None
    for a, b in zip(grads_m[:3], grads_t[:3]):  # inputs
        _close(a, b)
    _close(_packed_grads(mine, grads_m[3:]), torch.cat([g.flatten() for g in grads_t[3:] if g is not None]))


def _packed_grads(mine, grads):
    """The drop-in's parameter gradients in the order of torch's parameters."""
    by_name = dict(zip([n for n, _ in mine.named_parameters()], grads))
    order = []
    if mine.kdim == mine.embed_dim == mine.vdim:
        order.append(torch.cat([by_name[f"{p}_proj.weight"] for p in "qkv"]))
    else:
        order += [by_name[f"{p}_proj.weight"] for p in "qkv"]
    if mine.q_proj.bias is not None:
        order.append(torch.cat([by_name[f"{p}_proj.bias"] for p in "qkv"]))
    if mine.bias_k is not None:
        order += [by_name["bias_k"], by_name["bias_v"]]
    order += [by_name["out_proj.weight"]] + ([by_name["out_proj.bias"]] if mine.out_proj.bias is not None else [])
    return torch.cat([g.flatten() for g in order])


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("need_weights,average", [(True, True), (True, False), (False, True)])
def test_equals_torch_float64(batch_first, mask, need_weights, average):
    theirs, mine = _pair(batch_first=batch_first)
    padding, attend, causal = _masks(mask)
    _compare(theirs, mine, _inputs(batch_first), need_weights, average, key_padding_mask=padding,
             attn_mask=attend, is_causal=causal)


@pytest.mark.parametrize("bias,add_bias_kv,add_zero_attn,kdim,vdim",
                         [(False, False, False, None, None), (True, False, False, 5, 7),
                          (False, False, False, 5, 3), (True, True, False, None, None),
                          (True, False, True, None, None), (True, True, True, 6, 6)])
@pytest.mark.parametrize("need_weights", [True, False])
def test_options_equal_torch_float64(bias, add_bias_kv, add_zero_attn, kdim, vdim, need_weights):
    kwargs = dict(bias=bias, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn, kdim=kdim, vdim=vdim,
                  batch_first=True)
    theirs, mine = _pair(**kwargs)
    assert (mine.q_proj.bias is None) == (not bias) and (mine.out_proj.bias is None) == (not bias)
    inputs = _inputs(True, kdim=kdim or E, vdim=vdim or E)
    for mask in ("none", "both"):
        padding, attend, _ = _masks(mask)
        _compare(theirs, mine, inputs, need_weights, key_padding_mask=padding, attn_mask=attend)


@pytest.mark.parametrize("mask", ["none", "padding bool", "attn per head", "both causal hint"])
@pytest.mark.parametrize("need_weights,average", [(True, True), (True, False), (False, True)])
def test_unbatched_equals_torch_float64(mask, need_weights, average):
    theirs, mine = _pair(batch_first=True)
    padding, attend, causal = _masks(mask, batched=False)
    _compare(theirs, mine, _inputs(True, batched=False), need_weights, average, key_padding_mask=padding,
             attn_mask=attend, is_causal=causal)


def test_self_attention_and_float32():
    """query is key is value (torch's packed projection), and float32 within float32 rounding."""
    theirs, mine = _pair(batch_first=True)
    x = _inputs(True)[0]
    padding = torch.zeros(N, L, dtype=torch.bool)
    padding[1, -2:] = True
    _compare(theirs, mine, (x, x, x), key_padding_mask=padding)
    theirs, mine = theirs.float(), mine.float()
    x = x.detach().float()
    out_t, w_t = theirs(x, x, x)
    out_m, w_m = mine(x, x, x)
    assert torch.allclose(out_m, out_t, rtol=1e-5, atol=1e-6) and torch.allclose(w_m, w_t, rtol=1e-5, atol=1e-6)


def test_dropout_in_training_and_eval():
    """Dropout on the attention weights draws the same numbers as torch's with need_weights=True;
    eval mode drops nothing."""
    theirs, mine = _pair(dropout=0.5, batch_first=True)
    q, k, v = _inputs(True)
    torch.manual_seed(5)
    out_t, w_t = theirs(q, k, v, average_attn_weights=False)
    torch.manual_seed(5)
    out_m, w_m = mine(q, k, v, average_attn_weights=False)
    _close(out_m, out_t)
    _close(w_m, w_t)
    assert (w_m == 0).any()  # something was dropped
    out_plain, _ = mine(q, k, v, need_weights=False)  # scaled_dot_product_attention's dropout
    assert not torch.allclose(out_plain, out_m.detach())
    theirs.eval(), mine.eval()
    with torch.no_grad():
        _close(mine(q, k, v)[0], theirs(q, k, v)[0])


def test_same_initial_weights_as_torch_under_a_seed():
    for kwargs in ({}, {"kdim": 5, "vdim": 3}, {"add_bias_kv": True}, {"bias": False}):
        torch.manual_seed(0)
        theirs = nn.MultiheadAttention(E, HEADS, **kwargs)
        torch.manual_seed(0)
        mine = MultiheadAttention(E, HEADS, **kwargs)
        back = mine.to_torch()
        for (name, a), (_, b) in zip(theirs.named_parameters(), back.named_parameters()):
            assert torch.equal(a, b), (kwargs, name)


def test_to_torch_round_trip():
    theirs, mine = _pair(batch_first=True, kdim=5, vdim=6, add_bias_kv=True)
    back = mine.to_torch()
    assert type(back) is nn.MultiheadAttention and back.batch_first and back.kdim == 5
    for (n, a), (m, b) in zip(theirs.named_parameters(), back.named_parameters()):
        assert n == m and torch.equal(a, b)


def test_replace_multihead_attention_in_place():
    torch.manual_seed(0)
    shared = nn.MultiheadAttention(E, HEADS, batch_first=True)
    model = nn.ModuleDict({"a": shared, "b": nn.Sequential(shared, nn.Linear(E, E)),
                           "frozen": nn.MultiheadAttention(E, HEADS)})
    model["frozen"].in_proj_weight.requires_grad_(False)
    model.eval()
    x = torch.randn(2, 3, E)
    expected = shared(x, x, x)[0]
    assert replace_multihead_attention(model) is model
    assert type(model["a"]) is MultiheadAttention and model["b"][0] is model["a"]  # sharing kept
    assert not model["a"].training
    assert torch.allclose(model["a"](x, x, x)[0], expected, atol=1e-6)
    frozen = model["frozen"]
    assert [p.requires_grad for p in (frozen.q_proj.weight, frozen.k_proj.weight, frozen.out_proj.weight)] == \
        [False, False, True]
    assert not any(isinstance(m, nn.MultiheadAttention) for m in model.modules())
    alone = nn.MultiheadAttention(E, HEADS)
    assert type(replace_multihead_attention(alone)) is MultiheadAttention


@pytest.mark.parametrize("kwargs", [{}, {"kdim": 5, "vdim": 3, "bias": False}, {"add_bias_kv": True}],
                         ids=["packed", "kdim-vdim-no-bias", "bias_kv"])
def test_state_dict_saved_before_the_swap_loads_after_it(kwargs):
    """A checkpoint of a model with torch's module (packed in_proj_weight, or q/k/v_proj_weight
    with kdim/vdim) loads strictly into the swapped model, and the function that converts it
    gives the drop-in's own state_dict; the saved dict is left as it was."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(E, E), nn.ModuleDict({"attn": nn.MultiheadAttention(E, HEADS, **kwargs)}))
    model.double()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    keys = list(saved)
    q, k, v = (torch.randn(length, 2, dim, dtype=torch.float64)
               for length, dim in ((3, E), (4, kwargs.get("kdim", E)), (4, kwargs.get("vdim", E))))
    expected = model[1]["attn"](q, k, v)[0]
    torch.manual_seed(1)  # other weights: the load must bring them back
    fresh = replace_multihead_attention(nn.Sequential(
        nn.Linear(E, E), nn.ModuleDict({"attn": nn.MultiheadAttention(E, HEADS, **kwargs)})).double())
    fresh.load_state_dict(saved)  # strict
    assert list(saved) == keys
    _close(fresh[1]["attn"](q, k, v)[0], expected)
    converted = cafin.nn.convert_multihead_attention_state_dict(saved)
    mine = fresh.state_dict()
    assert set(converted) == set(mine)
    assert all(torch.equal(converted[key], mine[key]) for key in mine)
    fresh.load_state_dict(converted)  # its own layout loads as before


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="divisible"):
        MultiheadAttention(10, 3)
    with pytest.raises(ValueError, match="num_heads"):
        MultiheadAttention(8, 0)
    with pytest.raises(ValueError, match="dropout"):
        MultiheadAttention(8, 2, dropout=1.5)
    with pytest.raises(TypeError, match="torch.nn.MultiheadAttention"):
        MultiheadAttention.from_torch(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="model"):
        replace_multihead_attention("model")
    attention = MultiheadAttention(E, HEADS, batch_first=True)
    x = torch.randn(N, L, E)
    with pytest.raises(ValueError, match="is_causal"):
        attention(x, x, x, is_causal=True)
    with pytest.raises(ValueError, match="attn_mask"):
        attention(x, x, x, attn_mask=torch.zeros(L + 1, L))
    with pytest.raises(ValueError, match="key_padding_mask"):
        attention(x, x, x, key_padding_mask=torch.zeros(N, L + 1, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask"):
        attention(x, x, x, key_padding_mask=torch.zeros(N, L, dtype=torch.int64))
    with pytest.raises(ValueError, match="key"):
        attention(x, torch.randn(N, L, E + 1), x)
    with pytest.raises(ValueError, match="query"):
        attention(torch.randn(E), x, x)


# ----------------------------------------------------------------------------- the members
class Encoder(nn.Module):
    """Linear -> nn.TransformerEncoderLayer (causal) -> mean over time -> Linear."""

    def __init__(self, dim=16, heads=2, classes=3):
        super().__init__()
        self.embed = nn.Linear(6, dim)
        self.encoder = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
        return self.head(self.encoder(self.embed(x), src_mask=mask, is_causal=True).mean(1))


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")


def _curvature(run, module):
    """The member's curvature state of one Linear layer: (layer names it hooks, factor tensors)."""
    c = run.curvature
    if run.member.name == "KFACPreconditioner":
        names = {layer.name: layer.module for layer in c.layers}
        name = next(n for n, m in names.items() if m is module)
        return list(names), [c._state[name].A, c._state[name].G]
    if run.member.name == "TwoLevelKFAC":
        state = c.state[module.weight]
        return [layer.name for layer in c._layers], [state[k] for k in ("xxt", "ggt") if k in state]
    layers = {layer.name: layer.module for layer in c._curvature}
    state = c.state[module.weight]
    keys = ("fisher_S", "fisher_H") if run.member.name == "AdaFisher" else ("K.0", "C.0")
    return list(layers), [state[k] for k in keys]


@pytest.mark.parametrize("member", HOOKED, ids=lambda m: m.name)
def test_encoder_layer_trains_with_curvature_of_every_projection(member):
    """After replace_multihead_attention every hooked member hooks q/k/v/out and updates their
    factors, and the model trains."""
    torch.manual_seed(0)
    model = replace_multihead_attention(Encoder()).double()
    x = torch.randn(8, 5, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (8,))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*MultiheadAttention")  # none left to warn about
        # AdaFisher's step is about lr / Lambda: the table's lr 1e-2 is too long a step here
        run = Run(member, model, **({"lr": 1e-3} if member.name == "AdaFisher" else {}))
    attention = model.encoder.self_attn
    start = {p: [t.clone() for t in _curvature(run, getattr(attention, p))[1]] for p in PROJECTIONS}
    losses = []
    for _ in range(15):
        run.step(x, y)
        with torch.no_grad():
            losses.append(F.cross_entropy(model(x), y).item())
    assert losses[-1] < 0.7 * losses[0], losses
    for p in PROJECTIONS:
        names, factors = _curvature(run, getattr(attention, p))
        assert f"encoder.self_attn.{p}" in names
        assert all(torch.isfinite(f).all() for f in factors)
        assert all(not torch.equal(a, b) for a, b in zip(factors, start[p])), p


@pytest.mark.parametrize("member", HOOKED, ids=lambda m: m.name)
def test_members_warn_about_torch_multihead_attention(member):
    torch.manual_seed(0)
    model = Encoder()
    with pytest.warns(UserWarning, match="'encoder.self_attn'.*replace_multihead_attention"):
        member.build(model)
    frozen = Encoder()
    for p in frozen.encoder.self_attn.parameters():
        p.requires_grad_(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            member.build(frozen)
        except ValueError:  # a member may refuse the model for another reason; no warning first
            pass
    assert not [w for w in caught if "MultiheadAttention" in str(w.message)]


def test_encoder_layer_eval_mode_takes_the_ordinary_path():
    """nn.TransformerEncoder/-Layer in eval mode (torch's fused inference kernel reads the packed
    projection) gives the torch model's output after the swap."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2).eval()
    x = torch.randn(3, 5, 16)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[0, 3:] = True
    with torch.no_grad():
        expected = model(x, src_key_padding_mask=padding)
        replace_multihead_attention(model)
        got = model(x, src_key_padding_mask=padding)
    keep = ~padding  # torch's nested-tensor path leaves padded positions at 0
    assert torch.allclose(got[keep], expected[keep], atol=1e-5)
