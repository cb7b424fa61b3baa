//! What the engine needs of a tensor (address, element count, dtype, device, contiguity, whether
//! it is an inference tensor), read from its Python object in native code through torch's stable
//! C shim: the `aoti_torch_*` functions AOTInductor's compiled models call, exported by
//! `libtorch_cpu` with a C ABI that torch keeps stable (`torch/csrc/inductor/aoti_torch/c/shim.h`),
//! and `at::native::is_inference`, which the shim lacks. Each is a C call of a few nanoseconds
//! where the same read from Python (`t.is_contiguous()`, `t.dtype`, ...) goes through the
//! interpreter and torch's argument parser, and torch's list guard reads more of each tensor
//! than the engine needs. On the H200's host the planner's scan of 1,000 new gradients took
//! 231-268 us read so against 331-372 us through torch's guards, and the MoE step's gradient
//! stage 105-107 us against 141-252 us with `is_contiguous()` calls (run
//! `2026-12-02-h200/2fbca93-native-reads-ab`).
//!
//! The shim takes a tensor handle (`at::Tensor*`); a plain tensor's or parameter's Python object
//! holds its `at::Tensor` right after the object header (`THPVariable` in torch's public header
//! `torch/csrc/autograd/python_variable.h`, which every C++ extension's `THPVariable_Unpack`
//! compiles in) in the torch releases `gradclip` lists as verified (torch 2.9 and older hold a
//! `c10::MaybeOwned<at::Tensor>` there, whose first word is a flag). Only objects whose type is
//! exactly `torch.Tensor` or `torch.nn.Parameter` are read so, and only on a listed release;
//! there `gradclip` first compares the word after the header with the `TensorImpl` address
//! torch's own `Tensor._cdata` gives (`TensorFacts.header_words`, a read inside the object that
//! cannot fault), then checks that the reads equal Python's on a set of tensors
//! (`TensorFacts.read_all` against `gradclip._engine._python_facts`) before the planner uses
//! them. The shim turns C++ exceptions (a tensor without storage, say) into an error status,
//! which reads as "not the engine's".

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use gradclip::DType;
use pyo3::prelude::*;
use pyo3::types::PyType;

use crate::loaded_libs::{open_loaded, torch_library};
use crate::place::Place;

/// `AOTITorchError (*)(AtenTensorHandle, T*)`: 0 on success.
type Get<T> = unsafe extern "C" fn(*mut c_void, *mut T) -> c_int;
/// `int32_t (*)()`: a dtype's or device type's code.
type Code = unsafe extern "C" fn() -> i32;
/// `bool at::native::is_inference(const at::Tensor&)`: declared in torch's public headers
/// (`ATen/ops/is_inference_native.h`, `TORCH_API`), a check of the tensor's dispatch keys that
/// never throws. A free function taking a reference and returning bool is called as the C
/// function `bool (*)(const void*)` under the platform's C++ ABI (Itanium: Linux, macOS).
type IsInference = unsafe extern "C" fn(*const c_void) -> bool;

/// `const at::Tensor& c10::TensorImpl::grad() const`: declared in torch's public header
/// `c10/core/TensorImpl.h` (`C10_API`), defined out of line in libc10: the tensor's gradient, or
/// an undefined tensor. A member function takes `this` as its first argument and a reference
/// comes back as a pointer (Itanium C++ ABI).
type GradOf = unsafe extern "C" fn(*const c_void) -> *const c_void;

/// The mangled name of `c10::TensorImpl::grad() const`.
const GRAD: &[u8] = b"_ZNK3c1010TensorImpl4gradEv\0";

/// The mangled (Itanium ABI) name of `at::native::is_inference(const at::Tensor&)`.
const IS_INFERENCE: &[u8] = b"_ZN2at6native12is_inferenceERKNS_6TensorE\0";

