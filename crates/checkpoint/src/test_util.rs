//! The tensor crate's test helpers (random data, tolerant comparison, temporary paths, the
//! GPU when there is one, ...), under the name every test here imports.

pub(crate) use tensor::test_util::*;
