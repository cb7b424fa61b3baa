//! CUDA-graph capture on a real device: the launch budget of a captured clip, and every capture
//! pattern replaying like eager calls.
//! Without a CUDA GPU every test is reported as ignored, never as passed.

use cudarc::driver::{CudaContext, CudaStream, DevicePtr};
use gradclip::gpu::{GpuEngine, NewNorm};
use gradclip::plan::RawTensor;
use gradclip::{ClipOptions, Error, NormType};
use gradclip_tests::gpu::*;
use gradclip_tests::*;

/// The device addresses of `devs` (uploaded from `grads`), for the raw calls.
fn raw_tensors(devs: &[DevGrad], grads: &[Grad], stream: &CudaStream) -> Vec<RawTensor> {
    devs.iter()
        .zip(grads)
        .map(|(d, g)| {
            let (base, size) = match d {
                DevGrad::Bf16(b, _) => (b.device_ptr(stream).0, 2),
                DevGrad::F16(b, _) => (b.device_ptr(stream).0, 2),
                DevGrad::F32(b, _) => (b.device_ptr(stream).0, 4),
                DevGrad::F64(b, _) => (b.device_ptr(stream).0, 8),
            };
            RawTensor {
                addr: base + size * g.start() as u64,
                len: g.len() as u64,
                dtype: g.dtype(),
            }
        })
        .collect()
}

/// Kernel nodes of a captured graph: the launch budget made visible.
fn kernel_nodes(graph: &cudarc::driver::CudaGraph) -> usize {
    use cudarc::driver::sys;
    let mut n = 0usize;
    // SAFETY: the graph is alive; the first call asks for the count, the second fills `nodes`.
    unsafe {
        sys::cuGraphGetNodes(graph.cu_graph(), std::ptr::null_mut(), &mut n)
            .result()
            .unwrap();
        if n == 0 {
            return 0; // the driver rejects a node array for an empty graph
        }
        let mut nodes = vec![std::ptr::null_mut(); n];
        sys::cuGraphGetNodes(graph.cu_graph(), nodes.as_mut_ptr(), &mut n).result().unwrap();
        nodes
            .iter()
            .filter(|&&node| {
                let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
                sys::cuGraphNodeGetType(node, &mut t).result().unwrap();
                t == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL
            })
            .count()
    }
}

/// The whole clip (and the norm alone) captured in CUDA graphs: 2 and 1 kernels whatever the
/// dtype mix (+1 with per-tensor norms), correct on every replay, and seeing new values on each.
fn graph_capture(_: &Gpu) -> TestResult {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    // Its own context, so that turning off cudarc's per-buffer events touches no other test.
    let ctx = CudaContext::new_non_primary(0, 0).unwrap();
    // SAFETY: every buffer of this context is used on one stream only.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().unwrap();
    let gpu = Gpu { stream: stream.clone() };
    let mut grads = random_grads(77, 9, 100_000);
    grads.retain(|g| !g.is_empty());
    let devs = gpu.upload(&grads);
    let raws = raw_tensors(&devs, &grads, &stream);
    let mut engine = GpuEngine::new(stream.clone()).unwrap();
    let mut out = gradclip::gpu::DeviceNorm::new(&stream, 0).unwrap();
    let mut out_per = gradclip::gpu::DeviceNorm::new(&stream, raws.len()).unwrap();
    let opts = ClipOptions::default();
    // First call plans and uploads the table; the captured ones reuse it and allocate nothing.
    // SAFETY (all raw calls): raws point into `devs`, alive for the whole test.
    // One list for every call (the binding's way); the engine knows its tables by the list's id.
    let raws = list(&raws);
    unsafe { engine.clip_grad_norm_raw(&raws, 1e30, &opts, &mut out) }.unwrap();
    let capture = |f: &mut dyn FnMut()| {
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).unwrap();
        f();
        stream.end_capture(CUgraphInstantiate_flags(0)).unwrap().expect("a graph")
    };
    let norm_graph = capture(&mut || unsafe { engine.total_norm_raw(&raws, NormType::L2, &mut out) }.unwrap());
    let norm_per_graph = capture(&mut || unsafe { engine.total_norm_raw(&raws, NormType::L2, &mut out_per) }.unwrap());
    let clip_graph = capture(&mut || unsafe { engine.clip_grad_norm_raw(&raws, 0.5, &opts, &mut out) }.unwrap());
    // The launch budget, whatever the dtype mix: 1 kernel for the norm (+1 for per-tensor norms),
    // 2 for norm + clip.
    for (g, want, what) in [
        (&norm_graph, 1, "norm"),
        (&norm_per_graph, 2, "norm with per-tensor norms"),
        (&clip_graph, 2, "clip"),
    ] {
        let n = kernel_nodes(g);
        ensure(n == want, || format!("{what}: {n} kernels in the graph, expected {want}"))?;
    }

    let mut current = gpu.host_twins(&grads, &devs);
    for replay in 0..3 {
        norm_graph.launch().unwrap();
        norm_per_graph.launch().unwrap();
        let (g, gp) = (out.read().unwrap(), out_per.read().unwrap());
        let c = cpu_norm(&current, 2.0, true);
        ensure(same_bits(g.norm, c.norm) && same_bits(gp.norm, c.norm), || {
            format!("replay {replay}: {:e} vs {:e}", g.norm, c.norm)
        })?;
        ensure(gp.per_tensor == c.per_tensor, || {
            format!("replay {replay}: per-tensor norms differ")
        })?;
        clip_graph.launch().unwrap();
        let r = cpu_clip(&mut current, 0.5, &opts).unwrap();
        ensure(same_bits(out.read().unwrap().coef, r.coef), || {
            format!("replay {replay}: coefficient differs")
        })?;
        for (i, (d, t)) in devs.iter().zip(&current).enumerate() {
            ensure(d.download(&stream).bits() == t.bits(), || {
                format!("replay {replay}: tensor {i} differs")
            })?;
        }
    }
    Ok(())
}

