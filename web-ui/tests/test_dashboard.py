"""The dashboard in a real headless browser against the real API server.

The API runs with its store-backed control plane (the switch is not wired to
the API yet): load is unknown (`load_pps: null`), there are no migrations,
and connection counts and drain progress come from the flow mappings in the
store. Where a test needs connections it writes those mappings the way
switchd's flow writer does (see `Api.put_flows` in conftest.py); when the lab
is wired in, replace that with real client traffic and add assertions on the
load chart and the migration feed.
"""
import re

import requests

from playwright.sync_api import Page, expect

from conftest import VIP, PORT, SERVERS, Api, api_behind_switchd

UNKNOWN_TOKEN = "capy_" + "0" * 64


def login(page: Page, api: Api, token: str | None = None):
    page.goto(api.url + "/")
    page.get_by_test_id("login-token").fill(token or api.token)
    page.get_by_test_id("login-submit").click()
    expect(page.get_by_test_id("stream-status")).to_have_attribute("data-status", "live")
    # The re-list that follows the stream opening has landed.
    expect(page.get_by_test_id("stream-status")).not_to_have_attribute("data-syncs", "0")


def test_login_then_three_servers_with_live_counts(page: Page, api: Api, shot):
    page.goto(api.url + "/")
    expect(page.get_by_test_id("login-form")).to_be_visible()
    shot(page, "01-login")

    # A well-formed but unknown token is rejected by the API (401).
    page.get_by_test_id("login-token").fill(UNKNOWN_TOKEN)
    page.get_by_test_id("login-submit").click()
    expect(page.get_by_test_id("login-error")).to_contain_text("rejected")
    shot(page, "02-login-rejected")

    login(page, api)
    for sid, name in ((1, "web-1"), (2, "web-2"), (3, "web-3")):
        card = page.get_by_test_id(f"server-card-{sid}")
        expect(card).to_be_visible()
        expect(page.get_by_test_id(f"server-name-{sid}")).to_have_text(name)
        expect(page.get_by_test_id(f"server-state-{sid}")).to_have_text("active")
        # Created through the API, no hostagent registered them: the card
        # says so instead of looking like a serving server.
        expect(page.get_by_test_id(f"server-liveness-{sid}")).to_have_text("never seen")
        expect(card).to_have_attribute("data-liveness", "never_seen")
        expect(page.get_by_test_id(f"server-connections-{sid}")).to_have_text("0")

    # Connections appear on the cards without a reload, from the `load`
    # events of the stream (every second).
    api.put_flows(1, [("192.0.2.1", 40000 + i) for i in range(2)], VIP, PORT)
    api.put_flows(2, [("192.0.2.2", 41000 + i) for i in range(4)], VIP, PORT)
    api.put_flows(3, [("192.0.2.3", 42000)], VIP, PORT)
    expect(page.get_by_test_id("server-connections-1")).to_have_text("2")
    expect(page.get_by_test_id("server-connections-2")).to_have_text("4")
    expect(page.get_by_test_id("server-connections-3")).to_have_text("1")
    # The API agrees.
    by_id = {s["id"]: s for s in api.get("/v1/servers")["items"]}
    assert [by_id[i]["stats"]["connections"] for i in (1, 2, 3)] == [2, 4, 1]

    # Charts: the connections chart has a series per server with samples;
    # load is unknown from the store-backed control plane, and the page says so.
    chart = page.get_by_test_id("chart-connections")
    expect(chart).to_have_attribute("data-series", "3")
    api.wait_for("connection samples", lambda: int(chart.get_attribute("data-points")) >= 6)
    expect(page.get_by_test_id("chart-load")).to_be_visible()
    expect(page.get_by_test_id("load-unknown")).to_be_visible()
    expect(page.get_by_test_id("data-source")).to_have_text("data: store")
    # No migrations without a data plane.
    expect(page.get_by_test_id("migration-feed")).to_have_attribute("data-rows", "0")
    shot(page, "03-overview")

    # The token survives a reload (sessionStorage).
    page.reload()
    expect(page.get_by_test_id("server-card-1")).to_be_visible()


