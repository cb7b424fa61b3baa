//! Clip gradients in device memory on the GPU backend: `cargo run -p gradclip --example clip_gpu`.
//!
//! The norm and the clip are two kernel launches on the engine's stream; the result stays on the
//! device until `read()`, the only host synchronization. Without a GPU it says so and exits 0.

use gradclip::cudarc::driver::CudaContext;
use gradclip::gpu::{DeviceGradMut, GpuEngine, NewNorm};
use gradclip::half::bf16;
use gradclip::{Backend, ClipOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if Backend::detect() != Backend::Gpu {
        println!("no CUDA GPU here: nothing to run (see the clip_cpu example)");
        return Ok(());
    }
    let stream = CudaContext::new(0)?.default_stream();
    let mut w = stream.clone_htod(&vec![bf16::from_f32(0.01); 1 << 24])?;
    let mut b = stream.clone_htod(&vec![2.0f32; 4096])?;
    let mut engine = GpuEngine::new(stream.clone())?;
    let mut grads: [&mut dyn DeviceGradMut; 2] = [&mut w, &mut b];
    let norm = engine.clip_grad_norm(&mut grads, 1.0, &ClipOptions::default(), NewNorm::default())?;
    let r = norm.read()?;
    println!("total L2 norm {:.6}, clip coefficient {:.6e}", r.norm, r.coef);
    let b_host = stream.clone_dtoh(&b)?;
    println!("b[0] after the clip: {}", b_host[0]);
    Ok(())
}
