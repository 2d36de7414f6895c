"""smptk.settings: one parser per kind of value, every spelling it accepts, the errors, each accessor.

Parsers are checked on a scratch variable; accessors on their real variables, for the default, one set
value and one bad value each, so a variable read with the wrong kind or default fails here.
"""

from __future__ import annotations

import doctest
import os

import pytest

from smptk import settings

VAR = "SMPTK_TEST_SCRATCH"

TRUE_SPELLINGS = ["1", "true", "TRUE", "True", "yes", "YES", "Yes", "on", "ON", "On", " 1 ", "\ttrue\n"]
FALSE_SPELLINGS = ["0", "false", "FALSE", "False", "no", "NO", "No", "off", "OFF", "Off", " 0 ", " off "]
BAD_FLAGS = ["2", "-1", "y", "n", "t", "f", "enable", "truee", "1.0", "yes please", "o n"]


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch):
    """``env(value)`` sets the scratch variable; ``env(None)`` unsets it."""

    def set_to(value: str | None, name: str = VAR) -> None:
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)

    return set_to


# --- flag -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", TRUE_SPELLINGS)
@pytest.mark.parametrize("default", [True, False])
def test_flag_true_spellings(env, value, default):
    env(value)
    assert settings.flag(VAR, default) is True


@pytest.mark.parametrize("value", FALSE_SPELLINGS)
@pytest.mark.parametrize("default", [True, False])
def test_flag_false_spellings(env, value, default):
    env(value)
    assert settings.flag(VAR, default) is False


@pytest.mark.parametrize("value", [None, "", "   "], ids=["unset", "empty", "blank"])
@pytest.mark.parametrize("default", [True, False])
def test_flag_unset_or_empty_is_the_default(env, value, default):
    env(value)
    assert settings.flag(VAR, default) is default


@pytest.mark.parametrize("value", BAD_FLAGS)
def test_flag_rejects_anything_else_naming_the_variable(env, value):
    env(value)
    with pytest.raises(ValueError) as info:
        settings.flag(VAR, False)
    message = str(info.value)
    assert message.startswith(f"{VAR}={value!r}: expected one of 1/0, true/false, yes/no, on/off"), message


# --- integer, number, choice, text ------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [("4", 4), (" 4 ", 4), ("-3", -3), ("0", 0), ("", 7)])
def test_integer(env, value, expected):
    env(value)
    assert settings.integer(VAR, 7) == expected


@pytest.mark.parametrize("value", ["four", "4.0", "4e3", "0x10", "4 5"])
def test_integer_rejects_non_integers(env, value):
    env(value)
    with pytest.raises(ValueError, match=f"^{VAR}='{value}': expected an integer$"):
        settings.integer(VAR, 7)


def test_integer_lower_bound(env):
    env("0")
    with pytest.raises(ValueError, match=f"^{VAR}='0': expected an integer >= 1$"):
        settings.integer(VAR, None, low=1)
    env("1")
    assert settings.integer(VAR, None, low=1) == 1
    env(None)
    assert settings.integer(VAR, None, low=1) is None


def test_integer_upper_bound_and_multiple(env):
    env("300")
    with pytest.raises(ValueError, match=f"^{VAR}='300': expected an integer >= 1, <= 256$"):
        settings.integer(VAR, None, low=1, high=256)
    env("4100")
    with pytest.raises(ValueError, match=f"^{VAR}='4100': expected an integer a multiple of 16$"):
        settings.integer(VAR, None, multiple=16)
    env("4096")
    assert settings.integer(VAR, None, low=4096, multiple=16) == 4096
    assert settings.integer(VAR, None, high=4096) == 4096


def test_number_upper_bound(env):
    env("2e6")
    with pytest.raises(ValueError, match=f"^{VAR}='2e6': expected a number <= 1e\\+06$"):
        settings.number(VAR, None, positive=True, high=1e6)
    env("1e6")
    assert settings.number(VAR, None, high=1e6) == 1e6


