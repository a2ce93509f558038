"""docs/troubleshooting.md keeps up with the code: every refusal reason and every error code Sluice
can answer starts a row of one of its tables, whose second column gives the status the code sends.

The codes are read from the code itself: ``RefusalReason`` (each answered through ``Refused`` and
``admission_error``), every ``GatewayError`` subclass's ``default_code`` and ``status``, the
``code=`` given where an error is built in ``gateway/`` (found by parsing the sources, so a new
code at a new raise site fails here until the doc names it), and ``KeyStoreError``'s default. The
access line's refusal reasons must be named too, and the doc's links must lead somewhere.
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest

from gateway.admission.decision import Reject, RejectReason
from gateway.admission.retry_after import RefusalReason, RetryAfter
from gateway.http.errors import GatewayError, Refused, admission_error
from gateway.limits.base import LIMIT_KINDS
from gateway.tenants.auth import AuthFailure
from gateway.tenants.key_store import KeyStoreError

ROOT: Final = Path(__file__).resolve().parents[3]
DOCS: Final = ROOT / "docs"
DOC: Final = DOCS / "troubleshooting.md"
#: A retryable delay, to build the 429/503 form of an admission refusal.
_RETRY: Final = RetryAfter(delay_s=1.0, seconds=1, milliseconds=1000, base_s=1.0)


def _error_classes() -> Iterator[type[GatewayError]]:
    """``GatewayError`` and every subclass of it, depth first."""
    todo: list[type[GatewayError]] = [GatewayError]
    while todo:
        cls = todo.pop()
        yield cls
        todo.extend(cls.__subclasses__())


def _is_refusal(cls: type[GatewayError]) -> bool:
    return issubclass(cls, Refused)


def _constants(tree: ast.Module) -> dict[str, object]:
    """The module-level ``NAME = <literal>`` (or annotated) assignments of ``tree``."""
    found: dict[str, object] = {}
    for node in tree.body:
        target, value = None, None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            found[target.id] = value.value
    return found


def _literal(node: ast.expr | None, constants: dict[str, object]) -> object:
    """``node``'s value when it is a literal or a module constant, else ``None``."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    return None


def _default_status(cls: type[GatewayError], call: ast.Call) -> int | None:
    """The status of ``call`` (which builds a ``cls``) that gives no ``status=``: a refusal's from
    its ``RefusalReason.X`` argument (``None`` when not a literal member), else the class's."""
    if not _is_refusal(cls):
        return cls.status
    first = call.args[0] if call.args else None
    if not isinstance(first, ast.Attribute) or not isinstance(first.value, ast.Name):
        return None
    if first.value.id != RefusalReason.__name__:
        return None
    return Refused(RefusalReason[first.attr], "m", retry_after=None).status


def _called_name(func: ast.expr) -> str:
    """The name ``func`` is called by: ``Name`` or ``module.Name``; empty for anything else."""
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else ""


def raised_codes() -> dict[str, set[int | None]]:
    """Every code given literally as ``code=`` where ``gateway/`` builds an error (a
    ``GatewayError`` subclass or a ``KeyStoreError``), with the status that call sends (``None``:
    not a literal there)."""
    classes = {cls.__name__: cls for cls in _error_classes()}
    store = inspect.signature(KeyStoreError).parameters["status"].default
    found: dict[str, set[int | None]] = {}
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        constants = _constants(tree)
        for call in ast.walk(tree):
            if not isinstance(call, ast.Call):
                continue
            name = _called_name(call.func)
            if name not in classes and name != KeyStoreError.__name__:
                continue
            keywords = {k.arg: k.value for k in call.keywords if k.arg is not None}
            code = _literal(keywords.get("code"), constants)
            if not isinstance(code, str):
                continue
            if "status" in keywords:
                given = _literal(keywords["status"], constants)
                status = given if isinstance(given, int) else None
            elif name == KeyStoreError.__name__:
                status = store
            else:
                status = _default_status(classes[name], call)
            found.setdefault(code, set()).add(status)
    return found


