"""The configurations of the overhead bench: how each is installed, configured, started and stopped.

Each configuration is a real process (or none, for ``direct``) in front of the same fake backend:

* ``direct``: the backend itself;
* ``nginx``: ``proxy_pass`` to an upstream with keep-alive, ``proxy_buffering off`` (SSE relayed
  as it comes), one worker, its default access log on (to a file);
* ``vllm-router``: the Rust router from PyPI, ``round_robin`` over the one backend;
* ``litellm``: LiteLLM's proxy, one worker, per-key ``rpm_limit``/``tpm_limit`` from a
  ``custom_auth`` module (virtual keys need Postgres), the limiter's counters in Redis
  (``cache: true`` with ``supported_call_types: []``: nothing cached, counters shared);
* ``bare``: ``bench/overhead/bare.py``, a pass-through aiohttp proxy (the "bare" baseline);
* ``floor``: ``bench/overhead/floor.py``, the bare proxy plus the least of the work Sluice's
  everything-on list asks for (an API key, one Redis token bucket reserved and settled, a counter
  and a histogram, an access line; no predictions): what that work costs with these libraries
  when done as cheaply as it can be (its Redis calls on Sluice's pipelined connection), a floor
  under Sluice's cost; ``floor-redis-py``: the same with redis-py's ``Script`` call, as a gateway
  written on redis-py alone would make it;
* ``sluice``: ``sluice serve`` with everything on: API keys, Redis token buckets, the SLO
  admission with predictions (a hardware prior and the backend's scraped ``/metrics``),
  prediction headers, ``/metrics`` and the access log;
* ``sluice-lean``: ``sluice serve`` with no tenants (no keys, no limits, no Redis),
  ``admit_all``, no prediction headers and no access log (health checks, scrapes and ``/metrics``
  still run): how much of the cost is the proxy itself and how much the features.

Peers come from the registries into ignored folders under ``.cache/bench/overhead/`` (their own
venvs), or, for nginx, the Debian package ``nginx-light`` installed with apt only when no nginx is
on the PATH. A peer that cannot be installed or started is reported as unavailable with its
error; nothing is faked.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.shared import merge_settings
from gateway.tenants import hash_api_key
from tests.support.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "bench" / "overhead"
LITELLM_VERSION = "1.108.7"
ROUTER_VERSION = "0.1.17"
API_KEY = "sk-bench-overhead-7f3a"
#: Budgets the load never reaches, for Sluice's tenant and LiteLLM's key alike.
ROOMY_SLUICE = {"tokens_per_minute": 1.0e12, "requests_per_minute": 1.0e9, "max_concurrent": 100_000}
ROOMY_RPM, ROOMY_TPM = 1_000_000_000, 1_000_000_000_000

#: Every configuration, in the order of the tables.
ALL = (
    "direct",
    "nginx",
    "vllm-router",
    "litellm",
    "bare",
    "floor",
    "floor-redis-py",
    "sluice-lean",
    "sluice",
)


class Unavailable(RuntimeError):
    """A configuration could not be installed or started here; the message says why."""


@dataclass
class Layout:
    """Where things run: CPU sets for the proxy under test and for the rest, and shared parts."""

    proxy_cpus: str | None
    load_cpus: str | None
    work: Path
    backend_url: str
    redis_url: str
    redis_port: int


@dataclass
class Target:
    """A running configuration: base URL, the process whose tree's CPU is counted, version."""

    name: str
    url: str
    pid: int | None
    version: str
    headers: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None


def pinned(cpus: str | None, args: Sequence[str]) -> list[str]:
    """``args`` under ``taskset -c cpus`` (unchanged when ``cpus`` is None)."""
    return ["taskset", "-c", cpus, *args] if cpus else list(args)


def pin_all_threads(pid: int, cpus: str | None) -> None:
    """Pin every thread of ``pid`` to ``cpus`` (``taskset -a -p``); nothing when ``cpus`` is None."""
    if cpus:
        subprocess.run(["taskset", "-a", "-c", "-p", cpus, str(pid)], check=True, capture_output=True)