def test_comm_ranges_are_smptk_comms():
    """The table's ranges for SMPTK_COMM_* are those smptk.comm checks configure's values against."""
    from smptk.kernels.heap_layout import MAX_PROGRAMS

    assert settings.VARIABLES["SMPTK_COMM_MAX_SMS"].high == MAX_PROGRAMS
    import smptk.comm.collectives as collectives

    assert settings.VARIABLES["SMPTK_COMM_TIMEOUT_S"].high == collectives._MAX_TIMEOUT_S


@pytest.mark.parametrize(("value", "expected"), [("2.5", 2.5), (" 3 ", 3.0), ("1e-3", 1e-3), ("", 9.0)])
def test_number(env, value, expected):
    env(value)
    assert settings.number(VAR, 9.0) == expected


@pytest.mark.parametrize("value", ["30s", "1,5", "two"])
def test_number_rejects_non_numbers(env, value):
    env(value)
    with pytest.raises(ValueError, match=f"^{VAR}='{value}': expected a number$"):
        settings.number(VAR, 1.0)


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_number_positive(env, value):
    env(value)
    with pytest.raises(ValueError, match="expected a finite number > 0"):
        settings.number(VAR, None, positive=True)


@pytest.mark.parametrize(("value", "expected"), [("tma", "tma"), (" TMA ", "tma"), ("Pointer", "pointer")])
def test_choice(env, value, expected):
    env(value)
    assert settings.choice(VAR, "auto", ("auto", "tma", "pointer")) == expected


def test_choice_rejects_other_words_naming_them(env):
    env(" Fast ")
    with pytest.raises(ValueError) as info:
        settings.choice(VAR, "auto", ("auto", "tma", "pointer"))
    assert str(info.value) == f"{VAR}='fast': expected one of 'auto', 'tma', 'pointer'"


def test_choice_and_text_defaults(env):
    env("")
    assert settings.choice(VAR, "auto", ("auto",)) == "auto"
    assert settings.text(VAR, None) is None
    env("  run-1 ")
    assert settings.text(VAR, None) == "run-1"


# --- the table and the accessors ----------------------------------------------------------------------------

# accessor, variable, default, (a value to set, what it reads as), a value it rejects (None: accepts all)
ACCESSORS = [
    (settings.kernels, "SMPTK_KERNELS", "auto", ("Torch", "torch"), "cuda"),
    (settings.interpreter_fast_calls, "SMPTK_INTERPRETER_FAST_CALLS", True, ("no", False), "fast"),
    (settings.gemm_path, "SMPTK_GEMM_PATH", "auto", (" pointer", "pointer"), "wgmma"),
    (settings.autotune, "SMPTK_AUTOTUNE", True, ("off", False), "maybe"),
    (settings.poison_outputs, "SMPTK_POISON_OUTPUTS", False, ("yes", True), "2"),
    (settings.check_offsets, "SMPTK_CHECK_OFFSETS", False, ("On", True), "always"),
    (settings.comm_max_sms, "SMPTK_COMM_MAX_SMS", 8, ("4", 4), "four"),
    (settings.comm_timeout_s, "SMPTK_COMM_TIMEOUT_S", 300.0, ("2.5", 2.5), "30s"),
    (settings.comm_heap_bytes, "SMPTK_COMM_HEAP_BYTES", 64 << 20, ("8192", 8192), "64MiB"),
    (settings.comm_sync_check, "SMPTK_COMM_SYNC_CHECK", False, ("true", True), "sync"),
    (settings.comm_copy_path, "SMPTK_COMM_COPY_PATH", "pointer", ("TMA", "tma"), "fast"),
    (settings.compile_all, "SMPTK_COMPILE_ALL", False, ("1", True), "all"),
    (settings.compile_jobs, "SMPTK_COMPILE_JOBS", None, ("3", 3), "0"),
    (settings.bench_mode, "SMPTK_BENCH_MODE", None, ("QUICK", "quick"), "fast"),
    (settings.bench_rounds, "SMPTK_BENCH_ROUNDS", None, ("5", 5), "0"),
    (settings.bench_warmup, "SMPTK_BENCH_WARMUP", None, ("0", 0), "-1"),
    (settings.bench_jsonl, "SMPTK_BENCH_JSONL", None, ("rows.jsonl", "rows.jsonl"), None),
    (settings.bench_run_id, "SMPTK_BENCH_RUN_ID", None, ("r1", "r1"), None),
    (settings.bench_comm_dist_timeout_s, "SMPTK_BENCH_COMM_DIST_TIMEOUT_S", None, ("60", 60.0), "-5"),
    (settings.bench_tp_dist_timeout_s, "SMPTK_BENCH_TP_DIST_TIMEOUT_S", None, ("90", 90.0), "-1"),
    (settings.gpu_check, "SMPTK_GPU_CHECK", None, ('{"log": "x"}', '{"log": "x"}'), None),
    (settings.torch_spec, "SMPTK_TORCH_SPEC", None, ("torch==2.13.0", "torch==2.13.0"), None),
    (settings.triton_interpret, "TRITON_INTERPRET", False, ("Y", True), None),
]


