"""The layout rule of docs/architecture.md ("Where new code goes"): a file of cafin/ that grows
past ~500 lines is split by job; none is over 700."""
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "cafin"
LIMIT = 700


def test_no_file_of_cafin_is_over_the_limit():
    long = {str(p.relative_to(ROOT.parent)): n for p in sorted(ROOT.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > LIMIT}
    assert not long, f"over {LIMIT} lines (split by job): {long}"


def test_the_large_members_are_packages():
    for member in ("kfac", "twolevel", "singd", "dykaf"):
        package = ROOT / "optim" / member
        assert (package / "__init__.py").is_file() and not (ROOT / "optim" / f"{member}.py").exists(), member
