"""Keys issued, listed and revoked without a restart, kept in the keys file.

A real gateway (aiohttp) with ``tenants.keys_file``: a key issued through the admin API opens
the gateway at once and is in the file as a hash; listing shows ids and prefixes, never a secret
or a hash; a revoked key is a 401 at once and gone from the file; the file still loads as
configuration; ``sluice keys`` does the same round trip from the command line.
"""

from __future__ import annotations

import asyncio
import io
import logging
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli import main
from gateway.config.load import load_settings
from gateway.config.settings import Settings
from gateway.keys import STORE
from gateway.tenants import Authenticator, apply_keys_file, hash_api_key
from tests.unit.tenancy.conftest import KEY_A, Scripted, StartTenantGateway, tenancy_settings

HAND_KEY = "sk-hand-written-team-a-51c2"


def with_keys_file(path: Path) -> Any:
    def settings(url: str) -> Settings:
        path.write_text(f"team-a: ['{hash_api_key(HAND_KEY)}']\n")
        base = tenancy_settings(url)
        tenants = base.tenants.model_copy(update={"keys_file": str(path)})
        merged = tenants.model_copy(
            update={
                "tenants": {
                    **tenants.tenants,
                    "team-a": tenants.tenants["team-a"].model_copy(
                        update={"api_keys": [hash_api_key(KEY_A), hash_api_key(HAND_KEY)]}
                    ),
                }
            }
        )
        return base.model_copy(update={"tenants": merged})

    return settings


async def _json(resp: Any, status: int) -> Any:
    assert resp.status == status, await resp.text()
    return await resp.json()


async def test_issue_use_list_and_revoke_a_key_in_the_keys_file(
    start_tenant_gateway: StartTenantGateway, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys_file = tmp_path / "keys.yaml"
    gw = await start_tenant_gateway(Scripted().answer, settings=with_keys_file(keys_file))
    caplog.set_level(logging.INFO, logger="sluice.keys")

    resp = await gw.client.post("/sluice/v1/tenants/team-a/keys")
    issued = await _json(resp, 201)
    secret = issued["secret"]
    assert resp.headers["Cache-Control"] == "no-store"
    assert secret.startswith("sk-sluice-")
    assert len(secret) > 40
    assert issued["prefix"] == secret[:14]
    assert (issued["tenant"], issued["source"]) == ("team-a", "keys_file")
    assert (await gw.post(key=secret)).status == 200  # at once, no reload

    text = keys_file.read_text()
    assert secret not in text
    assert hash_api_key(secret) in text
    listed = (await _json(await gw.client.get("/sluice/v1/tenants/team-a/keys"), 200))["data"]
    by_id = {k["id"]: k for k in listed}
    assert by_id[issued["id"]]["prefix"] == issued["prefix"]
    assert {k["source"] for k in listed} == {"config", "keys_file"}
    assert [k["prefix"] for k in listed if k["source"] == "config"] == [None]
    assert len(listed) == 3  # KEY_A (YAML), HAND_KEY (keys file), the issued one
    flat = str(listed)
    assert secret not in flat
    assert "sha256:" not in flat
    assert "secret" not in flat

    gone = await _json(await gw.client.delete(f"/sluice/v1/tenants/team-a/keys/{issued['id']}"), 200)
    assert gone == {"id": issued["id"], "object": "api_key", "deleted": True}
    assert (await gw.post(key=secret)).status == 401
    assert hash_api_key(secret) not in keys_file.read_text()
    assert hash_api_key(HAND_KEY) in keys_file.read_text()
    again = await _json(await gw.client.delete(f"/sluice/v1/tenants/team-a/keys/{issued['id']}"), 404)
    assert again["error"]["code"] == "key_not_found"

    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert f"issued: tenant=team-a id={issued['id']}" in logged
    assert f"revoked: tenant=team-a id={issued['id']}" in logged
    assert secret not in logged
    assert hash_api_key(secret) not in logged


async def test_a_hand_written_file_key_can_be_revoked_a_yaml_key_cannot(
    start_tenant_gateway: StartTenantGateway, tmp_path: Path
) -> None:
    gw = await start_tenant_gateway(Scripted().answer, settings=with_keys_file(tmp_path / "keys.yaml"))
    listed = (await _json(await gw.client.get("/sluice/v1/tenants/team-a/keys"), 200))["data"]
    hand = next(k for k in listed if k["source"] == "keys_file")
    configured = next(k for k in listed if k["source"] == "config")

    refused = await _json(await gw.client.delete(f"/sluice/v1/tenants/team-a/keys/{configured['id']}"), 409)
    assert refused["error"]["code"] == "key_not_revocable"
    assert (await gw.post(key=KEY_A)).status == 200
    assert (await gw.post(key=HAND_KEY)).status == 200
    await _json(await gw.client.delete(f"/sluice/v1/tenants/team-a/keys/{hand['id']}"), 200)
    assert (await gw.post(key=HAND_KEY)).status == 401


async def test_without_a_keys_file_issuing_says_what_to_set(start_tenant_gateway: StartTenantGateway) -> None:
    gw = await start_tenant_gateway(Scripted().answer)
    body = await _json(await gw.client.post("/sluice/v1/tenants/team-a/keys"), 409)
    assert body["error"]["code"] == "keys_not_writable"
    assert "tenants.keys_file" in body["error"]["message"]
    unknown = await _json(await gw.client.post("/sluice/v1/tenants/team-z/keys"), 404)
    assert unknown["error"]["code"] == "tenant_not_found"


async def test_the_rewritten_keys_file_loads_as_configuration(
    start_tenant_gateway: StartTenantGateway, tmp_path: Path
) -> None:
    keys_file = tmp_path / "keys.yaml"
    gw = await start_tenant_gateway(Scripted().answer, settings=with_keys_file(keys_file))
    secret = (await _json(await gw.client.post("/sluice/v1/tenants/team-a/keys"), 201))["secret"]
    config = tmp_path / "sluice.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "replicas": [{"name": "r0", "url": "http://127.0.0.1:8000"}],
                "tenants": {"keys_file": "keys.yaml", "tenants": {"team-a": {}, "team-b": {}}},
            }
        )
    )
    auth = Authenticator(load_settings(config).tenants)
    assert getattr(auth.authenticate(f"Bearer {secret}"), "name", None) == "team-a"
    assert getattr(auth.authenticate(f"Bearer {HAND_KEY}"), "name", None) == "team-a"


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


