//! Compiles the `gradclip-kernels` crate to PTX with rustc's nvptx64 backend and leaves it in
//! `OUT_DIR/gradclip_kernels.ptx` for `include_str!`.
//!
//! The kernels need nightly Rust (the GPU kernel ABI, nvptx intrinsics, `-Zbuild-std=core`: there
//! is no prebuilt nvptx `core`), while gradclip itself, and any crate that depends on it, builds
//! on stable. So the nested build runs under the nightly pinned in `kernels-gpu/rust-toolchain.toml`
//! through rustup, whatever toolchain the outer build uses, and installs it with rustup when it
//! is missing (set `GRADCLIP_NO_TOOLCHAIN_INSTALL=1` to get an error naming the command instead).
//!
//! The nested `cargo rustc` has its own target dir (it never waits on the outer build's lock)
//! and writes the assembly to a path given on its command line (`--emit=asm=PATH`). There is
//! no bitcode linker for this target on the pinned nightly, so the kernels must not call
//! non-inlined code from other crates: any `.extern .func` left in the PTX fails the build here
//! instead of failing to load on a GPU.

use std::path::{Path, PathBuf};

#[path = "src/gpu/ptx_guard.rs"]
#[allow(dead_code)]
mod ptx_guard;
use std::process::{Command, Stdio};
use std::{env, fs};

/// Oldest GPU architecture the PTX targets: Ampere (A100); Hopper JIT-compiles it at load.
const TARGET_CPU: &str = "sm_80";
/// PTX ISA 7.8 (CUDA 11.8): needed for the `L1::no_allocate` load hint; every CUDA 12+ driver JITs it.
const PTX_ISA: &str = "ptx78";

fn main() {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let kernels = manifest_dir.join("../kernels-gpu");
    println!("cargo:rerun-if-changed={}", kernels.join("src").display());
    println!("cargo:rerun-if-changed={}", kernels.join("Cargo.toml").display());
    println!("cargo:rerun-if-changed={}", kernels.join("rust-toolchain.toml").display());
    // Tuning knobs read by the kernel crate (see gradclip_kernels::abi).
    println!("cargo:rerun-if-env-changed=GRADCLIP_CHUNK_VECS");
    println!("cargo:rerun-if-env-changed=GRADCLIP_LOAD_UNROLL");
    println!("cargo:rerun-if-env-changed=GRADCLIP_NO_TOOLCHAIN_INSTALL");
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let toolchain = pinned_toolchain(&kernels.join("rust-toolchain.toml"));
    ensure_toolchain(&toolchain);

    let mut cmd = Command::new("rustup");
    cmd.args(["run", &toolchain, "cargo", "rustc"])
        .arg("--manifest-path")
        .arg(kernels.join("Cargo.toml"))
        .args(["--release", "--lib", "--target", "nvptx64-nvidia-cuda", "-Zbuild-std=core"])
        .arg("--target-dir")
        .arg(out_dir.join("nvptx-target"));
    // Benchmark kernels (streaming read, fill, eager baseline) only when asked for.
    if env::var_os("CARGO_FEATURE_BENCH_KERNELS").is_some() {
        cmd.args(["--features", "bench-kernels"]);
    }
    // The assembly goes to a path of our choosing (beside cargo's own outputs, which it still
    // emits): no searching the deps folder for the newest file.
    let ptx = out_dir.join("nvptx-target/gradclip_kernels.s");
    cmd.arg("--").arg(format!("--emit=asm={}", ptx.display()));
    // The outer build's toolchain, flags and target settings are for the host, never for the
    // kernels: the nested cargo must find the pinned nightly's rustc, not the one cargo set here.
    for var in [
        "RUSTC",
        "RUSTDOC",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTUP_TOOLCHAIN",
        "RUSTFLAGS",
        "CARGO_BUILD_TARGET",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO",
    ] {
        cmd.env_remove(var);
    }
    // No debug info: a `.target sm_80, debug` module makes the driver JIT unoptimized code.
    cmd.env("CARGO_PROFILE_RELEASE_DEBUG", "false");
    // A high unroll threshold fully unrolls the per-lane batches of LOAD_UNROLL vectors, so they
    // stay in registers instead of a local-memory array (checked by the PTX test in gpu::kernels).
    // MIR JumpThreading can copy a barrier into both arms of a branch (ptx_guard): off.
    cmd.env(
        "CARGO_ENCODED_RUSTFLAGS",
        format!(
            "-Ctarget-cpu={TARGET_CPU}\x1f-Ctarget-feature=+{PTX_ISA}\x1f-Cllvm-args=-unroll-threshold=4000\x1f-Zmir-enable-passes=-JumpThreading"
        ),
    );
    let status = cmd
        .status()
        .unwrap_or_else(|e| fail(&format!("cannot run rustup ({e})"), &toolchain));
    if !status.success() {
        panic!("building the nvptx kernels with {toolchain} failed (see the errors above)");
    }
    let text = fs::read_to_string(&ptx).unwrap_or_else(|e| panic!("reading the emitted PTX {}: {e}", ptx.display()));
    if let Some(line) = text.lines().find(|l| l.contains(".extern .func")) {
        panic!(
            "the kernel PTX calls a function it does not define ({line}); \
             mark the callee #[inline(always)] or avoid that core API in kernels"
        );
    }
    for check in [ptx_guard::check_header(&text), ptx_guard::check_barriers(&text)] {
        if let Err(e) = check {
            panic!("{e}");
        }
    }
    fs::write(out_dir.join("gradclip_kernels.ptx"), with_register_limits(text)).expect("writing the PTX");
}

