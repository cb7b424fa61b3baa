//! The sharded norm's one algorithm, for both backends and for the Rust and Python callers.
//!
//! Every local gradient belongs to a *key*: the set of process groups its norm is summed over
//! (the groups it is split over; none for a gradient replicated on every rank or held by one
//! rank alone). A rank computes each tensor's norm, folds them into one partial per key
//! ([`key_partials`], the kernel `gradclip_key_partials` on the GPU), all-reduces each process
//! group's keys over that group in one global order ([`Reduction`]), and folds the combined
//! partials into the global norm and the clip coefficient ([`global`], `gradclip_keys_total`),
//! which the scale then reads. The arithmetic is `gradclip_kernels::combine`'s on both backends;
//! the collectives are the caller's (NCCL through [`crate::gpu::Communicator`] in Rust,
//! torch.distributed in `gradclip.torch`), issued in the order [`Reduction::all_reduces`] lists.

use std::ops::Range;

use gradclip_kernels::abi::{NormOutput, flags};
use gradclip_kernels::combine;

use crate::error::{Error, Result};
use crate::norm::NormType;

/// The most process groups one reduction takes (a key is a bit mask of them).
pub const MAX_GROUPS: usize = 64;

/// The most keys one reduction takes (threads of the one block of `gradclip_key_partials`).
pub const MAX_KEYS: usize = 1024;

/// One all-reduce of a reduction: the partials of the slots in `runs` over group `group` (its
/// position in the order the caller gave the groups in). With one run it reduces that range of
/// the partials vector in place; with several (a group whose keys cannot all be adjacent, from
/// three groups on) the caller gathers the runs into one buffer, all-reduces it and scatters it
/// back: one collective per group either way.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllReduce {
    /// The process group, by position.
    pub group: usize,
    /// The slots it reduces, as ascending, disjoint ranges.
    pub runs: Vec<Range<usize>>,
}

impl AllReduce {
    /// The number of slots it reduces.
    pub fn len(&self) -> usize {
        self.runs.iter().map(|r| r.len()).sum()
    }

    /// True when it reduces no slot (never, for the all-reduces of a [`Reduction`]).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where each key's partial sits (its *slot*) and the all-reduces that combine them.
///
/// The groups are given in one global order, outermost first, the same on every rank (a
/// DTensor's mesh dimensions by level, then by name; a Rust caller's by first appearance). The
/// all-reduces run group after group in that order, so every key's partial is reduced over
/// each of its groups in turn (ending as the reduction over their product), and no two ranks
/// wait on each other in opposite orders; each group with keys takes exactly one all-reduce. The
/// slots are the keys sorted in Gray-code order of their membership masks, so that a group's keys
/// are adjacent whenever the sets allow it (always with up to two groups: {}, {A}, {A, B}, {B}):
/// then the all-reduce is in place, else over the group's runs gathered ([`AllReduce`]).
#[derive(Clone, Debug)]
pub struct Reduction {
    slot_of: Vec<usize>,
    all_reduces: Vec<AllReduce>,
}

/// The position of `g` in the Gray-code sequence (the inverse of `i ^ (i >> 1)`).
fn inverse_gray(g: u64) -> u64 {
    let (mut b, mut s) = (g, g >> 1);
    while s != 0 {
        b ^= s;
        s >>= 1;
    }
    b
}

impl Reduction {
    /// The reduction of `keys`, each listed as the positions (in `0..num_groups`) of the groups
    /// it is reduced over. Keys that are the same set share a slot. Groups of one rank must be
    /// left out by the caller (they have nothing to combine).
    pub fn new(keys: &[Vec<usize>], num_groups: usize) -> Result<Self> {
        if num_groups > MAX_GROUPS {
            return Err(Error::ShardedLayout {
                detail: format!("{num_groups} process groups in one sharded norm; at most {MAX_GROUPS}: pass a norm_group that spans them"),
            });
        }
        let mut masks = Vec::with_capacity(keys.len());
        for (k, groups) in keys.iter().enumerate() {
            let mut m = 0u64;
            for &g in groups {
                if g >= num_groups {
                    return Err(Error::ShardedLayout {
                        detail: format!("key {k} names process group {g}, but only {num_groups} were given"),
                    });
                }
                m |= 1 << g;
            }
            masks.push(m);
        }
        let mut slots = masks.clone();
        slots.sort_unstable_by_key(|&m| inverse_gray(m));
        slots.dedup();
        if slots.len() > MAX_KEYS {
            return Err(Error::ShardedLayout {
                detail: format!(
                    "{} distinct sets of process groups in one sharded norm; at most {MAX_KEYS}",
                    slots.len()
                ),
            });
        }
        let slot_of = masks
            .iter()
            .map(|m| {
                slots
                    .binary_search_by_key(&inverse_gray(*m), |&s| inverse_gray(s))
                    .expect("every mask has a slot")
            })
            .collect();
        let mut all_reduces = Vec::new();
        for g in 0..num_groups {
            let bit = 1u64 << g;
            let mut runs: Vec<Range<usize>> = Vec::new();
            for (k, m) in slots.iter().enumerate() {
                if m & bit == 0 {
                    continue;
                }
                match runs.last_mut() {
                    Some(r) if r.end == k => r.end = k + 1,
                    _ => runs.push(k..k + 1),
                }
            }
            if !runs.is_empty() {
                all_reduces.push(AllReduce { group: g, runs });
            }
        }
        Ok(Reduction { slot_of, all_reduces })
    }

