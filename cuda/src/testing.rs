//! Test support shared by the crates whose tests need a GPU. Not part of the API.

use crate::CudaError;

/// True (after printing why) when this machine has no GPU to test on: no CUDA driver, or no
/// device. A driver that is present but fails to enumerate is a failure, not a skip.
pub fn skip_without_device() -> bool {
    let why = match crate::device_count() {
        Ok(n) if n > 0 => return false,
        Ok(_) => "no CUDA device".to_string(),
        Err(CudaError::NoDriver(why)) => format!("no CUDA driver ({why})"),
        Err(e) => panic!("device enumeration failed with a driver present: {e}"),
    };
    println!("skipped: {why}");
    true
}
