//! Compiles the bridges to the RDMA libraries where their headers are installed, each setting a
//! cfg: `csrc/ofi_shim.c` (libfabric, Debian `libfabric-dev`: `cfg(weft_ofi)`) and
//! `csrc/ibv_shim.c` (rdma-core's verbs, Debian `libibverbs-dev`: `cfg(weft_ibv)`). Elsewhere the
//! provider reports that it was not compiled in. The libraries themselves are loaded at run time
//! (dlopen), not linked, so binaries start on machines without them.

fn shim(name: &str, source: &str, cfg: &str, pkg: &str, include_env: &str, package: &str) {
    println!("cargo:rustc-check-cfg=cfg({cfg})");
    println!("cargo:rerun-if-changed={source}");
    println!("cargo:rerun-if-env-changed={include_env}");
    let mut build = cc::Build::new();
    build
        .file(source)
        .warnings(true)
        .flag_if_supported("-std=gnu11");
    if let Ok(dir) = std::env::var(include_env) {
        build.include(dir);
    } else if let Ok(out) = std::process::Command::new("pkg-config")
        .args(["--cflags-only-I", pkg])
        .output()
    {
        for flag in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            if let Some(dir) = flag.strip_prefix("-I") {
                build.include(dir);
            }
        }
    }
    match build.try_compile(name) {
        Ok(()) => {
            println!("cargo:rustc-cfg={cfg}");
            println!("cargo:rustc-link-lib=dl");
        }
        Err(e) => println!(
            "cargo:warning=headers for {pkg} not found (install {package}): its network provider \
             is not compiled in ({e})"
        ),
    }
}

fn main() {
    shim(
        "weft_ofi_shim",
        "csrc/ofi_shim.c",
        "weft_ofi",
        "libfabric",
        "WEFT_OFI_INCLUDE",
        "libfabric-dev",
    );
    shim(
        "weft_ibv_shim",
        "csrc/ibv_shim.c",
        "weft_ibv",
        "libibverbs",
        "WEFT_IBV_INCLUDE",
        "libibverbs-dev",
    );
}
