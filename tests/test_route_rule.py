"""One route from `step()` to a kernel: `cafin/core/route.py` decides how a step runs (eager,
compiled, captured) and which kernels a tensor runs on; no other file of cafin asks torch or tests
the backend itself. A new fork elsewhere is the kind no CPU test walks."""
import pathlib
import re

import torch

from cafin.core import route

ROOT = pathlib.Path(__file__).resolve().parents[1] / "cafin"
ROUTE = ROOT / "core" / "route.py"
FORBIDDEN = {
    r"\bis_compiling\s*\(": "torch.compiler.is_compiling(): ask cafin.core.route.compiled() or eager()",
    r"is_current_stream_capturing": "the capture state: ask cafin.core.route.captured() or eager()",
    r"(?<![.\w])capturing\s*\(": "capturing(): ask cafin.core.route.captured() or eager()",
    r"\bbackend\s*[!=]=": "a test of `backend`: ask the member's Route (route.fused, route.ops(...))",
    r"\bis\s+(not\s+)?(ops|reference)\b": "a test of the op module: ask Route.runs_kernels(...)",
    r"_BACKENDS\b": "a table of backends: cafin.core.route.Route picks the op module",
}


def _code_lines(path: pathlib.Path):
    for number, line in enumerate(path.read_text().splitlines(), 1):
        code = line.split("#", 1)[0]
        if code.strip():
            yield number, code


def test_only_the_route_decides():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == ROUTE:
            continue
        for number, code in _code_lines(path):
            for pattern, why in FORBIDDEN.items():
                if re.search(pattern, code):
                    found.append(f"{path.relative_to(ROOT.parent)}:{number}: {why}")
    assert not found, "\n".join(found)


def test_the_rule_sees_a_fork():
    """The patterns catch the forms the rule forbids (a rule that matches nothing holds vacuously)."""
    forks = ["if torch.compiler.is_compiling():", "if capturing():", "if self.backend == 'fused':",
             "if impl is ops:", "impl = _BACKENDS[backend]", "torch.cuda.is_current_stream_capturing()"]
    for fork in forks:
        assert any(re.search(p, fork) for p in FORBIDDEN), fork
    allowed = ["if route.eager():", "if self._route.fused:", "route.captured()"]
    for line in allowed:
        assert not any(re.search(p, line) for p in FORBIDDEN), line


def test_the_route_answers_inside_a_fullgraph_compile():
    """A member asks its Route inside a step that may be compiled; the answer for a CUDA device
    (a dispatcher query) is a constant of the build that Dynamo evaluates while tracing, not a
    graph break. Asked here on the CPU, where only the query for "cuda" can show it."""
    chosen = route.Route("fused", "a member", "kfac_precondition_apply_")

    def step(x, device):
        ops = chosen.ops(device, torch.float32)
        return x + 1 if chosen.runs_kernels(device, torch.float32) and ops is not None else x - 1

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    for device in (torch.device("cpu"), torch.device("cuda")):
        x = torch.ones(3)
        torch.testing.assert_close(compiled(x, device), step(x, device))
    assert route.Route("reference", "a member", "kfac_precondition_apply_").ops(
        torch.device("cpu"), torch.float32) is chosen.ops(torch.device("cuda"), torch.bfloat16)
