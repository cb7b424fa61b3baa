//! Compiles the `gradclip-kernels` crate to PTX with rustc's nvptx64 backend and leaves it in
//! `OUT_DIR/gradclip_kernels.ptx` for `include_str!`.
//!
//! A nested `cargo rustc` (its own target dir, so it never waits on the outer build's lock) builds
//! `core` from source (`-Zbuild-std=core`, there is no prebuilt nvptx std) and emits assembly.
//! There is no bitcode linker for this target on the pinned nightly, so the kernels must not call
//! non-inlined code from other crates: any `.extern .func` left in the PTX fails the build here
//! instead of failing to load on a GPU.

use std::path::{Path, PathBuf};
use std::process::Command;
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
    // Tuning knobs read by the kernel crate (see gradclip_kernels::abi).
    println!("cargo:rerun-if-env-changed=GRADCLIP_CHUNK_VECS");
    println!("cargo:rerun-if-env-changed=GRADCLIP_LOAD_UNROLL");
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let target_dir = out_dir.join("nvptx-target");
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());

    let mut cmd = Command::new(cargo);
    cmd.arg("rustc")
        .arg("--manifest-path")
        .arg(kernels.join("Cargo.toml"))
        .args(["--release", "--lib", "--target", "nvptx64-nvidia-cuda", "-Zbuild-std=core"])
        .arg("--target-dir")
        .arg(&target_dir)
        .args(["--", "--emit=asm"]);
    // The outer build's flags and target settings are for the host, never for the kernels.
    for var in [
        "RUSTFLAGS",
        "CARGO_BUILD_TARGET",
        "CARGO_TARGET_DIR",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_BUILD_RUSTFLAGS",
    ] {
        cmd.env_remove(var);
    }
    // No debug info: a `.target sm_80, debug` module makes the driver JIT unoptimized code.
    cmd.env("CARGO_PROFILE_RELEASE_DEBUG", "false");
    // A high unroll threshold fully unrolls the per-lane batches of LOAD_UNROLL vectors, so they
    // stay in registers instead of a local-memory array (checked by the PTX test in gpu::kernels).
    cmd.env(
        "CARGO_ENCODED_RUSTFLAGS",
        format!("-Ctarget-cpu={TARGET_CPU}\x1f-Ctarget-feature=+{PTX_ISA}\x1f-Cllvm-args=-unroll-threshold=4000"),
    );
    let status = cmd.status().expect("failed to start the nested cargo that builds the PTX");
    assert!(status.success(), "building the nvptx kernels failed (see the errors above)");

    let ptx = newest_asm(&target_dir.join("nvptx64-nvidia-cuda/release/deps"));
    let text = fs::read_to_string(&ptx).expect("reading the emitted PTX");
    if let Some(line) = text.lines().find(|l| l.contains(".extern .func")) {
        panic!(
            "the kernel PTX calls a function it does not define ({line}); \
             mark the callee #[inline(always)] or avoid that core API in kernels"
        );
    }
    fs::write(out_dir.join("gradclip_kernels.ptx"), text).expect("writing the PTX");
}

fn newest_asm(dir: &Path) -> PathBuf {
    fs::read_dir(dir)
        .expect("the nvptx build left no deps folder")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with("gradclip_kernels-") && name.ends_with(".s")
        })
        .max_by_key(|p| fs::metadata(p).and_then(|m| m.modified()).ok())
        .expect("the nvptx build emitted no gradclip_kernels-*.s")
}