/// The shim's functions, from the `libtorch_cpu` already loaded.
struct Shim {
    /// Keeps the library's handle (and so the functions below) valid.
    _lib: libloading::Library,
    data_ptr: Get<*mut c_void>,
    numel: Get<i64>,
    dtype: Get<i32>,
    device_type: Get<i32>,
    device_index: Get<i32>,
    contiguous: Get<bool>,
    layout: Get<i32>,
    is_defined: Get<bool>,
    /// `aoti_torch_get_dim` and `aoti_torch_get_sizes`: a tensor's shape (its rows, for the
    /// unit-wise clip), when this torch's shim has them.
    dim: Option<Get<i64>>,
    sizes: Option<Get<*mut i64>>,
    inference: IsInference,
    /// torch's code of the strided layout (dense tensors).
    strided: i32,
    /// torch's codes of the engine's dtypes, in [`DType::ALL`]'s order.
    dtypes: [i32; 4],
    cpu: i32,
    cuda: i32,
}

impl Shim {
    /// The shim of the first of `candidates` (paths or sonames) that is loaded and exports it.
    fn loaded(candidates: &[String]) -> Option<Shim> {
        candidates.iter().find_map(|name| {
            let lib = open_loaded(name)?;
            // SAFETY: the signatures of torch's stable C shim (aoti_torch/c/shim.h); the code
            // functions take nothing and return an int32_t.
            unsafe {
                let code = |sym: &[u8]| lib.get::<Code>(sym).ok().map(|f| f());
                let dtypes = [
                    code(b"aoti_torch_dtype_bfloat16\0")?,
                    code(b"aoti_torch_dtype_float16\0")?,
                    code(b"aoti_torch_dtype_float32\0")?,
                    code(b"aoti_torch_dtype_float64\0")?,
                ];
                let (cpu, cuda) = (code(b"aoti_torch_device_type_cpu\0")?, code(b"aoti_torch_device_type_cuda\0")?);
                let strided = code(b"aoti_torch_layout_strided\0")?;
                Some(Shim {
                    data_ptr: *lib.get(b"aoti_torch_get_data_ptr\0").ok()?,
                    numel: *lib.get(b"aoti_torch_get_numel\0").ok()?,
                    dtype: *lib.get(b"aoti_torch_get_dtype\0").ok()?,
                    device_type: *lib.get(b"aoti_torch_get_device_type\0").ok()?,
                    device_index: *lib.get(b"aoti_torch_get_device_index\0").ok()?,
                    contiguous: *lib.get(b"aoti_torch_is_contiguous\0").ok()?,
                    layout: *lib.get(b"aoti_torch_get_layout\0").ok()?,
                    is_defined: *lib.get(b"aoti_torch_is_defined\0").ok()?,
                    dim: lib.get(b"aoti_torch_get_dim\0").ok().map(|f| *f),
                    sizes: lib.get(b"aoti_torch_get_sizes\0").ok().map(|f| *f),
                    inference: *lib.get(IS_INFERENCE).ok()?,
                    strided,
                    dtypes,
                    cpu,
                    cuda,
                    _lib: lib,
                })
            }
        })
    }
}

/// One tensor as the engine sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Facts {
    /// `data_ptr()`: the first element's address.
    pub(crate) addr: u64,
    pub(crate) len: u64,
    /// None: not one of the engine's dtypes.
    pub(crate) dtype: Option<DType>,
    pub(crate) place: Place,
    pub(crate) contiguous: bool,
    /// An inference tensor (torch refuses in-place writes to it outside inference mode).
    pub(crate) inference: bool,
}

/// [`Facts`] as Python sees them: `(data_ptr, numel, dtype index or -1, device: -1 for the
/// CPU or the CUDA ordinal, contiguous, inference)`.
type PyFacts = (u64, u64, i64, i64, bool, bool);

/// Reads [`Facts`] of plain tensors and parameters through torch's shim.
#[pyclass(frozen, module = "gradclip._native")]
#[derive(Clone)]
pub struct TensorFacts(Arc<Reader>);

