//! weftcc's settings: every `WEFT_*` environment variable the library, the CUDA path and the
//! `weft` tool read, declared once in [`ALL`] (name, kind, default, one-line doc) with the
//! parser its kind implies, in the spirit of NCCL's `NCCL_PARAM`. The process environment is
//! read here and nowhere else (besides `weft run`, which writes its workers' environment):
//! a `WEFT_*` variable through its [`Setting`], another program's variable (a launcher's
//! `RANK`, SLURM's `SLURM_PROCID`, …) through [`foreign`] or [`process_environment`].
//!
//! A value that does not parse is a [`SettingError`] naming the variable, its value and what
//! was expected; unset and empty (or blank) values read as unset everywhere.

#![forbid(unsafe_code)]

mod size;
mod table;

pub use size::{parse_size, InvalidSize};
pub use table::*;

use std::collections::HashMap;
use std::fmt::Display;
use std::path::PathBuf;
use std::time::Duration;

/// What a setting's value is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// On or off: `1`, `true`, `yes`, `on`, or `0`, `false`, `no`, `off` (any case).
    Flag,
    /// A whole number from `min` to `max`.
    Number { min: u64, max: u64 },
    /// A byte size ([`parse_size`]: `4194304`, `512K`, `4MiB`, `1.5M`) of at least `min`.
    Size { min: usize },
    /// Seconds, fractions allowed, more than zero.
    Seconds,
    /// Whole microseconds.
    Micros,
    /// One of a few words (any case; [`Setting::choice`] returns the one as declared).
    Choice(&'static [&'static str]),
    /// Text in a grammar of its own, which its reader parses ([`Setting::parse`]).
    Text,
    /// A file or directory.
    Path,
    /// Written by `weft run` into its workers' environment (read back by the runtime).
    Launcher,
}

/// Whether the ranks of a job must give a setting the same value. Every rank's values of the
/// settings that are not [`Agreement::Own`] are compared when a communicator is made.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Agreement {
    /// Each rank's own (a path, a host's interface, a log level): not compared.
    Own,
    /// Ranks that differ still work together (a timeout, the connection time): a warning.
    Should,
    /// Ranks that differ would hang or compute different results (algorithms, protocols,
    /// deterministic mode, buffer and message sizes, socket striping, the network): the
    /// communicator is not made, on every rank.
    Must,
}

/// One environment variable: its name, kind, default (as the docs state it) and meaning.
#[derive(Debug)]
pub struct Setting {
    pub name: &'static str,
    pub kind: Kind,
    pub agreement: Agreement,
    pub default: &'static str,
    pub doc: &'static str,
}

/// A setting's value that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name}={value:?}: expected {expected}")]
pub struct SettingError {
    /// The variable.
    pub name: &'static str,
    /// Its value as set.
    pub value: String,
    /// What its kind allows.
    pub expected: String,
}

impl Setting {
    /// The value, trimmed; `None` when unset, empty or blank (or not Unicode). In a process
    /// that honours NCCL's variables ([`honour_nccl_twins`]), an unset variable with an
    /// `NCCL_*` twin ([`NCCL_TWINS`]) takes the twin's value.
    pub fn value(&self) -> Option<String> {
        read(self.name).or_else(|| {
            honouring_nccl_twins()
                .then(|| nccl_twin(self))
                .flatten()
                .and_then(read)
        })
    }

    /// Whether the variable is set to something other than blanks.
    pub fn is_set(&self) -> bool {
        self.value().is_some()
    }

    /// The error for `value` of this setting.
    pub fn invalid(&self, value: &str, expected: impl Into<String>) -> SettingError {
        SettingError {
            name: self.name,
            value: value.to_string(),
            expected: expected.into(),
        }
    }

    /// The value through `parse` (a grammar its reader owns); `None` when unset. `parse`'s
    /// error becomes what was expected.
    pub fn parse<T, E: Display>(
        &self,
        parse: impl FnOnce(&str) -> Result<T, E>,
    ) -> Result<Option<T>, SettingError> {
        self.parse_in(self.value().as_deref(), parse)
    }

