//! Soak test (run by `benches/soak.sh`; not a CI test): many communicator create/destroy cycles,
//! then random collectives for a given time, every result checked, with the process's resident
//! memory, file descriptors, threads and weftcc's /dev/shm entries sampled along the way.
//!
//! `weft run -n 4 -- target/release/examples/soak cycles 10000`
//! `weft run -n 4 -- target/release/examples/soak random 1800`
//!
//! Prints `SAMPLE <rank> <seconds> <rss_kib> <fds> <threads> <shm_entries> <done>` lines and exits
//! non-zero at the first wrong result.

use std::time::{Duration, Instant};
use weftcc::{CommConfig, Communicator, ReduceOp, UniqueId};
use weftcc_collectives::testing::SplitMix64;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let world = Communicator::from_env().unwrap_or_else(|e| die(&e.to_string()));
    let arg = |i: usize, default: u64| {
        args.get(i)
            .map(|v| v.parse().unwrap_or_else(|_| die("bad number")))
            .unwrap_or(default)
    };
    match args.get(1).map(String::as_str) {
        Some("cycles") => cycles(&world, arg(2, 10_000)),
        Some("random") => random(&world, Duration::from_secs(arg(2, 60)), arg(3, 1)),
        _ => die("usage: soak cycles N | soak random SECONDS [SEED]"),
    }
}

fn die(msg: &str) -> ! {
    eprintln!("soak: {msg}");
    std::process::exit(1)
}

/// A new communicator over the same ranks, set up through its own bootstrap store (rank 0 makes
/// the id and broadcasts it over `world`), with `algo` as its `WEFT_ALGO`.
fn fresh(world: &Communicator, algo: Option<&str>) -> Communicator {
    let mut text = [0u8; 256];
    if world.rank() == 0 {
        let id = UniqueId::new()
            .unwrap_or_else(|e| die(&e.to_string()))
            .to_string();
        text[..id.len()].copy_from_slice(id.as_bytes());
    }
    world
        .broadcast_in_place(&mut text, 0)
        .unwrap_or_else(|e| die(&e.to_string()));
    let end = text.iter().position(|&b| b == 0).unwrap_or(text.len());
    let id: UniqueId = std::str::from_utf8(&text[..end])
        .unwrap_or_else(|_| die("id is not text"))
        .parse()
        .unwrap_or_else(|e: weftcc::Error| die(&e.to_string()));
    match algo {
        Some(a) => std::env::set_var("WEFT_ALGO", a),
        None => std::env::remove_var("WEFT_ALGO"),
    }
    let config = CommConfig::from_env().unwrap_or_else(|e| die(&e.to_string()));
    Communicator::init_with(world.rank(), world.size(), &id, config)
        .unwrap_or_else(|e| die(&e.to_string()))
}

/// One line of what the process holds now.
fn sample(rank: usize, start: Instant, done: u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .unwrap_or("0")
            .to_string()
    };
    let count = |dir: &str, prefix: &str| {
        std::fs::read_dir(dir).map_or(0, |d| {
            d.filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
                .count()
        })
    };
    println!(
        "SAMPLE {rank} {:.0} {} {} {} {} {done}",
        start.elapsed().as_secs_f64(),
        field("VmRSS:"),
        count("/proc/self/fd", ""),
        field("Threads:"),
        count("/dev/shm", "weft"),
    );
}

fn cycles(world: &Communicator, n: u64) {
    let start = Instant::now();
    let size = world.size() as i64;
    sample(world.rank(), start, 0);
    for i in 1..=n {
        let comm = fresh(world, None);
        let mut v = vec![comm.rank() as i64 + 1; 8];
        comm.all_reduce_in_place(&mut v, ReduceOp::Sum)
            .unwrap_or_else(|e| die(&e.to_string()));
        if v.iter().any(|&x| x != size * (size + 1) / 2) {
            die(&format!("cycle {i}: wrong all-reduce {v:?}"));
        }
        drop(comm);
        if i % 500 == 0 || i == n {
            sample(world.rank(), start, i);
        }
    }
}

/// 0, or log-uniform in 1 ..= 2^20 elements.
fn random_count(rng: &mut SplitMix64) -> usize {
    if rng.below(16) == 0 {
        return 0;
    }
    let bits = rng.below(21);
    (1usize << bits) + rng.below(1 << bits) / 2
}

