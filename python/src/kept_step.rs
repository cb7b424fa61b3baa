//! What an optimizer step keeps between calls, whichever reader made it: torch's param groups
//! and state dict ([`crate::optim`], the eager step) or the compiled op's lists
//! ([`crate::list_step`]). Each reader checks that its tensors are still the ones read; the kept
//! step then makes the step's list of this call's gradients, one way for both: the gradients
//! recognized ([`StepGrads`]) and placed by the one list rule ([`StatedLists`]).
//!
//! # The gradients, recognized without holding them
//!
//! With torch's C shim and libc10's gradient getter ([`crate::tensor_facts`]) every gradient is
//! read natively from its parameter, without its Python object (autograd makes gradients without
//! one; reading `.grad` makes one, and the garbage collector's work with it): which parameters
//! have a gradient, and each gradient's address, length, dtype, device and contiguity
//! ([`StepGrads::list_read`]). What follows describes the reads through Python objects, which a
//! torch without that getter gets.
//!
//! A training loop hands the step the same gradient tensors again (`zero_grad(set_to_none=False)`,
//! accumulation), new tensors of the same shapes (`zero_grad()`, torch's default, often at the
//! same addresses), or a set whose None gradients changed (experts that got no tokens). Each is
//! recognized with the fewest calls into torch per gradient:
//! - **the same objects** (known by weak references, made once the gradients' Python objects sit
//!   where last step's did): their addresses are read in native code, no call into torch;
//! - **new objects** (of the same set or not): each gradient whose parameter had a gradient read
//!   before is read by contiguity and address only (natively through torch's C shim,
//!   [`crate::tensor_facts`], when the planner has it): torch gives a gradient its parameter's
//!   dtype, sizes and device (the `.grad` setter and autograd check them), and the parameter's
//!   layout is the layout's (its address is checked every step, its storage held). Any other
//!   gradient is read in full. At the kept addresses the kept list is the step's; elsewhere the
//!   kept list takes the new gradients ([`StepList::with_grads`]: only theirs are checked).
//!   The step list keeps the parameters whose gradient is None, marked absent, so the list and
//!   the kernels' tables stay those of the layout whatever the set of None gradients.
//!
//! torch's list guard (`TensorGuards`, which the clip's planner uses without the shim) is not
//! used here: on new
//! gradient objects it reads more of each tensor (dispatch keys, sizes, strides, requires_grad)
//! than the contiguity and address the step needs, and those first reads of new objects are what
//! a step with new gradients pays for (the MoE step's `grads` stage on the H200's host: about a
//! fifth less with new gradients at new addresses, a third less at reused ones; `benches/NOTES.md`,
//! eighteenth session).
//!
//! No strong reference to a gradient is kept between steps: a gradient that `zero_grad()` drops
//! is freed then, not after the next backward (which would hold a second set of gradients).

use gradclip::optim::StepList;
use gradclip::plan::RawTensor;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyType, PyWeakrefMethods, PyWeakrefReference};

use crate::guards::{AddressCheck, data_ptr};
use crate::place::Place;
use crate::scan::{Planner, entry_of, readable_at};
use crate::stated_lists::{ListMaker, StatedLists, StepGroup};
use crate::tensor_addresses::DataPtrReader;
use crate::tensor_facts::{Facts, TensorFacts};

/// A step's tensors as read (see the module's documentation).
pub(crate) struct KeptStep {
    pub(crate) place: Place,
    pub(crate) groups: Vec<StepGroup>,
    /// The storages of the tensors the step writes (parameters, states, step counts), held: a
    /// kept address stays theirs, so the readers' address checks say the tensors are the ones
    /// read.
    pub(crate) storages: Vec<Py<PyAny>>,
    pub(crate) grads: StepGrads,
}

/// The gradients of a step: their facts read natively, or their Python objects.
pub(crate) enum Present<'py> {
    Facts(Vec<Facts>),
    Objects(Bound<'py, PyList>),
}