def test_drain_shows_progress_then_undrain(page: Page, api: Api, shot):
    if api.get("/v1/servers/2")["stats"]["connections"] != 4:
        api.put_flows(2, [("192.0.2.2", 41000 + i) for i in range(4)], VIP, PORT)
    login(page, api)
    expect(page.get_by_test_id("server-connections-2")).to_have_text("4")

    page.get_by_test_id("drain-button-2").click()
    page.get_by_test_id("drain-deadline-2").fill("120")
    page.get_by_test_id("drain-mode-2").select_option("migrate")
    shot(page, "04-drain-form")
    page.get_by_test_id("drain-confirm-2").click()

    expect(page.get_by_test_id("server-state-2")).to_have_text("draining")
    progress = page.get_by_test_id("drain-progress-2")
    expect(progress).to_have_attribute("data-drain-state", "running")
    expect(page.get_by_test_id("drain-counts-2")).to_have_text(re.compile(r"4 remaining of 4"))
    drain = api.get("/v1/servers/2/drain")
    assert drain["state"] == "running" and drain["mode"] == "migrate"
    assert drain["progress"]["flows_total"] == 4
    shot(page, "05-draining")

    # Half the connections leave the server: progress moves live (drain events).
    assert api.move_flows(2, 1, 2) == 2
    expect(page.get_by_test_id("drain-counts-2")).to_have_text(re.compile(r"2 remaining of 4"))
    expect(progress).to_have_attribute("data-percent", "50")
    shot(page, "06-drain-half")

    # The rest leave: the drain completes and the server is drained.
    assert api.move_flows(2, 3, 2) == 2
    expect(page.get_by_test_id("server-state-2")).to_have_text("drained")
    expect(progress).to_have_attribute("data-drain-state", "completed")
    expect(progress).to_have_attribute("data-percent", "100")
    expect(page.get_by_test_id("server-connections-2")).to_have_text("0")
    assert api.get("/v1/servers/2")["state"] == "drained"
    assert api.get("/v1/servers/2/drain")["state"] == "completed"
    shot(page, "07-drained")

    page.get_by_test_id("undrain-button-2").click()
    expect(page.get_by_test_id("server-state-2")).to_have_text("active")
    expect(page.get_by_test_id("drain-button-2")).to_be_visible()
    assert api.get("/v1/servers/2")["state"] == "active"
    shot(page, "08-undrained")


def test_operator_weight_is_marked_and_cleared(page: Page, api: Api, shot):
    """A weight set in the dashboard is marked as the operator's, with the
    weight the server reports; Clear returns to that weight (DELETE
    /v1/servers/{id}/weight) and the mark goes."""
    before = api.get("/v1/servers/1")
    assert before["weight_source"] == "register", before
    login(page, api)
    expect(page.get_by_test_id("weight-operator-1")).to_have_count(0)
    page.get_by_test_id("server-weight-1").fill("40")
    page.get_by_test_id("weight-save-1").click()
    mark = page.get_by_test_id("weight-operator-1")
    expect(mark).to_contain_text(f"operator (reports {before['weight']})")
    s = api.get("/v1/servers/1")
    assert (s["weight"], s["weight_source"], s["register_weight"]) == (40, "operator", before["weight"])
    shot(page, "04b-operator-weight")

    page.get_by_test_id("weight-clear-1").click()
    expect(mark).to_have_count(0)
    expect(page.get_by_test_id("server-weight-1")).to_have_value(str(before["weight"]))
    s = api.get("/v1/servers/1")
    assert (s["weight"], s["weight_source"]) == (before["weight"], "register")


