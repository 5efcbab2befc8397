"""The API end to end, through the generated Python client and raw HTTP,
against a real capybara-api process and SQLite store."""

import json
import time

import pytest
import requests

import capybara_client as cc
from capybara_client.exceptions import ApiException
from conftest import make_token

PROBLEM = "application/problem+json"


def register(admin, name="web1", **kw):
    # One data address per name: two servers cannot share one (409).
    body = {"name": name, "mgmt_addr": "10.0.1.11:7000",
            "data_addr": f"10.0.2.{1 + sum(name.encode()) % 250}"}
    body.update(kw)
    return cc.ServersApi(admin).register_server(cc.ServerRegistration(**body))


def problem(resp):
    assert resp.headers["content-type"].startswith(PROBLEM), resp.headers
    body = resp.json()
    assert body["status"] == resp.status_code
    assert body["type"] and body["title"]
    return body


def h(token):
    return {"Authorization": f"Bearer {token}"}


def test_health_ready_metrics(server):
    assert requests.get(f"{server.url}/healthz", timeout=5).json()["status"] == "ok"
    assert requests.get(f"{server.url}/readyz", timeout=5).json()["store"] == "sqlite"
    m = requests.get(f"{server.url}/metrics", timeout=5)
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    for family in ["capybara_migrations_total", "capybara_migration_phase_seconds_bucket",
                   "capybara_store_up", "capybara_api_requests_total", "capybara_control_plane_live 0"]:
        assert family in m.text


def test_auth_missing_bad_and_roles(server, admin):
    r = requests.get(f"{server.url}/v1/servers", timeout=5)
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    problem(r)
    r = requests.get(f"{server.url}/v1/servers", headers=h("capy_" + "0" * 64), timeout=5)
    assert r.status_code == 401
    problem(r)
    viewer = make_token(server, "viewer", "v1")
    operator = make_token(server, "operator", "o1")
    register(admin)
    assert requests.get(f"{server.url}/v1/servers", headers=h(viewer), timeout=5).status_code == 200
    r = requests.post(f"{server.url}/v1/servers/1/drain", json={}, headers=h(viewer), timeout=5)
    assert r.status_code == 403
    assert "operator" in problem(r)["detail"]
    r = requests.get(f"{server.url}/v1/tokens", headers=h(operator), timeout=5)
    assert r.status_code == 403
    r = requests.post(f"{server.url}/v1/services", json={"name": "x", "vip": "10.0.0.1", "port": 80, "pool": []},
                      headers=h(operator), timeout=5)
    assert r.status_code == 403


def test_tokens_hashed_listed_revoked(server, admin):
    api = cc.TokensApi(admin)
    t = api.create_token(cc.TokenRequest(name="ci", role="operator"))
    assert t.secret.startswith("capy_") and len(t.secret) == 69
    listed = api.list_tokens().items
    assert {x.name for x in listed} >= {"bootstrap", "ci"}
    assert "secret" not in json.dumps([x.to_dict() for x in listed])
    assert requests.get(f"{server.url}/v1/policy", headers=h(t.secret), timeout=5).status_code == 200
    api.revoke_token(t.id)
    assert requests.get(f"{server.url}/v1/policy", headers=h(t.secret), timeout=5).status_code == 401
    with pytest.raises(ApiException) as e:
        api.create_token(cc.TokenRequest(name="bootstrap", role="viewer"))
    assert e.value.status == 409
    boot = next(x for x in listed if x.name == "bootstrap")
    r = requests.delete(f"{server.url}/v1/tokens/{boot.id}", headers=h(server.admin_token), timeout=5)
    assert r.status_code == 409  # last admin
    problem(r)


