//! `include/weftcc.h` is what cbindgen generates from `src/lib.rs` today. Regenerate it with
//! `WEFT_BLESS=1 cargo test -p weftcc-bindings --test header`.

use std::path::Path;

#[test]
fn header_is_current() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut generated);
    let path = dir.join("include/weftcc.h");
    if std::env::var_os("WEFT_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write include/weftcc.h");
        return;
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "include/weftcc.h is stale: regenerate it with \
         `WEFT_BLESS=1 cargo test -p weftcc-bindings --test header`"
    );
}