def expected_rows() -> dict[str, set[int]]:
    """Code (or refusal reason) -> the statuses the code answers it with."""
    expected: dict[str, set[int]] = {}

    def want(code: str, status: int) -> None:
        expected.setdefault(code, set()).add(status)

    for reason in RefusalReason:
        refused = Refused(reason, "m", retry_after=None)
        want(reason.value, refused.status)
        assert refused.code is not None
        want(refused.code, refused.status)
    for reject in RejectReason:
        for retry in (_RETRY, None):
            err = admission_error(Reject(reject, retry, None, "m"))
            want(reject.value, err.status)
            assert err.code is not None
            want(err.code, err.status)
    for cls in _error_classes():
        if cls.default_code is not None:
            want(cls.default_code, cls.status)
    parameters = inspect.signature(KeyStoreError).parameters
    want(parameters["code"].default, parameters["status"].default)
    for code, statuses in raised_codes().items():
        expected.setdefault(code, set())
        for status in statuses:
            if status is not None:
                want(code, status)
    return expected


def table_rows(text: str) -> list[str]:
    """The doc's table rows, each table's header and separator left out."""
    lines = text.splitlines()
    separator = re.compile(r"\|[\s:|-]+")
    rows = []
    for i, line in enumerate(lines):
        header = i + 1 < len(lines) and separator.fullmatch(lines[i + 1]) is not None
        if line.startswith("|") and not header and separator.fullmatch(line) is None:
            rows.append(line)
    return rows


EXPECTED: Final = expected_rows()


def test_the_check_is_not_vacuous() -> None:
    reasons = {reason.value for reason in RefusalReason}
    assert {"overloaded", "rate_limit_exceeded", "no_healthy_replica", "server_shutting_down"} <= reasons
    assert reasons <= set(EXPECTED)
    raised = raised_codes()
    assert {"request_too_complex", "unsupported_media_type", "malformed_request"} <= set(raised)
    assert {"keys_unavailable", "key_not_found", "invalid_admin_token"} <= set(raised)
    assert raised["unsupported_media_type"] == {415}
    assert raised["context_length_exceeded"] == {400}
    assert EXPECTED["overloaded"] == {400, 429}
    assert EXPECTED["upstream_error"] == {502}
    assert EXPECTED["client_disconnected"] == {499}
    assert EXPECTED["keys_not_writable"] == {409}
    assert len(table_rows(DOC.read_text(encoding="utf-8"))) >= len(reasons)


@pytest.mark.parametrize(("code", "statuses"), sorted(EXPECTED.items()), ids=sorted(EXPECTED))
def test_every_code_has_a_table_row_with_its_status(code: str, statuses: set[int]) -> None:
    cells = [row.strip("|").split("|") for row in table_rows(DOC.read_text(encoding="utf-8"))]
    rows = [row for row in cells if len(row) >= 2 and f"`{code}`" in row[0]]
    assert rows, f"docs/troubleshooting.md: no table row starts with `{code}`"
    for status in sorted(statuses):
        said = re.compile(rf"(?<![\w.]){status}(?![\w.])")
        assert any(said.search(row[1]) for row in rows), (
            f"docs/troubleshooting.md: no table row gives `{code}` its status {status} (second column)"
        )


def test_the_access_lines_refusal_reasons_are_named() -> None:
    text = DOC.read_text(encoding="utf-8")
    reasons = [f"auth_{failure.value}" for failure in AuthFailure] + [*LIMIT_KINDS, "oversize"]
    missing = [reason for reason in reasons if f"`{reason}`" not in text]
    assert not missing, f"docs/troubleshooting.md does not name the access line's reasons {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading's text."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    headings = re.findall(r"^#+\s+(.*)$", path.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return {_slug(heading) for heading in headings}


def test_its_links_lead_to_existing_sections() -> None:
    links = re.findall(r"\]\(([\w.-]*)(?:#([\w-]+))?\)", DOC.read_text(encoding="utf-8"))
    assert links
    broken = []
    for target, anchor in links:
        path = DOCS / target if target else DOC
        if not path.is_file() or (anchor and anchor not in _anchors(path)):
            broken.append(f"{target}#{anchor}")
    assert not broken, f"docs/troubleshooting.md links to missing files or sections: {broken}"
