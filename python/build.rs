//! Builds the one C++ file of the binding: a shim that calls torch's native data-pointer reader
//! and turns its C++ exceptions into a status (Rust cannot catch them).
fn main() {
    println!("cargo:rerun-if-changed=src/tensor_addresses.cpp");
    cc::Build::new()
        .cpp(true)
        .file("src/tensor_addresses.cpp")
        .flag_if_supported("-std=c++17")
        .compile("gradclip_tensor_addresses");
}
