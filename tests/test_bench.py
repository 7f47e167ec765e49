"""`python -m bench` runs end to end and writes well-formed JSON; `--published` imports a user's
file and times it; `--optimizers` selects members from the registry. No timing assertions: the
numbers depend on the machine; only their presence, shape and finiteness are checked."""
import ast
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import cafin  # noqa: F401  (registers the ops, so the kernel check below sees them)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import members, published  # noqa: E402
from bench.kfac_phases import FACTORS, INVERSE, PRECONDITION  # noqa: E402
from bench.measure import PreconditionedSGD, fmt_ms, fmt_ratio  # noqa: E402
from bench.speed import main as bench_main, parse_args  # noqa: E402

# A stand-in with the published AdaFisher's interface (AdaFisher(model, lr=..., TCov=..., ...),
# .step(), statistics hooks taken when steps % TCov == 0), logging what the bench made it do.
STAND_IN = textwrap.dedent('''
    import os
    import torch
    from torch import nn


    class AdaFisher(torch.optim.Optimizer):
        def __init__(self, model, lr=1e-3, beta=0.9, Lambda=1e-3, gamma=0.8, TCov=100,
                     weight_decay=0, dist=False):
            super().__init__(model.parameters(), dict(lr=lr, beta=beta, weight_decay=weight_decay))
            self.TCov, self.steps = TCov, 0
            self.log = open(os.environ["STAND_IN_LOG"], "a")
            self.log.write(f"init {TCov}\\n")
            for module in model.modules():
                if isinstance(module, nn.Linear):
                    module.register_forward_hook(self._statistics)

        def _statistics(self, module, inputs, output):
            if torch.is_grad_enabled() and self.steps % self.TCov == 0:
                self.log.write("statistics\\n")

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-group["lr"])
            self.steps += 1
            self.log.write("step\\n")
            self.log.flush()
''')


def _fused_on_cpu() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("cafin::adafisher_step_", "CPU")


def _bench(*args, env=None, timeout=300):
    # A fresh process: the extension is loaded once per process, as a user's run loads it.
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    proc = _bench("--quick", "--model", "mlp", "--device", "cpu", "--json", str(path),
                  "--markdown", str(path.with_suffix(".md")))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(path.read_text()), proc.stdout, proc.stderr, path.with_suffix(".md")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def test_environment_and_floor(quick_run):
    data, *_ = quick_run
    env = data["environment"]
    assert env["torch"] == torch.__version__
    assert env["device"] == "cpu" and isinstance(env["device_name"], str)
    assert isinstance(env["threads"], int) and env["threads"] >= 1
    assert isinstance(env["cuda_kernels_built"], bool)
    floor = data["floor"]
    for key in ("copy_bandwidth_gb_s", "bytes_per_step", "step_floor_ms", "statistics_floor_ms"):
        assert _finite(floor[key]) and floor[key] > 0, key
    assert floor["bytes_per_step"] == 20 * floor["parameters"]
    assert data["config"]["optimizers"] == [m.name for m in members.select(None, "mlp", "cpu")]
    assert data["config"]["tcov"] == 100 and data["config"]["published"] == {}


