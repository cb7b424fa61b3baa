//! Libraries already loaded into the process, opened by name without loading anything: how the
//! binding reaches the native functions of the torch it runs beside (its OpenMP runtime, its
//! stable C shim), never a second copy of them.

/// The library `name` (a path or a soname) when it is already loaded; None otherwise.
#[cfg(unix)]
pub(crate) fn open_loaded(name: &str) -> Option<libloading::Library> {
    // SAFETY: RTLD_NOLOAD only returns a handle to a library already loaded (and initialized)
    // in this process; nothing is loaded, no initializer runs.
    let lib = unsafe { libloading::os::unix::Library::open(Some(name), libc::RTLD_NOLOAD | libc::RTLD_LAZY) }.ok()?;
    Some(libloading::Library::from(lib))
}

/// The library `name` when it is already loaded: never found off Unix (no way to ask without
/// loading it).
#[cfg(not(unix))]
pub(crate) fn open_loaded(_name: &str) -> Option<libloading::Library> {
    None
}

/// The files mapped into this process whose file name passes `wanted`, in the order of the
/// mappings, each once (Linux's `/proc/self/maps`; empty elsewhere).
pub(crate) fn mapped_files(wanted: impl Fn(&str) -> bool) -> Vec<String> {
    let mut mapped: Vec<String> = std::fs::read_to_string("/proc/self/maps")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .filter(|path| path.rsplit('/').next().is_some_and(&wanted))
        .map(str::to_owned)
        .collect();
    mapped.dedup();
    mapped
}

/// Where to look, among the loaded libraries, for torch's library `stem` (`libtorch_cpu`,
/// `libc10`): in `torch_lib` (torch's own library folder), by soname, then any mapped file of
/// that name.
pub(crate) fn torch_library(torch_lib: Option<&str>, stem: &str) -> Vec<String> {
    let own = torch_lib.map(|dir| format!("{dir}/{stem}.so"));
    let mapped = mapped_files(|file| file.strip_prefix(stem).is_some_and(|rest| rest.starts_with('.')));
    own.into_iter()
        .chain([format!("{stem}.so"), format!("{stem}.dylib")])
        .chain(mapped)
        .collect()
}
