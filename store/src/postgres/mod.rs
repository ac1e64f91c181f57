//! PostgreSQL backend (to be written).