def test_member_floors(quick_run):
    """floor["members"]: each member's step floor, its GEMMs at the GEMM rate of this run plus
    its bytes at the copy bandwidth; every member step row is stated against its own floor."""
    data, stdout, _, md = quick_run
    floor = data["floor"]
    assert _finite(floor["sgemm_gflop_s"]) and floor["sgemm_gflop_s"] > 0
    got = {f["optimizer"]: f for f in floor["members"]}
    assert set(got) == {"kfac", "singd", "dykaf", "twolevel"}
    for f in floor["members"]:
        assert set(f) >= {"optimizer", "step_floor_ms", "flop", "bytes", "launches"}
        assert isinstance(f["flop"], int) and isinstance(f["bytes"], int) and f["bytes"] > 0
        expected = (f["flop"] / (floor["sgemm_gflop_s"] * 1e9)
                    + f["bytes"] / (floor["copy_bandwidth_gb_s"] * 1e9)
                    + f["launches"] * floor["launch_us"] * 1e-6) * 1e3
        assert f["step_floor_ms"] == pytest.approx(expected)
        if "check" in f:  # the members with a fused step row
            assert f["check"]["floor_error"] == (f["step_floor_ms"] > f["check"]["measured_ms"])
    assert any("check" in f for f in floor["members"])
    # bench.models.mlp: Linear 784 -> 512 -> 256 -> 10 (d_a = fan_in + 1, d_g = fan_out)
    gemms = sum(4 * g * a * (g + a) for a, g in ((785, 512), (513, 256), (257, 10)))
    assert got["kfac"]["flop"] == gemms and got["twolevel"]["flop"] == gemms + 2 * 3 * 3
    assert got["singd"]["flop"] == 0  # the step rows' diagonal structures: elementwise
    # the console wraps a long row label inside its cell; the markdown holds it whole
    assert "float32 GEMM rate" in stdout and "floor: K-FAC" in stdout
    text = md.read_text()
    assert "floor: K-FAC + SGD" in text
    names = {m.name: m.label for m in members.registry().values()}
    rows = [r for r in data["results"] if r["phase"] == "step" and r["optimizer"] in got]
    assert {r["optimizer"] for r in rows} >= {"kfac", "singd", "dykaf"}
    for r in rows:
        line = next(line for line in text.splitlines()
                    if line.replace("*", "").startswith(f"| {names[r['optimizer']]} ")
                    and line.replace("*", "").split(" | ")[1] == fmt_ms(r["median_ms"]))
        ratio = fmt_ratio(r["median_ms"] / got[r["optimizer"]]["step_floor_ms"])
        assert line.replace("*", "").split(" | ")[3] == ratio, line
    verdicts = {t["target"].split(" fused step vs its floor")[0]: t for t in data["targets"]
                if " fused step vs its floor" in t["target"]}
    fused = {names[r["optimizer"]]: r for r in rows if r["variant"] == "fused"}
    assert set(verdicts) == set(fused) >= {"K-FAC + SGD", "SINGD (diagonal)", "DyKAF"}
    for label, t in verdicts.items():
        r = fused[label]
        f = got[r["optimizer"]]
        if f["check"]["floor_error"]:  # a floor above the measured step: the floor's error, no verdict
            assert t["verdict"] == "n/a" and t["measured"] == f["check"]["note"], t
            continue
        ok = r["median_ms"] <= 1.3 * f["step_floor_ms"]
        assert t["verdict"] == ("met" if ok else "missed")


def test_results(quick_run):
    data, *_ = quick_run
    results = data["results"]
    assert results, "no measurement"
    for r in results:
        assert set(r) >= {"model", "phase", "optimizer", "variant", "median_ms", "allocated_bytes"}
        assert r["model"] == "mlp"
        assert r["phase"] in ("step", "statistics", "refresh step", "amortised, refresh every 10") or (
            r["optimizer"] == "kfac" and r["phase"] in (PRECONDITION, INVERSE, FACTORS)) or (
            r["optimizer"] == "twolevel" and r["phase"] == "coarse assembly")
        assert _finite(r["median_ms"]) and r["median_ms"] > 0
        assert isinstance(r["allocated_bytes"], int) and r["allocated_bytes"] >= 0
    measured = {(r["phase"], r["optimizer"], r["variant"]) for r in results}
    expected = {("step", "adafisher", "reference"), ("step", "adamw", "adamw-foreach"),
                ("statistics", "adafisher", "reference"),
                ("coarse assembly", "twolevel", "reference")}
    if _fused_on_cpu():
        expected |= {("step", "adafisher", "fused"), ("step", "adafisher", "fused-compiled"),
                     ("statistics", "adafisher", "fused"), ("coarse assembly", "twolevel", "fused")}
    assert expected <= measured, expected - measured
    # Slow to compile, so only on request; published only when given.
    assert not {v for _, _, v in measured} & {"reference-compiled", "published"}
    assert not [s for s in data["skipped"] if s["error"]], data["skipped"]
    assert len(measured) == len(results), "a variant was measured twice"
    why = {(s["phase"], s["variant"]): s["reason"] for s in data["skipped"]}
    assert "--published" in why[("step", "published")]


