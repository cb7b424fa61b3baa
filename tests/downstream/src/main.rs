//! A downstream user's program on stable Rust: the CPU backend always, the GPU backend where a
//! GPU exists. Exits non-zero if a result is wrong.

use gradclip::cpu::{Cpu, HostGradMut};
use gradclip::half::bf16;
use gradclip::{Backend, ClipOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut a = vec![3.0f32; 4];
    let mut b = vec![bf16::from_f32(4.0); 4];
    let mut grads = [HostGradMut::from(&mut a[..]), HostGradMut::from(&mut b[..])];
    let r = Cpu::new().clip_grad_norm(&mut grads, 1.0, &ClipOptions::default())?;
    assert_eq!(r.norm, 10.0, "sqrt(4*9 + 4*16)");
    assert!((a[0] - 0.3).abs() < 1e-6, "scaled by 1 / (10 + 1e-6): {}", a[0]);
    println!("downstream CPU check passed: norm {}", r.norm);
    if Backend::detect() == Backend::Gpu {
        use gradclip::gpu::{DeviceGradMut, GpuEngine, NewNorm};
        let stream = gradclip::cudarc::driver::CudaContext::new(0)?.default_stream();
        let mut g = stream.clone_htod(&[3.0f32, 4.0])?;
        let mut engine = GpuEngine::new(stream.clone())?;
        let mut grads: [&mut dyn DeviceGradMut; 1] = [&mut g];
        let norm = engine.clip_grad_norm(&mut grads, 1.0, &ClipOptions::default(), NewNorm::default())?.read()?.norm;
        assert_eq!(norm, 5.0);
        println!("downstream GPU check passed: norm {norm}");
    }
    Ok(())
}