def test_policy_threshold_validated_and_saved(page: Page, api: Api, shot):
    before = api.get("/v1/policy")
    login(page, api)
    page.get_by_test_id("nav-policy").click()
    field = page.get_by_test_id("policy-field-proactive_threshold_pct")
    expect(field).to_have_value(re.compile(r"^\d"))
    # Every tunable of the spec has a field.
    for name in before:
        expect(page.get_by_test_id(f"policy-field-{name}")).to_be_visible()

    # Client-side validation mirrors the spec (exclusive minimum 0) and blocks the save.
    field.fill("0")
    expect(page.get_by_test_id("policy-error-proactive_threshold_pct")).to_contain_text("above 0")
    page.get_by_test_id("policy-save").click()
    expect(page.get_by_test_id("policy-status")).to_have_attribute("data-kind", "error")
    shot(page, "09-policy-invalid")
    assert api.get("/v1/policy") == before

    # Cross-field rule: hysteresis must stay below the threshold.
    field.fill(str(before["hysteresis_pct"]))
    expect(page.get_by_test_id("policy-error-hysteresis_pct")).to_contain_text("below")

    # Server-side validation: a client whose rules lag the server's (here the
    # request is rewritten on its way out) gets the real API's 422 problem,
    # and the dashboard shows it next to the field it names.
    def out_of_range(route):
        route.continue_(post_data='{"proactive_threshold_pct": 5000}')

    page.route("**/v1/policy", lambda route: out_of_range(route) if route.request.method == "PATCH" else route.continue_())
    field.fill("30")
    page.get_by_test_id("policy-save").click()
    expect(page.get_by_test_id("policy-error-proactive_threshold_pct")).to_contain_text("5000")
    expect(page.get_by_test_id("policy-status")).to_contain_text("422")
    shot(page, "10-policy-server-error")
    page.unroute("**/v1/policy")
    assert api.get("/v1/policy") == before

    new = before["proactive_threshold_pct"] + 7.5
    field.fill(str(new))
    expect(page.get_by_test_id("policy-error-proactive_threshold_pct")).to_have_count(0)
    page.get_by_test_id("policy-save").click()
    expect(page.get_by_test_id("policy-status")).to_have_attribute("data-kind", "ok")
    shot(page, "11-policy-saved")
    after = api.get("/v1/policy")
    assert after["proactive_threshold_pct"] == new
    assert {k: v for k, v in after.items() if k != "proactive_threshold_pct"} == {
        k: v for k, v in before.items() if k != "proactive_threshold_pct"
    }


def test_services_page_lists_vip_and_pool(page: Page, api: Api, shot):
    login(page, api)
    page.get_by_test_id("nav-services").click()
    row = page.get_by_test_id("service-row-web")
    expect(row).to_contain_text(f"{VIP}:{PORT}")
    for name in ("web-1", "web-2", "web-3"):
        expect(row).to_contain_text(name)
    shot(page, "12-services")

    # A pool member is deregistered while the form is open: the API rejects
    # the pool (422 naming `pool[1]`) and the form shows it next to the pool.
    api.req("POST", "/v1/servers", 201, json={"id": 5, "name": "web-5", "mgmt_addr": "10.0.1.15:7000", "data_addr": "10.0.2.15"})
    page.get_by_test_id("service-new").click()
    page.get_by_test_id("service-field-name").fill("api")
    page.get_by_test_id("service-field-vip").fill("10.0.0.101")
    page.get_by_test_id("service-field-port").fill("443")
    page.get_by_test_id("service-pool-1").check()
    page.get_by_test_id("service-pool-5").check()
    api.req("POST", "/v1/servers/5/drain", 202, json={"deadline_seconds": 5})
    api.wait_for("web-5 drained", lambda: api.get("/v1/servers/5")["state"] == "drained")
    api.req("DELETE", "/v1/servers/5", 204)
    expect(page.get_by_test_id("service-pool-label-5")).to_contain_text("not registered")
    page.get_by_test_id("service-save").click()
    expect(page.get_by_test_id("service-error-pool")).to_contain_text("server 5 is not registered")
    shot(page, "13-service-pool-rejected")

    # Without the removed server the service is created and listed live.
    page.get_by_test_id("service-pool-5").uncheck()
    page.get_by_test_id("service-save").click()
    expect(page.get_by_test_id("service-row-api")).to_contain_text("10.0.0.101:443")
    assert api.get("/v1/services/api")["pool"] == [1]

    # Deleting asks first and says what happens to the open connections;
    # dismissed, nothing is deleted; accepted, the row goes.
    asked = []

    def answer(accept):
        def on_dialog(d):
            asked.append(d.message)
            if accept:
                d.accept()
            else:
                d.dismiss()

        return on_dialog

    page.once("dialog", answer(False))
    page.get_by_test_id("service-delete-api").click()
    expect(page.get_by_test_id("service-row-api")).to_be_visible()
    assert api.get("/v1/services/api")["name"] == "api"
    page.once("dialog", answer(True))
    page.get_by_test_id("service-delete-api").click()
    expect(page.get_by_test_id("service-row-api")).to_have_count(0)
    assert len(asked) == 2, asked
    assert "Delete service api?" in asked[0], asked
    assert "open connections are kept until they end" in asked[0], asked
    api.req("GET", "/v1/services/api", 404)


