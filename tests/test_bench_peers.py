"""The peers a user would compare the members with (bench/peers.py): torch.optim.Muon with AdamW on
the rest, as one optimizer, and heavyball's SOAP, as rows of the convergence bench (the digits CNN
and the text task) and of the speed bench's step table. No timing assertions."""
from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import text_task  # noqa: E402
from bench.convergence import DigitsCNN, load_data, main as convergence_main, optimizer_specs, select, train  # noqa: E402
from bench.models import GPT, mlp, resnet18  # noqa: E402
from bench.peers import MUON, MuonAdamW, muon_routes, soap_available  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# CI installs the bench extra, which holds heavyball on Python >= 3.11: SOAP must be there.
SOAP_EXPECTED = sys.version_info >= (3, 11)


def test_heavyball_imports_where_the_bench_extra_has_it():
    ok, why = soap_available()
    if SOAP_EXPECTED:
        assert ok, why
    else:
        assert "heavyball" in why


# ------------------------------------------------------------------------------------ routing
def _muon_names(model, **kw):
    return {n for n, r in muon_routes(model, **kw).items() if r == "muon"}


def test_routes_follow_muons_documented_rule():
    """Hidden Linear/Conv weights to Muon; the input and output layers, embeddings, biases, norms
    and bare parameters to AdamW; every trainable parameter exactly once."""
    cnn = DigitsCNN()
    assert _muon_names(cnn) == {"conv2.weight"}  # conv1 is the stem, fc the classifier
    gpt = GPT(vocab=64, dim=32, depth=2, heads=4, context=16)
    hidden = {f"blocks.{i}.{n}.weight" for i in range(2) for n in ("attn.qkv", "attn.proj", "fc", "out")}
    assert _muon_names(gpt) == hidden  # tok (and the tied head) and pos go to AdamW
    routes = muon_routes(gpt)
    assert routes["tok.weight"] == routes["pos"] == routes["ln.weight"] == "adamw"
    assert routes["blocks.0.attn.qkv.bias"] == routes["blocks.1.ln2.weight"] == "adamw"
    # one entry per parameter object (the tied head is the embedding's weight)
    assert len(routes) == len(list(gpt.parameters()))
    assert _muon_names(mlp((20, 16, 12, 10))) == {"2.weight"}  # the middle layer only
    resnet = resnet18(width=8, blocks=(1, 1, 1, 1))
    muon = _muon_names(resnet)
    assert "conv1.weight" not in muon and "fc.weight" not in muon
    assert "layers.0.conv1.weight" in muon and "layers.1.shortcut.0.weight" in muon
    assert not any(n.endswith("bias") or ".bn" in n for n in muon)


def test_explicit_adamw_layers_and_frozen_parameters():
    model = mlp((20, 16, 12, 10))
    assert _muon_names(model, adamw_layers=["2"]) == {"0.weight", "4.weight"}
    model[0].weight.requires_grad_(False)
    assert "0.weight" not in muon_routes(model)  # a frozen parameter trains in neither
    with pytest.raises(ValueError, match="adamw_layers names no module"):
        muon_routes(model, adamw_layers=["head"])


def test_a_model_with_no_hidden_matrix_is_refused():
    with pytest.raises(ValueError, match="no hidden Linear or Conv weight"):
        MuonAdamW(nn.Sequential(nn.Linear(4, 3)), dict(lr=1e-3))


def test_a_filter_without_a_2d_view_is_refused():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Conv2d(1, 4, 3), nn.Conv2d(4, 6, 3), nn.Linear(6, 2)
    net = Net()
    net.b.weight = nn.Parameter(net.b.weight.detach().permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3))
    with pytest.raises(ValueError, match="b.weight: Muon takes a filter as a 2-D view"):
        MuonAdamW(net, dict(lr=1e-3))


