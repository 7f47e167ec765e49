"""bench/text_task.py: the split of the standard library's sources, a tiny run of every member
through the command line (table, JSON, plot), and a diverging member reported as such."""
import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch

from bench import text_task
from bench.convergence import main as convergence_main

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--steps", "4", "--eval-every", "2", "--layers", "1", "--width", "16", "--heads", "2", "--context", "16",
        "--batch-size", "2", "--train-bytes", "8192", "--heldout-bytes", "2048"]


def test_split_is_deterministic_and_disjoint():
    root = sysconfig.get_paths()["stdlib"]
    every = sorted(p.name for p in Path(root).glob("*.py"))
    train, held = text_task.split_files()
    assert (train, held) == text_task.split_files()
    assert not set(train) & set(held) and sorted(train + held) == every
    assert len(held) == round(text_task.HELDOUT_FRACTION * len(every)) and train == sorted(train)
    assert text_task.split_files(seed=1) != (train, held)
    a = text_task.load_text(train_bytes=5000, heldout_bytes=3000)
    b = text_task.load_text(train_bytes=5000, heldout_bytes=3000)
    assert a.train.shape == (5000,) and a.heldout.shape == (3000,)
    assert torch.equal(a.train, b.train) and torch.equal(a.heldout, b.heldout)
    assert a.train.dtype == torch.int64 and 0 <= a.train.min() and a.train.max() < 256
    first = (Path(root) / a.train_files[0]).read_bytes()[:100]
    assert bytes(a.train[:100].tolist()) == first[:len(first)]


def test_split_of_a_directory_and_too_few_bytes(tmp_path):
    for i in range(20):
        (tmp_path / f"m{i:02d}.py").write_text(f"x = {i}\n" * 10)
    (tmp_path / "notes.txt").write_text("not python")
    train, held = text_task.split_files(str(tmp_path))
    assert len(held) == 2 and len(train) == 18 and "notes.txt" not in train + held
    data = text_task.load_text(str(tmp_path), train_bytes=500, heldout_bytes=50)
    assert bytes(data.train[:7].tolist()) == (tmp_path / train[0]).read_bytes()[:7]
    with pytest.raises(SystemExit, match="held-out"):
        text_task.load_text(str(tmp_path), train_bytes=500, heldout_bytes=10_000)


def test_batches_are_seeded_windows():
    data = torch.arange(1000) % 256
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    (x1, y1), (x2, y2) = text_task.random_batch(data, 16, 4, g1), text_task.random_batch(data, 16, 4, g2)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and x1.shape == (4, 16)
    assert torch.equal(y1[:, :-1], x1[:, 1:])  # targets are the next bytes
    x, y = text_task.eval_windows(data, 16, count=5)
    assert x.shape == (5, 16) and x[0, 0] == 0 and y[-1, -1] == data[-1]


def test_tiny_run_of_every_member_writes_table_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "text.json", tmp_path / "text.png"
    assert convergence_main(["--task", "text", *TINY, "--json", str(out), "--plot", str(png)]) == 0
    results = json.loads(out.read_text())
    rows = {r["member"].split(" (")[0]: r for r in results["members"]}
    assert set(rows) >= {"AdamW", "AdaFisher", "AdaFisherW", "K-FAC + SGD", "K-FAC + AdamW", "SINGD", "DyKAF",
                         "two-level K-FAC"}
    budget = results["config"]["budget_s"]
    assert budget == pytest.approx(results["curves"][0]["time_s"]) and budget > 0  # AdamW's time for the steps
    for name, row in rows.items():  # two-level K-FAC on the blocks (it refuses the Embedding)
        assert row["status"] == "ok", row
        assert math.isfinite(row["heldout_loss_at_steps"]) and row["steps_done"] >= 4
        assert row["heldout_loss_at_budget"] is None or math.isfinite(row["heldout_loss_at_budget"])
    curve = results["curves"][0]
    assert curve["eval_steps"] == [0, 2, 4] and len(curve["train_loss"]) == 4
    assert all(math.isfinite(v) for v in curve["heldout_loss"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "Byte-level GPT" in printed and "two-level K-FAC (nicolaides)" in printed


def test_a_diverging_member_is_reported(tmp_path):
    data = text_task.load_text(train_bytes=4096, heldout_bytes=1024)
    # a budget no run reaches first: the diverging run's loss at the budget is then None whatever
    # the machine's speed
    config = text_task.Config(steps=6, batch_size=2, eval_every=2, layers=1, width=16, heads=2, context=16,
                              budget_s=1e9)
    specs = [text_task.member_specs(2)[0],
             text_task.MemberSpec("SGD lr 1e8", "lr 1e8", lambda m: torch.optim.SGD(m.parameters(), lr=1e8))]
    results = text_task.run_task(config, data=data, specs=specs)
    adamw, broken = results["members"]
    assert adamw["status"] == "ok"
    assert broken["status"].startswith("diverged at step ") and broken["heldout_loss_at_steps"] is None
    assert broken["heldout_loss_at_budget"] is None and results["curves"][1]["diverged_at"] <= 6
    text = json.dumps(text_task.to_json(results), allow_nan=False)  # NaN written as null
    assert "diverged" in text
    from rich.console import Console
    console = Console(record=True, width=200)
    console.print(text_task.render(results))
    assert "diverged at step" in console.export_text()
    text_task.plot(results, str(tmp_path / "p.png"))


def test_budget_reading():
    """The loss at the budget is the one after the step that used it up (the run evaluates there)."""
    run = {"member": "m", "hyperparameters": "", "eval_steps": [0, 2, 4, 5, 6],
           "eval_time_s": [0.0, 1.0, 2.0, 2.6, 3.0], "heldout_loss": [5.0, 4.0, 3.0, 2.5, 2.0],
           "train_loss": [1.0] * 6, "diverged_at": None, "diverged_time_s": None, "error": None, "steps": 6,
           "time_s": 3.0}
    row = text_task.summarise(run, 4, 2.5)
    assert row["heldout_loss_at_steps"] == 3.0 and row["heldout_loss_at_budget"] == 2.5
    assert row["steps_to_budget"] == 5 and row["ms_per_step"] == pytest.approx(500.0)
    assert text_task.summarise(run, 4, 2.0)["heldout_loss_at_budget"] == 3.0
    assert text_task.summarise(run, 4, 9.0)["heldout_loss_at_budget"] is None  # never reached
    late = text_task.summarise(dict(run, diverged_at=7, diverged_time_s=3.2), 4, 2.5)
    assert late["status"] == "diverged at step 7" and late["heldout_loss_at_budget"] == 2.5
    early = text_task.summarise(dict(run, diverged_at=3, diverged_time_s=1.5, steps=3), 4, 2.5)
    assert early["heldout_loss_at_budget"] is None and early["heldout_loss_at_steps"] is None


def test_bad_flags_are_refused():
    with pytest.raises(SystemExit):
        text_task.main(["--steps", "0"])
    with pytest.raises(SystemExit):
        text_task.main(["--width", "10", "--heads", "4"])
    with pytest.raises(SystemExit, match="unknown member"):
        text_task.select(text_task.member_specs(2), "nope")
