//! The library's build id (`WEFTCC_BUILD_ID`, announced by every rank when a communicator is
//! made): the git commit the crate is built from (12 hex digits), or `unknown` where git or the
//! repository is not there (a crate built from a registry's sources). Never fails the build.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(std::env::var_os("CARGO_MANIFEST_DIR")?)
        .output()
        .ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    (out.status.success() && !text.trim().is_empty()).then(|| text.trim().to_string())
}

fn main() {
    let id = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=WEFTCC_BUILD_ID={id}");
    // Built again when HEAD moves (a checkout, or a commit on the branch HEAD names).
    for path in ["HEAD", "logs/HEAD"] {
        if let Some(p) = git(&["rev-parse", "--git-path", path]) {
            let p = std::path::Path::new(&p);
            let p = if p.is_relative() {
                std::path::Path::new(&std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default())
                    .join(p)
            } else {
                p.to_path_buf()
            };
            println!("cargo:rerun-if-changed={}", p.display());
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
