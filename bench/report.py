"""The rich console report of the speed bench: the header panel, the tables, the target verdicts."""
from __future__ import annotations

import math

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .measure import Run, fmt_bytes, fmt_ms, fmt_pct, fmt_ratio
from .singd_phases import T_AMORTISED, amortised

# The targets of the fused implementation (stated for ResNet-18, CPU, batch 32).
TARGET_CONFIG = ("resnet18", "cpu", 32)


LABELS = {
    "published": "published (your copy)",
    "singd": "singd (the package, importable)",
    "reference": "reference (cafin, plain PyTorch)",
    "reference-compiled": "reference, torch.compile",
    "fused": "fused",
    "fused-compiled": "fused, torch.compile",
    "fused-cached": "fused, cache_preconditioner=True",
    "cuda-graph": "fused, CUDA graph",
    "adamw-foreach": "AdamW(foreach=True)",
    "adamw-fused": "AdamW(fused=True)",
    "kfac-pytorch": "kfac-pytorch (installed)",
    "products-alone": "its eigenbasis GEMMs alone",
}


# rows that are no member of cafin
EXTRA_NAMES = {"adamw": "AdamW", "soap": "SOAP (heavyball)", "muon": "Muon (torch.optim)"}


def label(variant: str) -> str:
    return LABELS.get(variant, variant)


def header(env: dict, run: Run) -> Panel:
    lines = Text()
    rows = [("torch", env["torch"]), ("device", f"{env['device']} ({env['device_name']})"),
            ("threads", str(env["threads"])),
            ("CUDA kernels built", str(env["cuda_kernels_built"])),
            (f"fused kernels for {run.device.type}", str(env["fused_kernels_for_device"])),
            ("model", f"{run.model}, batch {run.batch_size}"),
            ("optimizers", ", ".join(run.optimizers) + " (and AdamW)"),
            ("published code", ", ".join(f"{k}: {v}" for k, v in run.published.items())
             or "none given (--published PATH)"),
            ("mode", "quick" if run.quick else "full")]
    load = env.get("load_average_1m")
    if load is not None:
        rows.append(("load average (1 min)", f"{load:.1f}" + (
            "  (busy: other processes share these cores; expect noisy numbers)"
            if load > env["threads"] + 0.5 else "")))
    for i, (k, v) in enumerate(rows):
        lines.append(f"{k:>22}: ", style="bold")
        lines.append(v + ("\n" if i < len(rows) - 1 else ""))
    return Panel(lines, title="cafin bench: speed, memory, agreement", expand=False)


def _member_phases(run: Run) -> list[str]:
    """Phases a member's `details` added (neither the shared step nor AdaFisher's statistics),
    in the order they ran."""
    out = []
    for r in run.results:
        if r.phase not in ("step", "statistics") and r.phase not in out:
            out.append(r.phase)
    return out


def _singd_amortised(run: Run) -> list[dict]:
    return [dict(a, T=T_AMORTISED) for a in amortised(run)]


def _base_of(run: Run, phase: str, optimizer: str):
    """The row speed-ups are stated against: the optimizer's published code when it was timed,
    else cafin's plain-PyTorch reference of it. AdamW rows use AdaFisher's."""
    if optimizer == "adamw":
        optimizer = "adafisher"
    for variant in ("published", "singd", "reference"):
        r = run.result(phase, variant, optimizer)
        if r:
            return r
    return None


