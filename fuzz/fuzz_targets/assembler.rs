//! The content assembler fed arbitrary frame sequences: never panics, and a completed publish
//! carries a body no longer than the message size limit.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use warren_amqp::assembler::{Assembler, AssemblyLimits};
use warren_amqp::frame::RawFrame;
use warren_amqp::limits::TABLE_DEPTH_MAX;

fuzz_target!(|data: &[u8]| {
    let limits = AssemblyLimits {
        message_size_max: 4096,
        table_depth_max: TABLE_DEPTH_MAX,
    };
    let mut asm = Assembler::default();
    // Each frame: kind (1 byte, folded onto method/header/body), length (1 byte), payload.
    let mut rest = data;
    while rest.len() >= 2 {
        let kind = 1 + rest[0] % 3;
        let len = usize::from(rest[1]).min(rest.len() - 2);
        let payload = Bytes::copy_from_slice(&rest[2..2 + len]);
        rest = &rest[2 + len..];
        let frame = RawFrame { kind, channel: 1, payload };
        match asm.handle_frame(frame, limits) {
            Ok(Some(cmd)) => {
                if let Some(c) = cmd.content {
                    assert!(c.body.len() as u64 <= limits.message_size_max);
                }
                assert!(!asm.in_content());
            }
            Ok(None) => {}
            Err(_) => asm = Assembler::default(),
        }
    }
});
