//! How the parameters that have their states become a step's list ([`ListMaker`]), for the eager
//! step's layout ([`crate::optim`]) and the compiled op's kept lists ([`crate::list_step`]) alike:
//! each group's parameters with their parts (the gradient each step's own), a parameter whose
//! gradient is None kept with an absent one, so that every set of None gradients makes a list of
//! the same parts; only when some such parameter is empty (its absent gradient would read as an
//! empty one, whose step count advances) do the lists hold the parameters with a gradient alone.

use std::cell::OnceCell;

use gradclip::optim::{Parts, StepList};
use gradclip::plan::RawTensor;

/// How a layout turns a step's gradients into a step list.
pub(crate) trait ListMaker {
    /// The step list's gradients, `present` (those of the parameters set in `mask`, in order)
    /// in the list's order with the absent ones the layout keeps
    /// ([`gradclip::optim::Parts::without_grad`]), and each present gradient's position there.
    fn full(&self, mask: &[bool], present: &[RawTensor]) -> (Vec<RawTensor>, Vec<usize>);
    /// True when lists of every mask have the same parts (absent gradients kept): a list then
    /// takes another mask's gradients ([`StepList::with_grads`]).
    fn keeps_absent(&self) -> bool;
    /// A new checked list of the gradients `full` for `mask`, or the check's error.
    fn make(&self, mask: &[bool], full: &[RawTensor]) -> Result<StepList, gradclip::Error>;
}

/// One parameter group as a step keeps it.
pub(crate) struct StepGroup {
    /// Each parameter's parts as its update reads them (the gradient each step's own); None: the
    /// parameter has no state yet (it never had a gradient), and is in no list.
    pub(crate) parts: Vec<Option<Parts>>,
    /// The states its rule keeps, by name, and whether each parameter's own step count is read
    /// (Adam's bias correction and SGD's first momentum step need it).
    pub(crate) names: &'static [&'static str],
    pub(crate) own_step: bool,
}

/// The step lists of some groups ([`ListMaker`]; see the module's documentation).
pub(crate) struct StatedLists<'a> {
    groups: &'a [StepGroup],
    /// Whether every parameter with states has elements: decided once, when first asked (only a
    /// step whose set of gradients changed asks).
    keep_absent: OnceCell<bool>,
}

impl<'a> StatedLists<'a> {
    pub(crate) fn new(groups: &'a [StepGroup]) -> Self {
        StatedLists {
            groups,
            keep_absent: OnceCell::new(),
        }
    }

    /// Each list tensor's parameter by its place in the mask (every parameter's, in order), for
    /// the gradients of `mask`.
    pub(crate) fn listed(&self, mask: &[bool]) -> impl Iterator<Item = usize> + '_ {
        let keep = self.keeps_absent();
        let mask = mask.to_vec();
        stated(self.groups).filter(move |&(i, _)| keep || mask[i]).map(|(i, _)| i)
    }
}

/// Each parameter of `groups` with its states, in order, and its place in the mask (every
/// parameter's).
fn stated(groups: &[StepGroup]) -> impl Iterator<Item = (usize, &Parts)> + '_ {
    groups
        .iter()
        .flat_map(|g| g.parts.iter())
        .enumerate()
        .filter_map(|(i, st)| st.as_ref().map(|st| (i, st)))
}

impl ListMaker for StatedLists<'_> {
    fn full(&self, mask: &[bool], present: &[RawTensor]) -> (Vec<RawTensor>, Vec<usize>) {
        if !self.keeps_absent() {
            return (present.to_vec(), (0..present.len()).collect());
        }
        let (mut full, mut at, mut next) = (Vec::with_capacity(mask.len()), Vec::with_capacity(present.len()), present.iter());
        for (i, st) in stated(self.groups) {
            match mask[i].then(|| next.next()).flatten() {
                Some(&g) => {
                    at.push(full.len());
                    full.push(g);
                }
                None => full.push(Parts::absent_grad(st.param)),
            }
        }
        (full, at)
    }

    fn keeps_absent(&self) -> bool {
        *self.keep_absent.get_or_init(|| stated(self.groups).all(|(_, st)| st.param.len > 0))
    }

    fn make(&self, mask: &[bool], full: &[RawTensor]) -> Result<StepList, gradclip::Error> {
        let keep = self.keeps_absent();
        let (mut i, mut next) = (0, full.iter());
        let groups: Vec<(Vec<Parts>, &'static [&'static str])> = self
            .groups
            .iter()
            .map(|g| {
                let parts = g
                    .parts
                    .iter()
                    .filter_map(|st| {
                        let has = mask[i];
                        i += 1;
                        let st = st.as_ref()?;
                        (has || keep).then(|| Parts {
                            grad: *next.next().expect("one gradient per listed parameter"),
                            ..*st
                        })
                    })
                    .collect();
                (parts, g.names)
            })
            .collect();
        StepList::new(&groups)
    }
}