def start(
    args: Sequence[str], log: Path, env: Mapping[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.Popen[bytes]:
    """Start ``args`` in its own session, output to ``log``."""
    with log.open("ab") as out:
        return subprocess.Popen(
            list(args),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
        )


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM, then SIGKILL to the process group if it lingers."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait(5)


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 90.0) -> None:
    """Poll ``url`` until it answers 200; ``Unavailable`` with the log's tail otherwise."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise Unavailable(f"exited with {proc.returncode}: {tail(log)}")
        with (
            contextlib.suppress(OSError, urllib.error.URLError),
            urllib.request.urlopen(url, timeout=2.0) as r,
        ):
            if r.status == 200:
                return
        time.sleep(0.2)
    raise Unavailable(f"{url} not ready after {timeout_s:g} s: {tail(log)}")


def start_ready(
    layout: Layout,
    args: Sequence[str],
    log: Path,
    port: int,
    ready_path: str,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path = ROOT,
    timeout_s: float = 90.0,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``args`` pinned to the proxy's CPUs and wait until ``ready_path`` answers 200 on
    ``port``; (the process, its base URL). Stopped again, and ``Unavailable`` raised, if it never
    does."""
    proc = start(pinned(layout.proxy_cpus, args), log, env=env, cwd=cwd)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url + ready_path, proc, log, timeout_s=timeout_s)
    except Unavailable:
        stop(proc)
        raise
    return proc, url


def tail(log: Path, lines: int = 15) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    return " | ".join(text.strip().splitlines()[-lines:])


# -- installs -----------------------------------------------------------------------------------------
def install_venv(name: str, requirements: Sequence[str], check: str, version: str) -> Path:
    """A venv under ``CACHE/name`` with ``requirements`` installed (once); its ``bin`` folder."""
    venv = CACHE / name
    python = venv / "bin" / "python"
    if python.exists() and _dist_version(python, check) == version:
        return venv / "bin"
    CACHE.mkdir(parents=True, exist_ok=True)
    log = CACHE / f"{name}-install.log"
    with log.open("wb") as out:
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, stdout=out, stderr=out)
        done = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", *requirements], stdout=out, stderr=out, check=False
        )
    if done.returncode != 0 or _dist_version(python, check) != version:
        raise Unavailable(f"pip install {' '.join(requirements)} failed: {tail(log, 5)}")
    return venv / "bin"