impl KeptStep {
    pub(crate) fn new(place: Place, groups: Vec<StepGroup>, storages: Vec<Py<PyAny>>) -> Self {
        let params = groups.iter().map(|g| g.parts.len()).sum();
        KeptStep {
            place,
            groups,
            storages,
            grads: StepGrads::new(params),
        }
    }

    /// Each list tensor's parameter, by its place among every group's parameters, for the
    /// gradients of `mask` (the telemetry's rows).
    pub(crate) fn listed(&self, mask: &[bool]) -> Vec<usize> {
        StatedLists::new(&self.groups).listed(mask).collect()
    }

    /// The checked step list of this call's gradients `present` (those of the parameters set in
    /// `mask`; `check_len`: see [`StepGrads::list`]); None when a gradient is not the engine's to read or
    /// the list fails its checks.
    pub(crate) fn list(
        &mut self,
        planner: &Planner,
        check_len: bool,
        mask: Vec<bool>,
        present: &Present<'_>,
    ) -> PyResult<Option<StepList>> {
        let lists = StatedLists::new(&self.groups);
        match present {
            Present::Facts(facts) => self.grads.list_read(planner, self.place, mask, facts, &lists),
            Present::Objects(objects) => self.grads.list(planner, self.place, check_len, mask, objects, &lists),
        }
    }
}

/// The gradients of the steps so far, as far as the next step needs them.
pub(crate) struct StepGrads {
    last: Option<Last>,
    /// Per parameter (every group's, in order): the gradient last read in full for it (its
    /// length and dtype are the parameter's), so a step whose set of None gradients changed
    /// reads only each gradient's contiguity and address.
    slots: Vec<Option<RawTensor>>,
    /// The type of the gradients read in full (`torch.Tensor`): a gradient of another type is
    /// read in full every time.
    tensor_type: Option<Py<PyType>>,
}

/// The last step's gradients.
struct Last {
    /// Which parameters (every group's, in order) had a gradient.
    mask: Vec<bool>,
    /// The list's gradients (absent ones included) and the position there of each present one.
    full: Vec<RawTensor>,
    at: Vec<usize>,
    list: StepList,
    /// The present gradients' addresses, checked when the same objects come back; None when
    /// the planner has no address check (then every step reads its gradients).
    addresses: Option<AddressCheck>,
    objects: Objects,
}

/// Which Python objects the last step's gradients were (none known when they were read without
/// their objects).
#[derive(Default)]
struct Objects {
    /// Their addresses (never dereferenced): where they equal the last step's, weak references
    /// are made, which the next step then checks.
    addrs: Vec<usize>,
    refs: Option<Vec<Py<PyWeakrefReference>>>,
}

/// True when `present` are the objects `refs` refer to.
fn same_objects(refs: &[Py<PyWeakrefReference>], present: &Bound<'_, PyList>) -> bool {
    let py = present.py();
    refs.len() == present.len()
        && refs
            .iter()
            .zip(present.iter())
            .all(|(r, g)| r.bind(py).upgrade().is_some_and(|o| o.is(&g)))
}

impl Objects {
    /// True when `present` are these objects (at `addrs`, their addresses).
    fn are(&self, present: &Bound<'_, PyList>, addrs: &[usize]) -> bool {
        self.addrs == addrs && self.refs.as_deref().is_some_and(|r| same_objects(r, present))
    }

    /// After a step whose gradients were read, not known to be these objects: weak references
    /// to them when their objects sit where the last step's did (the same objects may come back
    /// next step).
    fn note(&mut self, present: &Bound<'_, PyList>, addrs: Vec<usize>) {
        self.refs = if addrs == self.addrs {
            present
                .iter()
                .map(|g| PyWeakrefReference::new(&g).map(Bound::unbind))
                .collect::<PyResult<Vec<_>>>()
                .ok()
        } else {
            None
        };
        self.addrs = addrs;
    }
}

impl StepGrads {
    /// Nothing read yet, for a layout of `params` parameters.
    pub(crate) fn new(params: usize) -> Self {
        StepGrads {
            last: None,
            slots: vec![None; params],
            tensor_type: None,
        }
    }