def test_dykaf_refresh_and_soap_peer(quick_run):
    """DyKAF's own phases: the refresh step and the amortised step, which is composed from the
    plain and refresh medians; heavyball's SOAP in the same run when it imports."""
    data, *_ = quick_run
    rows = {(r["phase"], r["optimizer"], r["variant"]): r["median_ms"] for r in data["results"]}
    variants = ["reference"] + (["fused"] if _fused_on_cpu() else [])
    try:
        import heavyball  # noqa: F401
        peers = [("soap", "heavyball (eager)")]
    except ImportError:
        peers = []
        assert any(s["optimizer"] == "soap" for s in data["skipped"])
    for optimizer, variant in [("dykaf", v) for v in variants] + peers:
        plain = rows[("step", optimizer, variant)]
        refresh = rows[("refresh step", optimizer, variant)]
        amortised = rows[("amortised, refresh every 10", optimizer, variant)]
        assert amortised == pytest.approx((refresh + 9 * plain) / 10)
    if peers and _fused_on_cpu():
        target = [t for t in data["targets"] if t["target"].startswith("DyKAF fused amortised")]
        assert len(target) == 1 and target[0]["verdict"] in ("met", "missed")


def test_whole_step(quick_run):
    data, *_ = quick_run
    rows = {(w["optimizer"], w["variant"]): w for w in data["whole_step"]}
    adamw = [w for (o, _), w in rows.items() if o == "adamw"]
    assert len(adamw) == 1 and adamw[0]["overhead_vs_adamw"] == pytest.approx(0.0)
    expected = {("adafisher", "fused"), ("adafisher", "fused-compiled")} if _fused_on_cpu() else set()
    assert expected <= set(rows), set(rows)
    for (optimizer, _), w in rows.items():
        assert w["tcov"] == 100
        for key in ("plain_ms", "curvature_ms", "cycle_ms"):
            assert _finite(w[key]) and w[key] > 0, (optimizer, key)
        assert w["cycle_ms"] == pytest.approx((99 * w["plain_ms"] + w["curvature_ms"]) / 100)
        assert w["plain_n"] >= 2
        if optimizer != "adamw":
            assert w["curvature_n"] >= 2  # curvature and plain iterations alternate
            assert w["statistics_in_training_ms"] == pytest.approx(w["curvature_ms"] - w["plain_ms"])
            assert w["overhead_vs_adamw"] == pytest.approx(
                w["cycle_ms"] / adamw[0]["cycle_ms"] - 1)
    goals = [t for t in data["targets"] if "whole step over AdamW" in t["target"]]
    assert len(goals) == len(expected) and all(t["goal"] == "<= 3%" for t in goals)
    if _fused_on_cpu():
        [composed] = data["whole_step_from_phases"]
        step = {(r["optimizer"], r["phase"], r["variant"]): r["median_ms"] for r in data["results"]}
        assert composed["extra_ms"] == pytest.approx(
            step["adafisher", "step", "fused"] - step["adamw", "step", adamw[0]["variant"]]
            + step["adafisher", "statistics", "fused"] / 100)
        assert composed["overhead_vs_adamw"] == pytest.approx(
            composed["extra_ms"] / adamw[0]["plain_ms"])


def test_agreement(quick_run):
    data, *_ = quick_run
    if not _fused_on_cpu():
        assert data["agreement"] == []
        return
    assert [a["model"] for a in data["agreement"]] == ["mlp"]
    assert _finite(data["agreement"][0]["max_rel_diff"])


