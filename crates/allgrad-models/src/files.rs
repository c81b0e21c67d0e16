//! Writing tensors to disk with ordinary file permissions.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Result, Tensor};

/// Writes `tensors` to `path` as safetensors, readable as any file the process creates
/// (`0666` less the umask, so usually `0644`). Candle's writer goes through a temporary file
/// that it renames into place, and temporary files are private (`0600`): a checkpoint or an
/// exported model would then be unreadable to the colleagues who can read the rest of the run.
pub fn save_safetensors(tensors: &HashMap<String, Tensor>, path: &Path) -> Result<()> {
    candle_core::safetensors::save(tensors, path)?;
    set_default_mode(path).map_err(|e| candle_core::Error::Msg(format!("setting the permissions of {}: {e}", path.display())))
}

#[cfg(unix)]
fn set_default_mode(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666 & !umask()))
}

#[cfg(not(unix))]
fn set_default_mode(_: &Path) -> std::io::Result<()> {
    Ok(())
}

/// The process's umask, read from `/proc/self/status` (Linux 4.7+): `umask(2)` cannot be read
/// without being set, which would race with other threads creating files. `0o022` when the
/// kernel does not report it.
#[cfg(unix)]
fn umask() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Umask:").and_then(|v| u32::from_str_radix(v.trim(), 8).ok())))
        .unwrap_or(0o022)
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn saved_tensors_get_the_permissions_of_a_newly_created_file() {
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("plain");
        std::fs::write(&plain, "x").unwrap();
        let path = dir.path().join("t.safetensors");
        let t = Tensor::new(&[1f32, 2.0], &candle_core::Device::Cpu).unwrap();
        save_safetensors(&HashMap::from([("t".to_string(), t)]), &path).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), mode(&plain), "a plain file here gets {:o}", mode(&plain));
        assert_eq!(candle_core::safetensors::load(&path, &candle_core::Device::Cpu).unwrap().len(), 1);
    }
}
