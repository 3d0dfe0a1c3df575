"""Management API objects and side effects as RabbitMQ 4.2 has them, found by using Warren as
RabbitMQ users do (rabbitmqadmin's usual sequences, operators finding connections by name).
Each test names the RabbitMQ function whose behaviour it checks."""

import time
import uuid

import pika
import pytest
from pika.exceptions import ConnectionClosedByBroker

from amqp_helpers import wait_until
from test_management import eventually, http, q


@pytest.fixture
def api(management_url):
    def call(method, path, **kw):
        return http(method, management_url + path, **kw)
    return call


@pytest.fixture
def fresh_user(api):
    """An administrator of our own (name, password); deleted afterwards."""
    name = "parity-" + uuid.uuid4().hex[:10]
    password = "pw-" + uuid.uuid4().hex[:6]
    status, _, _ = api("PUT", f"/api/users/{name}",
                       body={"password": password, "tags": "administrator"})
    assert status in (201, 204), status
    yield name, password
    api("DELETE", f"/api/users/{name}")


def amqp(params, user, password, vhost="/", **props):
    return pika.BlockingConnection(pika.ConnectionParameters(
        host=params.host, port=params.port, virtual_host=vhost,
        credentials=pika.PlainCredentials(user, password), connection_attempts=1,
        client_properties=props or None))


def test_vhost_creator_gets_full_permissions(api, params, fresh_user):
    """rabbit_vhost:put_vhost/6 -> maybe_grant_full_permissions/2: the user who creates a
    vhost over the API may use it at once (rabbitmqadmin: declare vhost, then a queue in it)."""
    user, password = fresh_user
    vhost = "parity-vh-" + uuid.uuid4().hex[:8]
    status, _, _ = api("PUT", f"/api/vhosts/{q(vhost)}", user=user, password=password, body={})
    assert status == 201
    try:
        status, perm, _ = api("GET", f"/api/permissions/{q(vhost)}/{user}")
        assert status == 200
        assert (perm["configure"], perm["write"], perm["read"]) == (".*", ".*", ".*")
        status, _, _ = api("PUT", f"/api/queues/{q(vhost)}/work", user=user, password=password,
                           body={"durable": True})
        assert status == 201
        c = amqp(params, user, password, vhost)
        try:
            c.channel().queue_declare("work", passive=True)
        finally:
            c.close()
        # Only creation grants: an existing vhost PUT again by another user leaves it alone.
        status, _, _ = api("PUT", f"/api/vhosts/{q(vhost)}", body={})
        assert status == 204
        assert api("GET", f"/api/permissions/{q(vhost)}/guest")[0] == 404
    finally:
        api("DELETE", f"/api/vhosts/{q(vhost)}")


def test_definitions_import_grants_the_importer_and_keeps_the_files_permissions(api):
    """rabbit_definitions:apply_defs/2 adds vhosts as the acting user (so put_vhost grants the
    importer full permissions on the vhosts it creates), then applies the file's permissions,
    which win. Checked on RabbitMQ 4.0.5."""
    granted = "parity-def-" + uuid.uuid4().hex[:8]
    given = "parity-def-" + uuid.uuid4().hex[:8]
    status, _, _ = api("POST", "/api/definitions", body={
        "vhosts": [{"name": granted}, {"name": given}],
        "permissions": [{"user": "guest", "vhost": given,
                         "configure": "^cfg$", "write": "^w$", "read": "^r$"}],
    })
    assert status in (200, 201, 204), status
    try:
        status, perm, _ = api("GET", f"/api/permissions/{q(granted)}/guest")
        assert status == 200 and (perm["configure"], perm["write"], perm["read"]) == (".*",) * 3
        status, perm, _ = api("GET", f"/api/permissions/{q(given)}/guest")
        assert status == 200
        assert (perm["configure"], perm["write"], perm["read"]) == ("^cfg$", "^w$", "^r$")
    finally:
        api("DELETE", f"/api/vhosts/{q(granted)}")
        api("DELETE", f"/api/vhosts/{q(given)}")


def test_deleting_a_user_closes_its_connections_only(api, params, fresh_user, conn):
    """rabbit_connection_tracking (user_deleted): the deleted user's connections are closed
    with 320 CONNECTION_FORCED - user '<name>' is deleted; other users' stay open."""
    user, password = fresh_user
    assert api("PUT", f"/api/permissions/%2F/{user}",
               body={"configure": ".*", "write": ".*", "read": ".*"})[0] in (201, 204)
    doomed = amqp(params, user, password)
    doomed.channel()
    # The connection is listed once it is registered (RabbitMQ's stats lag; Warren's do not).
    eventually(lambda: api("GET", "/api/connections")[1],
               lambda cs: any(c["user"] == user for c in cs))
    assert api("DELETE", f"/api/users/{user}")[0] == 204
    with pytest.raises(ConnectionClosedByBroker) as e:
        wait_until(doomed, lambda: not doomed.is_open, timeout=10)
    assert e.value.reply_code == 320
    assert e.value.reply_text == f"CONNECTION_FORCED - user '{user}' is deleted"
    assert conn.is_open
    conn.channel().queue_declare("", exclusive=True)


