//! The sharded clip on a real device: keys combined through a communicator (mirrored ranks in one
//! process), NCCL on one rank and on two GPUs.
//! Without a CUDA GPU every test is reported as ignored, never as passed.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};
use gradclip::NormType;
use gradclip::cpu::{Cpu, HostGradMut};
use gradclip::gpu::DeviceGradMut;
use gradclip_tests::gpu::*;
use gradclip_tests::*;

/// A stand-in for a group of `ranks` ranks that all hold what this rank holds: its all-reduce
/// multiplies by `ranks` (max: leaves as is), through the host (a test needs no speed).
struct Mirror {
    ranks: usize,
}

impl gradclip::gpu::Communicator for Mirror {
    fn size(&self) -> usize {
        self.ranks
    }
    fn all_reduce_f64(
        &self,
        buf: &mut cudarc::driver::CudaViewMut<'_, f64>,
        op: gradclip::gpu::Reduce,
        stream: &Arc<CudaStream>,
    ) -> gradclip::Result<()> {
        let mut v = vec![0.0f64; buf.len()];
        stream.memcpy_dtoh(buf, &mut v)?;
        if op == gradclip::gpu::Reduce::Sum {
            v.iter_mut().for_each(|x| *x *= self.ranks as f64);
        }
        stream.memcpy_htod(&v, buf)?;
        Ok(())
    }
}