def test_live_updates_without_reload(page: Page, api: Api, shot):
    """Changes made by someone else (here: the REST API) reach the open page through the event stream."""
    login(page, api)
    api.req("POST", "/v1/servers", 201, json={"id": 4, "name": "web-4", "mgmt_addr": "10.0.1.14:7000", "data_addr": "10.0.2.14"})
    expect(page.get_by_test_id("server-card-4")).to_be_visible()
    api.req("POST", "/v1/servers/4/drain", 202, json={"deadline_seconds": 30})
    expect(page.get_by_test_id("server-state-4")).to_have_text("drained")
    api.req("DELETE", "/v1/servers/4", 204)
    expect(page.get_by_test_id("server-card-4")).to_have_count(0)

    page.get_by_test_id("nav-policy").click()
    current = api.get("/v1/policy")["migration_deadline_ms"]
    api.req("PATCH", "/v1/policy", 200, json={"migration_deadline_ms": current + 1})
    expect(page.get_by_test_id("policy-field-migration_deadline_ms")).to_have_value(str(current + 1))
    shot(page, "14-live-policy")


def test_viewer_sees_no_operator_controls(page: Page, api: Api, shot):
    """A viewer token can look but not operate: the dashboard asks /v1/whoami,
    shows the role and offers no drain, weight or policy save; the API itself
    still refuses a viewer's drain with a 403 problem."""
    created = api.req("POST", "/v1/tokens", 201, json={"name": "ui-viewer", "role": "viewer"})
    login(page, api, created["secret"])
    expect(page.get_by_test_id("whoami")).to_have_attribute("data-role", "viewer")
    expect(page.get_by_test_id("whoami")).to_contain_text("ui-viewer")
    expect(page.get_by_test_id("server-state-1")).to_have_text("active")
    expect(page.get_by_test_id("drain-button-1")).to_have_count(0)
    page.get_by_test_id("nav-policy").click()
    expect(page.get_by_test_id("policy-save")).to_be_disabled()
    page.get_by_test_id("nav-services").click()
    expect(page.get_by_test_id("service-new")).to_have_count(0)
    r = requests.post(api.url + "/v1/servers/1/drain", json={},
                      headers={"Authorization": f"Bearer {created['secret']}"}, timeout=5)
    assert r.status_code == 403
    assert api.get("/v1/servers/1")["state"] == "active"
    shot(page, "15-viewer-read-only")


def test_revoked_token_returns_to_login(page: Page, api: Api, shot):
    created = api.req("POST", "/v1/tokens", 201, json={"name": "ui-operator", "role": "operator"})
    login(page, api, created["secret"])
    api.req("DELETE", f"/v1/tokens/{created['id']}", 204)
    # The next request gets 401 and the dashboard goes back to the login page.
    page.get_by_test_id("server-weight-3").fill("50")
    page.get_by_test_id("weight-save-3").click()
    expect(page.get_by_test_id("login-form")).to_be_visible()
    expect(page.get_by_test_id("login-message")).to_contain_text("Signed out")
    shot(page, "16-signed-out")
    assert page.evaluate("sessionStorage.getItem('capybara.token')") is None


def test_stream_reconnects_after_api_restart(page: Page, api: Api, shot):
    """The API goes away and comes back: the dashboard says it is reconnecting,
    reopens the stream, and re-lists what changed while it was down."""
    login(page, api)
    status = page.get_by_test_id("stream-status")

    def while_down():
        expect(status).to_have_attribute("data-status", "reconnecting")
        shot(page, "17-reconnecting")
        # Changed while the API is down (the store is shared): only a
        # re-list after reconnecting can show it.
        api.put_flows(3, [("192.0.2.9", 43000 + i) for i in range(5)], VIP, PORT)

    before = int(page.get_by_test_id("server-connections-3").inner_text())
    api.restart(while_down)
    expect(status).to_have_attribute("data-status", "live", timeout=20_000)
    expect(page.get_by_test_id("server-connections-3")).to_have_text(str(before + 5))
    shot(page, "18-reconnected")


