//! Headers exchange matching (x-match all, any, all-with-x, any-with-x).

use amq_protocol::types::{AMQPValue, FieldTable};

/// How a headers binding matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XMatch {
    /// Every binding argument must match (x-* arguments ignored).
    All,
    /// At least one must match (x-* arguments ignored).
    Any,
    /// As `All`, including x-* arguments.
    AllWithX,
    /// As `Any`, including x-* arguments.
    AnyWithX,
}

impl XMatch {
    /// Read `x-match` from binding arguments (default `all`); `None` for an unknown value.
    #[must_use]
    pub fn from_args(args: &FieldTable) -> Option<Self> {
        match args.inner().get("x-match") {
            None => Some(Self::All),
            Some(AMQPValue::LongString(s)) => Self::parse(s.as_bytes()),
            Some(AMQPValue::ShortString(s)) => Self::parse(s.as_str().as_bytes()),
            Some(_) => None,
        }
    }

    fn parse(s: &[u8]) -> Option<Self> {
        match s {
            b"all" => Some(Self::All),
            b"any" => Some(Self::Any),
            b"all-with-x" => Some(Self::AllWithX),
            b"any-with-x" => Some(Self::AnyWithX),
            _ => None,
        }
    }
}

/// A header or binding value as RabbitMQ holds it after decoding, which is what
/// `rabbit_exchange_type_headers:match/2` compares with `=:=`: the field type is gone, so
/// long strings, short strings and byte arrays are all binaries, integers of every width are
/// integers, 32- and 64-bit floats are floats. Booleans, strings and numbers never equal
/// one another; an integer never equals a float.
#[derive(Debug, PartialEq)]
enum Decoded<'a> {
    Int(i128),
    Bytes(&'a [u8]),
    Float(f64),
    Bool(bool),
    /// Decimals, arrays, tables and void compare as the field values they are.
    Other(&'a AMQPValue),
}

impl<'a> Decoded<'a> {
    /// `message` is true for the published message's side: `mc_amqpl:routing_headers/2`
    /// turns a timestamp into milliseconds there, while a binding's timestamp stays in
    /// seconds (so the two only meet at 0, as in RabbitMQ).
    fn of(v: &'a AMQPValue, message: bool) -> Self {
        match v {
            AMQPValue::Timestamp(t) => Self::Int(i128::from(*t) * if message { 1000 } else { 1 }),
            AMQPValue::LongString(s) => Self::Bytes(s.as_bytes()),
            AMQPValue::ShortString(s) => Self::Bytes(s.as_str().as_bytes()),
            AMQPValue::ByteArray(b) => Self::Bytes(b.as_slice()),
            AMQPValue::Float(f) => Self::Float(f64::from(*f)),
            AMQPValue::Double(d) => Self::Float(*d),
            AMQPValue::Boolean(b) => Self::Bool(*b),
            other => crate::args::int_value(other).map_or(Self::Other(other), Self::Int),
        }
    }
}

/// Whether a message's header value equals a binding's.
fn same_value(binding: &AMQPValue, message: &AMQPValue) -> bool {
    Decoded::of(binding, false) == Decoded::of(message, true)
}

/// Whether message `headers` satisfy a binding's `args`.
#[must_use]
pub fn matches(args: &FieldTable, headers: Option<&FieldTable>) -> bool {
    let Some(mode) = XMatch::from_args(args) else {
        return false;
    };
    let with_x = matches!(mode, XMatch::AllWithX | XMatch::AnyWithX);
    let any = matches!(mode, XMatch::Any | XMatch::AnyWithX);
    let mut considered = 0usize;
    let mut hits = 0usize;
    for (key, want) in args.inner() {
        let key = key.as_str();
        if key == "x-match" || (!with_x && key.starts_with("x-")) {
            continue;
        }
        considered += 1;
        let got = headers.and_then(|h| h.inner().get(key));
        let hit = match (want, got) {
            (_, None) => false,
            (AMQPValue::Void, Some(_)) => true,
            (w, Some(g)) => same_value(w, g),
        };
        if hit {
            hits += 1;
            if any {
                return true;
            }
        } else if !any {
            return false;
        }
    }
    if any { false } else { hits == considered }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::table;
    use amq_protocol::types::LongString;

    fn s(v: &str) -> AMQPValue {
        AMQPValue::LongString(LongString::from(v.as_bytes().to_vec()))
    }

    #[test]
    fn all_any_and_with_x() {
        let h = table(&[("a", s("1")), ("b", s("2")), ("x-k", s("x"))]);
        assert!(matches(&table(&[("a", s("1")), ("b", s("2"))]), Some(&h)));
        assert!(!matches(&table(&[("a", s("1")), ("b", s("3"))]), Some(&h)));
        assert!(matches(
            &table(&[("x-match", s("any")), ("a", s("9")), ("b", s("2"))]),
            Some(&h)
        ));
        assert!(!matches(
            &table(&[("x-match", s("any")), ("a", s("9"))]),
            Some(&h)
        ));
        // x- keys are ignored by all/any but used by the -with-x variants.
        assert!(matches(
            &table(&[("a", s("1")), ("x-k", s("nope"))]),
            Some(&h)
        ));
        assert!(!matches(
            &table(&[
                ("x-match", s("all-with-x")),
                ("a", s("1")),
                ("x-k", s("nope"))
            ]),
            Some(&h)
        ));
        assert!(matches(
            &table(&[("x-match", s("any-with-x")), ("x-k", s("x"))]),
            Some(&h)
        ));
        assert!(!matches(
            &table(&[("x-match", s("any")), ("x-k", s("x"))]),
            Some(&h)
        ));
        // Void binding values only require presence; empty "all" matches everything.
        assert!(matches(&table(&[("a", AMQPValue::Void)]), Some(&h)));
        assert!(matches(&table(&[]), None));
        assert!(!matches(&table(&[("a", s("1"))]), None));
        // Integers compare by value across widths; a string never equals a number.
        let n = table(&[("n", AMQPValue::LongLongInt(42))]);
        assert!(matches(&table(&[("n", AMQPValue::LongInt(42))]), Some(&n)));
        assert!(!matches(&table(&[("n", s("42"))]), Some(&n)));
    }

    #[test]
    fn values_compare_as_rabbitmq_decodes_them() {
        use amq_protocol::types::ByteArray;
        let bytes = |v: &str| AMQPValue::ByteArray(ByteArray::from(v.as_bytes().to_vec()));
        let short = |v: &str| AMQPValue::ShortString(v.into());
        let one =
            |k: AMQPValue, v: AMQPValue| matches(&table(&[("k", k)]), Some(&table(&[("k", v)])));
        // The same bytes match whatever the string type.
        for (a, b) in [
            (s("abc"), short("abc")),
            (short("abc"), bytes("abc")),
            (bytes("abc"), s("abc")),
        ] {
            assert!(one(a.clone(), b.clone()), "{a:?} = {b:?}");
            assert!(one(b.clone(), a.clone()), "{b:?} = {a:?}");
        }
        assert!(!one(s("abc"), bytes("abd")));
        // Integers of every width by value.
        assert!(one(AMQPValue::ShortShortUInt(7), AMQPValue::LongLongInt(7)));
        assert!(one(AMQPValue::ShortInt(-3), AMQPValue::LongInt(-3)));
        assert!(!one(AMQPValue::ShortInt(-3), AMQPValue::LongInt(3)));
        // Booleans never equal integers, strings never numbers, integers never floats.
        assert!(!one(AMQPValue::Boolean(true), AMQPValue::ShortShortInt(1)));
        assert!(!one(AMQPValue::ShortShortInt(1), AMQPValue::Boolean(true)));
        assert!(!one(s("1"), AMQPValue::LongInt(1)));
        assert!(!one(AMQPValue::LongInt(1), AMQPValue::Double(1.0)));
        assert!(one(AMQPValue::Float(1.5), AMQPValue::Double(1.5)));
        assert!(one(AMQPValue::Boolean(false), AMQPValue::Boolean(false)));
        // A message's timestamp is in milliseconds by the time RabbitMQ compares it.
        assert!(one(AMQPValue::LongLongInt(5000), AMQPValue::Timestamp(5)));
        assert!(!one(AMQPValue::Timestamp(5), AMQPValue::Timestamp(5)));
    }
}
