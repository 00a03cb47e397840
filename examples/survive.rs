//! docs/failures.md's example: all-reduces in a loop and goes on without ranks that die. Run
//! it on 4 local ranks and kill one (`kill -9` of a worker's pid):
//! `cargo build --release --example survive && target/release/weft run --elastic -n 4 -- target/release/examples/survive`
//! docs/failures.md shows this file from its first line that is not `//!`
//! (tests/docs_programs.rs holds the two equal, and runs it on 2 ranks).

use weftcc::{Communicator, Error, ReduceOp};

fn main() -> weftcc::Result<()> {
    let mut comm = Communicator::from_env()?;
    for step in 0..1000 {
        let mut grads = vec![1.0f32; 1 << 16];
        all_reduce_surviving(&mut comm, &mut grads)?;
        assert_eq!(grads[0], comm.size() as f32);
        if step % 250 == 0 && comm.rank() == 0 {
            println!("step {step}: {} ranks, epoch {}", comm.size(), comm.epoch());
        }
    }
    Ok(())
}

/// All-reduces `buf`, going on without the ranks that fail meanwhile: the survivors redo the
/// call on a communicator of their own.
fn all_reduce_surviving(comm: &mut Communicator, buf: &mut [f32]) -> weftcc::Result<()> {
    let input = buf.to_vec();
    loop {
        match comm.all_reduce_in_place(buf, ReduceOp::Sum) {
            Ok(()) => return Ok(()),
            // A wrong argument is the caller's to fix.
            Err(e) if !e.is_fatal() => return Err(e),
            Err(_) => {
                *comm = shrink_to_survivors(comm)?;
                buf.copy_from_slice(&input);
            }
        }
    }
}

/// Agrees with the other survivors on who failed and makes their communicator; again if a
/// survivor dies meanwhile (the shrink then fails on every survivor, naming it): each retry
/// excludes at least one more rank, so there are fewer retries than ranks.
fn shrink_to_survivors(comm: &Communicator) -> weftcc::Result<Communicator> {
    let mut retries = comm.size();
    loop {
        let agreed = comm.agree_on_failures()?;
        match comm.shrink(&agreed.failed) {
            Err(Error::Bootstrap { .. }) if retries > 1 => retries -= 1,
            made => return made,
        }
    }
}
