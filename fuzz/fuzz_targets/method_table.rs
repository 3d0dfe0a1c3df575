//! Method, field-table and content-header decoding on arbitrary bytes: never panics, and a
//! table that decodes re-encodes to bytes that decode and re-encode identically.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use warren_amqp::limits::TABLE_DEPTH_MAX;
use warren_amqp::method;
use warren_amqp::properties::Properties;
use warren_amqp::table::{decode_table, encode_table};

fuzz_target!(|data: &[u8]| {
    let _ = method::decode(data, TABLE_DEPTH_MAX);
    if let Ok((table, used)) = decode_table(data, TABLE_DEPTH_MAX) {
        assert!(used <= data.len());
        // Compared as bytes: a NaN double is not equal to itself as a value.
        let again = encode_table(&table);
        let (round, _) = decode_table(&again, TABLE_DEPTH_MAX + 1).expect("re-encoded table decodes");
        assert_eq!(encode_table(&round), again);
    }
    if let Ok(p) = Properties::parse(Bytes::copy_from_slice(data), TABLE_DEPTH_MAX) {
        // Accessors on validated properties must not panic either.
        let _ = p.headers();
        let _ = p.expiration();
        let _ = p.user_id();
        let _ = p.reply_to();
        let _ = p.persistent();
        let _ = p.rewrite(&encode_table(&Default::default()), true);
        let _ = p.with_reply_to(b"amq.rabbitmq.reply-to.x");
    }
});
