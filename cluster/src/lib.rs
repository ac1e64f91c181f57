//! Lane assignment and lease arithmetic (pure code). Raft glue arrives with the cluster issue.