def test_migration_feed_opens_on_the_newest(page: Page, tmp_path, shot):
    """With more migrations than the feed holds (160 > 100), a freshly opened
    dashboard shows the newest 100 (#160 on top, #61 last), not the oldest;
    migrations reported afterwards arrive on top through the stream. The API
    runs with a stand-in for switchd's HTTP endpoint (`/status`, and
    `/migrations` with the servers' reports, as switchd answers them)."""
    import time

    # #160 started at 15:04:05.125 in the browser's time zone (its total
    # is 2 ms): the feed shows 24-hour time with milliseconds, not the
    # en-US "3:04:05 PM" of toLocaleTimeString.
    afternoon = page.evaluate("() => { const d = new Date(); d.setHours(15, 4, 5, 125); return d.getTime(); }")

    def report(seq: int) -> dict:
        finished = afternoon + 2 if seq == 160 else int(time.time() * 1000)
        return {
            "seq": seq, "migration_id": 0xC612020B00000000 + seq, "reporter": 1 + seq % 3,
            "role": "origin", "peer": 1 + (seq + 1) % 3, "client": f"192.0.2.7:{30000 + seq}",
            "service": f"{VIP}:{PORT}", "outcome": "migrated_out", "trigger": "proactive",
            "reason": None, "finished_unix_ms": finished,
            "phases": {"prepare_us": 40, "export_us": 9, "transfer_us": 78, "import_us": None, "total_us": 2000},
        }

    status = {"role": "active", "servers": []}
    reports = [report(s) for s in range(1, 161)]
    with api_behind_switchd(tmp_path, status, reports) as (api, switchd):
        api.wait_for(
            "the API to list the 160 reported migrations",
            lambda: len(api.get("/v1/migrations?limit=1000")["items"]) >= 160,
        )

        login(page, api)
        feed = page.get_by_test_id("migration-feed")
        expect(feed).to_have_attribute("data-rows", "100")
        rows = feed.locator("tbody tr")
        expect(rows.first).to_have_attribute("data-testid", "migration-row-160")
        expect(rows.last).to_have_attribute("data-testid", "migration-row-61")
        expect(page.get_by_test_id("migration-row-100")).to_contain_text("192.0.2.7:30100")
        expect(page.get_by_test_id("migration-row-60")).to_have_count(0)
        top = page.get_by_test_id("migration-row-160")
        expect(top.get_by_test_id("migration-started")).to_have_text("15:04:05.125")
        expect(top.get_by_test_id("migration-export")).to_have_text("9 µs")
        expect(top.get_by_test_id("migration-import")).to_have_text("—")
        shot(page, "19-migration-feed-newest")

        # Reported later: on top through the stream, the feed still 100 long.
        switchd.migrations.extend([report(s) for s in range(161, 166)])
        expect(rows.first).to_have_attribute("data-testid", "migration-row-165", timeout=10_000)
        expect(feed).to_have_attribute("data-rows", "100")
        expect(rows.last).to_have_attribute("data-testid", "migration-row-66")


