//! The broken-build demonstrations (`chaos/broken-build/run`) patch the
//! tree: the store's fenced writes (issue 7, `unfenced-writes.patch`) and
//! the rule that an attempt starts only if it can end inside its owner's
//! lease or drain (issue 18, `unbounded-attempts.patch`). When those files
//! change, the patches must be regenerated. This fails as soon as one no
//! longer applies to the tree, not only when someone runs the
//! demonstration.

use std::path::Path;
use std::process::Command;

fn applies(patch: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new("git")
        .args(["apply", "--check", patch])
        .current_dir(&root)
        .output()
        .expect("run git apply --check");
    assert!(
        out.status.success(),
        "{patch} no longer applies (regenerate it for the current code): {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn unfenced_writes_patch_applies_to_the_tree() {
    applies("chaos/broken-build/unfenced-writes.patch");
}

#[test]
fn unbounded_attempts_patch_applies_to_the_tree() {
    applies("chaos/broken-build/unbounded-attempts.patch");
}
