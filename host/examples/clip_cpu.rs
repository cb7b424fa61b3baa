//! Clip a mixed-precision gradient list on the CPU backend: `cargo run -p gradclip --example clip_cpu`.
//!
//! The CPU backend gives the same bits as the GPU kernels (it runs their reduction order), so it
//! also serves as the reference when checking a GPU run.

use gradclip::cpu::{Cpu, HostGradMut};
use gradclip::half::{bf16, f16};
use gradclip::{ClipOptions, NormType};

fn main() -> Result<(), gradclip::Error> {
    // Three "parameters" of a model, in three dtypes.
    let mut embedding: Vec<bf16> = (0..4096).map(|i| bf16::from_f32((i % 7) as f32 - 3.0)).collect();
    let mut weight: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut bias: Vec<f16> = vec![f16::from_f32(0.5); 64];

    let mut grads = [
        HostGradMut::from(&mut embedding[..]),
        HostGradMut::from(&mut weight[..]),
        HostGradMut::from(&mut bias[..]),
    ];
    let opts = ClipOptions {
        norm_type: NormType::L2,
        per_tensor_norms: true,
        ..Default::default()
    };
    let report = Cpu::new().clip_grad_norm(&mut grads, 1.0, &opts)?;
    println!("total L2 norm {:.6}, clip coefficient {:.6e}", report.norm, report.coef);
    for (name, n) in ["embedding", "weight", "bias"].iter().zip(report.per_tensor.unwrap_or_default()) {
        println!("  {name:>9}: norm {n:.6}");
    }
    println!("weight[1] after the clip: {}", weight[1]);
    Ok(())
}