def _oracle_step(model, grads, states, lr_muon, wd_muon, adamw):
    """One step by hand: torch's Muon functional on each filter reshaped to 2-D, torch's AdamW
    on the rest, each from the given state."""
    from torch.optim._muon import _single_tensor_muon
    routes = muon_routes(model)
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, route in routes.items():
            p, g = named[name], grads[name]
            if route == "muon":
                buf = states.setdefault(name, torch.zeros(p.shape[0], p[0].numel()))
                w = p.detach().reshape(p.shape[0], -1).clone()
                _single_tensor_muon([w], [g.reshape(w.shape)], [buf], lr=lr_muon,
                                    weight_decay=wd_muon, momentum=MUON["momentum"],
                                    nesterov=True, ns_coefficients=(3.4445, -4.7750, 2.0315),
                                    ns_steps=MUON["ns_steps"], eps=1e-7, adjust_lr_fn=None,
                                    has_complex=False)
                p.copy_(w.reshape(p.shape))
        rest = [named[n] for n, r in routes.items() if r == "adamw"]
        for n, r in routes.items():
            if r == "adamw":
                named[n].grad = grads[n].clone()
        opt = states.setdefault("adamw", torch.optim.AdamW(rest, **adamw))
        opt.step()
        for p in rest:
            p.grad = None


def test_steps_both_sides_as_torchs_muon_and_adamw_do():
    """Three steps of the wrapper on the digits CNN equal three steps by hand (Muon's functional
    on conv2's filter as a 2-D matrix, AdamW on the rest): every parameter moves, the filter by
    Muon's update in place, and zero_grad clears the filter's own gradient."""
    torch.manual_seed(0)
    a = DigitsCNN()
    b = DigitsCNN()
    b.load_state_dict(a.state_dict())
    adamw = dict(lr=1e-3, weight_decay=1e-2)
    opt = MuonAdamW(a, adamw)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(a.parameters()))
    start = {n: p.detach().clone() for n, p in a.named_parameters()}
    states: dict = {}
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    for _ in range(3):
        opt.zero_grad()
        assert all(p.grad is None for p in a.parameters())
        nn.functional.cross_entropy(a(x), y).backward()
        opt.step()
        b.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(b(x), y).backward()
        grads = {n: p.grad.detach().clone() for n, p in b.named_parameters()}
        _oracle_step(b, grads, states, MUON["lr"], MUON["weight_decay"], adamw)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert not torch.equal(pa, start[name]), f"{name} did not move"
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7, msg=name)
    # the filter's state is Muon's momentum, the rest AdamW's moments
    assert [type(o).__name__ for o in opt.optimizers] == ["Muon", "AdamW"]
    assert len(opt.muon.state) == 1 and len(opt.adamw.state) == len(list(a.parameters())) - 1


def test_state_dict_round_trip_continues_the_same_run():
    """A checkpoint of both sides (conv2's Muon state is kept on its 2-D view) resumes exactly."""
    torch.manual_seed(1)
    model = DigitsCNN()
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))

    def step(m, opt):
        opt.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()

    opt = MuonAdamW(model, dict(lr=1e-3))
    step(model, opt)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    step(model, opt)
    after = [p.detach().clone() for p in model.parameters()]
    twin = DigitsCNN()
    twin.load_state_dict(saved_model)
    twin_opt = MuonAdamW(twin, dict(lr=1e-3))
    twin_opt.load_state_dict(saved_opt)
    step(twin, twin_opt)
    for p, q in zip(after, twin.parameters()):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="not a MuonAdamW state_dict"):
        twin_opt.load_state_dict(saved_opt["muon"])


# ------------------------------------------------------------------------------- convergence
def test_digits_rows_of_both_peers():
    names = [s.name for s in select(optimizer_specs(), "peers")]
    expected = ["Muon + AdamW (torch)"] + (["SOAP (heavyball)"] if SOAP_EXPECTED else [])
    assert sorted(names) == sorted(expected)
    default = [s.name for s in select(optimizer_specs(), None)]
    assert set(expected) <= set(default)


