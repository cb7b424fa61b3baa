//! A parameter group's hyperparameters as the engine takes them: each rule's reading of a torch
//! param group (its keys, in one table, [`RULES`]), from the group's dict (every step, natively:
//! a step over hundreds of groups reads them all) or from the tuple the compiled op carries.

use gradclip::optim::{AdamConfig, LionConfig, Rule, SgdConfig};
use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use crate::py_errors::to_py;

/// One group's settings for a step.
pub(crate) struct Hyper {
    pub(crate) rule: Rule,
    /// The address of the group's two int64 (steps, skipped) on the tensors' device.
    pub(crate) count: u64,
    /// The address of a float64 learning rate on the tensors' device (a tensor `lr`), or 0.
    pub(crate) lr_in: u64,
}

/// Where one of a rule's four hyperparameters is in a torch param group.
#[derive(Clone, Copy)]
enum Key {
    /// `group[name]`, a number.
    Item(&'static str),
    /// `group[name][i]` (`betas`).
    Pair(&'static str, usize),
    /// Not the rule's (0).
    Unused,
}

/// A rule's reading of a torch param group: the four hyperparameters in the kernels' order and
/// three flags (the third may be absent, and is then the optimizer's own default: AdamW's
/// decoupled weight decay).
struct RuleKeys {
    kind: &'static str,
    h: [Key; 4],
    flags: [Option<&'static str>; 3],
}

/// Every rule's keys, in the order of `STEP_KINDS` (Python): a new rule is one entry here and
/// one arm of [`rule_of`].
const RULES: [RuleKeys; 3] = [
    RuleKeys {
        kind: "adam",
        h: [
            Key::Pair("betas", 0),
            Key::Pair("betas", 1),
            Key::Item("eps"),
            Key::Item("weight_decay"),
        ],
        flags: [Some("amsgrad"), Some("maximize"), Some("decoupled_weight_decay")],
    },
    RuleKeys {
        kind: "sgd",
        h: [
            Key::Item("momentum"),
            Key::Item("dampening"),
            Key::Item("weight_decay"),
            Key::Unused,
        ],
        flags: [Some("nesterov"), Some("maximize"), None],
    },
    RuleKeys {
        kind: "lion",
        h: [Key::Pair("betas", 0), Key::Pair("betas", 1), Key::Item("weight_decay"), Key::Unused],
        flags: [Some("maximize"), None, None],
    },
];

/// The rule `kind` with these hyperparameters (see [`RULES`] for what `h` and `b` hold), checked.
fn rule_of(kind: usize, lr: f64, [h0, h1, h2, h3]: [f64; 4], [b0, b1, b2]: [bool; 3]) -> PyResult<Rule> {
    let rule = match kind {
        0 => Rule::Adam(AdamConfig {
            lr,
            betas: (h0, h1),
            eps: h2,
            weight_decay: h3,
            amsgrad: b0,
            maximize: b1,
            decoupled_weight_decay: b2,
        }),
        1 => Rule::Sgd(SgdConfig {
            lr,
            momentum: h0,
            dampening: h1,
            weight_decay: h2,
            nesterov: b0,
            maximize: b1,
        }),
        _ => Rule::Lion(LionConfig {
            lr,
            betas: (h0, h1),
            weight_decay: h2,
            maximize: b0,
        }),
    };
    rule.validate().map_err(to_py)?;
    Ok(rule)
}

/// The index of rule `kind` in [`RULES`].
pub(crate) fn kind_index(kind: &str) -> PyResult<usize> {
    RULES
        .iter()
        .position(|r| r.kind == kind)
        .ok_or_else(|| PyValueError::new_err(format!("unknown optimizer {kind:?}: adam, sgd or lion")))
}

/// A rule's keys as Python strings ([`RuleKeys`]), each made once: a step over hundreds of
/// groups looks up a few thousand keys, and a `&str` key is a new Python string per lookup.
struct PyRuleKeys {
    /// Each hyperparameter's key and, for a pair, its index.
    h: [Option<(Py<PyString>, Option<usize>)>; 4],
    flags: [Option<Py<PyString>>; 3],
    lr: Py<PyString>,
}

/// Rule `kind`'s [`PyRuleKeys`] (`kind` an index of [`RULES`]).
fn py_keys(py: Python<'_>, kind: usize) -> &PyRuleKeys {
    static KEYS: PyOnceLock<Vec<PyRuleKeys>> = PyOnceLock::new();
    let keys = KEYS.get_or_init(py, || {
        let key = |n: &str| PyString::intern(py, n).unbind();
        RULES
            .iter()
            .map(|r| PyRuleKeys {
                h: r.h.map(|k| match k {
                    Key::Item(n) => Some((key(n), None)),
                    Key::Pair(n, i) => Some((key(n), Some(i))),
                    Key::Unused => None,
                }),
                flags: r.flags.map(|f| f.map(key)),
                lr: key("lr"),
            })
            .collect()
    });
    &keys[kind]
}

/// `group[key]`, or torch's KeyError.
fn item<'py>(group: &Bound<'py, PyDict>, key: &Py<PyString>) -> PyResult<Bound<'py, PyAny>> {
    group
        .get_item(key.bind(group.py()))?
        .ok_or_else(|| PyKeyError::new_err(key.to_string()))
}

/// A group's four hyperparameters and three flags by rule `kind`'s keys; `flag2`: the third
/// flag's default (the optimizer's own).
fn read_keys(kind: usize, flag2: bool, group: &Bound<'_, PyDict>) -> PyResult<([f64; 4], [bool; 3])> {
    let keys = py_keys(group.py(), kind);
    let mut h = [0.0; 4];
    for (v, key) in h.iter_mut().zip(&keys.h) {
        *v = match key {
            Some((k, None)) => item(group, k)?.extract()?,
            Some((k, Some(i))) => item(group, k)?.get_item(i)?.extract()?,
            None => 0.0,
        };
    }
    let mut b = [false; 3];
    for (i, (v, key)) in b.iter_mut().zip(&keys.flags).enumerate() {
        if let Some(k) = key {
            // The third flag may be absent (torch's Adam before `decoupled_weight_decay`).
            *v = match group.get_item(k.bind(group.py()))? {
                Some(x) => x.is_truthy()?,
                None if i == 2 => false,
                None => return Err(PyKeyError::new_err(k.to_string())),
            };
        }
    }
    b[2] |= flag2;
    Ok((h, b))
}

/// A group's rule read from its dict (`kind`: an index of [`RULES`]; `decoupled`: the
/// optimizer's own weight decay is AdamW's), and whether its learning rate is a tensor (the
/// rule's is then 0: the step reads it on the device).
pub(crate) fn read_group(kind: usize, decoupled: bool, group: &Bound<'_, PyDict>) -> PyResult<(Rule, bool)> {
    let (h, b) = read_keys(kind, decoupled, group)?;
    let lr = item(group, &py_keys(group.py(), kind).lr)?;
    let (lr, on_device) = if lr.is_instance_of::<PyFloat>() || lr.is_instance_of::<PyInt>() {
        (lr.extract::<f64>()?, false)
    } else {
        (0.0, true)
    };
    Ok((rule_of(kind, lr, h, b)?, on_device))
}

/// One rule's keys as Python takes them ([`rule_keys`]).
type RuleKeysPy = (&'static str, Vec<Option<(&'static str, i64)>>, Vec<Option<&'static str>>);

/// [`RULES`] for Python: per rule `(kind, h, flags)`, `h` four `(key, index)` (index -1: the
/// value itself; None: unused), `flags` three keys or None. The compiled step reads the groups
/// in Python (dynamo traces the reads and guards their values) by this one table.
#[pyfunction]
pub fn rule_keys() -> Vec<RuleKeysPy> {
    RULES
        .iter()
        .map(|r| {
            let h =
                r.h.iter()
                    .map(|k| match *k {
                        Key::Item(name) => Some((name, -1)),
                        Key::Pair(name, i) => Some((name, i as i64)),
                        Key::Unused => None,
                    })
                    .collect();
            (r.kind, h, r.flags.to_vec())
        })
        .collect()
}

/// `(kind, lr, (h0, h1, h2, h3), (b0, b1, b2), count, lr_in)` as the compiled op and the layout
/// carry a group (see [`RULES`] for what `h` and `b` hold).
pub(crate) fn read_hyper(h: &Bound<'_, PyAny>) -> PyResult<Hyper> {
    type Tuple = (String, f64, (f64, f64, f64, f64), (bool, bool, bool), u64, u64);
    let (kind, lr, (h0, h1, h2, h3), (b0, b1, b2), count, lr_in): Tuple = h.extract()?;
    if !count.is_multiple_of(8) {
        return Err(PyValueError::new_err("the step count must be an int64 tensor of two elements"));
    }
    if !lr_in.is_multiple_of(8) {
        return Err(PyValueError::new_err("a tensor learning rate must be passed as a float64 tensor"));
    }
    let rule = rule_of(kind_index(&kind)?, lr, [h0, h1, h2, h3], [b0, b1, b2])?;
    Ok(Hyper { rule, count, lr_in })
}

/// Whether some group of `groups` (torch's param group dicts) holds one of `keys` (str objects:
/// their hashes are kept in them): the clip groups' test, every step, at a few nanoseconds a
/// key where Python's `in` costs tens.
#[pyfunction]
pub fn groups_have_keys(groups: &Bound<'_, PyList>, keys: &Bound<'_, PyTuple>) -> PyResult<bool> {
    for g in groups.iter() {
        if holds_a_key(g.cast::<PyDict>()?, keys)? {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Whether `group` holds one of `keys`.
pub(crate) fn holds_a_key(group: &Bound<'_, PyDict>, keys: &Bound<'_, PyTuple>) -> PyResult<bool> {
    for k in keys.iter() {
        if group.contains(&k)? {
            return Ok(true);
        }
    }
    Ok(false)
}