def test_statistics_breakdown_rows(quick_run):
    """The per-op breakdown at 1 thread and at the run's count, each row against its floor, the
    whole statistics as "all ops", and a floor target per thread count."""
    data, *_ = quick_run
    if not _fused_on_cpu():
        return
    rows = data["statistics_breakdown"]
    counts = sorted({1, data["environment"]["threads"]})
    assert sorted({b["threads"] for b in rows}) == counts
    for b in rows:
        assert set(b) >= {"op", "threads", "calls", "bytes", "median_ms", "floor_ms", "x_floor"}
        for key in ("median_ms", "floor_ms", "x_floor"):
            assert _finite(b[key]) and b[key] > 0, (b, key)
    for t in counts:
        per = [b for b in rows if b["threads"] == t]
        whole = next(b for b in per if b["op"] == "all ops")
        assert whole["calls"] == sum(b["calls"] for b in per if b is not whole)
        assert whole["bytes"] == sum(b["bytes"] for b in per if b is not whole)
        assert whole["median_ms"] >= max(b["median_ms"] for b in per if b is not whole)
    names = {t["target"] for t in data["targets"]}
    assert "fused statistics vs floor, 1 thread (per-op passes)" in names


def test_statistics_breakdown_thread_counts():
    """The breakdown takes its thread counts in turns and gives the caller's count back."""
    from bench.adafisher_phases import capture, statistics_breakdown
    from bench.models import MODELS, batch_for
    if not _fused_on_cpu():
        return
    base = MODELS["mlp"]()
    x, y = batch_for("mlp", base, 8, generator=torch.Generator().manual_seed(0))
    captured = capture("mlp", base, x, y)
    before = torch.get_num_threads()
    rows = statistics_breakdown(captured, torch.device("cpu"), 1, [1, 2], copy_numel=1 << 16)
    assert torch.get_num_threads() == before
    assert [b["threads"] for b in rows].count(1) == [b["threads"] for b in rows].count(2) > 1
    assert {b["op"] for b in rows} >= {"Linear input", "Linear gradient", "fisher_average_", "all ops"}


def test_statistics_threads_flag(capsys):
    assert parse_args(["--statistics-threads", "2,1,2"]).statistics_threads == [1, 2]
    assert parse_args([]).statistics_threads is None
    for bad in ("0", "one", ","):
        with pytest.raises(SystemExit):
            parse_args(["--statistics-threads", bad])
        assert "--statistics-threads" in capsys.readouterr().err


def test_console_report(quick_run):
    data, stdout, stderr, _ = quick_run
    assert "targets" in stdout and "step: mlp" in stdout and "whole training step" in stdout
    assert "reference (cafin, plain PyTorch)" in stdout
    assert "published way" not in stdout  # the reference is not the published code's speed
    assert {t["verdict"] for t in data["targets"]} <= {"met", "missed", "n/a"}
    # torch.profiler (used to count allocations) must not print its kineto lines.
    for stream in (stdout, stderr):
        assert "profiler_start" not in stream and "USDT" not in stream, stream[-2000:]


def test_markdown(quick_run):
    data, _, _, md = quick_run
    text = md.read_text()
    assert text.startswith("`python -m bench --model mlp --quick`: mlp, batch 128, cpu")
    assert "| step | median ms | speed-up | x floor | allocated |" in text
    assert "| AdaFisher reference (cafin, plain PyTorch) |" in text
    assert "| whole training step, ms |" in text and "per iteration, TCov 100" in text
    assert text.count("| AdamW AdamW(fused=True) |") == 2  # the step and the whole step
    assert "Speed-up: against cafin's plain-PyTorch reference (--published PATH adds" in text
    assert "against the published code" not in text
    for t in data["targets"]:
        assert f"| {t['target']} | {t['measured']} | {t['goal']} | {t['verdict']} |" in text