def test_digits_json_has_the_peer_rows(tmp_path):
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    rc = convergence_main(["--epochs", "1", "--seeds", "1", "--optimizers", "peers,adamw",
                           "--json", str(out), "--plot", str(png)])
    assert rc == 0
    rows = {r["optimizer"]: r for r in json.loads(out.read_text())["optimizers"]}
    assert "Muon + AdamW (torch)" in rows and "AdamW" in rows
    assert ("SOAP (heavyball)" in rows) == soap_available()[0]
    for name in [n for n in rows if n != "AdamW"]:
        row = rows[name]
        assert row["peer"] is True and row["diverged_at"] == [None], row
        assert row["accuracy_after_epoch"]["1"]["mean"] > 0.5, row  # chance is 0.1
        assert row["step_ms_median"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_muon_trains_the_cnn(tmp_path):
    data = load_data()
    spec = [s for s in optimizer_specs() if s.name.startswith("Muon")][0]
    run = train(spec, data, seed=0, epochs=1, eval_every=None)
    assert all(math.isfinite(v) for v in run.train_loss)
    assert sum(run.train_loss[-5:]) / 5 < run.train_loss[0] / 2


def test_text_task_has_the_peer_rows():
    data = text_task.load_text(train_bytes=4096, heldout_bytes=1024)
    config = text_task.Config(steps=4, batch_size=2, eval_every=2, layers=1, width=16, heads=2, context=16)
    soap_ok = soap_available()[0]
    results = text_task.run_task(config, names="adamw,muon" + (",soap" if soap_ok else ""), data=data)
    rows = {r["member"]: r for r in results["members"]}
    assert set(rows) == {"AdamW", "Muon + AdamW (torch)"} | ({"SOAP (heavyball)"} if soap_ok else set())
    assert results["config"]["budget_s"] == results["curves"][0]["time_s"]  # AdamW's, for every row
    for row in rows.values():
        assert row["status"] == "ok", row
        assert math.isfinite(row["heldout_loss_at_steps"])
        assert row["heldout_loss_at_steps"] < row["initial_heldout_loss"], row
        # read at the budget, or trained on to the step cap without using it up
        assert row["heldout_loss_at_budget"] is not None or row["steps_done"] == 4 * text_task.MAX_STEP_FACTOR


# ------------------------------------------------------------------------------- step table
def test_step_table_has_the_peer_rows(tmp_path):
    out = tmp_path / "b.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--model", "mlp", "--device", "cpu", "--threads", "1",
         "--phases", "step", "--optimizers", "adafisher", "--variants", "fused,adamw-fused,muon,soap",
         "--json", str(out), "--markdown", str(out.with_suffix(".md"))],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    rows = {(r["optimizer"], r["variant"]): r for r in data["results"] if r["phase"] == "step"}
    assert ("adamw", "adamw-fused") in rows
    muon = rows[("muon", "hidden matrices; AdamW(fused) the rest")]
    assert muon["median_ms"] > 0
    if SOAP_EXPECTED:
        assert rows[("soap", "heavyball (eager)")]["median_ms"] > 0
    assert not [s for s in data["skipped"] if s["error"]], data["skipped"]
    md = out.with_suffix(".md").read_text()
    assert "Muon (torch.optim) hidden matrices" in md


def test_peers_are_picked_by_variants_and_model():
    from bench.peers import wanted_peers
    assert wanted_peers(set(), "gpt", "cpu") == ["muon", "soap"]
    assert wanted_peers(set(), "resnet18", "cpu") == []
    assert wanted_peers(set(), "resnet18", "cuda") == ["muon", "soap"]
    assert wanted_peers({"fused", "muon"}, "resnet18", "cpu") == ["muon"]
    assert wanted_peers({"fused"}, "gpt", "cpu") == []
