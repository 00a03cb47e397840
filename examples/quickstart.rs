//! The README's example. Run it on 4 local ranks:
//! `cargo build --release --example quickstart && target/release/weft run -n 4 -- target/release/examples/quickstart`
//! README.md shows this file from its first line that is not `//!` (tests/docs_programs.rs
//! holds the two equal).

use weftcc::{Communicator, ReduceOp};

fn main() -> weftcc::Result<()> {
    // Reads weft run's, torchrun's, SLURM's or Open MPI's environment.
    let comm = Communicator::from_env()?;
    let mut grads = vec![1.0f32; 1 << 20];
    comm.all_reduce_in_place(&mut grads, ReduceOp::Avg)?;

    // Out of place, other collectives, point-to-point in a group:
    let mine = vec![comm.rank() as u32; 4];
    let mut all = vec![0u32; 4 * comm.size()];
    comm.all_gather(&mine, &mut all)?;
    let next = (comm.rank() + 1) % comm.size();
    let prev = (comm.rank() + comm.size() - 1) % comm.size();
    let mut got = vec![0u32; 4];
    comm.group().send(&mine, next).recv(&mut got, prev).run()?;

    // Asynchronous: the handle returns the buffer; operations run in issue order.
    let handle = comm.all_reduce_async::<f64, _>(vec![1.0f64; 1024], ReduceOp::Sum);
    let summed = handle.wait()?;
    assert_eq!(summed[0], comm.size() as f64);
    if comm.rank() == 0 {
        println!(
            "{} ranks: all-reduce, all-gather {all:?}, send/recv and async all-reduce done",
            comm.size()
        );
    }
    Ok(())
}
