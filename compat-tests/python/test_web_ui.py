"""Warren's web management UI (served by the management listener at `/`), driven in a real
browser: Playwright (sync API) with Debian's Chromium.

The module starts a Warren of its own (`warren_process`) and walks an operator's path through the
UI: a wrong password is refused, the overview shows the node, a queue is declared, published to,
read from and purged from its page, and a client connection is closed from the Connections page.
A PNG of each step goes to $WARREN_TEST_ARTIFACTS (default <repo>/target/test-artifacts/web-ui/).

Chromium must be at /usr/bin/chromium (`playwright install` is never used). Without it the module
is skipped, unless WARREN_REQUIRE_BROWSER=1 asks for a failure instead.
"""

import base64
import json
import os
import re
import urllib.request
import uuid
from pathlib import Path

import pika
import pytest
from playwright.sync_api import expect, sync_playwright

from conftest import REPO_ROOT, free_port, warren_process

pytestmark = [pytest.mark.warren_only, pytest.mark.timeout(120)]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
# Generous bound for anything the UI shows after an action: its live refresh runs every 5 s, and
# actions refresh the view at once.
UI_TIMEOUT_MS = 15_000
CLOSE_REASON = "closed by the web UI test"


def _artifacts_dir():
    d = Path(os.environ.get("WARREN_TEST_ARTIFACTS") or REPO_ROOT / "target" / "test-artifacts" / "web-ui")
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="module")
def chromium_path():
    if not Path(CHROMIUM).exists():
        msg = f"{CHROMIUM} is not installed; the web UI test needs Debian's chromium package"
        if os.environ.get("WARREN_REQUIRE_BROWSER"):
            pytest.fail(msg + " (WARREN_REQUIRE_BROWSER is set)")
        pytest.skip(msg)
    return CHROMIUM


@pytest.fixture(scope="module")
def broker():
    """A Warren of our own; we wait for the management port (bound after the AMQP one)."""
    mport = free_port()
    with warren_process("--management-listen", f"127.0.0.1:{mport}", wait_port=mport) as w:
        w["management_port"] = mport
        w["base_url"] = f"http://127.0.0.1:{mport}/"
        yield w


