//! SQLite backend (to be written).
