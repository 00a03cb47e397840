//! The shared library's ELF name is NCCL's (`libnccl.so.2`), so programs linked against it look
//! for that file, as they do for NVIDIA's. `-Bsymbolic`: the `weft*` calls inside bind to this
//! library's own copy even when a process also loads `libweft.so` (weftcc's Python package).
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnccl.so.2");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-Bsymbolic");
    println!("cargo:rerun-if-changed=build.rs");
}