async def test_sluice_keys_round_trip(start_tenant_gateway: StartTenantGateway, tmp_path: Path) -> None:
    gw = await start_tenant_gateway(Scripted().answer, settings=with_keys_file(tmp_path / "keys.yaml"))
    url = str(gw.client.make_url("/")).rstrip("/")

    code, out, err = await asyncio.to_thread(_cli, "keys", "issue", "--tenant", "team-a", "--url", url)
    secret = out.strip()
    assert (code, out.count("\n")) == (0, 1)
    assert secret.startswith("sk-sluice-")
    assert "shown only this once" in err
    assert (await gw.post(key=secret)).status == 200
    key_id = err.split()[1]

    code, out, _ = await asyncio.to_thread(_cli, "keys", "list", "--url", url)
    assert code == 0
    assert key_id in out
    assert secret[:14] in out
    assert secret not in out

    code, _, err = await asyncio.to_thread(_cli, "keys", "revoke", "--tenant", "team-a", key_id, "--url", url)
    assert code == 0, err
    assert (await gw.post(key=secret)).status == 401
    code, _, err = await asyncio.to_thread(_cli, "keys", "revoke", "--tenant", "team-a", key_id, "--url", url)
    assert code == 1
    assert "404" in err
    assert "has no key" in err


async def test_a_keys_file_broken_by_hand_is_a_409_not_a_crash(
    start_tenant_gateway: StartTenantGateway, tmp_path: Path
) -> None:
    keys_file = tmp_path / "keys.yaml"
    gw = await start_tenant_gateway(Scripted().answer, settings=with_keys_file(keys_file))
    keys_file.write_text("team-a: ['sk-a-plaintext-key-pasted-here']\n")

    for resp in (
        await gw.client.post("/sluice/v1/tenants/team-a/keys"),
        await gw.client.get("/sluice/v1/tenants/team-a/keys"),
    ):
        body = await _json(resp, 409)
        assert body["error"]["code"] == "keys_file_invalid"
        assert "sk-a-plaintext" not in body["error"]["message"]
    assert "sk-a-plaintext-key-pasted-here" in keys_file.read_text()  # left as it was


async def test_a_reload_keeps_issued_keys_open_and_revoked_ones_closed(
    start_tenant_gateway: StartTenantGateway, tmp_path: Path
) -> None:
    keys_file = tmp_path / "keys.yaml"
    gw = await start_tenant_gateway(Scripted().answer, settings=with_keys_file(keys_file))
    secret = (await _json(await gw.client.post("/sluice/v1/tenants/team-a/keys"), 201))["secret"]
    listed = (await _json(await gw.client.get("/sluice/v1/tenants/team-a/keys"), 200))["data"]
    hand = next(k for k in listed if k["source"] == "keys_file" and k["prefix"] is None)
    await _json(await gw.client.delete(f"/sluice/v1/tenants/team-a/keys/{hand['id']}"), 200)

    store = gw.app[STORE]
    current = store.current
    bare = current.tenants.model_copy(
        update={
            "tenants": {
                **current.tenants.tenants,
                "team-a": current.tenants.tenants["team-a"].model_copy(
                    update={"api_keys": [hash_api_key(KEY_A)]}
                ),
            }
        }
    )
    store.swap(current.model_copy(update={"tenants": apply_keys_file(bare)}))  # what a reload loads

    assert (await gw.post(key=secret)).status == 200
    assert (await gw.post(key=HAND_KEY)).status == 401
    assert (await gw.post(key=KEY_A)).status == 200