/// The sharded clips on one GPU with mirrored "ranks": gradients over a group of 2 count twice,
/// over a group of 3 three times, replicated ones once, mixed in one call (several keys, two
/// process groups: one all-reduce each) and alone (the one-key path); against the CPU's norm
/// of the lists repeated that many times, and the CPU's scale by the coefficient.
fn sharded_keys_with_mirrors(gpu: &Gpu) -> TestResult {
    use gradclip::gpu::{Communicator, ShardGroup};
    let (two, three) = (Mirror { ranks: 2 }, Mirror { ranks: 3 });
    let lists = [
        random_grads(9400, 6, 80_000),
        random_grads(9500, 4, 60_000),
        random_grads(9600, 3, 40_000),
    ];
    for p in NORM_ORDERS {
        for mixed in [true, false] {
            let used: Vec<usize> = if mixed { vec![0, 1, 2] } else { vec![0] };
            let mine: Vec<Grad> = used.iter().flat_map(|&i| lists[i].iter().cloned()).collect();
            let mut devs = gpu.upload(&mine);
            let mut twins = gpu.host_twins(&mine, &devs);
            let mut out = gradclip::gpu::DeviceNorm::new(&gpu.stream, 0).unwrap();
            let mut engine = gpu.engine();
            {
                let mut boxes: Vec<Box<dyn DeviceGradMut + '_>> = devs.iter_mut().map(|d| d.view_mut()).collect();
                let mut refs: Vec<&mut (dyn DeviceGradMut + '_)> = boxes.iter_mut().map(|b| b.as_mut()).collect();
                let (a, rest) = refs.split_at_mut(lists[0].len());
                let (b, c) = rest.split_at_mut(if mixed { lists[1].len() } else { 0 });
                let o2: [&dyn Communicator; 1] = [&two];
                let o23: [&dyn Communicator; 2] = [&two, &three];
                let mut groups = vec![ShardGroup { grads: a, over: &o2 }];
                if mixed {
                    groups.push(ShardGroup { grads: b, over: &[] });
                    groups.push(ShardGroup { grads: c, over: &o23 });
                }
                engine
                    .clip_grad_norm_sharded_groups(&mut groups, 0.5, NormType::from_p(p).unwrap(), &mut out)
                    .map_err(|e| format!("p={p}: {e}"))?;
            }
            // The reference: list 0 twice, list 1 once, list 2 six times (2 x 3 ranks).
            let mut all: Vec<Grad> = Vec::new();
            for (i, times) in [(0usize, 2usize), (1, 1), (2, 6)] {
                if used.contains(&i) {
                    for _ in 0..times {
                        all.extend(lists[i].iter().cloned());
                    }
                }
            }
            let want = cpu_norm(&all, p, false).norm;
            let r = out.read().unwrap();
            ensure((r.norm - want).abs() <= 1e-12 * want, || {
                format!("p={p} mixed={mixed}: norm {} vs {want}", r.norm)
            })?;
            let mut views: Vec<HostGradMut> = twins.iter_mut().map(Grad::host_mut).collect();
            let coef = Cpu::new().clip_grads_with_norm(&mut views, 0.5, r.norm).unwrap();
            drop(views);
            ensure(same_bits(coef, r.coef), || format!("p={p}: coefficient {} vs {coef}", r.coef))?;
            ensure_same_bits(gpu, &devs, &twins, |i| {
                format!("p={p} mixed={mixed}: tensor {i} differs from the CPU's scale")
            })?;
        }
    }
    Ok(())
}

/// One rank's result: its report, its gradients' host twins, its gradients after the clip.
type RankResult = std::result::Result<(gradclip::NormReport, Vec<Grad>, Vec<Grad>), String>;

/// The sharded clip over NCCL on two GPUs (one thread per rank, a communicator bootstrapped
/// from one id): each rank holds different gradients (and, in the second round, the same
/// replicated gradients on both ranks, in a group of their own that is not reduced); both get
/// the global norm of all of them, each replicated gradient counted once (within 1e-12 of the
/// CPU's norm; the p-th powers are combined, not the partial accumulators), the same bits on
/// both ranks, and their gradients scaled by its coefficient exactly as the CPU scales them.
fn nccl_sharded_clip_two_gpus(_gpu: &Gpu) -> TestResult {
    nccl_sharded_clip(2)
}

/// The same on one GPU: a one-rank communicator (what a single-GPU run of a sharded trainer
/// makes), and one all-reduce through it on the engine's stream: NCCL found, loaded and called
/// through cudarc's bindings, whatever the host has.
fn nccl_one_rank(gpu: &Gpu) -> TestResult {
    use gradclip::gpu::{Communicator, Nccl, NcclId, Reduce};
    let comm = Nccl::new(gpu.stream.clone(), 0, 1, NcclId::new().map_err(|e| format!("{e}"))?).map_err(|e| format!("{e}"))?;
    ensure(comm.size() == 1 && comm.rank() == 0, || "a one-rank communicator".to_string())?;
    // NaN and the infinities too: Max reduces the values' i64 bits, which one rank leaves as they are.
    let host = [1.5f64, -0.0, f64::MIN_POSITIVE, 3e300, f64::NAN, f64::INFINITY, f64::NEG_INFINITY];
    let mut buf = gpu.stream.clone_htod(&host).map_err(|e| format!("{e}"))?;
    for op in [Reduce::Sum, Reduce::Max] {
        comm.all_reduce_f64(&mut buf.as_view_mut(), op, &gpu.stream)
            .map_err(|e| format!("{e}"))?;
        let got = gpu.stream.clone_dtoh(&buf).map_err(|e| format!("{e}"))?;
        ensure(got.iter().zip(&host).all(|(a, b)| same_bits(*a, *b)), || {
            format!("{op:?} over one rank changed the values: {got:?}")
        })?;
    }
    // A communicator of another stream is refused before anything is enqueued.
    let other = gpu.stream.fork().map_err(|e| format!("{e}"))?;
    ensure(comm.all_reduce_f64(&mut buf.as_view_mut(), Reduce::Sum, &other).is_err(), || {
        "an all-reduce on another stream than the communicator's was accepted".to_string()
    })?;
    nccl_sharded_clip(1)
}

/// `ranks` GPUs (one thread each, one NCCL communicator): each rank holds its shards (on one rank,
/// all of them) and optionally replicated gradients; the global norm is the CPU's on the unsharded
/// list within 1e-12, the ranks agree bit for bit, and every rank's clip equals the CPU's.
fn nccl_sharded_clip(ranks: usize) -> TestResult {
    use gradclip::gpu::{Nccl, NcclId};
    let split = [random_grads(9100, 30, 150_000), random_grads(9200, 7, 300_000)];
    let shards: Vec<Vec<Grad>> = match ranks {
        1 => vec![split.concat()],
        _ => split.to_vec(),
    };
    let replicated_lists = [Vec::new(), random_grads(9300, 5, 50_000)];
    for (p, replicated) in NORM_ORDERS.iter().flat_map(|&p| replicated_lists.iter().map(move |r| (p, r))) {
        let max_norm = 0.5;
        // An id bootstraps one communicator: a new one for each.
        let id = NcclId::new().map_err(|e| format!("{e}"))?;
        let results: Vec<RankResult> = std::thread::scope(|sc| {
            let handles: Vec<_> = shards
                .iter()
                .enumerate()
                .map(|(rank, grads)| {
                    sc.spawn(move || -> std::result::Result<_, String> {
                        let ctx = CudaContext::new(rank).map_err(|e| format!("device {rank}: {e}"))?;
                        let g = Gpu {
                            stream: ctx.default_stream(),
                        };
                        let mine: Vec<Grad> = grads.iter().chain(replicated).cloned().collect();
                        let mut devs = g.upload(&mine);
                        let twins = g.host_twins(&mine, &devs);
                        let comm = Nccl::new(g.stream.clone(), rank, ranks, id).map_err(|e| format!("rank {rank}: {e}"))?;
                        let mut engine = g.engine();
                        let mut out = gradclip::gpu::DeviceNorm::new(&g.stream, 0).unwrap();
                        {
                            let mut boxes: Vec<Box<dyn DeviceGradMut + '_>> = devs.iter_mut().map(|d| d.view_mut()).collect();
                            let mut refs: Vec<&mut (dyn DeviceGradMut + '_)> = boxes.iter_mut().map(|b| b.as_mut()).collect();
                            let (sharded, rest) = refs.split_at_mut(grads.len());
                            let over: [&dyn gradclip::gpu::Communicator; 1] = [&comm];
                            // Without replicated gradients one group: the one-key path.
                            let mut groups = vec![gradclip::gpu::ShardGroup {
                                grads: sharded,
                                over: &over,
                            }];
                            if !rest.is_empty() {
                                groups.push(gradclip::gpu::ShardGroup { grads: rest, over: &[] });
                            }
                            engine
                                .clip_grad_norm_sharded_groups(&mut groups, max_norm, NormType::from_p(p).unwrap(), &mut out)
                                .map_err(|e| format!("rank {rank}: {e}"))?;
                        }
                        let r = out.read().map_err(|e| format!("{e}"))?;
                        let after = devs.iter().map(|d| d.download(&g.stream)).collect();
                        Ok((r, twins, after))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("a rank panicked".into())))
                .collect()
        });
        let results = results.into_iter().collect::<std::result::Result<Vec<_>, _>>()?;
        let all: Vec<Grad> = shards.iter().flatten().chain(replicated).cloned().collect();
        let want = cpu_norm(&all, p, false).norm;
        let r0 = &results[0].0;
        for (rank, (r, ..)) in results.iter().enumerate().skip(1) {
            ensure(same_bits(r0.norm, r.norm) && same_bits(r0.coef, r.coef), || {
                format!("p={p}: ranks 0 and {rank} disagree: {r0:?} vs {r:?}")
            })?;
        }
        ensure((r0.norm - want).abs() <= 1e-12 * want, || {
            format!("p={p}: global norm {} vs CPU {want}", r0.norm)
        })?;
        for (rank, (r, twins, after)) in results.into_iter().enumerate() {
            let mut twins = twins;
            let mut views: Vec<HostGradMut> = twins.iter_mut().map(Grad::host_mut).collect();
            let coef = Cpu::new().clip_grads_with_norm(&mut views, max_norm, r.norm).unwrap();
            drop(views);
            ensure(same_bits(coef, r.coef), || {
                format!("p={p} rank {rank}: coefficient {} vs {coef}", r.coef)
            })?;
            for (i, (a, t)) in after.iter().zip(&twins).enumerate() {
                ensure(a.bits() == t.bits(), || {
                    format!("p={p} rank {rank}: tensor {i} differs from the CPU's scale")
                })?;
            }
        }
    }
    Ok(())
}

fn main() {
    run(
        vec![
            ("sharded_keys_with_mirrored_ranks", sharded_keys_with_mirrors),
            ("nccl_one_rank_all_reduce_and_sharded_clip", nccl_one_rank),
        ],
        vec![("nccl_sharded_clip_two_gpus", nccl_sharded_clip_two_gpus)],
    )
}
