//! The frame decoder on arbitrary bytes: never panics, never takes more bytes than a frame
//! holds, and every frame it returns fits the frame_max it was given.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use warren_amqp::frame::{FRAME_OVERHEAD, decode_frame};

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    // The first two bytes pick a frame_max between the protocol minimum and 64 KiB + 4 KiB.
    let frame_max = 4096 + u32::from(u16::from_be_bytes([data[0], data[1]]));
    let mut buf = BytesMut::from(&data[2..]);
    loop {
        let before = buf.len();
        match decode_frame(&mut buf, frame_max) {
            Ok(Some(frame)) => {
                let used = before - buf.len();
                assert_eq!(used, frame.payload.len() + FRAME_OVERHEAD);
                assert!(used <= frame_max as usize);
            }
            Ok(None) => {
                assert_eq!(buf.len(), before, "an incomplete frame consumes nothing");
                break;
            }
            Err(_) => break,
        }
    }
});