/// The shim and the two types whose objects it reads.
struct Reader {
    shim: Arc<Shim>,
    /// libc10's gradient getter, when found (see [`Grads`]).
    grads: Option<Grads>,
    tensor: Py<PyType>,
    parameter: Py<PyType>,
}

/// A tensor's gradient read without its Python object: `c10::TensorImpl::grad() const` from the
/// libc10 already loaded (the shim's `aoti_torch_is_defined` then tells whether there is one).
struct Grads {
    /// Keeps libc10's handle (and so `grad`) valid.
    _lib: libloading::Library,
    grad: GradOf,
}

impl Grads {
    fn loaded(torch_lib: Option<&str>) -> Option<Grads> {
        torch_library(torch_lib, "libc10").into_iter().find_map(|name| {
            let lib = open_loaded(&name)?;
            // SAFETY: `GRAD` names `c10::TensorImpl::grad() const` (see `GradOf`).
            let grad = unsafe { *lib.get::<GradOf>(GRAD).ok()? };
            Some(Grads { _lib: lib, grad })
        })
    }
}

impl TensorFacts {
    /// The facts of `t`; None when its type is not exactly `torch.Tensor` or
    /// `torch.nn.Parameter` (only those are read through their object's layout), it is not a
    /// dense tensor on the CPU or a CUDA device, or the shim reports an error.
    pub(crate) fn read(&self, t: &Bound<'_, PyAny>) -> Option<Facts> {
        // SAFETY: `tensor_of` checked that `t` is a plain tensor or parameter, alive while the
        // GIL is held (`t` is bound to it).
        self.tensor_of(t).and_then(|handle| unsafe { self.read_handle(handle) })
    }

    /// The `at::Tensor` of `t` when its type is exactly `torch.Tensor` or `torch.nn.Parameter`:
    /// torch's `THPVariable` holds it right after the object header (see the module's
    /// documentation).
    fn tensor_of(&self, t: &Bound<'_, PyAny>) -> Option<*const c_void> {
        let Reader { tensor, parameter, .. } = &*self.0;
        let ty = t.get_type();
        (ty.is(tensor) || ty.is(parameter)).then(|| {
            t.as_ptr()
                .cast::<u8>()
                .wrapping_add(size_of::<pyo3::ffi::PyObject>())
                .cast::<c_void>()
                .cast_const()
        })
    }

    /// The rows of `t` (its first dimension's size; 1 for a tensor of at most one dimension):
    /// None when it is not read natively or this torch's shim lacks the shape reads.
    pub(crate) fn rows(&self, t: &Bound<'_, PyAny>) -> Option<u64> {
        let s = &self.0.shim;
        let (dim, sizes) = (s.dim?, s.sizes?);
        let handle = self.tensor_of(t)?.cast_mut();
        let (mut n, mut at) = (0i64, std::ptr::null_mut());
        // SAFETY: `handle` is the `at::Tensor` of the live object `t` (`tensor_of`; the GIL is
        // held); each shim function writes its one out value (the sizes: a pointer into the
        // tensor's own shape, valid while the tensor lives, read at once); a nonzero status is
        // an error.
        unsafe {
            if (dim)(handle, &mut n) != 0 {
                return None;
            }
            if n <= 1 {
                return Some(1);
            }
            if (sizes)(handle, &mut at) != 0 || at.is_null() {
                return None;
            }
            u64::try_from(*at).ok()
        }
    }

    /// True when gradients can be read without their Python objects ([`TensorFacts::grad`]).
    pub(crate) fn reads_grads(&self) -> bool {
        self.0.grads.is_some()
    }