def _speedup_basis(run: Run, phase: str) -> str:
    """What a phase's speed-ups are stated against, as measured: the published code only for the
    optimizers whose published rows were timed; a published copy that was given but raised is
    named, so the note never claims a comparison that did not happen."""
    optimizers = sorted({r.optimizer for r in run.results if r.phase == phase and r.optimizer != "adamw"
                         and _base_of(run, phase, r.optimizer) is not None})  # peers have no base
    timed = [o for o in optimizers if run.result(phase, "published", o)]
    failed = sorted({s.optimizer for s in run.skipped if s.phase == phase and s.variant == "published"
                     and s.optimizer in run.published})  # not the "give your copy" notes
    rest = [o for o in optimizers if o not in timed]
    parts = []
    if timed:
        parts.append(f"against the published code for {', '.join(timed)}")
    if rest:
        parts.append(f"against cafin's plain-PyTorch reference for {', '.join(rest)}"
                     if timed else "against cafin's plain-PyTorch reference")
    text = "speed-up: " + ("; ".join(parts) if parts else "no base was timed")
    if failed:
        text += f" (the published code given for {', '.join(failed)} raised: see the skipped rows)"
    elif not run.published:
        text += " (--published PATH adds the published code)"
    return text


def member_floor_ms(run: Run) -> dict[str, float]:
    """Each member's own step floor (bench/floors.py), by optimizer name."""
    return {f["optimizer"]: f["step_floor_ms"] for f in run.floor.get("members", [])}


def _row_floor(run: Run, phase: str, optimizer: str, floor_ms: float | None) -> float | None:
    """The floor a row is stated against: a member's own step floor on its step rows; the
    phase's (20 B per parameter on the step) for AdaFisher and AdamW; none for other rows (a
    peer, such as SOAP, or a member whose floor could not be counted)."""
    if phase == "step":
        own = member_floor_ms(run)
        if optimizer in own:
            return own[optimizer]
        return floor_ms if optimizer in ("adafisher", "adamw") else None
    return floor_ms


def _floor_rows(run: Run, phase: str, names: dict[str, str]) -> list[tuple[str, float]]:
    """(label, ms) of the members' own floors shown in the step table."""
    if phase != "step":
        return []
    shown = {r.optimizer for r in run.results if r.phase == phase}
    return [(f"floor: {names.get(f['optimizer'], f['optimizer'])} ({f['flop'] / 1e9:.2f} GFLOP, "
             f"{fmt_bytes(f['bytes'])})", f["step_floor_ms"])
            for f in run.floor.get("members", []) if f["optimizer"] in shown]


def _x_floor(run: Run, phase: str, r, to_floor: float | None) -> str:
    """The "x floor" cell: under 1.0x against a member's own floor (bench/floors.py) is an error
    of that floor, flagged as such, not a step that beats it."""
    own = phase == "step" and r.optimizer in member_floor_ms(run)
    return fmt_ratio(to_floor) + (" floor err" if own and to_floor is not None and to_floor < 1 else "")


def _label_width(variants) -> int:
    """A narrow console wraps the widest column first; a variant's label stays whole (readers
    and the tests search for it) and the floor rows' longer notes wrap instead."""
    return max((len(label(v)) for v in variants), default=0)


def _phase_table(run: Run, phase: str, floor_ms: float | None, floor_label: str,
                 names: dict[str, str]) -> Table:
    table = Table(title=f"{phase}: {run.model}, batch {run.batch_size}, {run.device}",
                  title_justify="left",
                  caption=_speedup_basis(run, phase),
                  caption_justify="left")
    table.add_column("optimizer")
    table.add_column("variant", min_width=_label_width(r.variant for r in run.results if r.phase == phase))
    table.add_column("median ms", justify="right")
    table.add_column("IQR", justify="right")
    table.add_column("n", justify="right")
    table.add_column("speed-up", justify="right")
    table.add_column("x floor", justify="right")
    table.add_column("allocated", justify="right")
    table.add_column("first call s", justify="right")
    if floor_ms is not None:
        table.add_row("", Text(floor_label, style="dim"), fmt_ms(floor_ms), "", "", "", "1.00x",
                      "", "", style="dim")
    for text, ms in _floor_rows(run, phase, names):
        table.add_row("", Text(text, style="dim"), fmt_ms(ms), "", "", "", "1.00x", "", "",
                      style="dim")
    for r in run.results:
        if r.phase != phase:
            continue
        ref = _base_of(run, phase, r.optimizer)
        speedup = ref.median_ms / r.median_ms if ref else None
        row_floor = _row_floor(run, phase, r.optimizer, floor_ms)
        to_floor = r.median_ms / row_floor if row_floor else None
        iqr = f"{100 * r.spread:.0f}%" if math.isfinite(r.spread) else "-"
        style = "bold" if r.variant.startswith("fused") else None
        table.add_row(names.get(r.optimizer, r.optimizer), label(r.variant), fmt_ms(r.median_ms),
                      iqr, str(r.repeats), fmt_ratio(speedup), _x_floor(run, phase, r, to_floor),
                      fmt_bytes(r.allocated_bytes), f"{r.first_call_s:.2f}", style=style)
    return table


