"""cafin.core.views: each module type's view against computations written here from torch's own
layers: the rows rebuild the layer's output, their outer products are autograd's weight gradient
(per sample too), and the gradient matrix is that gradient oriented [gradient side, input side]."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cafin.core import views
from cafin.core.views import view_of



@pytest.fixture(autouse=True)
def float64():
    """Every tensor and layer here in float64 (and the default put back for other files)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


class Conv1D(nn.Module):
    """transformers' Conv1D, written here (x @ weight + bias, weight [nx, nf])."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.randn(nf))

    def forward(self, x):
        return x @ self.weight + self.bias


CONVS = [
    ("conv1d", lambda: nn.Conv1d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2), (3, 4, 11)),
    ("conv1d-reflect", lambda: nn.Conv1d(3, 2, 4, padding="same", padding_mode="reflect"), (2, 3, 9)),
    ("conv2d", lambda: nn.Conv2d(4, 6, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2),
                                 groups=2), (2, 4, 7, 8)),
    ("conv2d-same-even", lambda: nn.Conv2d(3, 4, (2, 4), padding="same", bias=False), (2, 3, 5, 6)),
    ("conv2d-circular", lambda: nn.Conv2d(2, 3, 3, padding=1, padding_mode="circular"), (2, 2, 5, 5)),
    ("conv3d", lambda: nn.Conv3d(4, 4, (2, 3, 2), stride=(1, 2, 1), padding=(1, 0, 1),
                                 dilation=(2, 1, 1), groups=4), (2, 4, 5, 6, 4)),
    ("conv3d-same", lambda: nn.Conv3d(2, 3, (2, 3, 2), padding="same", padding_mode="replicate"),
     (1, 2, 4, 5, 3)),
]


def _grads(layer, x):
    out = layer(x)
    g = torch.randn_like(out)
    out.backward(g)
    return out.detach(), g


def _check_rows(layer, x):
    """Rows rebuild the output and their outer products give autograd's gradient (and the
    gradient matrix read from .grad equals them)."""
    view = view_of(layer)
    out, g = _grads(layer, x)
    a, gr = view.input_rows(layer, x), view.grad_rows(layer, g)
    groups, d_a, d_g = view.sizes(layer)
    bias = getattr(layer, "bias", None) is not None
    assert a.shape[::2] == (groups, d_a - bias) and gr.shape[::2] == (groups, d_g)
    assert a.shape[1] == gr.shape[1]
    abar = torch.cat([a, torch.ones_like(a[..., :1])], 2) if bias else a
    w = view.grad_matrix(layer, layer.weight.detach(), layer.bias.detach() if bias else None)
    # the output's rows are W abar, row for row, in grad_rows' order
    torch.testing.assert_close(abar @ w.transpose(1, 2), view.grad_rows(layer, out))
    want = view.grad_matrix(layer, layer.weight.grad, layer.bias.grad if bias else None)
    assert want.shape == (groups, d_g, d_a)
    torch.testing.assert_close(gr.transpose(1, 2) @ abar, want)
    return view, a, gr, abar


@pytest.mark.parametrize("name,make,shape", CONVS, ids=[c[0] for c in CONVS])
def test_conv_rows_rebuild_the_output_and_the_gradient(name, make, shape):
    torch.manual_seed(0)
    conv = make()
    view, a, gr, abar = _check_rows(conv, torch.randn(shape))
    assert view.conv and not view.transposed and view.label == type(conv).__name__


@pytest.mark.parametrize("name,make,shape", CONVS, ids=[c[0] for c in CONVS])
def test_conv_rows_per_sample_are_the_per_sample_gradients(name, make, shape):
    torch.manual_seed(1)
    conv = make()
    x = torch.randn(shape)
    view = view_of(conv)
    _, g = _grads(conv, x)
    a, gr = view.input_rows(conv, x), view.grad_rows(conv, g)
    B = shape[0]
    per = a.shape[1] // B
    for b in range(B):
        conv.zero_grad()
        conv(x[b:b + 1]).backward(g[b:b + 1])
        rows = slice(b * per, (b + 1) * per)
        got = gr[:, rows].transpose(1, 2) @ a[:, rows]
        torch.testing.assert_close(got, view.grad_matrix(conv, conv.weight.grad, None))


def test_conv2d_channels_last_and_unbatched():
    torch.manual_seed(2)
    conv = nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2)
    x = torch.randn(3, 4, 7, 7)
    view = view_of(conv)
    want = view.input_rows(conv, x)
    torch.testing.assert_close(view.input_rows(conv, x.to(memory_format=torch.channels_last)), want)
    _check_rows(conv.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last))
    # an unbatched input is one sample
    torch.testing.assert_close(view.input_rows(conv, x[1]), view.input_rows(conv, x[1:2]))


@pytest.mark.parametrize("name,make,shape", CONVS, ids=[c[0] for c in CONVS])
def test_conv_patches_are_unfold_of_the_padded_input(name, make, shape):
    """Patches against F.unfold written here: the input padded by F.pad with the padding torch
    resolves (the conv's own output size says it is the right one), then unfolded in 2-d (a
    Conv1d as a unit-height Conv2d; a Conv3d one depth tap at a time)."""
    torch.manual_seed(3)
    conv = make()
    view = view_of(conv)
    x = torch.randn(shape)
    xp, padding = view.padded(conv, x)
    got = view.patches(conv, xp, padding)  # [B, C*prod(k), L]
    pads = conv._reversed_padding_repeated_twice
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    full = F.pad(x, pads, mode=mode)
    if view.dims == 1:
        want = F.unfold(full.unsqueeze(2), (1, conv.kernel_size[0]), dilation=(1, conv.dilation[0]),
                        stride=(1, conv.stride[0]))
    elif view.dims == 2:
        want = F.unfold(full, conv.kernel_size, dilation=conv.dilation, stride=conv.stride)
    else:
        kd, sd, dd = conv.kernel_size[0], conv.stride[0], conv.dilation[0]
        od = (full.shape[2] - dd * (kd - 1) - 1) // sd + 1
        B, C = full.shape[:2]
        taps = []  # entry order (c, t, kh, kw), locations (d, h, w)
        for t in range(kd):
            per_depth = [F.unfold(full[:, :, t * dd + o * sd], conv.kernel_size[1:],
                                  dilation=conv.dilation[1:], stride=conv.stride[1:])
                         for o in range(od)]  # each [B, C*kh*kw, L_hw]
            taps.append(torch.stack(per_depth, 2).reshape(B, C, -1, od, per_depth[0].shape[-1]))
        want = torch.stack(taps, 2)  # [B, C, kd, kh*kw, od, L_hw]
        want = want.reshape(B, -1, od * want.shape[-1])
    assert want.shape[2] == conv(x).shape[2:].numel()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(view.patches(conv, xp, padding, locations_first=True),
                               want.transpose(1, 2))


def test_linear_on_locations_and_conv1d_transposed():
    torch.manual_seed(4)
    lin = nn.Linear(5, 3)
    view, *_ = _check_rows(lin, torch.randn(2, 4, 5))
    assert view is views.LINEAR and view.sizes(lin) == (1, 6, 3) and not view.transposed
    c1 = Conv1D(3, 5)
    view, *_ = _check_rows(c1, torch.randn(2, 4, 5))
    assert view is views.CONV1D and view.transposed and view.sizes(c1) == (1, 6, 3)
    # its gradient matrix is the transposed .grad, as a view, and equals the Linear's layout
    assert view.weight_view(c1, c1.weight.grad)._base is c1.weight.grad or \
        view.weight_view(c1, c1.weight.grad).data_ptr() == c1.weight.grad.data_ptr()
    torch.testing.assert_close(view.weight_matrix(c1, c1.weight.grad), c1.weight.grad.t())


def test_embedding_padding_idx():
    torch.manual_seed(5)
    emb = nn.Embedding(7, 4, padding_idx=2)
    x = torch.tensor([[0, 2, 3, 2], [6, 3, 3, 1]])
    view, a, gr, _ = _check_rows(emb, x)
    assert view.transposed and view.diagonal_input and view.sizes(emb) == (1, 7, 4)
    assert torch.all(a[0, :, 2] == 0)  # padding positions are zero rows
    counts = view.token_counts(emb, x, torch.float64)
    torch.testing.assert_close(counts, torch.diagonal(a[0].t() @ a[0]))
    assert counts.tolist() == [1, 1, 0, 3, 0, 0, 1]


@pytest.mark.parametrize("kind", ["batchnorm", "layernorm"])
def test_norm_views(kind):
    """A norm layer's gradient rows times the normalised input's rows, summed, are autograd's
    weight gradient; its gradient matrix is [features, 2]."""
    torch.manual_seed(6)
    if kind == "batchnorm":
        layer, x = nn.BatchNorm2d(3), torch.randn(4, 3, 5, 2)
        xhat = F.batch_norm(x, None, None, training=True, eps=layer.eps)
    else:
        layer, x = nn.LayerNorm((2, 3)), torch.randn(4, 5, 2, 3)
        xhat = F.layer_norm(x, (2, 3), eps=layer.eps)
    view = view_of(layer)
    assert not view.kronecker and view.sizes(layer) == (1, 2, layer.weight.numel())
    _, g = _grads(layer, x)
    gr = view.grad_rows(layer, g)[0]
    hat = view.grad_rows(layer, xhat)[0]
    torch.testing.assert_close((gr * hat).sum(0), layer.weight.grad.reshape(-1))
    torch.testing.assert_close(gr.sum(0), layer.bias.grad.reshape(-1))
    m = view.grad_matrix(layer, layer.weight.grad, layer.bias.grad)
    assert m.shape == (1, layer.weight.numel(), 2)
    with pytest.raises(TypeError, match="normalised input"):
        view.input_rows(layer, x)


def test_view_of():
    class MyLinear(nn.Linear):
        pass

    assert view_of(MyLinear(2, 3)) is views.LINEAR
    assert view_of(nn.Conv3d(1, 1, 1)) is views.CONVS[3]
    assert view_of(nn.BatchNorm1d(3)) is views.BATCHNORM
    assert view_of(nn.LayerNorm(3)) is views.LAYERNORM
    assert view_of(Conv1D(2, 3)) is views.CONV1D
    assert view_of(nn.ReLU()) is None
    bad = Conv1D(2, 3)
    bad.nx = 5  # the shape contract does not hold: not recognised
    assert view_of(bad) is None


def test_view_named_and_dtype():
    assert views.view_named("Conv1D") is views.CONV1D and views.view_named("Conv2d") is views.CONVS[2]
    with pytest.raises(ValueError, match="'Dense' names no module view"):
        views.view_named("Dense")
    lin = nn.Linear(3, 2)
    assert view_of(lin).input_rows(lin, torch.randn(4, 3)).dtype == torch.float64
