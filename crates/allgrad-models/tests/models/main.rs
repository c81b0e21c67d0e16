//! allgrad-models' integration tests in one binary (one to compile and link instead of one per
//! file): each module is the tests of one loss, layer, model or method's parts, with `support`
//! (the committed tiny BERT, the face head's set-up). `cargo test -p allgrad-models --test models
//! clip_loss::` runs one module's tests.
//!
//! The modules share a process, and their tests run on parallel threads. That is safe here: the
//! path counters the tests read (`allgrad_models::tiled_paths`, `allgrad_nn::host_traffic`),
//! autocast and `transfer::set_device_path` are per thread, ranks are threads of the test
//! (`run_threads`), and thread pools are the test's own. A test file that changes process-wide
//! state (an environment variable, the current directory, the TF32 switch, a signal disposition)
//! needs a binary of its own; none here does.
//!
//! The fixtures stay beside this folder, in `tests/data/`.

mod support;

mod autocast_reference;
mod batch_norm_device;
mod bert_model;
mod bert_reference;
mod clip_data;
mod clip_eos;
mod clip_eval;
mod clip_init;
mod clip_loss;
mod clip_preprocess;
mod clip_reference;
mod face_bin;
mod face_head;
mod face_insightface;
mod face_margin_softmax;
mod face_sparse;
mod losses;
mod losses_reference;
mod no_host_reads;
mod siglip_reference;
mod simcse_data;
mod simcse_eval;
mod simcse_info_nce;
mod tiled_loss;