def test_user_provided_name_is_the_clients_connection_name(api, params):
    """rabbit_reader:augment_infos_with_user_provided_connection_name: the client property
    connection_name is reported as user_provided_name, in the listing and the single object."""
    label = "orders-service-" + uuid.uuid4().hex[:6]
    c = amqp(params, "guest", "guest", connection_name=label)
    try:
        c.channel()
        conns = eventually(lambda: api("GET", "/api/connections")[1],
                           lambda cs: any(x.get("user_provided_name") == label for x in cs))
        mine = [x for x in conns if x.get("user_provided_name") == label]
        assert len(mine) == 1, conns
        status, one, _ = api("GET", f"/api/connections/{q(mine[0]['name'])}")
        assert status == 200 and one["user_provided_name"] == label
        assert one["client_properties"]["connection_name"] == label
    finally:
        c.close()


def test_consumer_listings_show_arguments_and_exclusive(api, conn, names):
    """rabbit_mgmt: a consumer's basic.consume arguments and exclusive flag as given, in
    /api/consumers and the queue object's consumer_details."""
    queue = names.q()
    ch = conn.channel()
    ch.queue_declare(queue)
    ch.basic_qos(prefetch_count=7)
    tag = ch.basic_consume(queue, lambda *a: None, exclusive=True, arguments={"x-priority": 2})
    listed = eventually(lambda: api("GET", "/api/consumers")[1],
                        lambda cs: any(c["consumer_tag"] == tag for c in cs))
    mine = [c for c in listed if c["consumer_tag"] == tag]
    assert len(mine) == 1
    assert mine[0]["arguments"] == {"x-priority": 2}
    assert mine[0]["exclusive"] is True
    assert mine[0]["prefetch_count"] == 7
    assert mine[0]["queue"]["name"] == queue
    status, qo, _ = eventually(lambda: api("GET", f"/api/queues/%2F/{q(queue)}"),
                               lambda r: r[1].get("consumer_details"))
    assert status == 200
    details = [c for c in qo["consumer_details"] if c["consumer_tag"] == tag]
    assert details and details[0]["arguments"] == {"x-priority": 2}
    assert details[0]["exclusive"] is True


def test_quorum_and_stream_objects_name_their_members(api, conn, names):
    """rabbit_quorum_queue / rabbit_stream_queue info: leader, members and online, also for a
    queue whose only member is this node."""
    ch = conn.channel()
    node = api("GET", "/api/overview")[1]["node"]
    for kind in ("quorum", "stream"):
        queue = names.q(kind)
        ch.queue_declare(queue, durable=True, arguments={"x-queue-type": kind})
        status, info, _ = eventually(lambda: api("GET", f"/api/queues/%2F/{q(queue)}"),
                                     lambda r: r[1].get("leader"))
        assert status == 200, info
        assert info["type"] == kind
        assert isinstance(info["members"], list) and info["members"], info
        assert info["leader"] in info["members"]
        assert set(info["online"]) <= set(info["members"]) and info["online"]
        if len(info["members"]) == 1:
            assert info["members"] == [node] and info["leader"] == node


@pytest.mark.rabbitmq4
def test_queue_arguments_list_the_effective_queue_type(api, conn, names):
    """rabbit_amqqueue:augment_declare_args/5 (RabbitMQ 4): a queue declared without
    x-queue-type lists the type it got among its arguments."""
    ch = conn.channel()
    queue = names.q()
    ch.queue_declare(queue, arguments={"x-max-length": 3})
    status, info, _ = eventually(lambda: api("GET", f"/api/queues/%2F/{q(queue)}"),
                                 lambda r: r[0] == 200)
    assert info["arguments"] == {"x-max-length": 3, "x-queue-type": "classic"}


@pytest.mark.rabbitmq4
def test_whoami_says_the_user_is_internal(api):
    """rabbit_mgmt_format:user/1 (what /api/whoami returns): name, tags, is_internal_user."""
    status, me, _ = api("GET", "/api/whoami")
    assert status == 200
    assert me["name"] == "guest" and me["is_internal_user"] is True
    assert "administrator" in me["tags"]


def test_a_connection_closed_through_the_api_is_gone_from_the_next_listing(api, params):
    """Goal: once DELETE /api/connections/{name} has answered, the connection is no longer
    listed (RabbitMQ's next listing does not show it; Bunny's recovery specs poll the listing
    to see the client reconnect). Method: open a connection, DELETE it, list at once."""
    label = "doomed-" + uuid.uuid4().hex[:6]
    c = amqp(params, "guest", "guest", connection_name=label)
    try:
        conns = eventually(lambda: api("GET", "/api/connections")[1],
                           lambda cs: any(x.get("user_provided_name") == label for x in cs))
        name = next(x["name"] for x in conns if x.get("user_provided_name") == label)
        assert api("DELETE", f"/api/connections/{q(name)}")[0] == 204
        listed = api("GET", "/api/connections")[1]
        assert not any(x["name"] == name for x in listed), listed
    finally:
        try:
            c.close()
        except Exception:
            pass