/// Register limits per kernel, as `.maxnreg` directives: rustc has no `__launch_bounds__`, and
/// ptxas gives a kernel the registers of its most demanding path. Measured on the H200
/// (benches/NOTES.md): the Adam kernel ran a bf16 step in 26.5 ms at 80 registers (3 blocks of
/// 256 threads per SM) against 32.1 ms unbounded (94, 2 blocks); 64 (4 blocks, with spills) was
/// no faster. The limit keeps that occupancy when a change adds registers; SGD's and Lion's
/// kernels (the same walk, fewer states) take it too.
/// `GRADCLIP_ADAM_MAXNREG` overrides it for tuning runs (0: no limit), and
/// `GRADCLIP_STATS_MAXNREG` the telemetry (`_stats`) kernels' alone (their loops spill two f64
/// sums at 80; benches/NOTES.md).
fn with_register_limits(mut text: String) -> String {
    let limit = |var: &str, default: u32| {
        println!("cargo:rerun-if-env-changed={var}");
        match env::var(var) {
            Ok(v) => v.parse().unwrap_or_else(|_| panic!("{var}={v}: expected a register count")),
            Err(_) => default,
        }
    };
    let adam = limit("GRADCLIP_ADAM_MAXNREG", 80);
    let stats = limit("GRADCLIP_STATS_MAXNREG", adam);
    let kernels = ["gradclip_adam", "gradclip_sgd", "gradclip_lion"]
        .into_iter()
        .flat_map(|k| [(k.to_string(), adam), (format!("{k}_stats"), stats)]);
    for (kernel, regs) in kernels {
        if regs == 0 {
            continue;
        }
        let entry = format!(".entry {kernel}(");
        let Some(at) = text.find(&entry) else {
            panic!("the PTX has no kernel {kernel} to limit");
        };
        // The directive goes between the parameter list and the body.
        let Some(close) = text[at..].find(")\n").map(|i| at + i + 2) else {
            panic!("kernel {kernel}: no end of its parameter list in the PTX");
        };
        text.insert_str(close, &format!(".maxnreg {regs}\n"));
    }
    text
}

/// The `channel` of the kernels' rust-toolchain.toml (one line, no TOML parser needed).
fn pinned_toolchain(file: &Path) -> String {
    let text = fs::read_to_string(file).unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("channel"))
        .filter_map(|rest| rest.trim().strip_prefix('='))
        .map(|v| v.trim().trim_matches('"').to_string())
        .next()
        .unwrap_or_else(|| panic!("{} names no channel", file.display()))
}

/// True when `toolchain` is installed with the standard library's source (for -Zbuild-std).
fn has_toolchain(toolchain: &str) -> bool {
    let sysroot = Command::new("rustup")
        .args(["run", toolchain, "rustc", "--print", "sysroot"])
        .env_remove("RUSTUP_TOOLCHAIN")
        .stderr(Stdio::null())
        .output();
    match sysroot {
        Ok(o) if o.status.success() => {
            let root = PathBuf::from(String::from_utf8_lossy(&o.stdout).trim());
            root.join("lib/rustlib/src/rust/library/core").is_dir()
        }
        _ => false,
    }
}

/// Installs the pinned nightly and rust-src through rustup when they are missing.
fn ensure_toolchain(toolchain: &str) {
    if has_toolchain(toolchain) {
        return;
    }
    if env::var_os("GRADCLIP_NO_TOOLCHAIN_INSTALL").is_some() {
        fail("it is not installed (GRADCLIP_NO_TOOLCHAIN_INSTALL is set)", toolchain);
    }
    println!("cargo:warning=installing {toolchain} with rust-src through rustup, once, to build gradclip's GPU kernels");
    let status = Command::new("rustup")
        .args(["toolchain", "install", toolchain, "--profile", "minimal", "--component", "rust-src"])
        .env_remove("RUSTUP_TOOLCHAIN")
        .stdout(Stdio::null())
        .status();
    match status {
        Ok(s) if s.success() && has_toolchain(toolchain) => {}
        Ok(_) => fail("rustup could not install it", toolchain),
        Err(e) => fail(&format!("rustup is not available ({e})"), toolchain),
    }
}

/// Fails the build with one line that names the command to run.
fn fail(why: &str, toolchain: &str) -> ! {
    panic!(
        "gradclip's GPU kernels need the Rust toolchain {toolchain} with rust-src, and {why}: \
         run `rustup toolchain install {toolchain} --profile minimal --component rust-src`"
    )
}
