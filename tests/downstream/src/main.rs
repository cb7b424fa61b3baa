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
    // AdamW with the clip inside the step, bf16 parameters with f32 states.
    {
        use gradclip::cpu::HostGrad;
        use gradclip::optim::{AdamConfig, ClipConfig, HostAdamTensor, StepCount};
        let (mut w, g) = (vec![bf16::ONE; 8], vec![bf16::from_f32(2.0); 8]);
        let (mut m, mut v) = (vec![0.0f32; 8], vec![0.0f32; 8]);
        let mut count = StepCount::default();
        let mut tensors = [HostAdamTensor {
            param: HostGradMut::from(&mut w[..]),
            grad: HostGrad::from(&g[..]),
            exp_avg: HostGradMut::from(&mut m[..]),
            exp_avg_sq: HostGradMut::from(&mut v[..]),
            max_exp_avg_sq: None,
        }];
        let r = Cpu::new().adam_step(&mut tensors, &AdamConfig::adamw(0.1), &mut count, Some(&ClipConfig::new(1.0)))?;
        let norm = r.norm.ok_or("a clipped step reports its norm")?;
        assert!((norm - 32f64.sqrt()).abs() < 1e-12, "norm {norm}");
        assert_eq!(count.steps, 1);
        // The first Adam step moves each weight by about lr (minus the decay), whatever the clip.
        assert!((w[0].to_f32() - 0.9).abs() < 0.01, "weight {}", w[0]);
        println!("downstream optimizer check passed: norm {norm:.4}, weight {}", w[0]);
    }
    if Backend::detect() == Backend::Gpu {
        use gradclip::gpu::{DeviceGradMut, GpuEngine, NewNorm};
        let stream = gradclip::cudarc::driver::CudaContext::new(0)?.default_stream();
        let mut g = stream.clone_htod(&[3.0f32, 4.0])?;
        let mut engine = GpuEngine::new(stream.clone())?;
        let mut grads: [&mut dyn DeviceGradMut; 1] = [&mut g];
        let norm = engine
            .clip_grad_norm(&mut grads, 1.0, &ClipOptions::default(), NewNorm::default())?
            .read()?
            .norm;
        assert_eq!(norm, 5.0);
        println!("downstream GPU check passed: norm {norm}");
    }
    Ok(())
}