def test_published_stand_in(tmp_path):
    """--published PATH imports the file and times its step and its whole training step beside
    cafin's; the targets then compare against it."""
    stand_in, log = tmp_path / "AdaFisher.py", tmp_path / "calls.log"
    stand_in.write_text(STAND_IN)
    out = tmp_path / "bench.json"
    variants = "published,fused,adamw-fused" if _fused_on_cpu() else "published,adamw-foreach"
    proc = _bench("--quick", "--model", "mlp", "--device", "cpu", "--published", str(stand_in),
                  "--phases", "step,whole-step", "--variants", variants, "--json", str(out),
                  env={"STAND_IN_LOG": str(log)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["config"]["published"] == {"adafisher": str(stand_in)}
    assert ("step", "adafisher", "published") in {(r["phase"], r["optimizer"], r["variant"])
                                                   for r in data["results"]}
    whole = {(w["optimizer"], w["variant"]) for w in data["whole_step"]}
    assert ("adafisher", "published") in whole
    assert not data["skipped"] or all(not s["error"] for s in data["skipped"]), data["skipped"]
    calls = log.read_text().split()
    # The step phase builds it with a curvature interval no timed step reaches, the whole-step
    # phase with 2; both run its hooks on curvature passes and call its step many times.
    assert calls.count("init") == 2 and "1000000000" in calls and "2" in calls
    assert calls.count("statistics") >= 3 * 2  # 3 Linear layers, at least two curvature passes
    assert calls.count("step") >= 10
    if _fused_on_cpu():
        names = [t["target"] for t in data["targets"]]
        assert "fused step vs published" in names
        assert any(n.startswith("fused statistics vs published") for n in names)
    assert "published (your copy)" in proc.stdout


def test_published_code_that_raises_is_never_claimed(tmp_path):
    """A published copy whose step raises is a skipped row, and the notes under the tables say
    that it raised and what the speed-ups are against instead."""
    stand_in = tmp_path / "AdaFisher.py"
    stand_in.write_text(STAND_IN.replace("self.steps += 1", "raise RuntimeError('published step broke')"))
    out = tmp_path / "bench.json"
    proc = _bench("--quick", "--model", "mlp", "--device", "cpu", "--published", str(stand_in),
                  "--phases", "step", "--variants", "published,reference", "--json", str(out),
                  "--markdown", str(out.with_suffix(".md")), env={"STAND_IN_LOG": str(tmp_path / "log")})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    skipped = json.loads(out.read_text())["skipped"]
    assert any(s["variant"] == "published" and "published step broke" in s["reason"] for s in skipped)
    text = out.with_suffix(".md").read_text()
    assert "against the published code" not in text and "against the published code" not in proc.stdout
    assert "the published code given for adafisher raised" in text


def test_speedup_note_names_only_what_was_timed():
    """The note under a phase's table, from the rows alone: published only where published rows
    were timed, a raising copy named only when the user gave one, peers (no base) left out."""
    from bench.measure import Result, Run, Skip
    from bench.report import _speedup_basis

    def row(variant, optimizer):
        return Result("mlp", "step", variant, 1.0, 0, 3, 0.0, 0.0, 1.0, optimizer=optimizer)

    run = Run("mlp", torch.device("cpu"), 8, 3, True, None)
    run.results = [row("fused", "adafisher"), row("reference", "adafisher"), row("fused", "singd"),
                   row("reference", "singd"), row("muon", "muon"), row("adamw-fused", "adamw")]
    run.skipped = [Skip("mlp", "step", "published", "give your copy of the published code with ...")]
    note = _speedup_basis(run, "step")
    assert note == ("speed-up: against cafin's plain-PyTorch reference "
                    "(--published PATH adds the published code)"), note
    run.published = {"adafisher": "AdaFisher.py"}
    run.skipped = [Skip("mlp", "step", "published", "the published code raised RuntimeError")]
    assert "the published code given for adafisher raised" in _speedup_basis(run, "step")
    assert "against the published code" not in _speedup_basis(run, "step")
    run.skipped = []
    run.results.append(row("published", "adafisher"))
    note = _speedup_basis(run, "step")
    assert note.startswith("speed-up: against the published code for adafisher; against cafin's "
                           "plain-PyTorch reference for singd"), note


def test_published_errors(tmp_path, capsys):
    assert bench_main(["--published", str(tmp_path / "missing.py")]) == 2
    assert "no such file" in capsys.readouterr().err
    wrong = tmp_path / "wrong.py"
    wrong.write_text("class NotAdaFisher:\n    pass\n")
    assert bench_main(["--published", str(wrong)]) == 2
    assert "no class 'AdaFisher'" in capsys.readouterr().err
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('needs a package you lack')\n")
    assert bench_main(["--published", str(broken)]) == 2
    assert "needs a package you lack" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--optimizers", "adamw", "--published", "x.py"])  # adamw is no member
    with pytest.raises(SystemExit):
        parse_args(["--published", "a.py", "--published", "b.py"])


def test_optimizers_selection(capsys):
    registry = members.registry()
    assert list(registry)[0] == "adafisher"
    assert [m.name for m in members.select(None)] == list(registry)
    # A plain run on the CPU leaves out the members whose ResNet-18 decompositions take minutes.
    default = [m.name for m in members.select(None, "resnet18", "cpu")]
    assert "adafisher" in default and "kfac" not in default and "dykaf" not in default
    assert [m.name for m in members.select(None, "resnet18", "cuda")] == list(registry)
    assert [m.name for m in members.select(" AdaFisher ")] == ["adafisher"]
    with pytest.raises(ValueError, match="'nope'.*choose from adafisher"):
        members.select("adafisher,nope")
    with pytest.raises(SystemExit) as exc:
        parse_args(["--optimizers", "adafisher,nope"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--optimizers" in err and "'nope'" in err and "adafisher" in err
    args = parse_args(["--optimizers", "adafisher", "--phases", "step,whole-step"])
    assert [m.name for m in args.members] == ["adafisher"] and args.phases == {"step", "whole-step"}
    with pytest.raises(SystemExit):
        parse_args(["--phases", "steps"])
    with pytest.raises(SystemExit):
        parse_args(["--variants", "fast"])


def test_member_interface():
    """A member declares what it can run; the bench derives its variants from that."""
    ada = members.registry()["adafisher"]
    assert ada.variants() == ("published", "reference", "reference-compiled", "fused",
                              "fused-compiled", "cuda-graph")
    plain = members.Member(name="plain", label="Plain", build=lambda m, b, k: None,
                           backends=("fused",), compiles=False, captures=False)
    assert plain.variants() == ("fused",)
    assert published.parse(["x.py"], members.registry()) == {"adafisher": "x.py"}
    assert published.parse(["adafisher=y=z.py"], members.registry()) == {"adafisher": "y=z.py"}
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    opt = ada.build(model, "fused" if _fused_on_cpu() else "reference", 7)
    assert isinstance(opt, cafin.AdaFisher) and opt.TCov == 7


def test_kfac_rows(tmp_path):
    """K-FAC's rows: the step (+ SGD), the preconditioner alone (reference, fused, compiled), a
    decomposing step, the factor statistics; kfac-pytorch beside them when it is importable,
    else a skip that says why (not an error); the amortised-step targets from those rows."""
    out = tmp_path / "bench.json"
    fused = _fused_on_cpu()
    variants = "reference,fused,fused-compiled,adamw-fused" if fused else "reference,adamw-foreach"
    proc = _bench("--quick", "--model", "mlp", "--device", "cpu", "--threads", "1",
                  "--optimizers", "kfac", "--phases", "step,statistics", "--variants", variants,
                  "--json", str(out), "--markdown", str(out.with_suffix(".md")))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    rows = {(r["phase"], r["variant"]): r for r in data["results"] if r["optimizer"] == "kfac"}
    expected = {("step", "reference"), (PRECONDITION, "reference"), (INVERSE, "reference"),
                (FACTORS, "reference")}
    if fused:
        expected |= {("step", "fused"), ("step", "products-alone"), (PRECONDITION, "fused"),
                     (PRECONDITION, "fused-compiled"), (INVERSE, "fused"), (FACTORS, "fused")}
    try:
        import kfac  # noqa: F401  (a user's own install of kfac-pytorch)
        have_kfac = True
    except ImportError:
        have_kfac = False
    published = {("step", "kfac-pytorch"), (PRECONDITION, "kfac-pytorch"), (INVERSE, "kfac-pytorch")}
    if have_kfac:
        expected |= published
    else:
        skipped = {(s["phase"], s["variant"]): s for s in data["skipped"] if s["optimizer"] == "kfac"}
        assert published <= set(skipped)
        assert all(not skipped[k]["error"] and "not installed" in skipped[k]["reason"] for k in published)
    assert set(rows) == expected, set(rows) ^ expected
    for r in rows.values():
        assert _finite(r["median_ms"]) and r["median_ms"] > 0
        assert isinstance(r["allocated_bytes"], int) and r["allocated_bytes"] >= 0
    assert not [s for s in data["skipped"] if s["error"]], data["skipped"]
    # bench.models.mlp: Linear 784 -> 512 -> 256 -> 10, bias on (d_a = fan_in + 1, d_g = fan_out).
    assert data["floor"]["kfac_precondition_flop"] == sum(
        4 * g * a * (g + a) for a, g in ((785, 512), (513, 256), (257, 10)))
    # A step that eigendecomposes every factor costs more than one that does not.
    assert rows[INVERSE, "reference"]["median_ms"] > rows["step", "reference"]["median_ms"]
    targets = {t["target"]: t for t in data["targets"]
               if t["target"].startswith("K-FAC") and "vs its floor" not in t["target"]}
    assert len(targets) == 2
    assert [t for t in data["targets"] if t["target"].startswith("K-FAC + SGD fused step vs its floor")] \
        or not fused
    if fused:
        vs_adamw, vs_ref = (targets[k] for k in sorted(targets, key=lambda k: "reference" in k))
        amortised = (9 * rows["step", "fused"]["median_ms"] + rows[INVERSE, "fused"]["median_ms"]) / 10
        assert vs_adamw["amortised_ms"] == pytest.approx(amortised)
        adamw = next(r["median_ms"] for r in data["results"] if r["variant"] == "adamw-fused")
        assert vs_adamw["verdict"] == ("met" if amortised <= 2 * adamw else "missed")
        reference = (9 * rows["step", "reference"]["median_ms"]
                     + rows[INVERSE, "reference"]["median_ms"]) / 10
        assert vs_ref["reference_amortised_ms"] == pytest.approx(reference)
        assert vs_ref["verdict"] == ("met" if reference >= 3 * amortised else "missed")
    else:
        assert {t["verdict"] for t in targets.values()} == {"n/a"}
    text = out.with_suffix(".md").read_text()
    assert f"| {PRECONDITION} | median ms | speed-up | allocated |" in text
    assert "| K-FAC + SGD reference (cafin, plain PyTorch) |" in text
    assert f"{PRECONDITION}: mlp" in proc.stdout and f"{INVERSE}: mlp" in proc.stdout


def _bench_imports() -> dict[str, set[str]]:
    """Module -> the bench modules it imports, from every import statement of bench/*.py and
    bench/members/*.py, those inside functions and under `if TYPE_CHECKING` included. Importing
    a submodule imports its package first, so that is an edge too. (The registry's discovery,
    `importlib.import_module` in bench.members.registry(), runs when called, after the package
    has been imported: it is no import statement and no edge here.)"""
    files = {}
    for path in sorted((ROOT / "bench").glob("*.py")) + sorted((ROOT / "bench" / "members").glob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = (path, parts[-1] == "__init__")
    modules = set(files)

    def with_parents(name: str) -> set[str]:
        out = set()
        while name:
            if name in modules:
                out.add(name)
            name = name.rpartition(".")[0]
        return out

    graph = {}
    for name, (path, is_package) in files.items():
        package = name if is_package else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    edges |= with_parents(alias.name)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module
                edges |= with_parents(base)
                for alias in node.names:  # `from . import x` where x is a module
                    edges |= with_parents(f"{base}.{alias.name}") - with_parents(base)
        graph[name] = edges - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import cycle of `graph` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = "open"
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                return path[path.index(other):] + [other]
            if other not in state:
                found = visit(other, path + [other])
                if found:
                    return found
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state:
            found = visit(name, [name])
            if found:
                return found
    return None


def test_bench_imports_are_acyclic():
    """No import cycle among bench's modules: measure (shared types, measure(), the
    preconditioner + SGD wrapper) imports nothing from bench; phases import the leaves; the report
    is imported by the entry alone; nothing but __main__ imports the entry."""
    graph = _bench_imports()
    assert {"bench.measure", "bench.speed", "bench.report", "bench.members",
            "bench.members.kfac", "bench.kfac_phases"} <= set(graph)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    importers = {name: {m for m, edges in graph.items() if name in edges} for name in graph}
    assert graph["bench.measure"] <= {"bench"}
    assert importers["bench.report"] == {"bench.speed"}
    assert importers["bench.speed"] == {"bench.__main__"}
    assert not any(m.startswith("bench.members.") for m in graph["bench.kfac_phases"])


def test_bench_import_graph_sees_cycles(tmp_path, monkeypatch):
    """The graph above finds imports inside functions too (where a cycle could hide)."""
    package = tmp_path / "bench"
    (package / "members").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "members" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import x\n")
    (package / "b.py").write_text("def f():\n    from . import a\n")
    (package / "members" / "m.py").write_text("from .. import a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = _bench_imports()
    assert graph["bench.a"] == {"bench", "bench.b"} and graph["bench.b"] == {"bench", "bench.a"}
    assert graph["bench.members.m"] == {"bench", "bench.a"}
    assert _cycle(graph) == ["bench.a", "bench.b", "bench.a"]
    (package / "b.py").write_text("def f():\n    return 1\n")
    assert _cycle(_bench_imports()) is None


def test_preconditioned_sgd_drives_a_step():
    """The one preconditioner-then-SGD wrapper: the preconditioner runs before SGD; with
    stats_flag its update_stats is up from construction and after zero_grad and down after the
    step; restore_grads puts the gradients back."""
    calls = []

    class Pre:
        update_stats = False

        def step(self, update_params=None):
            calls.append(("pre", update_params, self.update_stats))
            for p in params:
                p.grad.mul_(2)

    params = [torch.nn.Parameter(torch.ones(3))]
    opt = torch.optim.SGD(params, lr=0.5)
    pre = Pre()
    wrapped = PreconditionedSGD(pre, opt, stats_flag=True, restore_grads=True)
    assert pre.update_stats
    params[0].grad = torch.ones(3)
    wrapped.step()
    assert calls == [("pre", True, True)] and not pre.update_stats
    assert torch.equal(params[0].grad, torch.ones(3))  # restored
    assert torch.equal(params[0].detach(), torch.zeros(3))  # 1 - 0.5 * 2
    wrapped.zero_grad()
    assert params[0].grad is None and pre.update_stats
    plain = PreconditionedSGD(Pre(), None, params=params)
    params[0].grad = torch.ones(3)
    plain.step()
    assert calls[-1] == ("pre", None, False) and torch.equal(params[0].grad, 2 * torch.ones(3))