    /// A step's gradients were refused: nothing of them is kept, not even the lengths and dtypes
    /// their reads noted per parameter (a refused gradient of another length than its parameter
    /// would otherwise be the length the next gradients are read by).
    fn refused(&mut self) {
        self.last = None;
        self.slots.iter_mut().for_each(|s| *s = None);
    }

    /// The layout gained parameters' states: the next step list is made anew.
    pub(crate) fn forget_list(&mut self) {
        self.last = None;
    }

    /// The checked step list for this step's gradients `present` (`check_len`: each one read by
    /// address has its length checked against its parameter's, where torch's `.grad` setter does
    /// not promise it: a DTensor's local shard, whose placements may differ from its
    /// parameter's, or the compiled op's lists, which hold any tensors),
    /// the gradients of the parameters in `mask`; `lists` places them in the layout's list.
    /// None when a gradient is not the engine's to read (sparse, strided, another type) or the
    /// list fails its checks: torch's step, which reports in torch's words.
    pub(crate) fn list(
        &mut self,
        planner: &Planner,
        place: Place,
        check_len: bool,
        mask: Vec<bool>,
        present: &Bound<'_, PyList>,
        lists: &impl ListMaker,
    ) -> PyResult<Option<StepList>> {
        let objects: Vec<usize> = present.iter().map(|g| g.as_ptr() as usize).collect();
        if let Some(k) = &self.last
            && k.mask == mask
            && k.objects.are(present, &objects)
            && k.addresses.as_ref().is_some_and(|a| a.same(present))
        {
            return Ok(Some(k.list.clone()));
        }
        let Some(tensors) = self.read_each(planner, place, check_len, &mask, present)? else {
            self.refused();
            return Ok(None);
        };
        self.settle(planner, mask, tensors, Some((present, objects)), lists)
    }

    /// [`StepGrads::list`] for gradients read natively without their Python objects
    /// ([`crate::tensor_facts::TensorFacts::grad`]): `present` their facts, in order.
    pub(crate) fn list_read(
        &mut self,
        planner: &Planner,
        place: Place,
        mask: Vec<bool>,
        present: &[Facts],
        lists: &impl ListMaker,
    ) -> PyResult<Option<StepList>> {
        let Some(tensors) = self.read_facts(place, &mask, present) else {
            self.refused();
            return Ok(None);
        };
        self.settle(planner, mask, tensors, None, lists)
    }

