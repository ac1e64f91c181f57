//! Byte spans of values inside a JSON document, to edit it in place.
//!
//! Personal fields ([`crate::personal`]) are sealed and opened by
//! replacing the text of single values and keeping every other byte as the
//! publisher sent it (key order, spacing, escapes, number spellings), so a
//! receiver gets exactly the published bytes. The spans come from serde_json's
//! own parser (its grammar, escapes and 128-level depth limit): a value
//! sought is read as a borrowed [`RawValue`] and a string as a borrowed
//! `&str`, both slices of the document, whose offsets give the span.
//!
//! ```text
//!   { "a" : {"b":  "x\u0041" }, "c":1e2 }
//!                  ^^^^^^^^^              span of /a/b: bytes 15..24
//! ```
//!
//! Duplicate keys: every occurrence of a sought pointer is reported (a
//! reader keeping the last one, as serde_json does, and one keeping the
//! first both see the edit).

use std::ops::Range;

use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserializer as _;
use serde_json::value::RawValue;

/// A visitor's methods accepting numbers, booleans, `null` and strings
/// with escapes (never an envelope), which neither walk looks into.
macro_rules! ignore_scalars {
    () => {
        fn visit_str<E>(self, _: &str) -> Result<(), E> {
            Ok(())
        }
        fn visit_bool<E>(self, _: bool) -> Result<(), E> {
            Ok(())
        }
        fn visit_i64<E>(self, _: i64) -> Result<(), E> {
            Ok(())
        }
        fn visit_u64<E>(self, _: u64) -> Result<(), E> {
            Ok(())
        }
        fn visit_f64<E>(self, _: f64) -> Result<(), E> {
            Ok(())
        }
        fn visit_unit<E>(self) -> Result<(), E> {
            Ok(())
        }
    };
}

/// A value found: which of the sought pointers (its index) and its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Span {
    /// Index of the pointer in the list given to [`find`].
    pub which: usize,
    /// The value's bytes in the document (no surrounding whitespace).
    pub range: Range<usize>,
}

/// The reference tokens of an RFC 6901 JSON pointer (`""`: the root, no
/// tokens); `None` for text that is not a pointer.
pub(crate) fn tokens(pointer: &str) -> Option<Vec<String>> {
    if pointer.is_empty() {
        return Some(Vec::new());
    }
    let rest = pointer.strip_prefix('/')?;
    Some(
        rest.split('/')
            .map(|t| t.replace("~1", "/").replace("~0", "~"))
            .collect(),
    )
}

/// `name` as a JSON pointer token (RFC 6901).
pub(crate) fn escape(name: &str) -> String {
    name.replace('~', "~0").replace('/', "~1")
}

/// Every value of `doc` at one of `pointers` (RFC 6901; array elements by
/// index), in document order. A pointer inside another found value is
/// found too; text that is not a pointer finds nothing.
///
/// # Errors
/// serde_json's, for a `doc` that is not one JSON document.
pub(crate) fn find(doc: &[u8], pointers: &[&str]) -> Result<Vec<Span>, serde_json::Error> {
    let sought: Vec<Vec<String>> = pointers
        .iter()
        .map(|p| tokens(p).unwrap_or_default())
        .collect();
    let (root, cands): (Vec<usize>, Vec<usize>) = (0..pointers.len())
        .filter(|&i| tokens(pointers[i]).is_some())
        .partition(|&i| sought[i].is_empty());
    let mut out = Vec::new();
    let base = doc.as_ptr() as usize;
    let mut de = serde_json::Deserializer::from_slice(doc);
    if root.is_empty() {
        Seek {
            base,
            sought: &sought,
            cands,
            depth: 0,
            out: &mut out,
        }
        .deserialize(&mut de)?;
    } else {
        let raw: &RawValue = serde::Deserialize::deserialize(&mut de)?;
        let mut top = Seek {
            base,
            sought: &sought,
            cands: root,
            depth: 0,
            out: &mut out,
        };
        top.found(raw);
        top.cands = cands;
        top.below(raw)?;
    }
    de.end()?;
    out.sort_by_key(|s| (s.range.start, s.which));
    Ok(out)
}

/// Walks one value looking for the children the candidates name.
struct Seek<'s, 'o> {
    /// Address of the whole document (offsets are from it: every value
    /// read is a slice of it).
    base: usize,
    sought: &'s [Vec<String>],
    /// Pointers (indices into `sought`) going below this value.
    cands: Vec<usize>,
    /// Depth of this value (its children are matched on token `depth`).
    depth: usize,
    out: &'o mut Vec<Span>,
}

