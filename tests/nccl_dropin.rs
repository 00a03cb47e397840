//! weftcc's `libnccl.so.2` (crate weftcc-nccl) as NCCL programs use it: C programs compiled
//! against NVIDIA's own `nccl.h` (headers only, from pip's nvidia-nccl wheel: `WEFT_NCCL_INCLUDE`,
//! fetched by `scripts/nccl_header.sh`) and linked with weftcc's library, run under `weft run` on
//! 1 to 4 ranks and as one process driving several ranks; the layouts of `ncclConfig_t`,
//! `ncclUniqueId` and the numbered values checked against the header at compile time; the
//! symbol table of docs/nccl-dropin.md held to the library and the header.
//!
//! Without the header the tests skip saying how to get it, unless `WEFT_NCCL_INCLUDE` is set
//! (CI): then a missing header fails them.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;
use weftcc_testkit::ranks::{wait_ranks, Finished};

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The directory of `nccl.h`, or None (after saying why) when it is not here.
fn nccl_include() -> Option<PathBuf> {
    if let Some(dir) = weftcc_settings::NCCL_INCLUDE.value() {
        let dir = PathBuf::from(dir);
        assert!(
            dir.join("nccl.h").is_file(),
            "WEFT_NCCL_INCLUDE={} holds no nccl.h (scripts/nccl_header.sh fetches it)",
            dir.display()
        );
        return Some(dir);
    }
    let found = Command::new("python3")
        .args([
            "-c",
            "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'include'))",
        ])
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
        .filter(|d| d.join("nccl.h").is_file());
    if found.is_none() {
        println!(
            "skipped: NVIDIA's nccl.h not found (no WEFT_NCCL_INCLUDE, no pip nvidia-nccl \
             wheel): export WEFT_NCCL_INCLUDE=$(scripts/nccl_header.sh)"
        );
    }
    found
}

/// The directory holding the libnccl.so this test was built with (cargo writes it beside the
/// test binary).
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent().expect("deps directory").to_path_buf()
}

/// A scratch directory of this test process.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("weftcc-nccl-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch directory");
    dir
}

/// Compiles `source` against `nccl.h` (the stand-in CUDA headers beside it): with `out`, links
/// it with weftcc's libnccl (its ELF name libnccl.so.2, as NVIDIA's) and `libs`; without, only
/// checks it.
fn cc(include: &Path, source: &Path, out: Option<&Path>, libs: &[&str]) {
    let mut c = Command::new("cc");
    c.args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-I"])
        .arg(root().join("nccl/tests/c/nocuda"))
        .arg("-I")
        .arg(root().join("testkit/c"))
        .arg("-I")
        .arg(include)
        .arg(source);
    match out {
        Some(out) => c
            .arg("-o")
            .arg(out)
            .arg("-L")
            .arg(lib_dir())
            .arg("-lnccl")
            .args(libs),
        None => c.arg("-fsyntax-only"),
    };
    let status = c.status().expect("a C compiler (cc)");
    assert!(status.success(), "{} does not compile", source.display());
}

/// A test program `nccl/tests/c/NAME.c` built in a scratch directory of its own, with a
/// directory holding `libnccl.so.2` (the name the program asks for) for LD_LIBRARY_PATH.
struct Program {
    dir: PathBuf,
    exe: PathBuf,
    libs: PathBuf,
}

impl Program {
    fn build(include: &Path, name: &str, scratch_name: &str, libs: &[&str]) -> Program {
        let dir = scratch(scratch_name);
        let exe = dir.join(name);
        let source = root().join(format!("nccl/tests/c/{name}.c"));
        cc(include, &source, Some(&exe), libs);
        let lib = dir.join("lib");
        std::fs::create_dir_all(&lib).expect("lib directory");
        std::os::unix::fs::symlink(lib_dir().join("libnccl.so"), lib.join("libnccl.so.2"))
            .expect("libnccl.so.2 link");
        Program {
            dir,
            exe,
            libs: lib,
        }
    }