    /// The step list of this step's gradients `tensors` (read), the kept one when they sit at
    /// its addresses; `objects`: the gradients' Python objects and their addresses when they
    /// were read through them (so the same objects can be known next step).
    fn settle(
        &mut self,
        planner: &Planner,
        mask: Vec<bool>,
        tensors: Vec<RawTensor>,
        objects: Option<(&Bound<'_, PyList>, Vec<usize>)>,
        lists: &impl ListMaker,
    ) -> PyResult<Option<StepList>> {
        if let Some(k) = &mut self.last
            && k.mask == mask
            && k.at.len() == tensors.len()
            && k.at.iter().zip(&tensors).all(|(&at, t)| k.full[at] == *t)
        {
            // New objects at the kept addresses (the caching allocator's usual answer).
            match objects {
                Some((present, objects)) => k.objects.note(present, objects),
                None => k.objects = Objects::default(),
            }
            return Ok(Some(k.list.clone()));
        }
        let (full, at) = lists.full(&mask, &tensors);
        // The kept list takes new gradients of the same parts: the same set, or another set
        // when absent gradients are kept.
        let list = match &self.last {
            Some(k) if (k.mask == mask || lists.keeps_absent()) && k.full.len() == full.len() => k.list.with_grads(&full).ok(),
            _ => lists.make(&mask, &full).ok(),
        };
        let Some(list) = list else {
            self.refused();
            return Ok(None);
        };
        let mut seen = Objects::default();
        let mut addresses = None;
        if let Some((present, objects)) = objects {
            let ptrs: Vec<u64> = tensors.iter().map(|t| t.addr).collect();
            addresses = planner.guard_fns().and_then(|f| f.addresses(present.py(), &ptrs));
            seen.addrs = match &mut self.last {
                Some(k) if k.mask == mask => std::mem::take(&mut k.objects.addrs),
                _ => Vec::new(),
            };
            seen.note(present, objects);
        }
        self.last = Some(Last {
            mask,
            full,
            at,
            list: list.clone(),
            addresses,
            objects: seen,
        });
        Ok(Some(list))
    }

    /// Gradient by gradient from their facts: as [`StepGrads::read_each`] reads them, all of
    /// the facts at hand. None when one is not the engine's.
    fn read_facts(&mut self, place: Place, mask: &[bool], present: &[Facts]) -> Option<Vec<RawTensor>> {
        let slots = mask.iter().enumerate().filter(|(_, m)| **m).map(|(i, _)| i);
        present
            .iter()
            .zip(slots)
            .map(|(f, slot)| {
                let e = entry_of(*f).filter(|e| e.place == place)?;
                match self.slots[slot] {
                    Some(t) if t.len == e.tensor.len && t.dtype == e.tensor.dtype => Some(e.tensor),
                    Some(_) => None,
                    None => {
                        self.slots[slot] = Some(e.tensor);
                        Some(e.tensor)
                    }
                }
            })
            .collect()
    }

    /// Gradient by gradient: by contiguity and address where its parameter's gradient was read
    /// in full before, in full otherwise. None when one is not the engine's.
    fn read_each(
        &mut self,
        planner: &Planner,
        place: Place,
        check_len: bool,
        mask: &[bool],
        present: &Bound<'_, PyList>,
    ) -> PyResult<Option<Vec<RawTensor>>> {
        let mut at = Some(place);
        let reader = planner.guard_fns().and_then(|f| f.reader());
        let facts = planner.facts();
        let mut tensors = Vec::with_capacity(present.len());
        let slots = mask.iter().enumerate().filter(|(_, m)| **m).map(|(i, _)| i);
        for (g, slot) in present.iter().zip(slots) {
            if let (Some(t), Some(ty)) = (self.slots[slot], &self.tensor_type)
                && g.get_type().is(ty)
                && let Some(addr) = quick_read(&g, t, check_len, facts, reader)
            {
                tensors.push(RawTensor { addr, ..t });
                continue;
            }
            match planner.entry(&g) {
                Ok(Some(e)) if *at.get_or_insert(e.place) == e.place => {
                    self.tensor_type.get_or_insert_with(|| g.get_type().unbind());
                    self.slots[slot] = Some(e.tensor);
                    tensors.push(e.tensor);
                }
                _ => return Ok(None),
            }
        }
        Ok(Some(tensors))
    }
}

/// The address of gradient `g` of a parameter whose last gradient read was `t`, when `g` is
/// contiguous (and, with `check_len`, of `t`'s length: a DTensor gradient's placements may
/// differ from its parameter's) at an address the kernels can read; None otherwise (any error
/// included): `g` is then read in full. Read natively when the planner has torch's C shim
/// (then the length and dtype are checked too, for free), else by calls into torch.
fn quick_read(
    g: &Bound<'_, PyAny>,
    t: RawTensor,
    check_len: bool,
    facts: Option<&TensorFacts>,
    reader: Option<&DataPtrReader>,
) -> Option<u64> {
    let usable = |addr: u64| readable_at(addr, t.len, t.dtype);
    if let Some(f) = facts.and_then(|r| r.read(g)) {
        // Natively: a few C calls, no call into torch from here.
        return (f.contiguous && f.len == t.len && f.dtype == Some(t.dtype) && usable(f.addr)).then_some(f.addr);
    }
    let py = g.py();
    if !g.call_method0(intern!(py, "is_contiguous")).ok()?.is_truthy().ok()? {
        return None;
    }
    if check_len && g.call_method0(intern!(py, "numel")).ok()?.extract::<u64>().ok()? != t.len {
        return None;
    }
    let addr = data_ptr(g, reader).ok()?;
    usable(addr).then_some(addr)
}
