# Bunny (Debian's ruby-bunny) against a broker: the operations Bunny's own specs exercise, as
# checks that print "ok NAME" or "FAIL NAME: why" and exit non-zero on any failure.
# Bunny's spec suite itself is not in any registry CI can reach (docs/compatibility.md gives
# the one-off run); these are Warren's own tests with the real library.
#   ruby compat-tests/ruby/bunny_checks.rb amqp://guest:guest@127.0.0.1:5672
require "bunny"
require "securerandom"

URL = ARGV[0] || "amqp://guest:guest@127.0.0.1:5672"
$failed = 0

def check(name)
  yield
  puts "ok #{name}"
rescue StandardError, Timeout::Error => e
  $failed += 1
  puts "FAIL #{name}: #{e.class}: #{e.message}"
end

def expect(cond, why)
  raise why unless cond
end

def name(s) = "bunny-#{s}-#{SecureRandom.hex(4)}"

conn = Bunny.new(URL, automatically_recover: false, logger: Logger.new(nil))
conn.start

check("server identity") do
  props = conn.server_properties
  expect(props["product"] == "RabbitMQ", "product #{props["product"].inspect}")
  expect(props["capabilities"]["publisher_confirms"] == true, "no publisher_confirms")
end

check("publish with confirms, pop, ack") do
  ch = conn.create_channel
  q = ch.queue(name("q"), exclusive: true)
  ch.confirm_select
  3.times { |i| ch.default_exchange.publish("m#{i}", routing_key: q.name, persistent: true) }
  expect(ch.wait_for_confirms, "publishes nacked")
  expect(q.message_count == 3, "count #{q.message_count}")
  info, _props, body = q.pop(manual_ack: true)
  expect(body == "m0", "first #{body.inspect}")
  ch.ack(info.delivery_tag)
  ch.close
end

check("subscribe with prefetch, nack requeue redelivers") do
  ch = conn.create_channel
  ch.prefetch(2)
  q = ch.queue(name("sub"), exclusive: true)
  x = ch.topic(name("x"), auto_delete: true)
  q.bind(x, routing_key: "a.*")
  got = Queue.new
  q.subscribe(manual_ack: true) { |info, _p, body| got << [info, body] }
  x.publish("one", routing_key: "a.b")
  x.publish("skip", routing_key: "b.a")
  info, body = Timeout.timeout(5) { got.pop }
  expect(body == "one", "got #{body.inspect}")
  ch.nack(info.delivery_tag, false, true)
  info, body = Timeout.timeout(5) { got.pop }
  expect(body == "one" && info.redelivered?, "redelivery #{body.inspect} #{info.redelivered?}")
  ch.ack(info.delivery_tag)
  ch.close
end

check("channel error on a missing exchange leaves the connection usable") do
  ch = conn.create_channel
  begin
    ch.exchange_declare(name("missing"), "direct", passive: true)
    raise "no error"
  rescue Bunny::NotFound => e
    expect(e.message.include?("NOT_FOUND"), e.message)
  end
  expect(conn.open?, "connection closed")
  conn.create_channel.close
end

check("redeclaring an exclusive queue as shared is 405") do
  ch = conn.create_channel
  qn = name("excl")
  ch.queue(qn, exclusive: true)
  begin
    conn.create_channel.queue(qn, exclusive: false)
    raise "no error"
  rescue Bunny::ResourceLocked
  end
  ch.close
end

check("inequivalent redeclare is 406") do
  ch = conn.create_channel
  qn = name("eq")
  ch.queue(qn, auto_delete: true, arguments: { "x-max-length" => 5 })
  begin
    conn.create_channel.queue(qn, auto_delete: true, arguments: { "x-max-length" => 6 })
    raise "no error"
  rescue Bunny::PreconditionFailed
  end
  ch.queue_delete(qn)
  ch.close
end

check("large message round trip") do
  ch = conn.create_channel
  q = ch.queue(name("big"), exclusive: true)
  body = SecureRandom.random_bytes(4 * 1024 * 1024)
  ch.confirm_select
  ch.default_exchange.publish(body, routing_key: q.name)
  expect(ch.wait_for_confirms, "nacked") # confirmed: it is in the queue
  _i, _p, got = q.pop
  expect(got == body, "body differs")
  ch.close
end

check("transactions") do
  ch = conn.create_channel
  q = ch.queue(name("tx"), exclusive: true)
  ch.tx_select
  ch.default_exchange.publish("rolled back", routing_key: q.name)
  ch.tx_rollback
  ch.default_exchange.publish("committed", routing_key: q.name)
  ch.tx_commit
  expect(q.message_count == 1, "count #{q.message_count}")
  ch.close
end

check("close") do
  conn.close
  expect(conn.closed?, "still open")
end

puts "bunny checks: #{$failed} failed"
exit($failed.zero? ? 0 : 1)