    /// The program with `args`, finding weftcc's library first.
    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.exe);
        c.args(args)
            .env("LD_LIBRARY_PATH", &self.libs)
            .env("WEFT_TIMEOUT", "60");
        c
    }

    /// `weft run -n N` of the program with `args`.
    fn weft_run(&self, n: usize, args: &[&str], library_path: &str) -> Command {
        let mut c = Command::new(WEFT);
        c.args(["run", "-n", &n.to_string(), "--"])
            .arg(&self.exe)
            .args(args)
            .env("LD_LIBRARY_PATH", library_path)
            .env("WEFT_TIMEOUT", "60");
        c
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn run(what: &str, mut cmd: Command) {
    let kid = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start");
    let Finished { failed, report } = wait_ranks(vec![(0, kid)], Duration::from_secs(180));
    assert!(failed.is_empty(), "{what} failed\n{report}");
}

/// Generates C static assertions of this library's layouts and values against the header.
#[test]
fn layouts_and_values_match_nccl_h() {
    let Some(include) = nccl_include() else {
        return;
    };
    let dir = scratch("layout");
    let mut c = String::from("#include <stddef.h>\n#include <nccl.h>\n");
    let mut assert = |cond: String| {
        c += &format!("_Static_assert({cond}, \"{}\");\n", cond.replace('"', "'"));
    };
    assert(format!(
        "sizeof(ncclUniqueId) == {}",
        std::mem::size_of::<nccl::ncclUniqueId>()
    ));
    assert(format!(
        "NCCL_UNIQUE_ID_BYTES == {}",
        nccl::NCCL_UNIQUE_ID_BYTES
    ));
    assert(format!(
        "sizeof(ncclConfig_t) == {}",
        std::mem::size_of::<nccl::ncclConfig_t>()
    ));
    for (field, offset) in nccl::CONFIG_FIELDS {
        assert(format!("offsetof(ncclConfig_t, {field}) == {offset}"));
    }
    assert(format!("NCCL_API_MAGIC == {:#x}", nccl::NCCL_API_MAGIC));
    assert(format!(
        "NCCL_CONFIG_UNDEF_INT == {}",
        nccl::NCCL_CONFIG_UNDEF_INT
    ));
    assert(format!(
        "NCCL_SPLIT_NOCOLOR == {}",
        nccl::NCCL_SPLIT_NOCOLOR
    ));
    // Result codes: this library's own constants.
    macro_rules! named {
        ($($code:ident),*) => { [$((stringify!($code), nccl::$code)),*] };
    }
    let codes = named![
        ncclSuccess,
        ncclUnhandledCudaError,
        ncclSystemError,
        ncclInternalError,
        ncclInvalidArgument,
        ncclInvalidUsage,
        ncclRemoteError,
        ncclInProgress,
        ncclTimeout
    ];
    for (name, value) in codes {
        assert(format!("{name} == {value}"));
    }
    // Types and reductions: weftcc's numbering, passed through unchanged.
    let suffixes = "Int8 Uint8 Int32 Uint32 Int64 Uint64 Float16 Float32 Float64 Bfloat16 \
                    Sum Prod Max Min Avg NumOps ScalarDevice ScalarHostImmediate";
    for suffix in suffixes.split_whitespace() {
        assert(format!(
            "nccl{suffix} == {}",
            weft_code(&format!("weft{suffix}"))
        ));
    }
    let source = dir.join("layout.c");
    std::fs::write(&source, &c).expect("write layout.c");
    cc(&include, &source, None, &[]);
    println!(
        "{} static assertions hold against {}",
        c.matches("_Static_assert").count(),
        include.display()
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A value of weftcc's C header `bindings/include/weftcc.h` (`#define NAME VALUE`).
fn weft_code(name: &str) -> i32 {
    let header = std::fs::read_to_string(root().join("bindings/include/weftcc.h"))
        .expect("bindings/include/weftcc.h");
    header
        .lines()
        .find_map(|l| {
            let rest = l.strip_prefix("#define ")?.strip_prefix(name)?;
            rest.trim().parse().ok()
        })
        .unwrap_or_else(|| panic!("{name} not defined in weftcc.h"))
}

#[test]
fn c_programs_against_nccl_h_run_on_1_to_4_ranks_and_in_one_process() {
    let Some(include) = nccl_include() else {
        return;
    };
    let p = Program::build(&include, "nccl_ranks", "ranks", &[]);
    let libs = p.libs.display().to_string();
    for n in 1..=4 {
        let ids = p.dir.join(format!("ids-{n}"));
        std::fs::create_dir_all(&ids).expect("ids directory");
        let ids = ids.display().to_string();
        run(
            &format!("weft run -n {n} nccl_ranks job"),
            p.weft_run(n, &["job", &ids], &libs),
        );
    }
    for n in ["1", "4"] {
        run(&format!("nccl_ranks local {n}"), p.command(&["local", n]));
    }
}

/// The C program on device buffers (`cudaMalloc`, a stream; the CUDA runtime opened at run
/// time): compiled against `nccl.h` everywhere, run under `weft run -n 2` where a GPU is
/// (docs/gpu-results.md), else skipped saying so.
#[test]
fn c_program_on_device_buffers_compiles_and_runs_where_a_gpu_is() {
    let Some(include) = nccl_include() else {
        return;
    };
    let p = Program::build(&include, "nccl_device", "device", &["-ldl"]);
    let gpus = if weftcc::cuda::driver_present() {
        weftcc::cuda::device_count().unwrap_or(0)
    } else {
        0
    };
    if gpus == 0 {
        println!("skipped running nccl_device: no CUDA device (compiled against nccl.h only)");
        return;
    }
    // The CUDA runtime is found where the machine's LD_LIBRARY_PATH says.
    let path = match weftcc_settings::foreign("LD_LIBRARY_PATH") {
        Some(rest) => format!("{}:{rest}", p.libs.display()),
        None => p.libs.display().to_string(),
    };
    let ids = p.dir.display().to_string();
    run("weft run -n 2 nccl_device", p.weft_run(2, &[&ids], &path));
}

/// NCCL's variables are read where their weftcc twin is unset, and the twin wins: a value
/// weftcc refuses (`NCCL_PROTO=bogus`) fails the init, unless `WEFT_PROTO` is set.
#[test]
fn nccl_variables_are_honoured_and_weft_ones_win() {
    let Some(include) = nccl_include() else {
        return;
    };
    let p = Program::build(&include, "nccl_ranks", "twins", &[]);
    let local = |weft_proto: Option<&str>| {
        let mut cmd = p.command(&["local", "2"]);
        cmd.env("NCCL_PROTO", "bogus").env_remove("WEFT_PROTO");
        if let Some(v) = weft_proto {
            cmd.env("WEFT_PROTO", v);
        }
        cmd.output().expect("run nccl_ranks")
    };
    let refused = local(None);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && stderr.contains("bogus"),
        "NCCL_PROTO=bogus was not read: {stderr}"
    );
    let won = local(Some("simple"));
    assert!(
        won.status.success(),
        "WEFT_PROTO did not win over NCCL_PROTO: {}",
        String::from_utf8_lossy(&won.stderr)
    );
}

/// The `nccl*` names in the first column of docs/nccl-dropin.md's symbol table.
fn documented_symbols() -> BTreeSet<String> {
    let doc = std::fs::read_to_string(root().join("docs/nccl-dropin.md")).expect("the guide");
    doc.lines()
        .filter(|l| l.starts_with("| `nccl"))
        .filter_map(|l| l.split('`').nth(1).map(str::to_string))
        .collect()
}

/// Every symbol the library exports and every call NVIDIA's header declares is in the guide's
/// table, and the table names nothing else.
#[test]
fn the_guide_lists_every_symbol() {
    let lib = lib_dir().join("libnccl.so");
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&lib)
        .output()
        .expect("nm (binutils)");
    let exported: BTreeSet<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .filter(|s| s.starts_with("nccl"))
        .map(str::to_string)
        .collect();
    assert!(
        exported.len() > 40,
        "{} exports only {exported:?}",
        lib.display()
    );
    let documented = documented_symbols();
    let missing: Vec<_> = exported.difference(&documented).collect();
    assert!(
        missing.is_empty(),
        "exported but not in docs/nccl-dropin.md: {missing:?}"
    );
    let mut known = exported.clone();
    if let Some(include) = nccl_include() {
        let header = std::fs::read_to_string(include.join("nccl.h")).expect("nccl.h");
        let declared: BTreeSet<String> = header
            .lines()
            .filter(|l| l.starts_with("ncclResult_t") || l.starts_with("const char*"))
            .filter_map(|l| {
                let name = l.split('(').next()?.split_whitespace().last()?;
                name.starts_with("nccl").then(|| name.to_string())
            })
            .collect();
        let missing: Vec<_> = declared.difference(&documented).collect();
        assert!(
            missing.is_empty(),
            "in nccl.h but not in docs/nccl-dropin.md: {missing:?}"
        );
        known.extend(declared);
    }
    let unknown: Vec<_> = documented.difference(&known).collect();
    assert!(
        unknown.is_empty(),
        "docs/nccl-dropin.md lists unknown calls: {unknown:?}"
    );
}