def test_stopping_and_stopped_servers_have_their_own_badges(page: Page, tmp_path, shot):
    """switchd says web-1's hostagent is stopping (`leaving`) and web-2's
    stopped cleanly (`stopped`), web-3 died (no such fields, as an older
    switchd writes): the cards say `stopping · N left` (N: the connections
    it has left), `stopped` and `not heard`, each its own badge. web-1
    starts stopping while the page is open: the badge comes through the
    event stream (no record changes), and its count follows the `load`
    events."""
    status = {"role": "active", "servers": [
        {"id": 1, "state": "live", "connections": 4, "load_pps": 12.0},
        {"id": 2, "state": "dead", "connections": 0, "leaving": True, "stopped": True},
        {"id": 3, "state": "dead", "connections": 0},
    ]}
    with api_behind_switchd(tmp_path, status) as (api, switchd):
        for s in ({"id": 1, "name": "web-1", "mgmt_addr": "10.0.1.11:7000", "data_addr": "10.0.2.11"},
                  {"id": 2, "name": "web-2", "mgmt_addr": "10.0.1.12:7000", "data_addr": "10.0.2.12"},
                  {"id": 3, "name": "web-3", "mgmt_addr": "10.0.1.13:7000", "data_addr": "10.0.2.13"}):
            api.req("POST", "/v1/servers", 201, json=s)
        api.hostagent_registers(1)
        api.hostagent_registers(2, "dead")
        # web-3: its record says active (switchd has not written its death).
        api.hostagent_registers(3)
        assert [s["liveness"] for s in api.get("/v1/servers")["items"]] == ["live", "stopped", "dead"]

        login(page, api)
        expect(page.get_by_test_id("server-card-1")).to_have_attribute("data-liveness", "live")
        expect(page.get_by_test_id("server-liveness-1")).to_have_count(0)
        badge2 = page.get_by_test_id("server-liveness-2")
        expect(badge2).to_have_text("stopped")
        expect(badge2).to_have_class(re.compile(r"\bbadge-stopped\b"))
        expect(page.get_by_test_id("server-card-2")).to_have_attribute("data-liveness", "stopped")
        badge3 = page.get_by_test_id("server-liveness-3")
        expect(badge3).to_have_text("not heard")
        expect(badge3).to_have_class(re.compile(r"\bbadge-dead\b"))

        switchd.status["servers"][0].update(leaving=True, connections=3)
        badge1 = page.get_by_test_id("server-liveness-1")
        expect(badge1).to_have_text("stopping · 3 left")
        expect(badge1).to_have_class(re.compile(r"\bbadge-stopping\b"))
        expect(page.get_by_test_id("server-card-1")).to_have_attribute("data-liveness", "stopping")
        expect(page.get_by_test_id("server-state-1")).to_have_text("active")
        switchd.status["servers"][0]["connections"] = 1
        expect(badge1).to_have_text("stopping · 1 left")
        shot(page, "20-stopping-and-stopped")

        # The pool of the Services page colours them the same way.
        api.req("POST", "/v1/services", 201, json={"name": "web", "vip": VIP, "port": PORT, "pool": [1, 2, 3]})
        page.get_by_test_id("nav-services").click()
        chips = page.get_by_test_id("service-row-web").locator("td").nth(2).locator(".chip")
        expect(chips).to_have_count(3)
        expect(chips.nth(0)).to_have_class(re.compile(r"\bbadge-stopping\b"))
        expect(chips.nth(1)).to_have_class(re.compile(r"\bbadge-stopped\b"))
        expect(chips.nth(2)).to_have_class(re.compile(r"\bbadge-dead\b"))


def test_services_mark_the_pool_members_that_take_new_connections(page: Page, tmp_path, shot):
    """switchd's `/status` says web's pool is 1,2,3 and only 1 takes new
    connections (`placing`): the Services page's serving chips of 2 and 3
    are outlined (`not-placing`), 1's solid. Nobody placing: "none
    placing". A switchd without `placing`: every chip solid, as before."""
    service = {"name": "web", "vip": f"{VIP}:{PORT}", "index": 0, "placement": "maglev",
               "pool": [{"server": i, "weight": 1} for i in (1, 2, 3)],
               "fail_open": False, "refusing": False, "retiring": False, "backend_down": [],
               "placing": [1]}
    status = {"role": "active", "servers": [
        {"id": i, "state": "live", "connections": 0} for i in (1, 2, 3)
    ], "services": [service]}
    with api_behind_switchd(tmp_path, status) as (api, switchd):
        for s in SERVERS:
            api.req("POST", "/v1/servers", 201, json=s)
        api.req("POST", "/v1/services", 201, json={"name": "web", "vip": VIP, "port": PORT, "pool": [1, 2, 3]})
        login(page, api)
        page.get_by_test_id("nav-services").click()
        serving = page.get_by_test_id("service-serving-web")
        chips = serving.locator(".chip[data-placing]")
        expect(chips).to_have_count(3)
        expect(chips.nth(0)).to_have_attribute("data-placing", "true")
        expect(chips.nth(0)).not_to_have_class(re.compile(r"\bnot-placing\b"))
        for i in (1, 2):
            expect(chips.nth(i)).to_have_attribute("data-placing", "false")
            expect(chips.nth(i)).to_have_class(re.compile(r"\bnot-placing\b"))
        shot(page, "21-services-placing")

        switchd.status["services"][0]["placing"] = []
        expect(serving.locator(".chip.not-placing")).to_have_count(3)
        expect(page.get_by_test_id("service-placing-none-web")).to_have_text("none placing")

        del switchd.status["services"][0]["placing"]
        expect(page.get_by_test_id("service-placing-none-web")).to_have_count(0)
        expect(serving.locator(".chip[data-placing]")).to_have_count(0)
        expect(serving.locator(".chip.not-placing")).to_have_count(0)
        expect(serving.locator(".chip")).to_have_count(4)  # "served" and the pool