def _whole_step_table(run: Run, names: dict[str, str]) -> Table:
    relu = " (ReLU not in place for every row: the published hooks need it)" \
        if run.published and run.model == "resnet18" else ""
    table = Table(title=f"whole training step (zero_grad, forward, backward, step), ms: {run.model}, "
                        f"batch {run.batch_size}, {run.device}{relu}", title_justify="left",
                  caption=f"plain / curvature: median iteration of each kind; statistics = "
                          f"curvature - plain; per iteration = the mean over a cycle of TCov = "
                          f"{run.tcov}: ((TCov - 1) x plain + curvature) / TCov; the rows ran "
                          "interleaved, round by round; 1st s: the first two iterations (compile)",
                  caption_justify="left")
    for col in ("optimizer", "variant", "plain", "IQR", "curvature", "statistics",
                "per iteration", "vs AdamW", "n", "1st s"):
        table.add_column(col, justify="left" if col in ("optimizer", "variant") else "right",
                         min_width=_label_width(w["variant"] for w in run.whole_step)
                         if col == "variant" else None)
    for w in run.whole_step:
        iqr = w["plain_iqr_over_median"]
        adamw = w["optimizer"] == "adamw"
        table.add_row(names.get(w["optimizer"], w["optimizer"]), label(w["variant"]),
                      fmt_ms(w["plain_ms"]), f"{100 * iqr:.0f}%" if iqr is not None else "-",
                      "" if adamw else fmt_ms(w["curvature_ms"]),
                      "" if adamw else fmt_ms(w["statistics_in_training_ms"]),
                      fmt_ms(w["cycle_ms"]), "" if adamw else fmt_pct(w["overhead_vs_adamw"]),
                      f"{w['plain_n']}" + ("" if adamw else f"+{w['curvature_n']}"),
                      f"{w['first_cycle_s']:.2f}",
                      style="bold" if w["variant"].startswith("fused") else None)
    return table


def _from_phases_lines(run: Run, names: dict[str, str]) -> list[str]:
    return [f"{names.get(c['optimizer'], c['optimizer'])} fused, composed from the steadier "
            f"phases: step {fmt_ms(c['step_ms'])} - AdamW step {fmt_ms(c['adamw_step_ms'])} + "
            f"statistics {fmt_ms(c['statistics_ms'])} / {c['tcov']} = {fmt_ms(c['extra_ms'])} ms "
            f"per iteration, {fmt_pct(c['overhead_vs_adamw'])} of AdamW's "
            f"{fmt_ms(c['adamw_iteration_ms'])} ms iteration" for c in run.whole_step_from_phases]