def test_register_validation_names_field(server, admin):
    s = register(admin)
    assert s.id == 1 and s.state == "active" and s.weight == 100
    assert s.stats.data_source == "store" and s.stats.load_pps is None
    url = f"{server.url}/v1/servers"
    cases = [
        ({"name": "bad name!", "mgmt_addr": "10.0.1.1:1", "data_addr": "10.0.2.1"}, "name"),
        ({"name": "a", "mgmt_addr": "nope", "data_addr": "10.0.2.1"}, "mgmt_addr"),
        ({"name": "a", "mgmt_addr": "10.0.1.1:1", "data_addr": "300.1.1.1"}, "data_addr"),
        ({"name": "a", "mgmt_addr": "10.0.1.1:1", "data_addr": "10.0.2.1", "weight": 70000}, "weight"),
        ({"name": "a", "mgmt_addr": "10.0.1.1:1", "data_addr": "10.0.2.1", "weight": "x"}, "weight"),
        ({"name": "a", "mgmt_addr": "10.0.1.1:1"}, "data_addr"),
        ({"name": "a", "mgmt_addr": "10.0.1.1:1", "data_addr": "10.0.2.1", "color": 1}, "color"),
        ({"name": "a", "mgmt_addr": "10.0.1.1:1", "data_addr": "10.0.2.1", "id": 0}, "id"),
    ]
    for body, field in cases:
        r = requests.post(url, json=body, headers=h(server.admin_token), timeout=5)
        assert r.status_code == 422, (body, r.text)
        assert problem(r)["field"] == field, (body, r.text)
    r = requests.post(url, data="{not json", headers={**h(server.admin_token), "Content-Type": "application/json"}, timeout=5)
    assert r.status_code == 400
    r = requests.post(url, data="x=1", headers={**h(server.admin_token), "Content-Type": "text/plain"}, timeout=5)
    assert r.status_code == 415
    r = requests.post(url, json={"name": "web1", "mgmt_addr": "10.0.1.1:1", "data_addr": "10.0.2.1"},
                      headers=h(server.admin_token), timeout=5)
    assert r.status_code == 409
    big = {"name": "a", "mgmt_addr": "10.0.1.1:1", "data_addr": "10.0.2.1", "pad": "x" * 70000}
    r = requests.post(url, json=big, headers=h(server.admin_token), timeout=5)
    assert r.status_code == 413
    problem(r)
    for path in ["/v1/servers/abc", "/v1/servers/0", "/v1/servers/99999999999"]:
        r = requests.get(server.url + path, headers=h(server.admin_token), timeout=5)
        assert r.status_code == 400 and problem(r)["field"] == "server_id"
    r = requests.get(server.url + "/v1/servers/7", headers=h(server.admin_token), timeout=5)
    assert r.status_code == 404
    r = requests.delete(server.url + "/v1/policy", headers=h(server.admin_token), timeout=5)
    assert r.status_code == 405 and "GET" in r.headers["allow"]
    problem(r)
    r = requests.get(server.url + "/v1/nothing", headers=h(server.admin_token), timeout=5)
    assert r.status_code == 404
    problem(r)


def test_weight_and_services(server, admin):
    register(admin, "web1")
    register(admin, "web2")
    s = cc.ServersApi(admin).set_server_weight(2, cc.WeightUpdate(weight=0))
    assert s.weight == 0
    svc_api = cc.ServicesApi(admin)
    svc = svc_api.create_service(cc.Service(name="web", vip="10.0.0.100", port=80, pool=[1, 2]))
    assert svc.pool == [1, 2]
    assert [x.name for x in svc_api.list_services().items] == ["web"]
    r = requests.post(f"{server.url}/v1/services", json={"name": "db", "vip": "10.0.0.101", "port": 5432, "pool": [1, 9]},
                      headers=h(server.admin_token), timeout=5)
    assert r.status_code == 422 and problem(r)["field"] == "pool[1]"
    r = requests.post(f"{server.url}/v1/services", json={"name": "web2", "vip": "10.0.0.100", "port": 80, "pool": []},
                      headers=h(server.admin_token), timeout=5)
    assert r.status_code == 409
    svc = svc_api.update_service("web", cc.ServiceUpdate(vip="10.0.0.100", port=8080, pool=[2]))
    assert svc.port == 8080
    svc_api.delete_service("web")
    with pytest.raises(ApiException) as e:
        svc_api.get_service("web")
    assert e.value.status == 404


def test_policy_get_patch_put_validation(server, admin):
    api = cc.PolicyApi(admin)
    p = api.get_policy()
    assert p.placement == "maglev"
    p2 = api.patch_policy(cc.PolicyPatch(proactive_threshold_pct=25.0, target_selection="least_loaded"))
    assert p2.proactive_threshold_pct == 25.0 and p2.target_selection == "least_loaded"
    url = f"{server.url}/v1/policy"
    for body, field in [
        ({"hysteresis_pct": 50}, "hysteresis_pct"),
        ({"heartbeat_interval_ms": 1000, "dead_after_ms": 1500}, "dead_after_ms"),
        ({"proactive_threshold_pct": -1}, "proactive_threshold_pct"),
        ({"placement": "random"}, "placement"),
        ({"bogus": 1}, "bogus"),
        ({"reactive_backlog_threshold": -5}, "reactive_backlog_threshold"),
    ]:
        r = requests.patch(url, json=body, headers=h(server.admin_token), timeout=5)
        assert r.status_code == 422, (body, r.text)
        assert problem(r)["field"] == field, (body, r.text)
    full = api.get_policy().to_dict()
    del full["buffer_mode"]
    r = requests.put(url, json=full, headers=h(server.admin_token), timeout=5)
    assert r.status_code == 422 and problem(r)["field"] == "buffer_mode"
    full["buffer_mode"] = "drop"
    assert requests.put(url, json=full, headers=h(server.admin_token), timeout=5).json()["buffer_mode"] == "drop"