def test_a_service_switchd_has_not_applied_yet_reads_pending(page: Page, tmp_path, shot):
    """switchd applies the store's services every 250 ms: right after a
    create its `/status` does not list the service (`serving.served`
    false). The Services page says "pending" in amber with ctl's words
    (within 1 s; if it stays, switchd's log), not a red "not served";
    once switchd lists it, "served"."""
    service = {"name": "web", "vip": f"{VIP}:{PORT}", "index": 0, "placement": "maglev",
               "pool": [{"server": 1, "weight": 1}],
               "fail_open": False, "refusing": False, "retiring": False, "backend_down": [],
               "placing": [1]}
    status = {"role": "active", "servers": [{"id": 1, "state": "live", "connections": 0}],
              "services": []}
    with api_behind_switchd(tmp_path, status) as (api, switchd):
        api.req("POST", "/v1/servers", 201, json=SERVERS[0])
        api.req("POST", "/v1/services", 201, json={"name": "web", "vip": VIP, "port": PORT, "pool": [1]})
        login(page, api)
        page.get_by_test_id("nav-services").click()
        serving = page.get_by_test_id("service-serving-web")
        pending = serving.get_by_test_id("service-pending-web")
        expect(pending).to_have_text("pending")
        expect(pending).to_have_attribute("data-served", "pending")
        expect(pending).to_have_class(re.compile(r"\bbadge-draining\b"))
        expect(pending).not_to_have_class(re.compile(r"\bbadge-dead\b"))
        expect(pending).to_have_attribute(
            "title", "switchd applies it within 1 s (if it stays pending, see switchd's log)")
        expect(serving).not_to_contain_text("not served")
        shot(page, "22-service-pending")

        switchd.status["services"] = [service]
        expect(serving.locator("[data-served='true']")).to_be_visible(timeout=10_000)
        expect(serving.get_by_test_id("service-pending-web")).to_have_count(0)


def test_a_service_switchd_refuses_reads_refused_with_its_reason(page: Page, tmp_path, shot):
    """A stored service switchd read and will not serve (its `/status`
    lists it in `refused_services`, e.g. another stored service has its
    VIP:port) read "pending" for ever, like one not read yet. The Services
    page says "refused" in red with switchd's reason; pending before
    switchd reads it, served once the refusal is gone and it serves it."""
    service = {"name": "web", "vip": f"{VIP}:{PORT}", "index": 0, "placement": "maglev",
               "pool": [{"server": 1, "weight": 1}],
               "fail_open": False, "refusing": False, "retiring": False, "backend_down": [],
               "placing": [1]}
    reason = f'{VIP}:{PORT} is already the address of service "www"'
    status = {"role": "active", "servers": [{"id": 1, "state": "live", "connections": 0}],
              "services": [], "refused_services": []}
    with api_behind_switchd(tmp_path, status) as (api, switchd):
        api.req("POST", "/v1/servers", 201, json=SERVERS[0])
        api.req("POST", "/v1/services", 201, json={"name": "web", "vip": VIP, "port": PORT, "pool": [1]})
        login(page, api)
        page.get_by_test_id("nav-services").click()
        serving = page.get_by_test_id("service-serving-web")
        expect(serving.get_by_test_id("service-pending-web")).to_have_text("pending")
        assert api.get("/v1/services/web")["serving"]["state"] == "pending"

        switchd.status["refused_services"] = [{"name": "web", "vip": f"{VIP}:{PORT}", "reason": reason}]
        refused = serving.get_by_test_id("service-refused-web")
        expect(refused).to_be_visible(timeout=10_000)
        expect(refused).to_have_text("refused")
        expect(refused).to_have_class(re.compile(r"\bbadge-dead\b"))
        expect(refused).to_have_attribute("title", f"switchd refused this service: {reason}")
        expect(serving.get_by_test_id("service-refused-reason-web")).to_have_text(reason)
        expect(serving.locator("[data-served='refused']")).to_be_visible()
        expect(serving.get_by_test_id("service-pending-web")).to_have_count(0)
        v = api.get("/v1/services/web")["serving"]
        assert (v["served"], v["state"], v["refused_reason"]) == (False, "refused", reason), v
        shot(page, "22b-service-refused")

        # The one in its way changed: switchd serves it.
        switchd.status["refused_services"] = []
        switchd.status["services"] = [service]
        expect(serving.locator("[data-served='true']")).to_be_visible(timeout=10_000)
        expect(serving.get_by_test_id("service-refused-web")).to_have_count(0)
        assert api.get("/v1/services/web")["serving"]["state"] == "applied"