def targets(run: Run, members=()) -> list[dict]:
    """The targets, each met / missed / n/a with its numbers. AdaFisher's are stated for
    ResNet-18, CPU, batch 32; against the published code when it was timed, else against cafin's
    plain-PyTorch reference; the whole-step overhead goal applies to every member that states one."""
    def ms(phase, variant, optimizer=None):
        r = run.result(phase, variant, optimizer)
        return r.median_ms if r else None

    out = []

    def add(name, measured, goal, ok):
        out.append({"target": name, "measured": measured, "goal": goal,
                    "verdict": "n/a" if ok is None else ("met" if ok else "missed")})

    ref, fused = ms("step", "reference"), ms("step", "fused")
    pub = ms("step", "published")
    refc, adamw = ms("step", "reference-compiled"), ms("step", "adamw-fused")
    floor = run.floor.get("step_floor_ms")
    both = fused is not None
    if pub is not None:
        add("fused step vs published", f"{fmt_ratio(pub / fused)} faster" if both else "-",
            ">= 5x faster", (pub / fused >= 5) if both else None)
    add("fused step vs reference (cafin's, eager)",
        f"{fmt_ratio(ref / fused)} faster" if both and ref else "-", ">= 5x faster",
        (ref / fused >= 5) if both and ref else None)
    add("fused step vs reference-compiled",
        f"{fmt_ratio(refc / fused)} faster" if both and refc else "-", "faster",
        (fused < refc) if both and refc else None)
    add("fused step vs adamw-fused", f"{fmt_ratio(fused / adamw)} its time" if both and adamw else "-",
        "<= 1.2x its time", (fused <= 1.2 * adamw) if both and adamw else None)
    add("fused step vs floor", f"{fmt_ratio(fused / floor)} the floor" if both and floor else "-",
        "<= 1.3x the floor", (fused <= 1.3 * floor) if both and floor else None)
    sref, sfused = ms("statistics", "reference"), ms("statistics", "fused")
    wpub, wfused = run.whole("adafisher", "published"), run.whole("adafisher", "fused")
    spub = wpub and wpub["statistics_in_training_ms"]
    sfused_train = wfused and wfused["statistics_in_training_ms"]
    if spub is not None:
        ok = (spub / sfused_train >= 100) if sfused_train and sfused_train > 0 else None
        add("fused statistics vs published (in training: curvature - plain iteration)",
            f"{fmt_ratio(spub / sfused_train)} faster" if ok is not None else
            f"published {fmt_ms(spub)} ms, fused {fmt_ms(sfused_train)} ms", ">= 100x faster", ok)
    add("fused statistics vs reference (captured activations)",
        f"{fmt_ratio(sref / sfused)} faster" if sref and sfused else "-", ">= 100x faster",
        (sref / sfused >= 100) if sref and sfused else None)
    sgraph, sfloor = ms("statistics", "cuda-graph"), run.floor.get("statistics_floor_ms")
    if sgraph is not None and sfloor:
        add("fused statistics replayed from a CUDA graph vs floor (read x, g once)",
            f"{fmt_ratio(sgraph / sfloor)} the floor", "<= 2x the floor", sgraph <= 2 * sfloor)
    for b in run.breakdown:
        if b["op"] == "all ops":
            add(f"fused statistics vs floor, {b['threads']} thread{'s' if b['threads'] > 1 else ''} "
                "(per-op passes)", f"{fmt_ratio(b['x_floor'])} the floor", "<= 1.25x the floor",
                b["x_floor"] <= 1.25)
    r = run.result("step", "fused")
    add("bytes allocated in the fused step", fmt_bytes(r.allocated_bytes) if r else "-", "0 B",
        (r.allocated_bytes == 0) if r else None)
    r = run.result("statistics", "fused")
    bound = run.floor.get("statistics_output_bytes")
    add("bytes allocated in the fused statistics", fmt_bytes(r.allocated_bytes) if r else "-",
        f"<= output vectors ({fmt_bytes(bound)})",
        (r.allocated_bytes <= bound) if r and bound is not None else None)
    agree = run.agreement[0]["max_rel_diff"] if run.agreement else None
    add(f"agreement after {run.steps} steps (float32)",
        f"{agree:.2e}" if agree is not None else "-", "<= 1e-5",
        (agree <= 1e-5) if agree is not None else None)
    singd_diag, adamw_fused = ms("step", "fused", "singd"), ms("step", "adamw-fused")
    if singd_diag is not None:
        add("SINGD (diagonal) fused step vs adamw-fused",
            f"{fmt_ratio(singd_diag / adamw_fused)} its time" if adamw_fused else "-",
            "<= 1.5x its time", (singd_diag <= 1.5 * adamw_fused) if adamw_fused else None)
    for a in _singd_amortised(run):
        if a["variant"].startswith("fused") and a["vs_singd"] is not None:
            add(f"SINGD {a['structure']} {label(a['variant'])} vs singd, per step amortised over "
                f"T={a['T']}", f"{fmt_ratio(a['vs_singd'])} faster", ">= 3x faster",
                a["vs_singd"] >= 3)
    for f in run.floor.get("members", []):
        r = run.result("step", "fused", f["optimizer"])
        if r is None:
            continue
        name = next((m.label for m in members if m.name == f["optimizer"]), f["optimizer"])
        ratio = r.median_ms / f["step_floor_ms"]
        # A floor above the measured time is the floor's error (bench/floors.py `check`): no
        # verdict, and the note instead of the ratio.
        error = f.get("check", {}).get("floor_error", False)
        add(f"{name} fused step vs its floor ({f['flop'] / 1e9:.2f} GFLOP at "
            f"{run.floor['sgemm_gflop_s']:.0f} GFLOP/s + {fmt_bytes(f['bytes'])} + "
            f"{f.get('launches', 0)} launches)",
            f["check"]["note"] if error else f"{fmt_ratio(ratio)} the floor", "<= 1.3x the floor",
            None if error else ratio <= 1.3)
    for member in members:
        if member.targets is not None:
            out += member.targets(run)
    for member in members:
        if member.overhead_goal is None:
            continue
        for variant in ("fused", "fused-compiled", "cuda-graph"):
            w = run.whole(member.name, variant)
            if w is None:
                continue
            over = w["overhead_vs_adamw"]
            add(f"{member.label} {label(variant)}: whole step over AdamW (TCov {run.tcov})",
                fmt_pct(over), f"<= {100 * member.overhead_goal:.0f}%",
                (over <= member.overhead_goal) if over is not None else None)
        for c in run.whole_step_from_phases:
            if c["optimizer"] == member.name:
                over = c["overhead_vs_adamw"]
                add(f"{member.label} fused: the same, composed from the step and statistics "
                    "phases", fmt_pct(over), f"<= {100 * member.overhead_goal:.0f}%",
                    over <= member.overhead_goal)
    return out