@pytest.fixture(scope="module")
def browser(chromium_path):
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser):
    """A fresh browser context (fresh sessionStorage) per test; JavaScript errors fail the test."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    pg = context.new_page()
    errors = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    # Purge / delete / close ask for confirmation with confirm(); the test says yes.
    pg.on("dialog", lambda d: d.accept())
    pg.set_default_timeout(UI_TIMEOUT_MS)
    expect.set_options(timeout=UI_TIMEOUT_MS)
    yield pg
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


class Shots:
    """Numbered screenshots across the module: 01-login.png, 02-overview.png, ..."""

    def __init__(self):
        self.dir = _artifacts_dir()
        for old in self.dir.glob("*.png"):
            old.unlink()
        self.n = 0

    def take(self, page, name):
        self.n += 1
        page.screenshot(path=str(self.dir / f"{self.n:02d}-{name}.png"), full_page=True)


@pytest.fixture(scope="module")
def shots():
    return Shots()


def api_get(broker, path):
    req = urllib.request.Request(f"http://127.0.0.1:{broker['management_port']}{path}")
    req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def login(page, broker, user="guest", password="guest"):
    page.goto(broker["base_url"])
    page.fill("#login-username", user)
    page.fill("#login-password", password)
    page.click("#login-submit")
    if password == "guest":
        expect(page.locator("#app-shell")).to_be_visible()
        expect(page.locator("#hdr-user")).to_have_text(user)


# ---------------------------------------------------------------------------------------------


def test_wrong_password_shows_login_error(page, broker, shots):
    page.goto(broker["base_url"])
    expect(page.locator("#login-username")).to_be_visible()
    page.fill("#login-username", "guest")
    page.fill("#login-password", "not-the-password")
    page.click("#login-submit")
    error = page.locator("#login-error")
    expect(error).to_be_visible()
    expect(error).to_contain_text("Login failed")
    expect(page.locator("#app-shell")).to_be_hidden()
    shots.take(page, "login")


def test_overview_shows_node(page, broker, shots):
    node = api_get(broker, "/api/overview")["node"]
    login(page, broker)
    expect(page.locator("#nav-overview")).to_have_class(re.compile(r"\bactive\b"))
    expect(page.locator("#overview-node-name")).to_have_text(node)
    expect(page.locator("#hdr-node")).to_have_text(node)
    expect(page.locator("#overview-alarms")).to_contain_text("No resource alarms")
    expect(page.locator(f'#nodes-table tr[data-node="{node}"]')).to_be_visible()
    expect(page.locator("#overview-exchanges")).not_to_have_text("–")
    shots.take(page, "overview")


def test_queue_declare_publish_get_purge(page, broker, shots):
    # A name with markup in it: the UI must show it as text, never as HTML.
    name = f"ui-test <em>{uuid.uuid4().hex[:8]}</em>"
    login(page, broker)

    page.click("#nav-queues")
    expect(page.locator("#add-queue-form")).to_be_visible()
    expect(page.locator("#add-queue-vhost")).to_have_value("/")
    page.fill("#add-queue-name", name)
    page.click("#add-queue-submit")
    expect(page.locator("#add-queue-result")).to_contain_text("declared")
    row = page.locator(f'#queues-table tr[data-queue="{name}"]')
    expect(row).to_be_visible()
    expect(row.locator('td[data-col="messages_ready"]')).to_have_text("0")
    assert page.locator("main em").count() == 0, "queue name was rendered as HTML"
    shots.take(page, "queues")

    row.locator("a.name-link").click()
    expect(page.locator("#queue-name")).to_have_text(name)
    expect(page.locator("#queue-messages-ready")).to_have_text("0")

    for i in range(1, 4):
        page.fill("#publish-payload", f"message {i}")
        page.click("#publish-submit")
        expect(page.locator("#publish-result")).to_have_text("Message published.")
    expect(page.locator("#queue-messages-ready")).to_have_text("3")
    expect(page.locator("#queue-messages-total")).to_have_text("3")
    shots.take(page, "queue-published")

    page.select_option("#get-ackmode", "ack_requeue_false")
    page.click("#get-submit")
    payload = page.locator('#get-result [data-testid="message-payload"]')
    expect(payload).to_have_count(1)
    expect(payload).to_have_text("message 1")
    expect(page.locator("#queue-messages-ready")).to_have_text("2")
    expect(page.locator("#queue-messages-total")).to_have_text("2")
    shots.take(page, "queue-get")

    page.click("#queue-purge")
    expect(page.locator("#queue-action-result")).to_have_text("Queue purged.")
    expect(page.locator("#queue-messages-ready")).to_have_text("0")
    expect(page.locator("#queue-messages-total")).to_have_text("0")
    shots.take(page, "queue-purged")

    # The broker agrees with what the page shows.
    q = api_get(broker, "/api/queues/%2F/" + urllib.request.quote(name, safe=""))
    assert q["messages"] == 0


def test_move_messages_out_of_a_queue(page, broker, shots):
    """The queue page's "Move messages" form starts a redrive into a named queue and shows
    its progress until it completes; the broker agrees."""
    dlq, dest = f"ui-dlq-{uuid.uuid4().hex[:8]}", f"ui-dest-{uuid.uuid4().hex[:8]}"
    conn = pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", broker["port"], credentials=pika.PlainCredentials("guest", "guest")))
    ch = conn.channel()
    ch.queue_declare(dlq, durable=True)
    ch.queue_declare(dest, durable=True)
    for i in range(3):
        ch.basic_publish("", dlq, f"dead {i}")
    conn.close()
    login(page, broker)
    page.goto(f"{broker['base_url']}#/queues/%2F/{dlq}")
    expect(page.locator("#queue-messages-ready")).to_have_text("3")
    page.fill("#redrive-to", dest)
    page.click("#redrive-submit")
    expect(page.locator("#redrive-status")).to_contain_text("completed: 3 moved")
    expect(page.locator("#redrive-progress")).to_contain_text("COMPLETED, moved 3")
    expect(page.locator("#queue-messages-ready")).to_have_text("0")
    shots.take(page, "queue-redrive")
    assert api_get(broker, f"/api/queues/%2F/{dest}")["messages"] == 3


def api_post(broker, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{broker['management_port']}{path}",
                                 data=json.dumps(body).encode(), method="POST")
    req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def test_queue_page_shows_work_queue_figures_and_browses(page, broker, shots):
    """The queue page shows scheduled and claimed counts and browses ready, scheduled and
    claimed messages without taking them."""
    name = f"ui-work-{uuid.uuid4().hex[:8]}"
    conn = pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", broker["port"], credentials=pika.PlainCredentials("guest", "guest")))
    conn.channel().queue_declare(name, durable=True)
    conn.close()
    base = f"/v1/queues/%2F/{name}"
    api_post(broker, f"{base}/messages", {"messages": [
        {"payload": "claimed one"}, {"payload": "ready one"},
        {"payload": "later one", "delay_ms": 600_000}]})
    claimed = api_post(broker, f"{base}/leases", {"max_items": 1, "lease_ms": 600_000})
    assert [d["payload"] for d in claimed["deliveries"]] == ["claimed one"]
    login(page, broker)
    page.goto(f"{broker['base_url']}#/queues/%2F/{name}")
    expect(page.locator("#queue-scheduled")).to_have_text("1")
    expect(page.locator("#queue-leased")).to_have_text("1")
    expect(page.locator("#queue-messages-ready")).to_have_text("1")
    for state, payload in [("ready", "ready one"), ("scheduled", "later one"),
                           ("unacked", "claimed one")]:
        page.select_option("#browse-state", state)
        page.click("#browse-submit")
        expect(page.locator("#browse-status")).to_have_text("1 message.")
        rows = page.locator("#browse-table tbody tr")
        expect(rows).to_have_count(1)
        expect(rows.first).to_contain_text(payload)
    expect(page.locator("#browse-table tbody tr").first).to_contain_text("guest")
    shots.take(page, "queue-browse")
    # Browsing took nothing.
    q = api_get(broker, f"/api/queues/%2F/{name}")
    assert (q["messages_ready"], q["messages_scheduled"], q["leases"]["leased"]) == (1, 1, 1)


def test_close_connection_from_connections_page(page, broker, shots):
    conn_name = f"web-ui-test-{uuid.uuid4().hex[:8]}"
    params = pika.ConnectionParameters(
        host="127.0.0.1", port=broker["port"], credentials=pika.PlainCredentials("guest", "guest"),
        client_properties={"connection_name": conn_name})
    conn = pika.BlockingConnection(params)
    try:
        login(page, broker)
        page.click("#nav-connections")
        row = page.locator("#connections-table tbody tr", has_text=conn_name)
        expect(row).to_have_count(1)
        expect(row.locator('td[data-col="user"]')).to_have_text("guest")
        page.fill("#close-reason", CLOSE_REASON)
        shots.take(page, "connections")

        row.locator('[data-testid="close-connection"]').click()
        # The client is told, with the reason the operator typed (pika only sees the broker's
        # connection.close, and answers it, when it processes I/O).
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as closed:
            conn.process_data_events(time_limit=10)
        assert closed.value.reply_code == 320
        assert CLOSE_REASON in closed.value.reply_text
        # Gone from the list at the next refresh.
        expect(row).to_have_count(0)
        shots.take(page, "connection-closed")
    finally:
        if conn.is_open:
            conn.close()


@pytest.mark.parametrize("tab, marker", [
    ("channels", "#channels-table"),
    ("exchanges", '#exchanges-table tr[data-exchange="amq.direct"]'),
    ("admin", '#users-table tr[data-user="guest"]'),
    ("definitions", "#definitions-download"),
])
def test_other_tabs_render(page, broker, shots, tab, marker):
    login(page, broker)
    page.click(f"#nav-{tab}")
    expect(page.locator(marker)).to_be_visible()
    expect(page.locator("#last-updated")).to_contain_text("Updated")
    expect(page.locator("#view-error")).to_be_hidden()
    shots.take(page, tab)
