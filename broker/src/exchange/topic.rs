//! Topic matching with a trie over binding-key words.
//!
//! `*` matches exactly one word, `#` zero or more; words are separated by `.` and may be empty
//! (`a..b` has three words); the empty key has no words, as in RabbitMQ. Matching walks the trie once per routing key with a visited set of
//! (node, word index), so a pattern full of `#` costs O(nodes x words), never exponential.

use std::collections::{HashMap, HashSet};

/// The words of a key: the empty key has none (RabbitMQ), otherwise split on every dot.
fn words(key: &str) -> impl Iterator<Item = &str> {
    key.split('.').filter(move |_| !key.is_empty())
}

#[derive(Debug, Default, Clone)]
struct Node {
    children: HashMap<String, usize>,
    star: Option<usize>,
    hash: Option<usize>,
    /// Binding indices whose key ends here.
    terminal: Vec<usize>,
}

/// A trie of topic binding keys mapping to binding indices.
#[derive(Debug, Clone)]
pub struct TopicTrie {
    nodes: Vec<Node>,
}

impl Default for TopicTrie {
    fn default() -> Self {
        Self {
            nodes: vec![Node::default()],
        }
    }
}

impl TopicTrie {
    /// Add binding `index` under `key`.
    pub fn insert(&mut self, key: &str, index: usize) {
        let mut at = 0;
        for word in words(key) {
            let next = match word {
                "*" => self.nodes[at].star,
                "#" => self.nodes[at].hash,
                w => self.nodes[at].children.get(w).copied(),
            };
            at = match next {
                Some(n) => n,
                None => {
                    let n = self.nodes.len();
                    self.nodes.push(Node::default());
                    match word {
                        "*" => self.nodes[at].star = Some(n),
                        "#" => self.nodes[at].hash = Some(n),
                        w => {
                            self.nodes[at].children.insert(w.to_string(), n);
                        }
                    }
                    n
                }
            };
        }
        self.nodes[at].terminal.push(index);
    }

    /// Binding indices matching `routing_key`, each once, in ascending order.
    #[must_use]
    pub fn matches(&self, routing_key: &str) -> Vec<usize> {
        let words: Vec<&str> = words(routing_key).collect();
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        let mut stack = vec![(0usize, 0usize)];
        while let Some((node, i)) = stack.pop() {
            if !seen.insert((node, i)) {
                continue;
            }
            let n = &self.nodes[node];
            if i == words.len() {
                out.extend_from_slice(&n.terminal);
            } else {
                if let Some(&c) = n.children.get(words[i]) {
                    stack.push((c, i + 1));
                }
                if let Some(s) = n.star {
                    stack.push((s, i + 1));
                }
            }
            if let Some(h) = n.hash {
                // '#' consumes zero or more words: try every remaining suffix.
                for j in i..=words.len() {
                    stack.push((h, j));
                }
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matches(key: &str, rk: &str) -> bool {
        let mut t = TopicTrie::default();
        t.insert(key, 0);
        t.matches(rk) == vec![0]
    }

    #[test]
    fn table_of_topic_cases() {
        for (key, rk, expect) in [
            ("a.b.c", "a.b.c", true),
            ("a.*.c", "a.b.c", true),
            ("a.*.c", "a.c", false),
            ("a.#", "a", true),
            ("a.#", "a.b.c", true),
            ("#", "", true),
            ("#", "anything.at.all", true),
            ("#.c", "c", true),
            ("#.c", "a.b.c", true),
            ("a.#.c", "a.c", true),
            ("a.#.c", "a.x.y.c", true),
            ("a.#.c", "a.x.y.d", false),
            ("*", "", false),
            ("*.#", "", false),
            ("a.*", "a.", true),
            ("*", "a.b", false),
            ("a..b", "a..b", true),
            ("a.*.b", "a..b", true),
            ("", "", true),
            ("", "a", false),
            ("*.*", "a.", true),
            ("#.#", "a.b", true),
            ("a.#.#.b", "a.b", true),
            ("*.#.*", "a", false),
            ("*.#.*", "a.b", true),
        ] {
            assert_eq!(matches(key, rk), expect, "key {key:?} rk {rk:?}");
        }
    }

    #[test]
    fn many_hashes_stay_fast() {
        let mut t = TopicTrie::default();
        t.insert(&vec!["#"; 30].join("."), 0);
        let rk = vec!["w"; 100].join(".");
        assert_eq!(t.matches(&rk), vec![0]);
    }
}
