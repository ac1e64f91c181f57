//! Runnable examples live under `examples/examples/` (added with the issues that need them).