    /// [`Setting::parse`] of a value given (`None` or blank: unset) rather than read.
    pub fn parse_in<T, E: Display>(
        &self,
        text: Option<&str>,
        parse: impl FnOnce(&str) -> Result<T, E>,
    ) -> Result<Option<T>, SettingError> {
        let Some(v) = text.map(str::trim).filter(|v| !v.is_empty()) else {
            return Ok(None);
        };
        parse(v)
            .map(Some)
            .map_err(|e| self.invalid(v, e.to_string()))
    }

    /// A [`Kind::Flag`]: `default` when unset.
    pub fn flag_or(&self, default: bool) -> Result<bool, SettingError> {
        self.flag_in(self.value().as_deref(), default)
    }

    /// A [`Kind::Flag`] that is off unless set.
    pub fn flag(&self) -> Result<bool, SettingError> {
        self.flag_or(false)
    }

    /// [`Setting::flag_or`] of a value given.
    pub fn flag_in(&self, text: Option<&str>, default: bool) -> Result<bool, SettingError> {
        debug_assert_eq!(self.kind, Kind::Flag, "{} is not a flag", self.name);
        Ok(self.parse_in(text, parse_flag)?.unwrap_or(default))
    }

    /// A [`Kind::Number`], checked against its range.
    pub fn number(&self) -> Result<Option<u64>, SettingError> {
        self.number_in(self.value().as_deref())
    }

    /// [`Setting::number`] of a value given.
    pub fn number_in(&self, text: Option<&str>) -> Result<Option<u64>, SettingError> {
        let Kind::Number { min, max } = self.kind else {
            debug_assert!(false, "{} is not a number", self.name);
            return Ok(None);
        };
        self.parse_in(text, |v| {
            v.parse::<u64>()
                .ok()
                .filter(|n| (min..=max).contains(n))
                .ok_or(format!("a whole number from {min} to {max}"))
        })
    }

    /// A [`Kind::Size`] in bytes, at least its minimum.
    pub fn size(&self) -> Result<Option<usize>, SettingError> {
        self.size_in(self.value().as_deref())
    }

    /// [`Setting::size`] of a value given.
    pub fn size_in(&self, text: Option<&str>) -> Result<Option<usize>, SettingError> {
        let Kind::Size { min } = self.kind else {
            debug_assert!(false, "{} is not a size", self.name);
            return Ok(None);
        };
        self.parse_in(text, |v| {
            parse_size(v).ok().filter(|&n| n >= min).ok_or(if min > 0 {
                format!("a size of at least {min} bytes (4194304, 512K, 4MiB, 1.5M)")
            } else {
                "a size (4194304, 512K, 4MiB, 1.5M)".to_string()
            })
        })
    }

    /// A [`Kind::Seconds`].
    pub fn seconds(&self) -> Result<Option<Duration>, SettingError> {
        debug_assert_eq!(self.kind, Kind::Seconds, "{} is not in seconds", self.name);
        self.parse(|v| {
            v.parse::<f64>()
                .ok()
                .filter(|s| *s > 0.0 && s.is_finite())
                .and_then(|s| Duration::try_from_secs_f64(s).ok())
                .ok_or("a positive number of seconds")
        })
    }

    /// A [`Kind::Micros`].
    pub fn micros(&self) -> Result<Option<Duration>, SettingError> {
        debug_assert_eq!(self.kind, Kind::Micros, "{} is not in µs", self.name);
        self.parse(|v| {
            v.parse::<u64>()
                .map(Duration::from_micros)
                .map_err(|_| "a whole number of microseconds")
        })
    }

