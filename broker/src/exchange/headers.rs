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

/// RabbitMQ compares header values with `==`, so integers match across widths (`I` 42 equals
/// `l` 42) and short and long strings match by content.
fn same_value(a: &AMQPValue, b: &AMQPValue) -> bool {
    if let (Some(x), Some(y)) = (crate::args::int_value(a), crate::args::int_value(b)) {
        return x == y;
    }
    match (a, b) {
        (AMQPValue::LongString(x), AMQPValue::ShortString(y))
        | (AMQPValue::ShortString(y), AMQPValue::LongString(x)) => {
            x.as_bytes() == y.as_str().as_bytes()
        }
        _ => a == b,
    }
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
}
