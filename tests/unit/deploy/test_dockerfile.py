"""The Dockerfile, checked without a Docker daemon: it installs Sluice with its runtime
dependencies only, from paths that exist and that ``.dockerignore`` lets into the build context,
into a slim image run by an unprivileged user with a health check on the gateway's own probe.
"""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from gateway.config.settings import ServerSettings

ROOT = Path(__file__).resolve().parents[3]


@dataclass
class Stage:
    """One ``FROM`` stage: its base and its instructions, ``(KEYWORD, arguments)`` in order."""

    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def _instructions(text: str) -> list[tuple[str, str]]:
    """``(KEYWORD, arguments)`` of each instruction: comments dropped, continuations joined."""
    kept = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    found = []
    for line in kept.replace("\\\n", " ").splitlines():
        if line.strip():
            keyword, _, args = line.strip().partition(" ")
            found.append((keyword.upper(), " ".join(args.split())))
    return found


def _parse() -> tuple[dict[str, str], list[Stage]]:
    """The global ``ARG`` defaults and the stages."""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for keyword, rest in _instructions((ROOT / "Dockerfile").read_text(encoding="utf-8")):
        if keyword == "FROM":
            base, _, name = rest.partition(" AS ")
            stages.append(Stage(base.strip(), name.strip() or None))
        elif not stages and keyword == "ARG":
            key, _, value = rest.partition("=")
            args[key] = value
        else:
            stages[-1].instructions.append((keyword, rest))
    return args, stages


def _copy_sources(stage: Stage) -> list[str]:
    """The context paths a stage's ``COPY`` instructions read (not ``--from`` ones)."""
    sources: list[str] = []
    for args in stage.all("COPY"):
        words = args.split()
        if any(word.startswith("--from") for word in words):
            continue
        sources += [w for w in words[:-1] if not w.startswith("--")]
    return sources


def _in_context(path: str) -> bool:
    """Whether ``.dockerignore`` lets ``path`` (a top-level name) into the build context: its
    patterns in order, the last one that matches deciding (``!`` re-includes)."""
    kept = True
    for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negated = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path.rstrip("/"), pattern):
            kept = negated
    return kept


def _pyproject() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_two_stages_on_one_slim_base() -> None:
    args, (build, runtime) = _parse()
    assert args["PYTHON_IMAGE"].startswith("python:3.11")
    assert args["PYTHON_IMAGE"].endswith("-slim")
    # The runtime venv's python links to the build stage's interpreter: the same image.
    assert build.base == runtime.base == "${PYTHON_IMAGE}"
    assert build.name == "build"


def test_the_build_copies_what_the_wheel_holds_from_paths_that_exist() -> None:
    _, (build, _) = _parse()
    sources = _copy_sources(build)
    project = _pyproject()
    packages = project["tool"]["setuptools"]["packages"]["find"]["include"]  # type: ignore[index]
    readme = project["project"]["readme"]  # type: ignore[index]

    assert sorted(s for s in sources if (ROOT / s).is_dir()) == sorted(p.rstrip("*") for p in packages)
    assert {"pyproject.toml", readme} <= set(sources)
    assert [s for s in sources if not (ROOT / s).exists()] == []
    assert [s for s in sources if not _in_context(s)] == [], ".dockerignore keeps these out of the context"


def test_the_context_leaves_out_the_development_trees() -> None:
    assert not any(_in_context(path) for path in (".venv", ".cache", ".git", "tests", "bench", "docs"))


def test_the_install_is_the_runtime_dependencies_only() -> None:
    _, (build, _) = _parse()
    (run,) = build.all("RUN")
    installs = re.findall(r"pip install ([^&]*)", run)

    assert [i.split() for i in installs] == [["--no-cache-dir", "."]]  # no extra, not editable
    assert "pip uninstall --yes pip setuptools" in run  # nor the installer, in the image


def test_the_runtime_stage_runs_unprivileged_with_a_health_check() -> None:
    _, (_, runtime) = _parse()
    (user,) = runtime.all("USER")
    (healthcheck,) = runtime.all("HEALTHCHECK")
    (env,) = runtime.all("ENV")
    (entrypoint,) = runtime.all("ENTRYPOINT")

    assert user not in ("root", "0")
    assert _copy_sources(runtime) == []  # only the build stage's venv is copied in
    assert runtime.all("COPY") == ["--from=build /opt/sluice /opt/sluice"]
    assert "SLUICE_HEALTHCHECK_URL" in healthcheck.partition("CMD")[2]
    # The default probe is the gateway's own liveness route on its default port.
    url = re.search(r"SLUICE_HEALTHCHECK_URL=(\S+)", env)
    assert url is not None
    assert url.group(1) == f"http://127.0.0.1:{ServerSettings().port}/healthz"
    assert json.loads(entrypoint) == ["sluice"]