def _targets_table(rows: list[dict], run: Run) -> Table:
    note = ""
    if (run.model, run.device.type, run.batch_size) != TARGET_CONFIG:
        note = " (the step and statistics targets are stated for resnet18, cpu, batch 32)"
    table = Table(title=f"targets{note}", title_justify="left")
    table.add_column("target")
    table.add_column("measured", justify="right")
    table.add_column("goal", justify="right")
    table.add_column("verdict")
    colours = {"met": "green", "missed": "red", "n/a": "dim"}
    for row in rows:
        table.add_row(row["target"], row["measured"], row["goal"],
                      Text(row["verdict"], style=colours[row["verdict"]]))
    return table


def print_all(console: Console, run: Run, env: dict, target_rows: list[dict],
              elapsed_s: float, members=()) -> None:
    names = {m.name: m.label for m in members} | EXTRA_NAMES
    floor = run.floor
    if floor:
        console.print(f"copy bandwidth {floor['copy_bandwidth_gb_s']:.1f} GB/s "
                      f"({fmt_bytes(floor['copy_buffer_bytes'])} buffers); step floor "
                      f"{fmt_bytes(floor['bytes_per_step'])} = 20 B x {floor['parameters']:,} parameters")
    if floor.get("sgemm_gflop_s"):
        console.print(f"float32 GEMM rate {floor['sgemm_gflop_s']:.1f} GFLOP/s ({floor['sgemm_n']}^3 "
                      "products): with the copy bandwidth, each member's own step floor "
                      "(its GEMMs' FLOPs + its elementwise bytes; bench/floors.py)")
    if any(r.phase == "step" for r in run.results):
        console.print(_phase_table(run, "step", floor.get("step_floor_ms"), "floor (20 B/param)",
                                   names))
    if any(r.phase == "statistics" for r in run.results):
        console.print(_phase_table(run, "statistics", floor.get("statistics_floor_ms"),
                                   "floor (read x, g once)", names))
    for phase in _member_phases(run):
        console.print(_phase_table(run, phase, None, "", names))
    amortised = _singd_amortised(run)
    if amortised:
        table = Table(title=f"SINGD per step amortised over T = {amortised[0]['T']} (update + "
                            f"{amortised[0]['T'] - 1} plain steps) / {amortised[0]['T']}",
                      title_justify="left")
        for col in ("structure", "variant", "ms", "vs singd"):
            table.add_column(col, justify="left" if col in ("structure", "variant") else "right")
        for a in amortised:
            table.add_row(a["structure"], label(a["variant"]), fmt_ms(a["ms"]), fmt_ratio(a["vs_singd"]))
        console.print(table)
    if run.breakdown:
        console.print(_breakdown_table(run))
    if run.agreement:
        table = Table(title="agreement: fused vs reference, float32, same batches, parameters "
                            "re-synchronised before each step", title_justify="left")
        for col in ("model", "steps", "TCov", "batch", "max rel diff", "per step"):
            table.add_column(col, justify="left" if col in ("model", "per step") else "right")
        for a in run.agreement:
            table.add_row(a["model"], str(a["steps"]), str(a["tcov"]), str(a["batch_size"]),
                          f"{a['max_rel_diff']:.2e}", " ".join(f"{d:.1e}" for d in a["per_step"]))
        console.print(table)
    # Where the fused variants allocate, so a nonzero count comes with its cause.
    for r in run.results:
        if r.variant.startswith("fused") and r.allocated_bytes and r.allocations and r.allocations.sources:
            table = Table(title=f"allocations inside {r.phase} / {r.optimizer} {r.variant}: {r.allocations.count} "
                                f"allocations, {fmt_bytes(r.allocated_bytes)}", title_justify="left")
            table.add_column("bytes", justify="right")
            table.add_column("count", justify="right")
            table.add_column("made by (innermost op first) <- Python function")
            for size, count, where in r.allocations.sources:
                table.add_row(fmt_bytes(size), str(count), where)
            console.print(table)
    if run.whole_step:
        console.print(_whole_step_table(run, names))
        for line in _from_phases_lines(run, names):
            console.print(line)
    if run.skipped:
        table = Table(title="not measured", title_justify="left")
        table.add_column("optimizer")
        table.add_column("phase")
        table.add_column("variant")
        table.add_column("why")
        for s in run.skipped:
            table.add_row(names.get(s.optimizer, s.optimizer), s.phase, s.variant,
                          Text(s.reason[:300], style="red" if s.error else "dim"))
        console.print(table)
    console.print(_targets_table(target_rows, run))
    loads = [env[k] for k in ("load_average_1m", "load_average_1m_end") if env.get(k) is not None]
    if loads and max(loads) > env["threads"] + 0.5:
        console.print(f"[yellow]the machine was busy (1-minute load average {max(loads):.1f} on "
                      f"{env['threads']} threads): parallel kernels wait for descheduled threads, "
                      "so these numbers mostly measure the other processes; rerun when idle, or "
                      "with --threads 1, which suffers far less from sharing[/yellow]")
    console.print(f"done in {elapsed_s:.0f} s")