def _dist_version(python: Path, dist: str) -> str | None:
    done = subprocess.run(
        [str(python), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() if done.returncode == 0 else None


def install_litellm() -> Path:
    return install_venv(
        "litellm", [f"litellm[proxy]=={LITELLM_VERSION}", "prometheus_client"], "litellm", LITELLM_VERSION
    )


def install_router() -> Path:
    return install_venv("router", [f"vllm-router=={ROUTER_VERSION}"], "vllm-router", ROUTER_VERSION)


def install_nginx() -> tuple[str, str]:
    """(path of the nginx binary, what was done): the one on PATH, else ``apt-get install nginx-light``."""
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if found:
        return found, "found on the machine"
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise Unavailable(
            "nginx is not installed and apt-get cannot run here (needs root): apt-get install nginx-light"
        )
    log = CACHE / "nginx-install.log"
    CACHE.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        done = subprocess.run(
            ["apt-get", "install", "-y", "--no-install-recommends", "nginx-light"],
            stdout=out,
            stderr=out,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
            check=False,
        )
    found = shutil.which("nginx", path="/usr/sbin:/usr/local/sbin:/usr/bin")
    if done.returncode != 0 or not found:
        raise Unavailable(f"apt-get install nginx-light failed: {tail(log, 5)}")
    return found, "apt-get install nginx-light (by this bench)"


def version_line(args: Sequence[str]) -> str:
    done = subprocess.run(list(args), capture_output=True, text=True, check=False)
    return (done.stdout + done.stderr).strip().splitlines()[0] if (done.stdout + done.stderr).strip() else "?"


# -- starting each configuration ---------------------------------------------------------------------
def start_bare(layout: Layout) -> Target:
    port = free_port()
    log = layout.work / "bare.log"
    args = [
        sys.executable,
        "-m",
        "bench.overhead.bare",
        "--port",
        str(port),
        "--upstream",
        layout.backend_url,
    ]
    proc, url = start_ready(layout, args, log, port, "/health")
    import aiohttp

    return Target("bare", url, proc.pid, f"aiohttp {aiohttp.__version__} + uvloop", proc=proc, log=log)


def start_floor(layout: Layout, *, redis_client: str = "pipelined") -> Target:
    """``bench/overhead/floor.py`` with the bench's API key and its Redis; ``redis_client``:
    ``pipelined`` (``floor``) or ``redis-py`` (``floor-redis-py``)."""
    name = "floor" if redis_client == "pipelined" else f"floor-{redis_client}"
    port = free_port()
    log = layout.work / f"{name}.log"
    digest = hash_api_key(API_KEY).removeprefix("sha256:")
    args = [
        *(sys.executable, "-m", "bench.overhead.floor", "--port", str(port)),
        *("--upstream", layout.backend_url, "--redis-url", layout.redis_url, "--key-sha256", digest),
        *("--redis-client", redis_client),
    ]
    proc, url = start_ready(layout, args, log, port, "/health")
    import redis

    headers = {"Authorization": f"Bearer {API_KEY}"}
    via = (
        "Sluice's pipelined script calls" if redis_client == "pipelined" else f"redis-py {redis.__version__}"
    )
    version = f"bench/overhead/floor.py: bare + {via}"
    return Target(name, url, proc.pid, version, headers=headers, proc=proc, log=log)


def sluice_config(
    layout: Layout, port: int, *, lean: bool = False, patch: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Sluice with everything on (see the module doc); ``lean``: no tenants (no keys, no limits,
    no Redis), ``admit_all``, no prediction headers, no access log: what is left is the proxy with
    its health checks, scrapes and metrics, Sluice's floor. ``patch``: settings merged into the
    everything-on configuration (``merge_settings``), to take one feature's cost apart."""
    if lean:
        return {
            "server": {"host": "127.0.0.1", "port": port},
            "replicas": [{"name": "fake", "url": layout.backend_url, "backend": "vllm"}],
            "admission": {"policy": "admit_all", "expose_prediction_headers": False},
            "logging": {"level": "INFO", "access_log": False},
        }
    config: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port},
        "replicas": [
            {
                "name": "fake",
                "url": layout.backend_url,
                "backend": "vllm",
                "hardware": {
                    "gpu": "H100-SXM",
                    "model": "Llama-3-8B",
                    "max_num_seqs": 256,
                    "max_num_batched_tokens": 8192,
                },
            }
        ],
        "admission": {"policy": "slo", "expose_prediction_headers": True},
        "logging": {"level": "INFO", "access_log": True},
        "tenants": {"tenants": {"bench": {"api_keys": [hash_api_key(API_KEY)], "limits": ROOMY_SLUICE}}},
        # A roomy call timeout: on a shared machine a 50 ms (default) miss would make Sluice fail
        # open to local buckets for a second, and the bench would measure Sluice without Redis.
        "limits": {"backend": "redis", "redis": {"url": layout.redis_url, "timeout_s": 1.0}},
    }
    return merge_settings(config, patch or {})


def start_sluice(
    layout: Layout,
    *,
    lean: bool = False,
    tree: Path | None = None,
    name: str | None = None,
    patch: Mapping[str, Any] | None = None,
    launcher: Sequence[str] = (sys.executable, "-m", "gateway.cli"),
    env: Mapping[str, str] | None = None,
) -> Target:
    """``sluice serve`` from this checkout, or (``tree``) from another one, e.g. an exported
    commit for a before/after comparison inside one run (``--baseline-tree``); ``patch``: see
    ``sluice_config`` (``--variant``). ``launcher``: the command ``serve --config FILE`` follows
    (``bench.gc_pauses`` runs ``gateway.cli`` under a shim); ``env``: added to the environment."""
    name = name or ("sluice-lean" if lean else "sluice")
    port = free_port()
    config = layout.work / f"{name}.yaml"
    config.write_text(yaml.safe_dump(sluice_config(layout, port, lean=lean, patch=patch)))
    log = layout.work / f"{name}.log"
    args = [*launcher, "serve", "--config", str(config)]
    proc, url = start_ready(layout, args, log, port, "/readyz", env=env, cwd=tree or ROOT)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    version = _sluice_version() if tree is None else f"tree {tree}"
    return Target(name, url, proc.pid, version, headers=headers, proc=proc, log=log)


def _sluice_version() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=False
    )
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "gateway"], capture_output=True, text=True, cwd=ROOT, check=False
    )
    rev = done.stdout.strip() or "?"
    return f"git {rev}" + (" + uncommitted changes in gateway/" if dirty.stdout.strip() else "")


NGINX_CONF = """\
daemon off;
worker_processes 1;
{user}
pid {work}/nginx.pid;
error_log {work}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log {work}/nginx-access.log;
    client_body_temp_path {work}/nginx-body;
    proxy_temp_path {work}/nginx-proxy;
    fastcgi_temp_path {work}/nginx-fastcgi;
    uwsgi_temp_path {work}/nginx-uwsgi;
    scgi_temp_path {work}/nginx-scgi;
    upstream backend {{ server {backend}; keepalive 128; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_cache off;
        }}
    }}
}}
"""


def start_nginx(layout: Layout) -> Target:
    binary, how = install_nginx()
    port = free_port()
    conf = layout.work / "nginx.conf"
    user = "user root;" if os.geteuid() == 0 else ""
    backend = layout.backend_url.removeprefix("http://")
    conf.write_text(NGINX_CONF.format(user=user, work=layout.work, backend=backend, port=port))
    log = layout.work / "nginx.log"
    args = [binary, "-c", str(conf), "-e", str(layout.work / "nginx-error.log")]
    proc, url = start_ready(layout, args, log, port, "/health")
    version = version_line([binary, "-v"]).removeprefix("nginx version: ")
    return Target("nginx", url, proc.pid, f"{version} ({how})", proc=proc, log=log)


