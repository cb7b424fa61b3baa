//! Each parameter group's hyperparameters kept from the step that read them, for as long as the
//! group's dict holds the same objects: a step over hundreds of groups then walks each dict once
//! by identity (no hashing) instead of looking up its keys and converting their values.
//!
//! A dict is taken as unchanged when it is the same dict, of the same length, whose entries are
//! the same key and value objects in the same order. That says nothing of a value changed in
//! place, so a group is kept only when every value but `params` (read every step, by identity,
//! with the gradients) is immutable: a float, an int, a bool, None, a str, or a tuple of those.
//! A kept value is held, so its address cannot be reused by a new object. A group with a tensor
//! learning rate, a list of betas or a policy object, or a dict of a subclass, is read every
//! step, as before.
//! Measured on the development host, 465 AdamW groups: 196 ns a group read every step (the
//! lookups of seven keys and the conversions), against about 40 ns a group walked.

use gradclip::optim::Rule;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use crate::dict_walk::{Walk, each_item};
use crate::hyper::{holds_a_key, read_group};

/// One group as its rule was read from it.
struct Seen {
    dict: Py<PyDict>,
    /// The dict's entries, in order, as read.
    entries: Vec<(Py<PyAny>, Py<PyAny>)>,
    /// The group's `params` list, as read.
    params: Option<Py<PyList>>,
    kind: usize,
    decoupled: bool,
    rule: Rule,
    on_device: bool,
    /// Whether the dict holds one of a tuple of keys (the clip groups'), for that tuple.
    keys: Option<(Py<PyTuple>, bool)>,
}

/// The groups' kept reads, by the group's place in `param_groups`.
#[derive(Default)]
pub(crate) struct SeenGroups {
    groups: Vec<Option<Seen>>,
}

impl SeenGroups {
    /// Group `at`'s rule and whether its learning rate is a tensor ([`read_group`]'s answer),
    /// and whether it holds one of `keys` (false without them): the kept answers when its dict
    /// holds the same objects, else read, and kept when every value is immutable.
    pub(crate) fn read(
        &mut self,
        at: usize,
        kind: usize,
        decoupled: bool,
        group: &Bound<'_, PyDict>,
        keys: Option<&Bound<'_, PyTuple>>,
    ) -> PyResult<(Rule, bool, bool)> {
        if let Some(Some(s)) = self.groups.get_mut(at)
            && s.kind == kind
            && s.decoupled == decoupled
            && s.holds(group)
        {
            let held = match (keys, &s.keys) {
                (None, _) => false,
                (Some(k), Some((kept, held))) if k.is(kept) => *held,
                (Some(k), _) => {
                    let held = holds_a_key(group, k)?;
                    s.keys = Some((k.clone().unbind(), held));
                    held
                }
            };
            return Ok((s.rule, s.on_device, held));
        }
        let (rule, on_device) = read_group(kind, decoupled, group)?;
        let keys = keys
            .map(|k| Ok::<_, PyErr>((k.clone().unbind(), holds_a_key(group, k)?)))
            .transpose()?;
        let held = keys.as_ref().is_some_and(|k| k.1);
        if self.groups.len() <= at {
            self.groups.resize_with(at + 1, || None);
        }
        self.groups[at] = Seen::of(group, kind, decoupled, rule, on_device).map(|s| Seen { keys, ..s });
        Ok((rule, on_device, held))
    }

    /// Forgets the groups past the first `n` (the optimizer has `n`): nothing of a removed group
    /// (its `params` list, so its tensors) is held.
    pub(crate) fn keep_first(&mut self, n: usize) {
        self.groups.truncate(n);
    }

    /// Group `at`'s `params` list, when its dict is `group` as read at this step (by
    /// [`SeenGroups::read`], with no Python code run since): no lookup.
    pub(crate) fn params<'py>(&self, at: usize, group: &Bound<'py, PyAny>) -> Option<Bound<'py, PyList>> {
        let s = self.groups.get(at)?.as_ref()?;
        group
            .is(&s.dict)
            .then(|| s.params.as_ref().map(|l| l.bind(group.py()).clone()))
            .flatten()
    }
}

impl Seen {
    /// `group` as read, or None when a value may change in place, or the dict is a subclass
    /// (whose own methods may answer other than its entries).
    fn of(group: &Bound<'_, PyDict>, kind: usize, decoupled: bool, rule: Rule, on_device: bool) -> Option<Seen> {
        if !group.is_exact_instance_of::<PyDict>() {
            return None;
        }
        let params_key = pyo3::intern!(group.py(), "params");
        let (mut entries, mut params) = (Vec::with_capacity(group.len()), None);
        for (k, v) in group.iter() {
            if k.is_exact_instance_of::<PyString>() && k.eq(params_key).unwrap_or(false) {
                params = v.cast_exact::<PyList>().ok().map(|l| l.clone().unbind());
            } else if !immutable(&v) {
                return None;
            }
            entries.push((k.unbind(), v.unbind()));
        }
        Some(Seen {
            dict: group.clone().unbind(),
            entries,
            params,
            kind,
            decoupled,
            rule,
            on_device,
            keys: None,
        })
    }

    /// Whether `group` is the dict read, holding the same entries (a walk of borrowed entries:
    /// PyO3's iterator counts references through a function call each under the limited API,
    /// which cost as much as reading the keys).
    fn holds(&self, group: &Bound<'_, PyDict>) -> bool {
        if !group.is(&self.dict) || group.len() != self.entries.len() {
            return false;
        }
        let mut kept = self.entries.iter();
        each_item(group.as_ptr(), |k, v| {
            kept.next().is_some_and(|(sk, sv)| k == sk.as_ptr() && v == sv.as_ptr())
        }) == Walk::Done
    }
}

/// Whether `v` cannot change in place: a float, int, bool, None or str, or a tuple of those
/// (exact types: a subclass may carry state).
fn immutable(v: &Bound<'_, PyAny>) -> bool {
    let scalar = |v: &Bound<'_, PyAny>| {
        v.is_none()
            || v.is_exact_instance_of::<PyFloat>()
            || v.is_exact_instance_of::<PyInt>()
            || v.is_exact_instance_of::<PyBool>()
            || v.is_exact_instance_of::<PyString>()
    };
    scalar(v) || v.cast_exact::<PyTuple>().is_ok_and(|t| t.iter().all(|x| scalar(&x)))
}