def _breakdown_counts(run: Run) -> list[int]:
    return sorted({b["threads"] for b in run.breakdown})


def _breakdown_rows(run: Run) -> list[tuple[dict, dict[int, dict]]]:
    """The breakdown per op: its first row and its row at each thread count."""
    ops: dict[str, dict[int, dict]] = {}
    for b in run.breakdown:
        ops.setdefault(b["op"], {})[b["threads"]] = b
    return [(next(iter(per.values())), per) for per in ops.values()]


def _breakdown_table(run: Run) -> Table:
    counts = _breakdown_counts(run)
    table = Table(title="fused statistics by op (summed over calls; median of passes; the thread "
                        "counts take turns pass by pass, each against the copy floor at its count)",
                  title_justify="left")
    for col in ["op", "calls", "reads"] + [c for t in counts for c in (f"ms {t}t", f"x floor {t}t")]:
        table.add_column(col, justify="left" if col == "op" else "right")
    for first, per in _breakdown_rows(run):
        cells = [first["op"], str(first["calls"]), fmt_bytes(first["bytes"])]
        for t in counts:
            b = per.get(t)
            cells += [fmt_ms(b["median_ms"]), fmt_ratio(b["x_floor"])] if b else ["-", "-"]
        table.add_row(*cells)
    return table


