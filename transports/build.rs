//! Compiles the bridges to the RDMA libraries where their headers are installed, each setting a
//! cfg: `csrc/ofi_shim.c` (libfabric, Debian `libfabric-dev`: `cfg(weft_ofi)`) and
//! `csrc/ibv_shim.c` (rdma-core's verbs, Debian `libibverbs-dev`: `cfg(weft_ibv)`). Elsewhere the
//! provider reports that it was not compiled in. The libraries themselves are loaded at run time
//! (dlopen), not linked, so binaries start on machines without them.
//!
//! Where the verbs headers are found, `csrc/ibemu.c` is also built into a shared library, the
//! emulated RDMA device the tests load through `WEFT_IB_LIBRARY`; its path is compiled in as
//! `WEFTCC_IBEMU_LIBRARY`. Nothing loads it unless told to.
//!
//! The build is redone when the headers appear or change (`rerun-if-changed` on the header
//! files and their directories), so a first build before `apt-get install libfabric-dev
//! libibverbs-dev` does not stay without the providers.

/// Where Debian and most distributions install the headers.
const HEADERS: [(&str, &str); 2] = [
    ("/usr/include/rdma", "/usr/include/rdma/fabric.h"),
    ("/usr/include/infiniband", "/usr/include/infiniband/verbs.h"),
];

/// Compiles `source`; true when it built.
fn shim(name: &str, source: &str, cfg: &str, pkg: &str, include_env: &str, package: &str) -> bool {
    println!("cargo:rustc-check-cfg=cfg({cfg})");
    println!("cargo:rerun-if-changed={source}");
    println!("cargo:rerun-if-env-changed={include_env}");
    let mut build = cc::Build::new();
    let includes = include_dirs(include_env, pkg);
    for dir in &includes {
        build.include(dir);
    }
    build
        .file(source)
        .warnings(true)
        .flag_if_supported("-std=gnu11");
    match build.try_compile(name) {
        Ok(()) => {
            println!("cargo:rustc-cfg={cfg}");
            println!("cargo:rustc-link-lib=dl");
            true
        }
        Err(e) => {
            println!(
                "cargo:warning=headers for {pkg} not found (install {package}): its network \
                 provider is not compiled in ({e})"
            );
            false
        }
    }
}

/// The include directories for `pkg`: `include_env`, else pkg-config's.
fn include_dirs(include_env: &str, pkg: &str) -> Vec<String> {
    if let Ok(dir) = std::env::var(include_env) {
        println!("cargo:rerun-if-changed={dir}");
        return vec![dir];
    }
    let Ok(out) = std::process::Command::new("pkg-config")
        .args(["--cflags-only-I", pkg])
        .output()
    else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|f| f.strip_prefix("-I").map(str::to_string))
        .collect()
}

/// Builds the emulated RDMA device (`csrc/ibemu.c`) as a shared library in OUT_DIR.
fn emulator() {
    println!("cargo:rustc-check-cfg=cfg(weft_ibemu)");
    println!("cargo:rerun-if-changed=csrc/ibemu.c");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let lib = out.join("libweft_ibemu.so");
    let compiler = cc::Build::new().get_compiler();
    let mut cmd = compiler.to_command();
    cmd.args([
        "-std=gnu11",
        "-O2",
        "-g",
        "-Wall",
        "-Wextra",
        "-fPIC",
        "-shared",
        "-pthread",
    ]);
    for dir in include_dirs("WEFT_IBV_INCLUDE", "libibverbs") {
        cmd.arg(format!("-I{dir}"));
    }
    cmd.arg("csrc/ibemu.c").arg("-o").arg(&lib);
    match cmd.status() {
        Ok(s) if s.success() => {
            println!("cargo:rustc-cfg=weft_ibemu");
            println!("cargo:rustc-env=WEFTCC_IBEMU_LIBRARY={}", lib.display());
        }
        other => {
            println!("cargo:warning=the emulated RDMA device did not build ({other:?})");
            return;
        }
    }
    // Its checks through the verbs API (tests/verbs_emulated.rs runs them).
    println!("cargo:rerun-if-changed=csrc/ibemu_check.c");
    let check = out.join("ibemu_check");
    let mut cmd = compiler.to_command();
    cmd.args(["-std=gnu11", "-O1", "-g", "-Wall", "-Wextra"]);
    for dir in include_dirs("WEFT_IBV_INCLUDE", "libibverbs") {
        cmd.arg(format!("-I{dir}"));
    }
    cmd.arg("csrc/ibemu_check.c")
        .arg("-o")
        .arg(&check)
        .arg("-ldl");
    match cmd.status() {
        Ok(s) if s.success() => {
            println!("cargo:rustc-env=WEFTCC_IBEMU_CHECK={}", check.display());
        }
        other => {
            println!("cargo:warning=the emulated RDMA device's checks did not build ({other:?})")
        }
    }
}

fn main() {
    // Headers installed after a first build: watch each header where it is, else the nearest
    // directory that exists (its modification time changes when the header's directory or file
    // is added; a missing path would rerun this script on every build).
    for (dir, header) in HEADERS {
        let watched = [header, dir, "/usr/include"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists());
        if let Some(path) = watched {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    let _ = shim(
        "weft_ofi_shim",
        "csrc/ofi_shim.c",
        "weft_ofi",
        "libfabric",
        "WEFT_OFI_INCLUDE",
        "libfabric-dev",
    );
    if shim(
        "weft_ibv_shim",
        "csrc/ibv_shim.c",
        "weft_ibv",
        "libibverbs",
        "WEFT_IBV_INCLUDE",
        "libibverbs-dev",
    ) {
        emulator();
    }
}
