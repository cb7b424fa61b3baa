// Calls torch's native reader of a tensor's data pointer (`void* (*)(PyObject*)`, the function
// torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr points to, which Inductor's
// generated launchers call) and turns any C++ exception it throws (a non-tensor, a tensor
// without storage such as a sparse one or a wrapper subclass) into a status: an exception must
// never unwind into Rust. Called with the GIL held.
extern "C" int gradclip_tensor_data_ptr(void* (*read)(void*), void* obj, void** out) noexcept {
    try {
        *out = read(obj);
        return 0;
    } catch (...) {
        return 1;
    }
}
