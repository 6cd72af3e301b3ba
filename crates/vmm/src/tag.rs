//! Tags: the names that group allocations for release and materialize.

use crate::error::{Error, Result};
use std::borrow::Cow;
use std::fmt;

/// The name of a group of allocations that are released and materialized together.
///
/// Three tags are well known ([`Tag::WEIGHTS`], [`Tag::KV_CACHE`], [`Tag::ACTIVATIONS`]);
/// any other name made of `[A-Za-z0-9_.-]` (at most 64 bytes) is a user-defined tag.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Tag(Cow<'static, str>);

impl Tag {
    /// Model weights, typically refilled from the checkpoint on wakeup.
    pub const WEIGHTS: Tag = Tag(Cow::Borrowed("weights"));
    /// The attention key/value cache.
    pub const KV_CACHE: Tag = Tag(Cow::Borrowed("kv_cache"));
    /// Scratch space of one forward pass.
    pub const ACTIVATIONS: Tag = Tag(Cow::Borrowed("activations"));

    /// The well-known tags, which every manager knows from the start.
    pub const WELL_KNOWN: [Tag; 3] = [Tag::WEIGHTS, Tag::KV_CACHE, Tag::ACTIVATIONS];

    /// A tag with the given name.
    ///
    /// # Errors
    /// [`Error::InvalidTag`] when the name is empty, longer than 64 bytes or has a character
    /// outside `[A-Za-z0-9_.-]`.
    pub fn new(name: impl Into<String>) -> Result<Tag> {
        let name = name.into();
        let why = if name.is_empty() {
            Some("a tag cannot be empty")
        } else if name.len() > 64 {
            Some("a tag has at most 64 bytes")
        } else if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b)) {
            Some("a tag has only the characters A-Z a-z 0-9 _ . -")
        } else {
            None
        };
        match why {
            Some(why) => Err(Error::InvalidTag { tag: name, why }),
            None => Ok(Tag::WELL_KNOWN
                .into_iter()
                .find(|t| t.as_str() == name)
                .unwrap_or(Tag(Cow::Owned(name)))),
        }
    }

    /// The tag's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether this is one of [`Tag::WELL_KNOWN`].
    pub fn is_well_known(&self) -> bool {
        Tag::WELL_KNOWN.contains(self)
    }
}

impl AsRef<str> for Tag {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tag({:?})", self.as_str())
    }
}

impl TryFrom<&str> for Tag {
    type Error = Error;

    fn try_from(name: &str) -> Result<Tag> {
        Tag::new(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn well_known_and_user_tags() {
        assert_eq!(Tag::new("kv_cache").unwrap(), Tag::KV_CACHE);
        assert!(Tag::new("weights").unwrap().is_well_known());
        let lora = Tag::new("lora-0.a").unwrap();
        assert!(!lora.is_well_known());
        assert_eq!(lora.to_string(), "lora-0.a");
    }

    #[test]
    fn rejects_bad_names() {
        for (name, needle) in [
            ("", "empty"),
            ("a b", "characters"),
            ("é", "characters"),
            (&"x".repeat(65), "64 bytes"),
        ] {
            let err = Tag::new(name).unwrap_err().to_string();
            assert!(err.contains(needle), "{name}: {err}");
        }
    }
}
