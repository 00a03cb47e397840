//! Compiles the libfabric bridge (`csrc/ofi_shim.c`) where libfabric's headers are installed
//! (Debian: `libfabric-dev`) and sets `cfg(weft_ofi)`; elsewhere the OFI provider reports that
//! it was not compiled in. The library itself is loaded at run time (dlopen), not linked.

fn main() {
    println!("cargo:rustc-check-cfg=cfg(weft_ofi)");
    println!("cargo:rerun-if-changed=csrc/ofi_shim.c");
    println!("cargo:rerun-if-env-changed=WEFT_OFI_INCLUDE");
    let mut build = cc::Build::new();
    build
        .file("csrc/ofi_shim.c")
        .warnings(true)
        .flag_if_supported("-std=gnu11");
    if let Ok(dir) = std::env::var("WEFT_OFI_INCLUDE") {
        build.include(dir);
    } else if let Ok(out) = std::process::Command::new("pkg-config")
        .args(["--cflags-only-I", "libfabric"])
        .output()
    {
        for flag in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            if let Some(dir) = flag.strip_prefix("-I") {
                build.include(dir);
            }
        }
    }
    match build.try_compile("weft_ofi_shim") {
        Ok(()) => {
            println!("cargo:rustc-cfg=weft_ofi");
            println!("cargo:rustc-link-lib=dl");
        }
        Err(e) => println!(
            "cargo:warning=libfabric headers not found (install libfabric-dev): the OFI \
             network provider is not compiled in ({e})"
        ),
    }
}