    /// A [`Kind::Choice`]: the word as declared (matched in any case); an error listing the
    /// allowed words otherwise.
    pub fn choice(&self) -> Result<Option<&'static str>, SettingError> {
        self.choice_in(self.value().as_deref())
    }

    /// [`Setting::choice`] of a value given.
    pub fn choice_in(&self, text: Option<&str>) -> Result<Option<&'static str>, SettingError> {
        let Kind::Choice(words) = self.kind else {
            debug_assert!(false, "{} is not a choice", self.name);
            return Ok(None);
        };
        self.parse_in(text, |v| {
            words
                .iter()
                .copied()
                .find(|w| w.eq_ignore_ascii_case(v))
                .ok_or_else(|| format!("one of {}", words.join(", ")))
        })
    }

    /// The value as ranks compare it ([`Agreement`]): a flag as `on`/`off`, a number or size in
    /// its unit, a duration, a choice as declared, other text trimmed; `unset` when unset. A
    /// value that does not parse is the error its reader gives.
    pub fn compared_value(&self) -> Result<String, SettingError> {
        let Some(text) = self.value() else {
            return Ok("unset".to_string());
        };
        let given = Some(text.as_str());
        let shown = |d: Option<Duration>| d.map(|d| format!("{d:?}"));
        Ok(match self.kind {
            Kind::Flag => Some(
                if self.flag_in(given, false)? {
                    "on"
                } else {
                    "off"
                }
                .to_string(),
            ),
            Kind::Number { .. } => self.number_in(given)?.map(|n| n.to_string()),
            Kind::Size { .. } => self.size_in(given)?.map(|n| n.to_string()),
            Kind::Seconds => shown(self.seconds()?),
            Kind::Micros => shown(self.micros()?),
            Kind::Choice(_) => self.choice_in(given)?.map(str::to_string),
            Kind::Text | Kind::Path | Kind::Launcher => None,
        }
        .unwrap_or(text))
    }

    /// Checks the value against its kind (flags, numbers, sizes, seconds, microseconds,
    /// choices); text in a grammar of its own is its reader's to check, paths and the
    /// launcher's variables are taken as they are.
    pub fn check(&self) -> Result<(), SettingError> {
        match self.kind {
            Kind::Flag => self.flag().map(drop),
            Kind::Number { .. } => self.number().map(drop),
            Kind::Size { .. } => self.size().map(drop),
            Kind::Seconds => self.seconds().map(drop),
            Kind::Micros => self.micros().map(drop),
            Kind::Choice(_) => self.choice().map(drop),
            Kind::Text | Kind::Path | Kind::Launcher => Ok(()),
        }
    }

    /// A [`Kind::Path`] (any bytes the platform allows); `None` when unset, empty or blank.
    pub fn path(&self) -> Option<PathBuf> {
        debug_assert_eq!(self.kind, Kind::Path, "{} is not a path", self.name);
        std::env::var_os(self.name)
            .filter(|v| !v.to_string_lossy().trim().is_empty())
            .map(PathBuf::from)
    }
}

/// Every declared setting whose value does not fit its kind ([`Setting::check`]), in
/// declaration order: what a launcher checks once before it starts any rank.
pub fn check_all() -> Vec<SettingError> {
    ALL.iter().filter_map(|s| s.check().err()).collect()
}

/// The variable `name`, trimmed; `None` when unset, blank or not Unicode.
fn read(name: &str) -> Option<String> {
    let v = std::env::var(name).ok()?;
    let v = v.trim();
    (!v.is_empty()).then(|| v.to_string())
}

/// The one grammar of on/off values.
fn parse_flag(v: &str) -> Result<bool, &'static str> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err("1, true, yes or on; 0, false, no or off"),
    }
}

/// A variable of another program that weftcc reads (a launcher's `RANK`, SLURM's
/// `SLURM_PROCID`, OpenMP's `OMP_NUM_THREADS`, …), trimmed; `None` when unset or blank.
/// weftcc's own variables are read through their [`Setting`].
pub fn foreign(name: &str) -> Option<String> {
    debug_assert!(
        !name.starts_with("WEFT_"),
        "{name} is weftcc's own: use its Setting"
    );
    read(name)
}

