"""One route from `step()` to a kernel: `cafin/core/route.py` decides how a step runs (eager,
compiled, captured) and which kernels a tensor runs on; no other file of cafin asks torch or tests
the backend itself. A new fork elsewhere is the kind no CPU test walks."""
import pathlib
import re

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