impl Seek<'_, '_> {
    /// The candidates whose token at this depth is `token`: those that end
    /// at that child and those that go below it.
    fn under(&self, token: &str) -> (Vec<usize>, Vec<usize>) {
        self.cands
            .iter()
            .copied()
            .filter(|&i| self.sought[i][self.depth] == token)
            .partition(|&i| self.sought[i].len() == self.depth + 1)
    }

    /// Records `raw` as found for every candidate.
    fn found(&mut self, raw: &RawValue) {
        let start = raw.get().as_ptr() as usize - self.base;
        for &which in &self.cands {
            self.out.push(Span {
                which,
                range: start..start + raw.get().len(),
            });
        }
    }

    /// Looks below `raw` (already read) for the candidates.
    fn below(self, raw: &RawValue) -> Result<(), serde_json::Error> {
        self.deserialize(&mut serde_json::Deserializer::from_str(raw.get()))
    }

    /// A child's seeker.
    fn child(&mut self, cands: Vec<usize>) -> Seek<'_, '_> {
        Seek {
            base: self.base,
            sought: self.sought,
            cands,
            depth: self.depth + 1,
            out: &mut *self.out,
        }
    }

    /// Reads the child whose candidates are `ending` there and `deeper`.
    fn read<'de, E: de::Error>(
        &mut self,
        raw: Option<&'de RawValue>,
        ending: Vec<usize>,
        deeper: Vec<usize>,
    ) -> Result<(), E> {
        let Some(raw) = raw else { return Ok(()) };
        self.child(ending).found(raw);
        if deeper.is_empty() {
            return Ok(());
        }
        self.child(deeper).below(raw).map_err(E::custom)
    }
}

impl<'de> DeserializeSeed<'de> for Seek<'_, '_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Seek<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<Key<'de>>()? {
            match self.under(key.as_str()) {
                (ending, deeper) if ending.is_empty() && deeper.is_empty() => {
                    map.next_value::<IgnoredAny>()?;
                }
                (ending, deeper) if ending.is_empty() => {
                    map.next_value_seed(self.child(deeper))?;
                }
                (ending, deeper) => {
                    let raw: &'de RawValue = map.next_value()?;
                    self.read::<A::Error>(Some(raw), ending, deeper)?;
                }
            }
        }
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        let mut i = 0usize;
        loop {
            let more = match self.under(&i.to_string()) {
                (ending, deeper) if ending.is_empty() && deeper.is_empty() => {
                    seq.next_element::<IgnoredAny>()?.is_some()
                }
                (ending, deeper) if ending.is_empty() => {
                    seq.next_element_seed(self.child(deeper))?.is_some()
                }
                (ending, deeper) => {
                    let raw: Option<&'de RawValue> = seq.next_element()?;
                    let more = raw.is_some();
                    self.read::<A::Error>(raw, ending, deeper)?;
                    more
                }
            };
            if !more {
                return Ok(());
            }
            i += 1;
        }
    }

    ignore_scalars!();
}

/// An object key, borrowed from the document when it has no escapes.
enum Key<'de> {
    Borrowed(&'de str),
    Owned(String),
}

impl Key<'_> {
    fn as_str(&self) -> &str {
        match self {
            Key::Borrowed(s) => s,
            Key::Owned(s) => s,
        }
    }
}

impl<'de> serde::Deserialize<'de> for Key<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Key<'de>, E> {
                Ok(Key::Borrowed(s))
            }
            fn visit_str<E>(self, s: &str) -> Result<Key<'de>, E> {
                Ok(Key::Owned(s.to_owned()))
            }
        }
        d.deserialize_str(V)
    }
}

/// Every string value of `doc` whose text (between its quotes, without
/// escapes) starts with `prefix`: its JSON pointer and its bytes, quotes
/// included, in document order. A string written with escapes is not
/// reported.
///
/// # Errors
/// serde_json's, for a `doc` that is not one JSON document.
pub(crate) fn strings_with_prefix(
    doc: &[u8],
    prefix: &str,
) -> Result<Vec<(String, Range<usize>)>, serde_json::Error> {
    let mut out = Vec::new();
    let mut de = serde_json::Deserializer::from_slice(doc);
    de.deserialize_any(Strings {
        doc,
        prefix,
        at: String::new(),
        out: &mut out,
    })?;
    de.end()?;
    Ok(out)
}

