//! The broken-build demonstration (`chaos/broken-build/run`, issue 7) patches
//! the store's fenced writes; when those files change, the patch must be
//! regenerated. This fails as soon as it no longer applies to the tree, not
//! only when someone runs the demonstration.

use std::path::Path;
use std::process::Command;

#[test]
fn unfenced_writes_patch_applies_to_the_tree() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new("git")
        .args([
            "apply",
            "--check",
            "chaos/broken-build/unfenced-writes.patch",
        ])
        .current_dir(&root)
        .output()
        .expect("run git apply --check");
    assert!(
        out.status.success(),
        "chaos/broken-build/unfenced-writes.patch no longer applies (regenerate it for the \
         current store SQL): {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