def wait_drain(api, sid, want, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        d = api.get_drain(sid)
        if d.state == want:
            return d
        time.sleep(0.1)
    raise AssertionError(f"drain of {sid} did not reach {want}: {d}")


def test_drain_undrain_and_state_survives_restart(server, admin):
    register(admin, "web1")
    register(admin, "web2")
    api = cc.ServersApi(admin)
    d = api.drain_server(1, cc.DrainRequest(deadline_seconds=5, mode="migrate"))
    assert d.state in ("running", "completed") and d.mode == "migrate"
    wait_drain(api, 1, "completed")
    assert api.get_server(1).state == "drained"
    with pytest.raises(ApiException) as e:
        api.get_drain(2)
    assert e.value.status == 404
    r = requests.post(f"{server.url}/v1/servers/1/drain", json={"deadline_seconds": 0},
                      headers=h(server.admin_token), timeout=5)
    assert r.status_code == 422 and problem(r)["field"] == "deadline_seconds"
    r = requests.post(f"{server.url}/v1/servers/1/drain", json={"mode": "gentle"}, headers=h(server.admin_token), timeout=5)
    assert r.status_code == 422 and problem(r)["field"] == "mode"
    server.restart()
    with server.client() as c:
        api = cc.ServersApi(c)
        assert api.get_server(1).state == "drained"
        assert api.get_drain(1).state == "completed"
        assert api.undrain_server(1).state == "active"
        # the token survived the restart too, and the audit log
        entries = cc.AuditApi(c).list_audit(limit=1000).items
        actions = [e.action for e in entries]
        assert actions.count("server.register") == 2
        assert "server.drain" in actions and "server.undrain" in actions
        assert all(e.actor.startswith("bootstrap") for e in entries)


def test_connections_and_migrations(server, admin):
    register(admin)
    page = cc.ConnectionsApi(admin).list_connections(server=1)
    assert page.items == [] and page.total == 0 and page.data_source == "store"
    r = requests.post(f"{server.url}/v1/connections/192.0.2.1:5000-10.0.0.100:80/migrate", json={"target": 1},
                      headers=h(server.admin_token), timeout=5)
    assert r.status_code == 404
    problem(r)
    assert cc.MigrationsApi(admin).list_migrations().items == []


def test_audit_records_who_what_when(server, admin):
    op = make_token(server, "operator", "alice")
    before = int(time.time() * 1000) - 1000
    r = requests.patch(f"{server.url}/v1/policy", json={"connection_cooldown_ms": 2000}, headers=h(op), timeout=5)
    assert r.status_code == 200
    entries = cc.AuditApi(admin).list_audit().items
    e = [x for x in entries if x.action == "policy.update"][-1]
    assert e.actor.startswith("alice")
    assert e.at_unix_ms >= before
    assert e.detail["changed"]["connection_cooldown_ms"] == {"old": 1000, "new": 2000}
    tok = [x for x in entries if x.action == "token.create"][-1]
    assert "capy_" not in json.dumps(tok.detail)


def test_sse_stream_delivers_policy_and_drain_events(server, admin):
    register(admin)
    url = f"{server.url}/v1/events?types=policy,drain&access_token={server.admin_token}"
    with requests.get(url, stream=True, timeout=10) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines(decode_unicode=True)
        assert next(lines).startswith(":")  # connected comment
        cc.PolicyApi(admin).patch_policy(cc.PolicyPatch(hysteresis_pct=3.0))
        cc.ServersApi(admin).drain_server(1, cc.DrainRequest(deadline_seconds=5))
        seen = {}
        deadline = time.monotonic() + 10
        event = None
        for line in lines:
            if time.monotonic() > deadline:
                break
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event:
                seen.setdefault(event, []).append(json.loads(line[6:]))
                if "policy" in seen and any(d["state"] == "completed" for d in seen.get("drain", [])):
                    break
        assert seen["policy"][0]["hysteresis_pct"] == 3.0
        assert any(d["state"] == "completed" and d["server"] == 1 for d in seen["drain"])
    r = requests.get(f"{server.url}/v1/events?types=nope", headers=h(server.admin_token), timeout=5)
    assert r.status_code == 400
    assert requests.get(f"{server.url}/v1/events", timeout=5).status_code == 401


def test_load_events_arrive(server, admin):
    register(admin)
    with requests.get(f"{server.url}/v1/events?types=load", headers=h(server.admin_token), stream=True, timeout=10) as r:
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("data: "):
                d = json.loads(line[6:])
                assert d["data_source"] == "store"
                assert d["servers"] == [{"id": 1, "connections": 0, "load_pps": None}]
                break


def test_whoami_names_the_callers_token_and_role(server, admin):
    for role in ["viewer", "operator", "admin"]:
        secret = make_token(server, role, f"who-{role}")
        r = requests.get(f"{server.url}/v1/whoami", headers=h(secret), timeout=5)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["name"] == f"who-{role}" and body["role"] == role and body["revoked"] is False
        assert "secret" not in body
    r = requests.get(f"{server.url}/v1/whoami", timeout=5)
    assert r.status_code == 401
    problem(r)
    me = cc.TokensApi(admin).whoami()
    assert me.role == "admin"