@pytest.mark.parametrize(
    ("accessor", "name", "default", "good", "bad"), ACCESSORS, ids=[a[1] for a in ACCESSORS]
)
def test_accessor(env, accessor, name, default, good, bad):
    assert settings.VARIABLES[name].default == default
    env(None, name)
    assert accessor() == default
    env(good[0], name)
    assert accessor() == good[1]
    assert settings.VARIABLES[name].read() == good[1]
    if bad is not None:
        env(bad, name)
        with pytest.raises(ValueError, match=f"^{name}="):
            accessor()


def test_every_variable_has_an_accessor_and_a_meaning():
    assert {a[1] for a in ACCESSORS} == set(settings.VARIABLES)
    for var in settings.VARIABLES.values():
        assert len(var.meaning) > 20, var.name


def test_every_smptk_variable_in_the_repository_is_in_the_table():
    """A variable named anywhere in the package, tests, benchmarks, examples, scripts or Makefile is declared
    here, spelled the same (names of Python constants that merely start with SMPTK_ are listed)."""
    import re
    from pathlib import Path

    root = Path(settings.__file__).resolve().parent.parent
    files = [
        root / "Makefile",
        *(p for d in ("smptk", "tests", "bench", "examples", "scripts") for p in (root / d).rglob("*.py")),
    ]
    used = set()
    for path in files:
        if path.is_file():
            used |= set(re.findall(r"\bSMPTK_[A-Z][A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    not_variables = {
        "SMPTK_CASES",  # bench/comm_dist.py: a tuple of cases
        "SMPTK_TEST_SCRATCH",  # this file's scratch variable
    }
    assert used - set(settings.VARIABLES) - not_variables == set()


def test_the_readme_names_every_variable_of_the_table_and_no_other():
    """The README named 13 of the table's 23 variables: none of the benchmarks' or the compile test's."""
    import re
    from pathlib import Path

    readme = (Path(settings.__file__).resolve().parent.parent / "README.md").read_text()
    named = set(re.findall(r"\b(?:SMPTK_[A-Z][A-Z0-9_]*[A-Z0-9]|TRITON_INTERPRET)\b", readme))
    assert set(settings.VARIABLES) - named == set()
    assert named - set(settings.VARIABLES) == set()


def test_no_variable_of_the_table_is_read_past_its_accessor():
    """smptk, the benchmarks, scripts and examples read a variable of the table only through smptk.settings
    (or smptk.kernels.runtime), never with os.environ / os.getenv, by its name or by a constant that holds
    it. The benchmarks read SMPTK_BENCH_JSONL raw, so a blank value wrote rows to a file named by the
    blanks and " rows.jsonl" to a file whose name starts with a space, where smptk.settings reads both as
    the table documents."""
    import re
    from pathlib import Path

    root = Path(settings.__file__).resolve().parent.parent
    files = [p for d in ("smptk", "bench", "scripts", "examples") for p in (root / d).rglob("*.py")]
    files = [p for p in files if p.resolve() != Path(settings.__file__).resolve()]
    texts = {p: p.read_text() for p in files}
    holds = {}  # constants that hold a variable's name: JSONL_ENV = "SMPTK_BENCH_JSONL"
    for text in texts.values():
        for const, name in re.findall(r'^\s*([A-Z][A-Z0-9_]*)\s*=\s*"([A-Z][A-Z0-9_]*)"\s*$', text, re.M):
            holds[const] = name
    read = re.compile(
        r"os\.environ\.get\(\s*([^,)]+)|os\.getenv\(\s*([^,)]+)|os\.environ\[([^\]]+)\](?!\s*=[^=])"
    )
    found = []
    for path, text in texts.items():
        for match in read.finditer(text):
            arg = next(g for g in match.groups() if g).strip()
            name = arg.strip("\"'") if arg[0] in "\"'" else holds.get(arg.rsplit(".", 1)[-1])
            start = text.rfind("\n", 0, match.start()) + 1
            if name in settings.VARIABLES and not text[start:].lstrip(" >.").startswith("del "):
                line = text.count("\n", 0, match.start()) + 1
                found.append(f"{path.relative_to(root)}:{line}: {match.group(0)}")
    assert found == []


def test_triton_interpret_agrees_with_triton():
    """TRITON_INTERPRET is Triton's: ours must read it exactly as Triton's own parser does."""
    libtriton = pytest.importorskip("triton._C.libtriton", reason="triton is not installed")
    saved = os.environ.get("TRITON_INTERPRET")
    try:
        for value in ["1", "0", "true", "TRUE", "yes", "on", "y", "Y", "n", "no", "off", "", " 1", "bogus"]:
            os.environ["TRITON_INTERPRET"] = value
            assert settings.triton_interpret() is libtriton.getenv_bool("TRITON_INTERPRET", False), value
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


def test_snapshot_never_raises(env):
    env("maybe", "SMPTK_AUTOTUNE")
    env("pointer", "SMPTK_GEMM_PATH")
    env(None, "SMPTK_CHECK_OFFSETS")
    snap = settings.snapshot()
    assert set(snap) == set(settings.VARIABLES)
    assert snap["SMPTK_AUTOTUNE"]["value"].startswith("error: SMPTK_AUTOTUNE='maybe'")
    meaning = settings.VARIABLES["SMPTK_GEMM_PATH"].meaning
    assert snap["SMPTK_GEMM_PATH"] == {"value": "pointer", "set": True, "meaning": meaning}
    assert snap["SMPTK_CHECK_OFFSETS"]["set"] is False


def test_module_example(monkeypatch):
    monkeypatch.delenv("SMPTK_POISON_OUTPUTS", raising=False)
    monkeypatch.setenv("SMPTK_POISON_OUTPUTS", "0")  # the example sets it; monkeypatch restores it
    result = doctest.testmod(settings, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0 and result.attempted > 0


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, "torch==2.13.0"),
        ("", "torch==2.13.0"),
        ("  ", "torch==2.13.0"),
        (" torch==2.11.0 ", "torch==2.11.0"),
    ],
    ids=["unset", "empty", "blank", "spaces"],
)
def test_bootstrap_reads_the_torch_spec_as_the_table_does(env, value, expected):
    """scripts/bootstrap.py (make's venv builder) read SMPTK_TORCH_SPEC with os.environ.get, so an empty
    value (``SMPTK_TORCH_SPEC= make test``) reached pip as the requirement '' instead of the default."""
    import importlib.util
    from pathlib import Path

    path = Path(settings.__file__).resolve().parent.parent / "scripts" / "bootstrap.py"
    spec = importlib.util.spec_from_file_location("smptk_bootstrap_under_test", path)
    bootstrap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bootstrap)
    env(value, "SMPTK_TORCH_SPEC")
    assert bootstrap.DEFAULT_TORCH_SPEC == "torch==2.13.0"
    assert bootstrap.torch_spec() == expected
