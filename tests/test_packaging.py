"""What a user meets on a fresh machine: the README's two commands, CI running the test one."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def readme_commands():
    blocks = re.findall(r"```\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)
    return [b for b in blocks if b.startswith("pip install")]


def test_readme_has_exactly_the_two_setup_commands():
    main_job, tests = readme_commands()
    assert main_job.endswith("python -m bench")
    assert tests.endswith("python -m pytest -q")
    assert ".[test,bench,integrations]" in tests  # the optional integrations' tests run, not skip
    for command in (main_job, tests):
        assert "pip install torch==2.13.0" in command  # the CPU build, not a multi-GB CUDA one
        assert "--no-build-isolation -e" in command


def test_ci_runs_the_readme_test_command():
    _, tests = readme_commands()
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


def test_extension_is_one_build():
    import cafin
    builds = list((ROOT / "cafin").glob("_C*.so"))
    assert len(builds) <= 1, builds
    assert cafin._C.__file__.startswith(str(ROOT / "cafin")) or not builds


MEMBERS = ("AdaFisher", "AdaFisherW", "KFACPreconditioner", "TwoLevelKFAC", "SINGD", "DyKAF")


def undocumented(cls, doc):
    """The constructor arguments of `cls` without an `Args:` entry (`name (type...): ...`) in doc."""
    import inspect
    names = [n for n in inspect.signature(cls.__init__).parameters if n != "self"]
    return [n for n in names if not re.search(rf"^\s+{re.escape(n)} \([^)]*\):", doc or "", flags=re.M)]


def test_every_constructor_argument_is_in_the_docstring():
    import cafin
    for name in MEMBERS:
        cls = getattr(cafin, name)
        assert undocumented(cls, cls.__doc__) == [], name
        # the check can fail: dropping any one entry is caught
        for arg in ("lr", "backend", "process_group", "published_bugs", "grad_scaler"):
            entry = re.search(rf"^\s+{arg} \(.*$", cls.__doc__, flags=re.M)
            if entry is not None:
                assert undocumented(cls, cls.__doc__.replace(entry.group(0), "")) == [arg], (name, arg)