    /// The facts of the gradient of `p` (a plain tensor or parameter), read without making or
    /// touching the gradient's Python object (autograd makes gradients without one; `.grad`
    /// makes it on first read): `Some(None)` when it has none, None when it is not read so
    /// (another type, no getter, or the shim failed on the gradient: a tensor subclass without
    /// storage, say, which the shim logs; callers then read `.grad`).
    pub(crate) fn grad(&self, p: &Bound<'_, PyAny>) -> Option<Option<Facts>> {
        let (s, g) = (&self.0.shim, self.0.grads.as_ref()?);
        let handle = self.tensor_of(p)?;
        // SAFETY: `handle` is the `at::Tensor` of the live object `p` (`tensor_of`; the GIL is
        // held). An `at::Tensor` is one `intrusive_ptr<TensorImpl>`, which is one pointer
        // (`TensorBase::impl_`, `intrusive_ptr::target_` in torch's public headers), never null
        // (an undefined tensor points at the undefined singleton; checked anyway). `grad()`
        // returns a reference to a tensor the parameter's autograd metadata holds (or a static
        // undefined one), alive while the parameter keeps that gradient: read here, under the
        // GIL, before any Python code runs.
        unsafe {
            let impl_ = *handle.cast::<*const c_void>();
            if impl_.is_null() {
                return None;
            }
            let grad = (g.grad)(impl_);
            let mut defined = false;
            if grad.is_null() || (s.is_defined)(grad.cast_mut(), &mut defined) != 0 {
                return None;
            }
            if !defined {
                return Some(None);
            }
            self.read_handle(grad).map(Some)
        }
    }

    /// The facts of the `at::Tensor` at `handle`.
    ///
    /// # Safety
    /// `handle` points at a live `at::Tensor` (the GIL held, nothing running that could free it).
    unsafe fn read_handle(&self, handle: *const c_void) -> Option<Facts> {
        let s = &self.0.shim;
        let handle = handle.cast_mut();
        let (mut device, mut layout, mut index) = (0i32, 0i32, 0i32);
        let (mut addr, mut len, mut dtype, mut contiguous) = (std::ptr::null_mut(), 0i64, 0i32, false);
        // SAFETY: the caller's contract (a live `at::Tensor` at `handle`); each function writes
        // its one out value. The shim catches torch's exceptions and returns a nonzero status, but logs them: the
        // device and layout are asked first (they never throw), and only a dense tensor of the
        // CPU or a CUDA device is asked for its data pointer (a sparse one would throw).
        let ok = unsafe {
            (s.device_type)(handle, &mut device) == 0
                && (device == s.cpu || device == s.cuda)
                && (s.layout)(handle, &mut layout) == 0
                && layout == s.strided
                && (s.device_index)(handle, &mut index) == 0
                && (s.dtype)(handle, &mut dtype) == 0
                && (s.numel)(handle, &mut len) == 0
                && (s.contiguous)(handle, &mut contiguous) == 0
                && (s.data_ptr)(handle, &mut addr) == 0
        };
        if !ok {
            return None;
        }
        // SAFETY: as above; `is_inference` only reads the tensor's dispatch keys.
        let inference = unsafe { (s.inference)(handle) };
        Some(Facts {
            addr: addr as u64,
            len: u64::try_from(len).ok()?,
            dtype: s.dtypes.iter().position(|&c| c == dtype).map(|i| DType::ALL[i]),
            place: if device == s.cuda { Place::Cuda(index.into()) } else { Place::Cpu },
            contiguous,
            inference,
        })
    }
}

