//! With feature `cuda`, compiles the fused element-wise kernels (`src/cuda/*.cu`) to PTX with
//! nvcc, through `cudaforge`, the crate Candle's own kernels (`candle-kernels`) are built with:
//! it finds nvcc (CUDA_ROOT / CUDA_PATH / PATH), takes CUDA_COMPUTE_CAP as Candle's build does,
//! and writes `ptx.rs` with one `&str` constant per `.cu` file. Without the feature nothing is
//! compiled and no nvcc is needed.

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    #[cfg(feature = "cuda")]
    ptx();
}

#[cfg(feature = "cuda")]
fn ptx() {
    println!("cargo::rerun-if-changed=src/cuda");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let built = cudaforge::KernelBuilder::new()
        .source_dir("src/cuda")
        .arg("-std=c++17")
        .arg("-O3")
        // No contraction of `a·x + b` into a fused multiply-add: the element-wise kernels then
        // round as the CPU kernels do (Rust never contracts), so the two agree to the last bit
        // wherever they evaluate the same expression.
        .arg("--fmad=false")
        .build_ptx()
        .and_then(|p| p.write(out.join("ptx.rs")));
    if let Err(e) = built {
        panic!("allgrad-nn: compiling the CUDA kernels (src/cuda) to PTX failed: {e}");
    }
}
