"""Users and permissions managed with rabbitmqctl's verbs (`warren ctl`, or `rabbitmqctl`
when the suite runs against RabbitMQ): exit codes, listings, and what a client sees at login
and connection.open."""

import pika
import pytest
from pika.exceptions import ProbableAccessDeniedError, ProbableAuthenticationError


def rows(out, header):
    """The tab-separated rows after `header` in a rabbitmqctl listing (rabbitmqctl prints no
    header for an empty listing)."""
    lines = out.splitlines()
    if header not in lines:
        return []
    at = lines.index(header)
    return [tuple(l.split("\t")) for l in lines[at + 1:] if "\t" in l]


@pytest.fixture
def user(ctl, prefix):
    """A fresh user name; deleted after the test."""
    name = prefix.replace("compat.", "u.")[:60]
    yield name
    ctl("delete_user", name)


def params_for(params, user, password, vhost="/"):
    return pika.ConnectionParameters(
        host=params.host, port=params.port, virtual_host=vhost,
        credentials=pika.PlainCredentials(user, password), connection_attempts=1)


def assert_can_use(params, user, password):
    conn = pika.BlockingConnection(params_for(params, user, password))
    try:
        ch = conn.channel()
        q = ch.queue_declare("", exclusive=True).method.queue
        ch.basic_publish("", q, b"hello")
        method, _, body = ch.basic_get(q, auto_ack=True)
        assert method is not None and body == b"hello"
    finally:
        conn.close()


def test_a_new_user_with_permissions_can_log_in_and_a_wrong_password_is_refused(ctl, params, user):
    assert ctl("add_user", user, "pw1")[0] == 0
    assert ctl("set_permissions", "-p", "/", user, ".*", ".*", ".*")[0] == 0
    assert_can_use(params, user, "pw1")
    with pytest.raises(ProbableAuthenticationError):
        pika.BlockingConnection(params_for(params, user, "wrong"))


def test_a_user_without_permissions_is_refused_the_vhost(ctl, params, user):
    assert ctl("add_user", user, "pw")[0] == 0
    with pytest.raises(ProbableAccessDeniedError) as e:
        pika.BlockingConnection(params_for(params, user, "pw"))
    assert "530" in str(e.value) and f"access to vhost '/' refused for user '{user}'" in str(e.value)


def test_change_password_and_delete_user(ctl, params, user):
    ctl("add_user", user, "old")
    ctl("set_permissions", user, ".*", ".*", ".*")
    assert ctl("change_password", user, "new")[0] == 0
    with pytest.raises(ProbableAuthenticationError):
        pika.BlockingConnection(params_for(params, user, "old"))
    assert_can_use(params, user, "new")
    assert ctl("delete_user", user)[0] == 0
    with pytest.raises(ProbableAuthenticationError):
        pika.BlockingConnection(params_for(params, user, "new"))
    code, out = ctl("list_permissions", "-p", "/")
    assert code == 0 and user not in out


def test_exit_codes_match_rabbitmqctl(ctl, user):
    assert ctl("add_user", user, "pw")[0] == 0
    assert ctl("add_user", user, "pw")[0] == 70             # already exists
    assert ctl("delete_user", user + ".none")[0] == 67      # no such user
    assert ctl("change_password", user + ".none", "x")[0] == 67
    assert ctl("set_permissions", user + ".none", ".*", ".*", ".*")[0] == 67
    assert ctl("set_permissions", "-p", "no-such-vhost", user, ".*", ".*", ".*")[0] == 69
    assert ctl("set_permissions", user, "(", ".*", ".*")[0] == 69   # invalid regex
    assert ctl("authenticate_user", user, "pw")[0] == 0
    assert ctl("authenticate_user", user, "nope")[0] == 65


def test_listings_show_tags_and_permissions(ctl, user):
    ctl("add_user", user, "pw")
    assert ctl("set_user_tags", user, "monitoring", "management")[0] == 0
    ctl("set_permissions", user, "^conf", "^write", "^read")
    code, out = ctl("list_users")
    assert code == 0
    listed = dict(rows(out, "user\ttags"))
    assert listed[user] == "[monitoring, management]"
    assert listed["guest"] == "[administrator]"
    code, out = ctl("list_permissions", "-p", "/")
    assert (user, "^conf", "^write", "^read") in rows(out, "user\tconfigure\twrite\tread")
    code, out = ctl("list_user_permissions", user)
    assert rows(out, "vhost\tconfigure\twrite\tread") == [("/", "^conf", "^write", "^read")]
    assert ctl("clear_permissions", user)[0] == 0
    code, out = ctl("list_user_permissions", user)
    assert rows(out, "vhost\tconfigure\twrite\tread") == []


def test_only_an_impersonator_may_publish_with_another_user_id(ctl, params, user):
    """RabbitMQ validates the user_id property against the connection's user, except for users
    tagged `impersonator` (tags are read at connection.open)."""
    from pika.exceptions import ChannelClosedByBroker
    assert ctl("add_user", user, "pw")[0] == 0
    assert ctl("set_permissions", user, ".*", ".*", ".*")[0] == 0

    def publish_as(user_id):
        conn = pika.BlockingConnection(params_for(params, user, "pw"))
        try:
            ch = conn.channel()
            q = ch.queue_declare("", exclusive=True).method.queue
            ch.basic_publish("", q, b"x", pika.BasicProperties(user_id=user_id))
            method, props, _ = ch.basic_get(q, auto_ack=True)
            assert method is not None and props.user_id == user_id
        finally:
            if conn.is_open:
                conn.close()

    publish_as(user)
    with pytest.raises(ChannelClosedByBroker) as e:
        publish_as("someone-else")
    assert e.value.reply_code == 406
    assert e.value.reply_text == (
        f"PRECONDITION_FAILED - user_id property set to 'someone-else' but authenticated user "
        f"was '{user}'")
    assert ctl("set_user_tags", user, "impersonator")[0] == 0
    publish_as("someone-else")