/// Rank `r`'s element `i`: small integers, exact in every type and sum of ranks.
fn value(r: usize, i: usize) -> f64 {
    ((r * 7 + i * 3) % 13) as f64
}

fn random(world: &Communicator, duration: Duration, seed: u64) {
    let algos = [None, Some("ring"), Some("tree"), Some("rd")];
    let comms: Vec<Communicator> = algos.iter().map(|a| fresh(world, *a)).collect();
    let (n, me) = (world.size(), world.rank());
    let mut rng = SplitMix64(seed);
    let start = Instant::now();
    let mut last = Instant::now();
    let mut done = 0u64;
    sample(me, start, 0);
    while start.elapsed() < duration {
        let comm = &comms[rng.below(comms.len())];
        let count = random_count(&mut rng);
        let kind = rng.below(6);
        let as_f64 = rng.below(2) == 0;
        let check = |what: &str, got: &[f64], want: &dyn Fn(usize) -> f64| {
            if let Some(i) = (0..got.len()).find(|&i| got[i] != want(i)) {
                die(&format!(
                    "op {done} ({what}, {count} elements): [{i}] = {}, want {}",
                    got[i],
                    want(i)
                ));
            }
        };
        let sum = |i: usize| (0..n).map(|r| value(r, i)).sum::<f64>();
        // f32 carries the same small integers exactly; run it through f32 buffers.
        let run = |f: &dyn Fn(&Communicator) -> weftcc::Result<Vec<f64>>| {
            f(comm).unwrap_or_else(|e| die(&e.to_string()))
        };
        match kind {
            0 => {
                let got = run(&|c| {
                    if as_f64 {
                        let mut v: Vec<f64> = (0..count).map(|i| value(me, i)).collect();
                        c.all_reduce_in_place(&mut v, ReduceOp::Sum).map(|()| v)
                    } else {
                        let mut v: Vec<f32> = (0..count).map(|i| value(me, i) as f32).collect();
                        c.all_reduce_in_place(&mut v, ReduceOp::Sum)
                            .map(|()| v.iter().map(|&x| x as f64).collect())
                    }
                });
                check("all-reduce", &got, &sum);
            }
            1 => {
                let send: Vec<f64> = (0..count * n).map(|i| value(me, i)).collect();
                let mut recv = vec![0f64; count];
                let got = run(&|c| {
                    let mut r = recv.clone();
                    c.reduce_scatter(&send, &mut r, ReduceOp::Sum).map(|()| r)
                });
                recv.clear();
                check("reduce-scatter", &got, &|i| sum(me * count + i));
            }
            2 => {
                let send: Vec<f64> = (0..count).map(|i| value(me, i)).collect();
                let got = run(&|c| {
                    let mut r = vec![0f64; count * n];
                    c.all_gather(&send, &mut r).map(|()| r)
                });
                check("all-gather", &got, &|i| {
                    value(i / count.max(1), i % count.max(1))
                });
            }
            3 => {
                let root = rng.below(n);
                let got = run(&|c| {
                    let mut v: Vec<f64> = (0..count)
                        .map(|i| if me == root { value(root, i) } else { -1.0 })
                        .collect();
                    c.broadcast_in_place(&mut v, root).map(|()| v)
                });
                check("broadcast", &got, &|i| value(root, i));
            }
            4 => {
                let send: Vec<f64> = (0..count * n).map(|i| value(me, i)).collect();
                let got = run(&|c| {
                    let mut r = vec![0f64; count * n];
                    c.all_to_all(&send, &mut r).map(|()| r)
                });
                // Block j of the result is rank j's block `me`.
                check("all-to-all", &got, &|i| {
                    let (j, k) = (i / count.max(1), i % count.max(1));
                    value(j, me * count + k)
                });
            }
            _ => {
                let root = rng.below(n);
                let send: Vec<f64> = (0..count).map(|i| value(me, i)).collect();
                let got = run(&|c| {
                    let mut r = vec![0f64; count];
                    c.reduce(&send, &mut r, ReduceOp::Sum, root).map(|()| r)
                });
                if me == root {
                    check("reduce", &got, &sum);
                }
            }
        }
        done += 1;
        if last.elapsed() >= Duration::from_secs(10) {
            sample(me, start, done);
            last = Instant::now();
        }
    }
    world.barrier().unwrap_or_else(|e| die(&e.to_string()));
    sample(me, start, done);
}
