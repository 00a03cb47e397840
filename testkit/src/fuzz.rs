//! Fuzzing on stable Rust: proptest run for many cases over one target, the count printed.
//! `WEFT_FUZZ_CASES` sets the cases per target (default 1000).

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use std::cell::Cell;

/// The cases each target runs: `WEFT_FUZZ_CASES`, default 1000 (a value that does not parse
/// fails the test, naming the variable).
pub fn cases() -> u32 {
    match weftcc_settings::FUZZ_CASES.number() {
        Ok(n) => n.map_or(1000, |n| n as u32),
        Err(e) => panic!("{e}"),
    }
}

/// Runs `test` on [`cases`] values of `strategy`, prints how many ran as `fuzz {name}: N cases
/// run`, and panics with the shrunk case if one failed. Returns the count.
pub fn fuzz<S: Strategy>(
    name: &str,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) -> u64
where
    S::Value: std::fmt::Debug,
{
    let mut runner = TestRunner::new(Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    });
    let ran = Cell::new(0u64);
    let result = runner.run(&strategy, |v| {
        ran.set(ran.get() + 1);
        test(v)
    });
    println!("fuzz {name}: {} cases run", ran.get());
    if let Err(e) = result {
        panic!("fuzz {name}: {e}");
    }
    ran.get()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_case_runs_and_a_failure_panics_with_the_target() {
        let n = fuzz("count", 0u32..10, |v| {
            proptest::prop_assert!(v < 10);
            Ok(())
        });
        assert_eq!(n, u64::from(cases()));
        let failed = std::panic::catch_unwind(|| {
            fuzz("fails", 0u32..10, |v| {
                proptest::prop_assert!(v < 5);
                Ok(())
            })
        });
        let message = failed.expect_err("a failing case panics");
        let text = message
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_default();
        assert!(text.starts_with("fuzz fails:"), "{text}");
    }
}