#[pymethods]
impl TensorFacts {
    /// torch's shim from the `libtorch_cpu` already loaded (looked for first in `torch_lib`,
    /// torch's library folder), reading objects of exactly the types `tensor` and `parameter`
    /// (`torch.Tensor`, `torch.nn.Parameter`); None when no such library is loaded.
    #[staticmethod]
    #[pyo3(signature = (torch_lib, tensor, parameter))]
    fn load(torch_lib: Option<String>, tensor: Bound<'_, PyType>, parameter: Bound<'_, PyType>) -> Option<TensorFacts> {
        // Objects too small to hold a word after their header are never read (see header_words).
        let word_fits = |ty: &Bound<'_, PyType>| {
            ty.getattr("__basicsize__")
                .and_then(|n| n.extract::<usize>())
                .is_ok_and(|n| n >= size_of::<pyo3::ffi::PyObject>() + size_of::<usize>())
        };
        if !word_fits(&tensor) || !word_fits(&parameter) {
            return None;
        }
        let shim = Shim::loaded(&torch_library(torch_lib.as_deref(), "libtorch_cpu"))?;
        let grads = Grads::loaded(torch_lib.as_deref());
        Some(TensorFacts(Arc::new(Reader {
            shim: Arc::new(shim),
            grads,
            tensor: tensor.unbind(),
            parameter: parameter.unbind(),
        })))
    }

    /// The word right after each object's header, where the reads take the `at::Tensor`'s one
    /// pointer (its `TensorImpl`) from, for objects of exactly the two types; None for others.
    /// What `gradclip` compares with `Tensor._cdata` (the `TensorImpl`'s address, from torch)
    /// before any read goes through that word: reading it cannot fault whatever this torch's
    /// layout, since `load` checked that both types' objects are large enough to hold it.
    fn header_words(&self, objs: Vec<Bound<'_, PyAny>>) -> Vec<Option<usize>> {
        objs.iter()
            .map(|o| {
                // SAFETY: `tensor_of` returns the address right after the header of a live object
                // of one of the two types (the GIL is held), whose basic size holds at least one
                // word past the header (checked in `load`); it is read as a plain word, without
                // following it, unaligned reads allowed.
                self.tensor_of(o).map(|at| unsafe { at.cast::<usize>().read_unaligned() })
            })
            .collect()
    }

    /// Each object's facts as `(data_ptr, numel, dtype, device, contiguous, inference)` (dtype:
    /// its index in the engine's order bfloat16, float16, float32, float64, or -1; device: -1
    /// for the CPU, or the CUDA ordinal), or None where it is not read: what `gradclip` compares
    /// with Python's reads before the planner uses them.
    fn read_all(&self, objs: Vec<Bound<'_, PyAny>>) -> Vec<Option<PyFacts>> {
        objs.iter().map(|o| self.read(o).map(|f| py_facts(&f))).collect()
    }

    /// The same reader without native gradient reads (`gradclip` switches them off when they
    /// do not read what `.grad` reads).
    fn without_grads(&self, py: Python<'_>) -> TensorFacts {
        let r = &*self.0;
        TensorFacts(Arc::new(Reader {
            shim: r.shim.clone(),
            grads: None,
            tensor: r.tensor.clone_ref(py),
            parameter: r.parameter.clone_ref(py),
        }))
    }

    /// The facts of each object's gradient read without its Python object, as `read_all`
    /// reports them, or False where it has none, or None where it is not read so (see
    /// `grad`): what `gradclip` compares with Python's reads of `.grad`. None when this torch
    /// gives no gradient getter.
    fn read_grads<'py>(&self, objs: Vec<Bound<'py, PyAny>>) -> PyResult<Option<Vec<Bound<'py, PyAny>>>> {
        if !self.reads_grads() {
            return Ok(None);
        }
        let Some(py) = objs.first().map(|o| o.py()) else {
            return Ok(Some(Vec::new()));
        };
        objs.iter()
            .map(|o| match self.grad(o) {
                None => Ok(py.None().into_bound(py)),
                Some(None) => Ok(false.into_pyobject(py)?.to_owned().into_any()),
                Some(Some(f)) => Ok(py_facts(&f).into_pyobject(py)?.into_any()),
            })
            .collect::<PyResult<Vec<_>>>()
            .map(Some)
    }
}

/// `f` as Python sees it ([`PyFacts`]).
fn py_facts(f: &Facts) -> PyFacts {
    let dtype = f
        .dtype
        .and_then(|d| DType::ALL.iter().position(|&x| x == d))
        .map_or(-1, |i| i as i64);
    let device = match f.place {
        Place::Cpu => -1,
        Place::Cuda(i) => i,
    };
    (f.addr, f.len, dtype, device, f.contiguous, f.inference)
}