def markdown(run: Run, env: dict, target_rows: list[dict], elapsed_s: float, members=()) -> str:
    """The run as Markdown tables, for docs/bench.md (`--markdown PATH`)."""
    names = {m.name: m.label for m in members} | EXTRA_NAMES
    load = [env[k] for k in ("load_average_1m", "load_average_1m_end") if env.get(k) is not None]
    out = [f"`python -m bench{_flags(run)}`: {run.model}, batch {run.batch_size}, "
           f"{env['device']} ({env['device_name']}), {env['threads']} threads, torch "
           f"{env['torch']}, done in {elapsed_s:.0f} s"
           + (f"; 1-minute load average {min(load):.1f} to {max(load):.1f}" if load else "")
           + ". Medians; only ratios within one run mean anything.", ""]
    if load and max(load) > env["threads"] + 0.5:
        out += ["**The machine was busy** (load above its thread count): other processes took "
                "most of the cores, so the absolute times are inflated and noisy.", ""]
    floor = run.floor
    for phase, floor_key, floor_label in (
            ("step", "step_floor_ms", "floor: 20 B/param at the measured copy bandwidth "
             f"({floor.get('copy_bandwidth_gb_s', math.nan):.1f} GB/s)"),
            ("statistics", "statistics_floor_ms", "floor: read every activation and output "
             "gradient once")):
        rows = [r for r in run.results if r.phase == phase]
        if not rows:
            continue
        title = "step" if phase == "step" else "statistics of one curvature step"
        out += [f"| {title} | median ms | speed-up | x floor | allocated |",
                "|---|---|---|---|---|"]
        if floor.get(floor_key):
            out.append(f"| {floor_label} | {fmt_ms(floor[floor_key])} | | 1.00x | |")
        for text, ms in _floor_rows(run, phase, names):
            out.append(f"| {text} at {floor.get('sgemm_gflop_s', math.nan):.1f} GFLOP/s | "
                       f"{fmt_ms(ms)} | | 1.00x | |")
        for r in rows:
            ref = _base_of(run, phase, r.optimizer)
            row_floor = _row_floor(run, phase, r.optimizer, floor.get(floor_key))
            cells = [f"{names.get(r.optimizer, r.optimizer)} {label(r.variant)}",
                     fmt_ms(r.median_ms), fmt_ratio(ref.median_ms / r.median_ms) if ref else "",
                     fmt_ratio(r.median_ms / row_floor) if row_floor else "",
                     fmt_bytes(r.allocated_bytes)]
            if r.variant.startswith("fused"):
                cells = [f"**{c}**" if c else c for c in cells]
            out.append("| " + " | ".join(cells) + " |")
        out += ["", _speedup_basis(run, phase)[0].upper() + _speedup_basis(run, phase)[1:] + ".", ""]
    for phase in _member_phases(run):
        out += [f"| {phase} | median ms | speed-up | allocated |", "|---|---|---|---|"]
        for r in run.results:
            if r.phase != phase:
                continue
            ref = _base_of(run, phase, r.optimizer)
            out.append(f"| {names.get(r.optimizer, r.optimizer)} {label(r.variant)} | "
                       f"{fmt_ms(r.median_ms)} | {fmt_ratio(ref.median_ms / r.median_ms) if ref else ''} | "
                       f"{fmt_bytes(r.allocated_bytes)} |")
        out.append("")
    amortised = _singd_amortised(run)
    if amortised:
        out += [f"| SINGD per step, amortised over T = {amortised[0]['T']} | ms | vs singd |",
                "|---|---|---|"]
        out += [f"| {a['structure']} {label(a['variant'])} | {fmt_ms(a['ms'])} | "
                f"{fmt_ratio(a['vs_singd']) if a['vs_singd'] else ''} |" for a in amortised]
        out.append("")
    if run.whole_step:
        out += [f"| whole training step, ms | plain iteration | curvature iteration | statistics "
                f"| per iteration, TCov {run.tcov} | vs AdamW |", "|---|---|---|---|---|---|"]
        for w in run.whole_step:
            adamw = w["optimizer"] == "adamw"
            out.append("| " + " | ".join([
                f"{names.get(w['optimizer'], w['optimizer'])} {label(w['variant'])}",
                fmt_ms(w["plain_ms"]), "" if adamw else fmt_ms(w["curvature_ms"]),
                "" if adamw else fmt_ms(w["statistics_in_training_ms"]), fmt_ms(w["cycle_ms"]),
                "" if adamw else fmt_pct(w["overhead_vs_adamw"])]) + " |")
        out += ["", f"A training iteration (zero_grad, forward, backward, step) of each optimizer "
                "on its own copy of the model, the optimizers interleaved round by round; "
                "curvature and plain iterations alternate, and the mean over a cycle of "
                f"TCov = {run.tcov} is ((TCov - 1) x plain + curvature) / TCov. Statistics: "
                "the curvature iteration's extra time, hooks included." + (
                    " ReLU not in place in every row (the published hooks need it)."
                    if run.published and run.model == "resnet18" else ""), ""]
        lines = _from_phases_lines(run, names)
        if lines:
            out += [line + "." for line in lines] + [""]
    if run.breakdown:
        counts = _breakdown_counts(run)
        out += ["| fused statistics by op | calls | reads | "
                + " | ".join(f"ms {t}t | x floor {t}t" for t in counts) + " |",
                "|---|---|---|" + "---|---|" * len(counts)]
        for first, per in _breakdown_rows(run):
            cells = [first["op"], str(first["calls"]), fmt_bytes(first["bytes"])]
            for t in counts:
                b = per.get(t)
                cells += [fmt_ms(b["median_ms"]), fmt_ratio(b["x_floor"])] if b else ["", ""]
            out.append("| " + " | ".join(cells) + " |")
        out += ["", "Summed over the calls, medians of passes in which the thread counts take "
                "turns; the floor: the bytes read at the copy bandwidth measured at the same "
                "thread count in the same pass.", ""]
    if run.agreement:
        a = run.agreement[0]
        out += [f"Agreement, fused vs reference after {a['steps']} float32 steps from the same "
                f"state: {a['max_rel_diff']:.1e} (max relative).", ""]
    if target_rows:
        out += ["| target | measured | goal | verdict |", "|---|---|---|---|"]
        out += [f"| {t['target']} | {t['measured']} | {t['goal']} | {t['verdict']} |"
                for t in target_rows]
        out.append("")
    return "\n".join(out)


def _flags(run: Run) -> str:
    flags = []
    if run.model != "resnet18":
        flags.append(f"--model {run.model}")
    if run.published:
        flags.append("--published AdaFisher.py")
    if run.quick:
        flags.append("--quick")
    return (" " + " ".join(flags)) if flags else ""