    /// The slot of key `key` (its index in the list given to [`Reduction::new`]); None past
    /// the last key.
    pub fn slot(&self, key: usize) -> Option<usize> {
        self.slot_of.get(key).copied()
    }

    /// The number of keys given to [`Reduction::new`].
    pub fn num_keys(&self) -> usize {
        self.slot_of.len()
    }

    /// The number of slots (distinct keys): the length of the partials vector.
    pub fn num_slots(&self) -> usize {
        self.slot_of.iter().max().map_or(0, |m| m + 1)
    }

    /// The all-reduces, in the order every rank must issue them.
    pub fn all_reduces(&self) -> &[AllReduce] {
        &self.all_reduces
    }

    /// The key tables of `gradclip_key_partials` for tensors whose keys are `keys` (None: a
    /// tensor not counted on this rank): the tensor indices slot after slot (in list order within
    /// a slot), then `num_slots + 1` offsets into them. A key index out of range is an error
    /// naming the tensor.
    pub fn key_tables(&self, keys: &[Option<usize>]) -> Result<Vec<u32>> {
        let n = self.num_slots();
        let mut count = vec![0u32; n + 1];
        for (t, k) in keys.iter().enumerate() {
            if let Some(k) = *k {
                let slot = *self.slot_of.get(k).ok_or_else(|| Error::ShardedLayout {
                    detail: format!("tensor {t} has key {k}, but the reduction has {} keys", self.slot_of.len()),
                })?;
                count[slot + 1] += 1;
            }
        }
        for s in 0..n {
            count[s + 1] += count[s];
        }
        let counted = count[n] as usize;
        let mut idx = vec![0u32; counted];
        let mut next = count.clone();
        for (t, k) in keys.iter().enumerate() {
            if let Some(k) = *k {
                let s = self.slot_of[k];
                idx[next[s] as usize] = t as u32;
                next[s] += 1;
            }
        }
        idx.extend_from_slice(&count);
        Ok(idx)
    }
}

/// What the ranks combine for a local norm (its p-th power; the norm for L1 and inf).
pub fn to_partial(norm: f64, norm_type: NormType) -> f64 {
    combine::to_partial(norm, norm_type.kind() as u32, norm_type.p())
}

/// The CPU's `gradclip_key_partials`: one partial per slot from the per-tensor norms and the key
/// tables of [`Reduction::key_tables`] (`num_slots` slots).
pub fn key_partials(per_tensor: &[f64], tables: &[u32], num_slots: usize, norm_type: NormType) -> Result<Vec<f64>> {
    let (idx, offsets) = split_tables(tables, num_slots, per_tensor.len())?;
    let (kind, p) = (norm_type.kind() as u32, norm_type.p());
    Ok((0..num_slots)
        .map(|s| {
            let run = &idx[offsets[s] as usize..offsets[s + 1] as usize];
            combine::key_partial(run.iter().map(|&t| per_tensor[t as usize]), kind, p)
        })
        .collect())
}

/// The key tables split into indices and offsets, checked: what the kernel relies on.
fn split_tables(tables: &[u32], num_slots: usize, num_tensors: usize) -> Result<(&[u32], &[u32])> {
    let bad = |detail: String| Err(Error::ShardedLayout { detail });
    if tables.len() < num_slots + 1 {
        return bad(format!("key tables of {} entries for {num_slots} slots", tables.len()));
    }
    let (idx, offsets) = tables.split_at(tables.len() - (num_slots + 1));
    if offsets[0] != 0 || offsets.windows(2).any(|w| w[0] > w[1]) || offsets[num_slots] as usize != idx.len() {
        return bad("key table offsets are not a partition of the indices".into());
    }
    if let Some(&t) = idx.iter().find(|&&t| t as usize >= num_tensors) {
        return bad(format!("key tables name tensor {t} of {num_tensors}"));
    }
    Ok((idx, offsets))
}

/// The CPU's `gradclip_keys_total`: the global norm of the combined partials (in slot order),
/// with the clip coefficient for `max_norm`, as the norm kernel writes its output.
pub fn global(partials: &[f64], norm_type: NormType, max_norm: f64) -> NormOutput {
    let kind = norm_type.kind() as u32;
    let v = combine::keys_partial(partials.iter().copied(), kind);
    combine::global_output(v, kind, norm_type.p(), max_norm, flags::CLIP)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one run of slots, as a Vec of runs
    fn two_process_groups_need_one_all_reduce_each() {
        // Keys over {}, {A}, {A, B}, {B}, given in another order: slots in Gray-code order.
        let r = Reduction::new(&[vec![0, 1], vec![], vec![1], vec![0], vec![1, 0]], 2).unwrap();
        assert_eq!(r.num_slots(), 4);
        assert_eq!(
            (r.slot(1).unwrap(), r.slot(3).unwrap(), r.slot(0).unwrap(), r.slot(2).unwrap()),
            (0, 1, 2, 3)
        );
        assert_eq!(r.slot(4).unwrap(), r.slot(0).unwrap(), "the same set shares a slot");
        assert_eq!(
            r.all_reduces(),
            [
                AllReduce {
                    group: 0,
                    runs: vec![1..3]
                },
                AllReduce {
                    group: 1,
                    runs: vec![2..4]
                }
            ]
        );
        assert_eq!(
            (0..16u64).map(|i| inverse_gray(i ^ (i >> 1))).collect::<Vec<_>>(),
            (0..16).collect::<Vec<_>>()
        );
    }

    #[test]
    fn every_key_is_reduced_over_each_of_its_groups_once_in_group_order() {
        // Three groups, every subset: some group's keys cannot all be adjacent.
        let keys: Vec<Vec<usize>> = (0..8usize).map(|m| (0..3).filter(|g| m & (1 << g) != 0).collect()).collect();
        let r = Reduction::new(&keys, 3).unwrap();
        let mut seen = vec![Vec::new(); 8];
        assert_eq!(
            r.all_reduces().iter().map(|a| a.group).collect::<Vec<_>>(),
            [0, 1, 2],
            "one per group, in order"
        );
        for a in r.all_reduces() {
            assert!(a.runs.windows(2).all(|w| w[0].end < w[1].start), "runs ascending and apart");
            for s in a.runs.iter().flat_map(|r| r.clone()) {
                seen[s].push(a.group);
            }
        }
        for (k, groups) in keys.iter().enumerate() {
            assert_eq!(&seen[r.slot(k).unwrap()], groups, "key {k}");
        }
        assert!(
            r.all_reduces().iter().any(|a| a.runs.len() > 1),
            "three groups: some group's keys are apart"
        );
    }

    #[test]
    fn key_tables_and_partials_match_a_direct_sum() {
        let r = Reduction::new(&[vec![0], vec![]], 1).unwrap();
        let keys = [Some(0), None, Some(1), Some(0), Some(1)];
        let tables = r.key_tables(&keys).unwrap();
        // Slot 0 is the empty set ({} first in Gray order): tensors 2 and 4; slot 1: 0 and 3.
        assert_eq!(tables, [2, 4, 0, 3, 0, 2, 4]);
        let norms = [3.0, 100.0, 1.0, 4.0, 2.0];
        let parts = key_partials(&norms, &tables, 2, NormType::L2).unwrap();
        assert_eq!(parts, [5.0, 25.0]);
        let out = global(&parts, NormType::L2, 1.0);
        assert_eq!(out.norm, 30f64.sqrt());
        assert_eq!(out.coef, gradclip_kernels::accum::clip_coefficient(30f64.sqrt(), 1.0));
        let inf = key_partials(&norms, &tables, 2, NormType::Inf).unwrap();
        assert_eq!((inf, global(&[2.0, 4.0], NormType::Inf, 1.0).norm), (vec![2.0, 4.0], 4.0));
    }

    #[test]
    fn bad_layouts_are_refused_by_name() {
        let e = Reduction::new(&[vec![2]], 2).unwrap_err().to_string();
        assert!(e.contains("key 0 names process group 2"), "{e}");
        assert!(Reduction::new(&[], 65).is_err());
        let r = Reduction::new(&[vec![0]], 1).unwrap();
        assert_eq!(r.slot(1), None, "a key past the last has no slot");
        let e = r.key_tables(&[Some(0), Some(3)]).unwrap_err().to_string();
        assert!(e.contains("tensor 1 has key 3"), "{e}");
        assert!(key_partials(&[1.0], &[5, 0, 1], 1, NormType::L2).is_err());
        assert!(key_partials(&[1.0], &[0, 0, 2], 1, NormType::L2).is_err());
        assert!(key_partials(&[1.0], &[0], 1, NormType::L2).is_err());
    }
}