/// Walks every value, recording the strings [`strings_with_prefix`] wants.
struct Strings<'d, 'o> {
    doc: &'d [u8],
    prefix: &'d str,
    /// Pointer of this value.
    at: String,
    out: &'o mut Vec<(String, Range<usize>)>,
}

impl<'de> DeserializeSeed<'de> for Strings<'_, '_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Strings<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<Key<'de>>()? {
            map.next_value_seed(Strings {
                doc: self.doc,
                prefix: self.prefix,
                at: format!("{}/{}", self.at, escape(key.as_str())),
                out: &mut *self.out,
            })?;
        }
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut i = 0usize;
        while seq
            .next_element_seed(Strings {
                doc: self.doc,
                prefix: self.prefix,
                at: format!("{}/{i}", self.at),
                out: &mut *self.out,
            })?
            .is_some()
        {
            i += 1;
        }
        Ok(())
    }

    fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<(), E> {
        if !s.starts_with(self.prefix) {
            return Ok(());
        }
        // A borrowed string is a slice of the document between its quotes.
        let start = (s.as_ptr() as usize)
            .checked_sub(self.doc.as_ptr() as usize)
            .filter(|&at| at >= 1 && at + s.len() < self.doc.len())
            .ok_or_else(|| E::custom("a string outside the document"))?;
        self.out.push((self.at, start - 1..start + s.len() + 1));
        Ok(())
    }

    ignore_scalars!();
}

/// `doc` with each range replaced by its bytes; `edits` in document order,
/// not overlapping (a range overlapping an earlier one is skipped).
pub(crate) fn splice<B: AsRef<[u8]>>(doc: &[u8], edits: &[(Range<usize>, B)]) -> Vec<u8> {
    let grow: usize = edits.iter().map(|(_, b)| b.as_ref().len()).sum();
    let mut out = Vec::with_capacity(doc.len() + grow);
    let mut at = 0;
    for (range, bytes) in edits {
        if range.start < at || range.end > doc.len() {
            continue;
        }
        out.extend_from_slice(&doc[at..range.start]);
        out.extend_from_slice(bytes.as_ref());
        at = range.end;
    }
    out.extend_from_slice(&doc[at..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts<'a>(doc: &'a str, spans: &[Span]) -> Vec<(usize, &'a str)> {
        spans
            .iter()
            .map(|s| (s.which, &doc[s.range.clone()]))
            .collect()
    }

    #[test]
    fn finds_values_with_their_exact_text() {
        let doc = r#" { "a" : {"b":  "x\u0041" ,"c" : [ 1 , {"d":1e2} ]}, "e~f/g":-0.50E+1 } "#;
        let spans = find(
            doc.as_bytes(),
            &[
                "/a/b", "/a/c/1/d", "/e~0f~1g", "/missing", "/a/c/5", "bad", "/a", "",
            ],
        )
        .unwrap();
        assert_eq!(
            texts(doc, &spans),
            vec![
                (7, doc.trim()),
                (6, r#"{"b":  "x\u0041" ,"c" : [ 1 , {"d":1e2} ]}"#),
                (0, r#""x\u0041""#),
                (1, "1e2"),
                (2, "-0.50E+1"),
            ]
        );
    }

    #[test]
    fn escaped_keys_match_and_duplicates_are_all_found() {
        let doc = r#"{"e\u006dail":"a","email" : "b","x":{"email":"c"}}"#;
        let spans = find(doc.as_bytes(), &["/email"]).unwrap();
        assert_eq!(texts(doc, &spans), vec![(0, r#""a""#), (0, r#""b""#)]);
        assert!(find(b"{\"a\":1} x", &["/a"]).is_err());
        assert!(find(b"{\"a\":", &["/a"]).is_err());
    }

    #[test]
    fn strings_with_a_prefix_are_found_with_their_pointer() {
        let doc = r#"{"a/b":"lb:1", "c":["x", "lb:2", {"d": "lb\u003a3"}], "lb:k": 1}"#;
        let found = strings_with_prefix(doc.as_bytes(), "lb:").unwrap();
        let got: Vec<(&str, &str)> = found
            .iter()
            .map(|(p, r)| (p.as_str(), &doc[r.clone()]))
            .collect();
        assert_eq!(got, vec![("/a~1b", r#""lb:1""#), ("/c/1", r#""lb:2""#)]);
    }

    #[test]
    fn splice_replaces_ranges_in_order() {
        let doc = b"{\"a\": 1 , \"b\":[2]}";
        let out = splice(doc, &[(6..7, &b"null"[..]), (14..17, b"3")]);
        assert_eq!(out, b"{\"a\": null , \"b\":3}");
    }
}