/// New random values for a list of the shapes, dtypes and phases of `like`.
fn fresh_values(like: &[Grad], seed: u64) -> Vec<Grad> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    };
    like.iter()
        .map(|g| {
            let scale = 10f64.powf(3.0 * next());
            let values: Vec<f64> = (0..g.len()).map(|_| scale * next()).collect();
            Grad::from_f64(g.dtype(), &values, g.start())
        })
        .collect()
}

/// Issue 11's capture patterns through the raw API, captured in global mode (PyTorch's default):
/// a first call of a never-seen list on a never-used stream, another list run eagerly on the
/// same engine between capture and replay, two graphs of two lists, 1,000 replays with changing
/// values each bit-identical to an eager call on another stream, calls that cannot be captured
/// refused with a typed error that leaves the capture valid, and the graphs' tables freed once
/// the graphs are destroyed.
fn graph_capture_patterns(_: &Gpu) -> TestResult {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    use gradclip::gpu::{DeviceNorm, graph_tables_live};
    let ctx = CudaContext::new_non_primary(0, 0).unwrap();
    // SAFETY: every buffer of this context is ordered by explicit synchronization below.
    unsafe { ctx.disable_event_tracking() };
    let (eager_stream, capture_stream) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let gpu = Gpu {
        stream: eager_stream.clone(),
    };
    let nonempty = |mut v: Vec<Grad>| {
        v.retain(|g| !g.is_empty());
        v
    };
    let (list_a, list_b) = (nonempty(random_grads(101, 7, 20_000)), nonempty(random_grads(102, 4, 3_000)));
    let (mut devs_a, devs_b) = (gpu.upload(&list_a), gpu.upload(&list_b));
    let (raws_a, raws_b) = (
        raw_tensors(&devs_a, &list_a, &eager_stream),
        raw_tensors(&devs_b, &list_b, &eager_stream),
    );
    eager_stream.synchronize().unwrap();
    let mut captor = GpuEngine::new(capture_stream.clone()).unwrap();
    let mut eager = GpuEngine::new(eager_stream.clone()).unwrap();
    let (mut out_a, mut out_b) = (
        DeviceNorm::new(&capture_stream, 0).unwrap(),
        DeviceNorm::new(&capture_stream, 0).unwrap(),
    );
    let mut out_eager = DeviceNorm::new(&eager_stream, 0).unwrap();
    let opts = ClipOptions::default();
    let live = graph_tables_live();
    let capture = |f: &mut dyn FnMut()| {
        capture_stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
            .unwrap();
        f();
        capture_stream.end_capture(CUgraphInstantiate_flags(0)).unwrap()
    };

    // Refused under capture, with the capture still valid (it ends without error).
    let mut refused = Vec::new();
    let empty = capture(&mut || {
        // SAFETY (every raw call in this test): the raws point into devs_a/devs_b, alive here.
        refused.push(unsafe { captor.total_norm_raw(&list(&raws_a), NormType::L2, NewNorm::default()) }.err());
        let strict = ClipOptions {
            error_if_nonfinite: true,
            ..opts
        };
        refused.push(unsafe { captor.clip_grad_norm_raw(&list(&raws_a), 1.0, &strict, &mut out_a) }.err());
    });
    ensure(refused.iter().all(|r| matches!(r, Some(Error::NotCapturable { .. }))), || {
        format!("expected NotCapturable twice, got {refused:?}")
    })?;
    ensure(empty.is_none_or(|g| kernel_nodes(&g) == 0), || "refused calls left kernels".into())?;

    // A never-seen list, first call of a new engine, under capture.
    let graph_a = capture(&mut || unsafe { captor.clip_grad_norm_raw(&list(&raws_a), 0.5, &opts, &mut out_a) }.unwrap()).expect("a graph");
    // Another list runs on the same engine before the replays (its workspace now holds list B).
    unsafe { captor.clip_grad_norm_raw(&list(&raws_b), 1e30, &opts, &mut out_b) }.unwrap();
    let graph_b = capture(&mut || unsafe { captor.total_norm_raw(&list(&raws_b), NormType::Inf, &mut out_b) }.unwrap()).expect("a graph");
    ensure(graph_tables_live() == live + 2, || {
        format!("{} graph tables live, expected {}", graph_tables_live(), live + 2)
    })?;
    for (g, want) in [(&graph_a, 2), (&graph_b, 1)] {
        ensure(kernel_nodes(g) == want, || format!("{} kernels, expected {want}", kernel_nodes(g)))?;
    }

    let want_b = eager
        .total_norm(
            &devs_b
                .iter()
                .map(|d| d.view())
                .collect::<Vec<_>>()
                .iter()
                .map(|b| b.as_ref())
                .collect::<Vec<_>>(),
            NormType::Inf,
            NewNorm::default(),
        )
        .unwrap()
        .read()
        .unwrap();
    for replay in 0..1000u64 {
        let values = fresh_values(&list_a, replay);
        devs_a.iter_mut().zip(&values).for_each(|(d, v)| d.overwrite(&eager_stream, v));
        eager_stream.synchronize().unwrap();
        graph_a.launch().unwrap();
        if replay % 100 == 0 {
            graph_b.launch().unwrap();
            let got_b = out_b.read().unwrap();
            ensure(same_bits(got_b.norm, want_b.norm), || format!("replay {replay}: graph B's norm"))?;
        }
        let got = out_a.read().unwrap();
        let got_grads: Vec<Grad> = devs_a.iter().map(|d| d.download(&capture_stream)).collect();
        devs_a.iter_mut().zip(&values).for_each(|(d, v)| d.overwrite(&eager_stream, v));
        unsafe { eager.clip_grad_norm_raw(&list(&raws_a), 0.5, &opts, &mut out_eager) }.unwrap();
        let want = out_eager.read().unwrap();
        ensure(same_bits(got.norm, want.norm) && same_bits(got.coef, want.coef), || {
            format!("replay {replay}: norm {:e} vs eager {:e}", got.norm, want.norm)
        })?;
        for (i, (d, g)) in devs_a.iter().zip(&got_grads).enumerate() {
            ensure(d.download(&eager_stream).bits() == g.bits(), || {
                format!("replay {replay}: tensor {i} differs from the eager clip")
            })?;
        }
    }

    // Destroyed graphs release their tables; the driver queues them, the next call frees them.
    drop((graph_a, graph_b));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while graph_tables_live() != live && std::time::Instant::now() < deadline {
        unsafe { captor.total_norm_raw(&list(&raws_b), NormType::L2, &mut out_b) }.unwrap();
        capture_stream.synchronize().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    ensure(graph_tables_live() == live, || {
        format!(
            "{} graph tables live after the graphs were dropped, expected {live}",
            graph_tables_live()
        )
    })
}

fn main() {
    run(
        vec![
            ("graph_capture_launch_budget_and_replays", graph_capture),
            ("graph_capture_patterns_replay_like_eager", graph_capture_patterns),
        ],
        vec![],
    )
}
