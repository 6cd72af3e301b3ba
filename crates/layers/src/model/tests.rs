//! Model tests.