/// The `NCCL_*` twin of `setting` ([`NCCL_TWINS`]), if it has one.
pub fn nccl_twin(setting: &Setting) -> Option<&'static str> {
    NCCL_TWINS
        .iter()
        .find(|(s, _)| std::ptr::eq(*s, setting))
        .map(|(_, twin)| *twin)
}

static NCCL_TWINS_ON: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// From now on, in this process, a `WEFT_*` variable that is unset takes the value of its
/// `NCCL_*` twin ([`NCCL_TWINS`]): called by weftcc's `libnccl.so.2`, whose users configure
/// NCCL. Values are read as the `WEFT_*` variable's (its grammar); an error names the `WEFT_*`
/// variable and the value given.
pub fn honour_nccl_twins() {
    NCCL_TWINS_ON.store(true, std::sync::atomic::Ordering::Relaxed);
}

fn honouring_nccl_twins() -> bool {
    NCCL_TWINS_ON.load(std::sync::atomic::Ordering::Relaxed)
}

/// The whole process environment (Unicode entries), for readers of a launcher's variables
/// that look at many names at once (`LaunchInfo::from_env`, `weft status --pid` of this
/// process).
pub fn process_environment() -> HashMap<String, String> {
    std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_var<R>(name: &str, value: &str, f: impl FnOnce() -> R) -> R {
        // Each test uses variables of its own, so tests running in parallel do not meet.
        std::env::set_var(name, value);
        let r = f();
        std::env::remove_var(name);
        r
    }

    static T_FLAG: Setting = Setting {
        name: "WEFT_SETTINGS_TEST_FLAG",
        kind: Kind::Flag,
        agreement: Agreement::Own,
        default: "off",
        doc: "",
    };
    static T_NUM: Setting = Setting {
        name: "WEFT_SETTINGS_TEST_NUM",
        kind: Kind::Number { min: 1, max: 16 },
        agreement: Agreement::Own,
        default: "1",
        doc: "",
    };
    static T_SIZE: Setting = Setting {
        name: "WEFT_SETTINGS_TEST_SIZE",
        kind: Kind::Size { min: 1 },
        agreement: Agreement::Own,
        default: "1M",
        doc: "",
    };
    static T_SECS: Setting = Setting {
        name: "WEFT_SETTINGS_TEST_SECS",
        kind: Kind::Seconds,
        agreement: Agreement::Own,
        default: "600",
        doc: "",
    };

    #[test]
    fn compared_values_are_one_spelling_per_meaning() {
        assert_eq!(T_FLAG.compared_value().as_deref(), Ok("unset"));
        for on in ["1", "yes", " ON "] {
            assert_eq!(
                with_var(T_FLAG.name, on, || T_FLAG.compared_value()).as_deref(),
                Ok("on")
            );
        }
        assert_eq!(
            with_var(T_SIZE.name, "1M", || T_SIZE.compared_value()),
            with_var(T_SIZE.name, "1048576", || T_SIZE.compared_value())
        );
        assert_eq!(
            with_var(T_SECS.name, "1.5", || T_SECS.compared_value()).as_deref(),
            Ok("1.5s")
        );
        assert!(with_var(T_NUM.name, "99", || T_NUM.compared_value()).is_err());
        // The table: what must agree includes the examples, and no launcher variable.
        for must in [&ALGO, &DETERMINISTIC, &BUFFSIZE, &NET, &SOCKET_NTHREADS] {
            assert_eq!(must.agreement, Agreement::Must, "{}", must.name);
        }
        assert!(ALL
            .iter()
            .filter(|s| s.kind == Kind::Launcher || s.kind == Kind::Path)
            .all(|s| s.agreement != Agreement::Must || s.name == CALIBRATION.name));
    }

    #[test]
    fn values_parse_by_kind_and_bad_ones_name_the_variable() {
        assert_eq!(T_FLAG.flag(), Ok(false));
        assert_eq!(with_var(T_FLAG.name, " On ", || T_FLAG.flag()), Ok(true));
        assert_eq!(
            with_var(T_FLAG.name, "0", || T_FLAG.flag_or(true)),
            Ok(false)
        );
        assert_eq!(
            with_var(T_FLAG.name, "  ", || T_FLAG.flag_or(true)),
            Ok(true)
        );
        let e = with_var(T_FLAG.name, "maybe", || T_FLAG.flag()).unwrap_err();
        assert_eq!(e.name, "WEFT_SETTINGS_TEST_FLAG");
        assert!(e
            .to_string()
            .starts_with("WEFT_SETTINGS_TEST_FLAG=\"maybe\": expected"));

        assert_eq!(with_var(T_NUM.name, " 4 ", || T_NUM.number()), Ok(Some(4)));
        for bad in ["0", "17", "-1", "x", "4.5"] {
            let e = with_var(T_NUM.name, bad, || T_NUM.number()).unwrap_err();
            assert_eq!(e.expected, "a whole number from 1 to 16", "{bad}");
        }
        assert_eq!(
            with_var(T_SIZE.name, "4MiB", || T_SIZE.size()),
            Ok(Some(4 << 20))
        );
        assert!(with_var(T_SIZE.name, "0", || T_SIZE.size()).is_err());
        assert!(with_var(T_SIZE.name, "lots", || T_SIZE.size()).is_err());
        assert_eq!(
            with_var(T_SECS.name, "0.5", || T_SECS.seconds()),
            Ok(Some(Duration::from_millis(500)))
        );
        for bad in ["0", "-3", "inf", "NaN", "1e30", "soon"] {
            assert!(
                with_var(T_SECS.name, bad, || T_SECS.seconds()).is_err(),
                "{bad}"
            );
        }
    }

    static T_CHOICE: Setting = Setting {
        name: "WEFT_SETTINGS_TEST_CHOICE",
        kind: Kind::Choice(&["WARN", "INFO"]),
        agreement: Agreement::Own,
        default: "off",
        doc: "",
    };

    #[test]
    fn a_choice_is_one_of_its_words_in_any_case_and_an_error_lists_them() {
        assert_eq!(T_CHOICE.choice(), Ok(None));
        assert_eq!(
            with_var(T_CHOICE.name, " info ", || T_CHOICE.choice()),
            Ok(Some("INFO"))
        );
        let e = with_var(T_CHOICE.name, "LOUD", || T_CHOICE.choice()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "WEFT_SETTINGS_TEST_CHOICE=\"LOUD\": expected one of WARN, INFO"
        );
        assert!(with_var(T_CHOICE.name, "LOUD", || T_CHOICE.check()).is_err());
        assert!(with_var(T_NUM.name, "99", || T_NUM.check()).is_err());
        assert!(with_var(T_SECS.name, "soon", || T_SECS.check()).is_err());
        assert_eq!(with_var(T_FLAG.name, "yes", || T_FLAG.check()), Ok(()));
    }

    #[test]
    fn check_all_names_every_bad_declared_setting() {
        // Declared settings of kinds no other test of this binary sets.
        std::env::set_var(DEBUG.name, "LOUD");
        std::env::set_var(CUDA_DEPTH.name, "0");
        let bad: Vec<&str> = check_all().iter().map(|e| e.name).collect();
        std::env::remove_var(DEBUG.name);
        std::env::remove_var(CUDA_DEPTH.name);
        assert!(bad.contains(&"WEFT_DEBUG"), "{bad:?}");
        assert!(bad.contains(&"WEFT_CUDA_DEPTH"), "{bad:?}");
    }

    #[test]
    fn every_declared_name_is_weft_and_unique() {
        let mut names: Vec<&str> = ALL.iter().map(|s| s.name).collect();
        assert!(names.iter().all(|n| n.starts_with("WEFT_")));
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n, "a variable is declared twice");
        assert!(
            ALL.iter().all(|s| !s.doc.is_empty()),
            "every setting says what it is"
        );
    }
}
