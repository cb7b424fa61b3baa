//! Checks of the kernels' PTX against two known hazards of rustc's nvptx path, run by the build
//! script on every build (a failed check fails the build) and by this module's tests on PTX fed
//! to them:
//! - The PTX header: `.version` and `.target` are pinned ([`PTX_VERSION`], [`PTX_TARGET`]). With
//!   LLVM 22 the PTX ISA version is no longer implied by the target features (rust issue
//!   #157868), so a nightly bump could change what the driver is asked to JIT without a word.
//! - Barriers: each kernel's count of `bar.sync` is pinned ([`BARRIERS`]). rustc's MIR
//!   JumpThreading pass can copy a barrier into both arms of a branch, after which the threads
//!   of a block wait at different barriers; the build turns that pass off
//!   (`-Zmir-enable-passes=-JumpThreading`), and a count that changes (a barrier copied, or one
//!   added in a branch) fails the build until someone has looked at the new PTX and updated the
//!   table. Each kernel's barriers are placed where every thread of the block reaches them (see
//!   the SAFETY notes at each `sync_threads` in `kernels-gpu`).
//!
//! Shared with `host/build.rs` by `#[path]` (standard library only).

/// The PTX ISA version the kernels are built for (`-Ctarget-feature=+ptx78`: CUDA 11.8, the
/// `L1::no_allocate` load hint; every CUDA 12+ driver JITs it).
pub const PTX_VERSION: &str = "7.8";
/// The oldest architecture the PTX targets (Ampere; Hopper JIT-compiles it at load), without
/// debug info (a `, debug` target makes the driver JIT unoptimized code).
pub const PTX_TARGET: &str = "sm_80";

/// Each kernel's `bar.sync` count, as reviewed; kernels not listed have none. The norm kernels:
/// the block reduction's (two), and the last block's fold after its ticket (one, reached by the
/// whole block: the ticket flag is shared). The updates (`update_end`): the block's end before
/// thread 0's tickets and after them; with telemetry, the first is the tally's block
/// reduction's, and the block that finishes a tensor reduces its partials (a third, reached by
/// the whole block: the flag is shared). The policies: after thread 0's decision, AutoClip's
/// move (two per window), after it; AdaGC's decision: after the folds, the block reduction's,
/// after thread 0's call words.
pub const BARRIERS: &[(&str, usize)] = &[
    ("gradclip_norm_l1", 3),
    ("gradclip_norm_l2", 3),
    ("gradclip_norm_inf", 3),
    ("gradclip_norm_p", 3),
    ("gradclip_adam", 2),
    ("gradclip_sgd", 2),
    ("gradclip_lion", 2),
    ("gradclip_adam_stats", 3),
    ("gradclip_sgd_stats", 3),
    ("gradclip_lion_stats", 3),
    ("gradclip_clip_policy", 4),
    ("gradclip_adagc_decide", 3),
];

/// The header's `.version` and `.target`, when they are the pinned ones; else what differs.
pub fn check_header(ptx: &str) -> Result<(), String> {
    let field = |key: &str| {
        ptx.lines()
            .find_map(|l| l.trim().strip_prefix(key).map(|v| v.trim().to_string()))
            .unwrap_or_default()
    };
    let (version, target) = (field(".version"), field(".target"));
    if version != PTX_VERSION || target != PTX_TARGET {
        return Err(format!(
            "the kernels' PTX says .version {version:?} and .target {target:?}, not the pinned {PTX_VERSION} and {PTX_TARGET} \
             (a nightly bump may have changed them: see docs/toolchain.md)"
        ));
    }
    Ok(())
}

/// Each kernel's `bar.sync` count, in the PTX's order.
pub fn barrier_counts(ptx: &str) -> Vec<(String, usize)> {
    let mut out: Vec<(String, usize)> = Vec::new();
    for line in ptx.lines() {
        let l = line.trim();
        if let Some(rest) = l.strip_prefix(".visible .entry ") {
            out.push((rest.trim_end_matches('(').trim().to_string(), 0));
        } else if (l.starts_with("bar.sync") || l.starts_with("barrier.sync") || l.starts_with("bar.red"))
            && let Some(last) = out.last_mut()
        {
            last.1 += 1;
        }
    }
    out
}

/// Every kernel's barrier count as [`BARRIERS`] pins it; else the kernels that differ.
pub fn check_barriers(ptx: &str) -> Result<(), String> {
    let wrong: Vec<String> = barrier_counts(ptx)
        .into_iter()
        .filter_map(|(kernel, n)| {
            let want = BARRIERS.iter().find(|(k, _)| *k == kernel).map_or(0, |(_, n)| *n);
            (n != want).then(|| format!("{kernel}: {n} barriers, {want} reviewed"))
        })
        .collect();
    if wrong.is_empty() {
        return Ok(());
    }
    Err(format!(
        "the kernels' barriers changed ({}): a barrier copied into a branch (MIR JumpThreading) or one added \
         where not every thread may reach it; look at the PTX, then update BARRIERS in host/src/gpu/ptx_guard.rs",
        wrong.join("; ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const KERNEL: &str = ".version 7.8\n.target sm_80\n.address_size 64\n\n.visible .entry gradclip_clip_policy(\n)\n{\n\tbar.sync \t0;\n\tbar.sync \t0;\n\tbar.sync \t0;\n\tbar.sync \t0;\n\tret;\n}\n";

    #[test]
    fn the_built_ptx_passes_both_checks() {
        let ptx = crate::gpu::kernels::PTX;
        assert_eq!(check_header(ptx), Ok(()));
        assert_eq!(check_barriers(ptx), Ok(()));
        // Every pinned kernel is in the PTX (a renamed kernel would leave its row unchecked).
        let built = barrier_counts(ptx);
        for (k, _) in BARRIERS {
            assert!(built.iter().any(|(b, _)| b == k), "{k} is pinned but not in the PTX");
        }
    }

    #[test]
    fn a_changed_header_fails() {
        assert_eq!(check_header(KERNEL), Ok(()));
        for bad in [
            KERNEL.replace(".version 7.8", ".version 8.7"),
            KERNEL.replace("sm_80", "sm_90"),
            KERNEL.replace("sm_80", "sm_80, debug"),
        ] {
            assert!(check_header(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_barrier_copied_into_a_branch_fails() {
        assert_eq!(check_barriers(KERNEL), Ok(()));
        // JumpThreading's copy: the barrier after a branch now in both of its arms.
        let copied = KERNEL.replace(
            "\tret;",
            "\t@%p1 bra $L__BB0_2;\n\tbar.sync \t0;\n\tret;\n$L__BB0_2:\n\tbar.sync \t0;\n\tret;",
        );
        let err = check_barriers(&copied).unwrap_err();
        assert!(err.contains("gradclip_clip_policy: 6 barriers, 4 reviewed"), "{err}");
        // A kernel that is not pinned has none.
        let other = format!("{KERNEL}.visible .entry gradclip_scale(\n)\n{{\n\tbar.sync \t0;\n}}\n");
        assert!(
            check_barriers(&other)
                .unwrap_err()
                .contains("gradclip_scale: 1 barriers, 0 reviewed")
        );
    }
}
