//! Unit tests of the sleep/wakeup protocol.
