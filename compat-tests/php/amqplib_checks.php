<?php
// php-amqplib (Debian's php-amqplib) against a broker: the operations its own test suite
// exercises, as checks that print "ok NAME" or "FAIL NAME: why" and exit non-zero on any
// failure. php-amqplib's tests are not in any registry CI can reach (docs/compatibility.md
// gives the one-off run); these are Warren's own tests with the real library.
//   php compat-tests/php/amqplib_checks.php HOST PORT
require_once '/usr/share/php/PhpAmqpLib/autoload.php';

use PhpAmqpLib\Connection\AMQPStreamConnection;
use PhpAmqpLib\Exception\AMQPProtocolChannelException;
use PhpAmqpLib\Message\AMQPMessage;
use PhpAmqpLib\Wire\AMQPTable;

$host = $argv[1] ?? '127.0.0.1';
$port = (int)($argv[2] ?? 5672);
$failed = 0;

function check(string $name, callable $f): void {
    global $failed;
    try {
        $f();
        echo "ok $name\n";
    } catch (Throwable $e) {
        $failed++;
        echo "FAIL $name: " . get_class($e) . ': ' . $e->getMessage() . "\n";
    }
}

function expect(bool $cond, string $why): void {
    if (!$cond) {
        throw new RuntimeException($why);
    }
}

function qname(string $s): string {
    return "php-$s-" . bin2hex(random_bytes(4));
}

$conn = new AMQPStreamConnection($host, $port, 'guest', 'guest');

check('server identity', function () use ($conn) {
    $props = $conn->getServerProperties();
    expect($props['product'][1] === 'RabbitMQ', 'product ' . json_encode($props['product']));
});

check('publisher confirms and basic.get', function () use ($conn) {
    $ch = $conn->channel();
    [$q] = $ch->queue_declare('', false, false, true, true);
    $ch->confirm_select();
    $acked = 0;
    $ch->set_ack_handler(function () use (&$acked) { $acked++; });
    for ($i = 0; $i < 3; $i++) {
        $ch->basic_publish(new AMQPMessage("m$i", ['delivery_mode' => 2]), '', $q);
    }
    $ch->wait_for_pending_acks_returns(5);
    expect($acked >= 1, "acks $acked");
    $m = $ch->basic_get($q);
    expect($m !== null && $m->getBody() === 'm0', 'first message');
    $m->ack();
    $ch->close();
});

check('consume with prefetch, reject requeue, headers', function () use ($conn) {
    $ch = $conn->channel();
    [$q] = $ch->queue_declare('', false, false, true, true);
    $ch->basic_qos(0, 1, false);
    $headers = new AMQPTable(['k' => 'v', 'n' => 7]);
    $ch->basic_publish(new AMQPMessage('hello', ['application_headers' => $headers]), '', $q);
    $seen = [];
    $tag = $ch->basic_consume($q, '', false, false, false, false, function ($m) use (&$seen) {
        $seen[] = [$m->getBody(), $m->isRedelivered(), $m->get('application_headers')->getNativeData()];
        if (count($seen) === 1) {
            $m->reject(true);
        } else {
            $m->ack();
        }
    });
    while (count($seen) < 2) {
        $ch->wait(null, false, 5);
    }
    $ch->basic_cancel($tag);
    expect($seen[0][0] === 'hello' && !$seen[0][1], 'first delivery');
    expect($seen[1][0] === 'hello' && $seen[1][1], 'redelivery');
    expect($seen[1][2] === ['k' => 'v', 'n' => 7], 'headers ' . json_encode($seen[1][2]));
    $ch->close();
});

check('mandatory publish to nowhere is returned', function () use ($conn) {
    $ch = $conn->channel();
    $returned = null;
    $ch->set_return_listener(function ($code, $text) use (&$returned) { $returned = [$code, $text]; });
    $ch->confirm_select();
    $ch->basic_publish(new AMQPMessage('lost'), 'amq.direct', qname('nobody'), true);
    $ch->wait_for_pending_acks_returns(5);
    expect($returned === [312, 'NO_ROUTE'], 'return ' . json_encode($returned));
    $ch->close();
});

check('missing queue is 404 and the connection stays', function () use ($conn) {
    $ch = $conn->channel();
    try {
        $ch->queue_declare(qname('missing'), true);
        throw new RuntimeException('no error');
    } catch (AMQPProtocolChannelException $e) {
        expect($e->getCode() === 404, 'code ' . $e->getCode());
    }
    expect($conn->isConnected(), 'connection closed');
    $conn->channel()->close();
});

check('exchange to exchange binding routes', function () use ($conn) {
    $ch = $conn->channel();
    $src = qname('src');
    $dst = qname('dst');
    $ch->exchange_declare($src, 'fanout', false, false, true);
    $ch->exchange_declare($dst, 'direct', false, false, true);
    $ch->exchange_bind($dst, $src);
    [$q] = $ch->queue_declare('', false, false, true, true);
    $ch->queue_bind($q, $dst, 'k');
    $ch->confirm_select();
    $ch->basic_publish(new AMQPMessage('via e2e'), $src, 'k');
    $ch->wait_for_pending_acks(5); // confirmed: routed and enqueued
    $m = $ch->basic_get($q, true);
    expect($m !== null && $m->getBody() === 'via e2e', 'not routed');
    $ch->close();
});

check('close', function () use ($conn) {
    $conn->close();
    expect(!$conn->isConnected(), 'still connected');
});

echo "php-amqplib checks: $failed failed\n";
exit($failed === 0 ? 0 : 1);