def start_router(layout: Layout) -> Target:
    bin_dir = install_router()
    port, metrics_port = free_port(), free_port()
    log = layout.work / "vllm-router.log"
    args = [
        str(bin_dir / "vllm-router"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        layout.backend_url,
        "--policy",
        "round_robin",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        "--log-level",
        "warning",
    ]
    path_env = {"PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}
    proc, url = start_ready(layout, args, log, port, "/health", env=path_env)
    return Target(
        "vllm-router", url, proc.pid, f"vllm-router {ROUTER_VERSION} (PyPI wheel)", proc=proc, log=log
    )


CUSTOM_AUTH = f'''\
"""Per-key limits for the overhead bench (LiteLLM's virtual keys need Postgres)."""
from fastapi import Request
from litellm.proxy._types import UserAPIKeyAuth


async def user_api_key_auth(request: Request, api_key: str) -> UserAPIKeyAuth:
    if api_key != "{API_KEY}":
        raise Exception("invalid api key")
    return UserAPIKeyAuth(api_key=api_key, rpm_limit={ROOMY_RPM}, tpm_limit={ROOMY_TPM})
'''


def litellm_config(layout: Layout) -> dict[str, Any]:
    from bench.overhead.backend import MODEL

    return {
        "model_list": [
            {
                "model_name": MODEL,
                "litellm_params": {
                    "model": f"openai/{MODEL}",
                    "api_base": layout.backend_url + "/v1",
                    "api_key": "sk-unused",
                },
            }
        ],
        "litellm_settings": {
            "cache": True,
            "cache_params": {
                "type": "redis",
                "host": "127.0.0.1",
                "port": layout.redis_port,
                "supported_call_types": [],
            },
            "drop_params": True,
            "telemetry": False,
        },
        # A master key must be set (else LiteLLM refuses to start); the bench never uses it.
        "general_settings": {
            "custom_auth": "custom_auth.user_api_key_auth",
            "master_key": "sk-" + secrets.token_hex(32),
        },
    }


def start_litellm(layout: Layout) -> Target:
    bin_dir = install_litellm()
    port = free_port()
    folder = layout.work / "litellm"
    folder.mkdir(exist_ok=True)
    (folder / "custom_auth.py").write_text(CUSTOM_AUTH)
    (folder / "config.yaml").write_text(yaml.safe_dump(litellm_config(layout)))
    log = layout.work / "litellm.log"
    args = [str(bin_dir / "litellm"), "--config", str(folder / "config.yaml")]
    args += ["--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    env = {
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_LOG": "ERROR",
        "LITELLM_TELEMETRY": "False",
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(folder),
    }
    ready = "/health/liveliness"
    proc, url = start_ready(layout, args, log, port, ready, env=env, cwd=folder, timeout_s=180.0)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return Target(
        "litellm", url, proc.pid, f"litellm[proxy] {LITELLM_VERSION}", headers=headers, proc=proc, log=log
    )


STARTERS: dict[str, Callable[[Layout], Target]] = {
    "nginx": start_nginx,
    "vllm-router": start_router,
    "litellm": start_litellm,
    "bare": start_bare,
    "floor": start_floor,
    "floor-redis-py": functools.partial(start_floor, redis_client="redis-py"),
    "sluice-lean": functools.partial(start_sluice, lean=True),
    "sluice": start_sluice,
}


@contextlib.contextmanager
def started(names: Sequence[str], layout: Layout) -> Iterator[tuple[dict[str, Target], dict[str, str]]]:
    """Start every configuration in ``names`` (but ``direct``); yields (running, unavailable: why)."""
    running: dict[str, Target] = {}
    failed: dict[str, str] = {}
    try:
        for name in names:
            if name == "direct":
                running[name] = Target("direct", layout.backend_url, None, "bench/overhead/backend.py")
                continue
            try:
                running[name] = STARTERS[name](layout)
            except (Unavailable, OSError, subprocess.CalledProcessError) as exc:
                failed[name] = str(exc)
        yield running, failed
    finally:
        for target in running.values():
            stop(target.proc)


def process_tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and every live descendant."""
    ticks = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    used: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(entry.name)] = int(fields[1])
        used[int(entry.name)] = (int(fields[11]) + int(fields[12])) / ticks
    tree, frontier = {pid}, [pid]
    while frontier:
        p = frontier.pop()
        for child, ppid in parent.items():
            if ppid == p and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(used.get(p, 0.0) for p in tree)
