//! What each rank announces when a communicator is made (its [`Announcement`]: library version,
//! the settings that are not each rank's own, CPU and GPU) and the rule that compares them
//! ([`compare`]). Which settings must agree is the settings table's to say
//! ([`weftcc_settings::Agreement`]); this module only compares.

use serde::{Deserialize, Serialize};
use std::fmt;
use weftcc_settings::Agreement;

/// Store key (under a communicator's namespace) of rank `rank`'s announcement.
pub fn announcement_key(namespace: &str, rank: usize) -> String {
    format!("{namespace}/announce/{rank}")
}

/// Store key of rank 0's verdict: the [`Disagreement`]s it found, which every rank reads.
pub fn verdict_key(namespace: &str) -> String {
    format!("{namespace}/announce-verdict")
}

/// One thing a rank announces: what (a setting's name, or `library version`, `CPU model`, …),
/// its value, and how much agreement it needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Item {
    pub what: String,
    pub value: String,
    pub agreement: Agreement,
}

/// Everything one rank announces.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Announcement {
    pub items: Vec<Item>,
}

impl Announcement {
    /// Adds (or replaces) `what`.
    pub fn set(&mut self, what: &str, value: impl Into<String>, agreement: Agreement) {
        let item = Item {
            what: what.to_string(),
            value: value.into(),
            agreement,
        };
        match self.items.iter_mut().find(|i| i.what == what) {
            Some(i) => *i = item,
            None => self.items.push(item),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Option<Announcement> {
        serde_json::from_slice(bytes).ok()
    }
}

/// Ranks that announced different values of one thing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Disagreement {
    /// The setting (`WEFT_ALGO`) or property (`library version`).
    pub what: String,
    /// [`Agreement::Must`]: the communicator is not made; [`Agreement::Should`]: a warning.
    pub agreement: Agreement,
    /// Each value and the ranks that announced it, the value of rank 0 first.
    pub values: Vec<(String, Vec<usize>)>,
}

impl Disagreement {
    /// The ranks outside the largest group (those most likely started differently); on a tie,
    /// those outside rank 0's group.
    pub fn odd_ranks(&self) -> Vec<usize> {
        let largest = self
            .values
            .iter()
            .enumerate()
            .max_by_key(|(i, (_, ranks))| (ranks.len(), std::cmp::Reverse(*i)))
            .map_or(0, |(i, _)| i);
        let mut odd: Vec<usize> = self
            .values
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != largest)
            .flat_map(|(_, (_, ranks))| ranks.iter().copied())
            .collect();
        odd.sort_unstable();
        odd
    }
}

impl fmt::Display for Disagreement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.what)?;
        for (i, (value, ranks)) in self.values.iter().enumerate() {
            let sep = if i == 0 { "" } else { "; " };
            let s = if ranks.len() == 1 { "" } else { "s" };
            write!(f, "{sep}{value:?} on rank{s} {}", rank_list(ranks))?;
        }
        Ok(())
    }
}

/// `0-3, 5, 7` (at most 8 runs, then how many more ranks).
pub fn rank_list(ranks: &[usize]) -> String {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &r in ranks {
        match runs.last_mut() {
            Some((_, end)) if *end + 1 == r => *end = r,
            _ => runs.push((r, r)),
        }
    }
    const SHOWN: usize = 8;
    let mut parts: Vec<String> = runs
        .iter()
        .take(SHOWN)
        .map(|&(a, b)| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}-{b}")
            }
        })
        .collect();
    let more: usize = runs.iter().skip(SHOWN).map(|(a, b)| b - a + 1).sum();
    if more > 0 {
        parts.push(format!("and {more} more"));
    }
    parts.join(", ")
}

/// Every thing whose value is not the same on all ranks (`announcements[r]` is rank r's; a
/// thing one rank does not announce has the value `(not announced)` there), in the order of
/// rank 0's announcement, then of first appearance. A thing is as strict as the strictest
/// rank says; [`Agreement::Own`] things are not compared.
pub fn compare(announcements: &[Announcement]) -> Vec<Disagreement> {
    let mut order: Vec<(&str, Agreement)> = Vec::new();
    for item in announcements.iter().flat_map(|a| &a.items) {
        match order.iter_mut().find(|(w, _)| *w == item.what) {
            Some((_, a)) => *a = (*a).max(item.agreement),
            None => order.push((&item.what, item.agreement)),
        }
    }
    let mut found = Vec::new();
    for (what, agreement) in order {
        if agreement == Agreement::Own {
            continue;
        }
        let mut values: Vec<(String, Vec<usize>)> = Vec::new();
        for (rank, a) in announcements.iter().enumerate() {
            let value = a
                .items
                .iter()
                .find(|i| i.what == what)
                .map_or("(not announced)", |i| i.value.as_str());
            match values.iter_mut().find(|(v, _)| v == value) {
                Some((_, ranks)) => ranks.push(rank),
                None => values.push((value.to_string(), vec![rank])),
            }
        }
        if values.len() > 1 {
            found.push(Disagreement {
                what: what.to_string(),
                agreement,
                values,
            });
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn announcing(pairs: &[(&str, &str, Agreement)]) -> Announcement {
        let mut a = Announcement::default();
        for (what, value, agreement) in pairs {
            a.set(what, *value, *agreement);
        }
        a
    }

    #[test]
    fn ranks_that_differ_are_named_with_their_values_and_own_things_are_not_compared() {
        use Agreement::*;
        let base = [
            ("library version", "0.1.0", Must),
            ("WEFT_ALGO", "unset", Must),
            ("WEFT_TIMEOUT", "unset", Should),
            ("WEFT_TRACE_DUMP_DIR", "/a", Own),
        ];
        let mut all: Vec<Announcement> = (0..4).map(|_| announcing(&base)).collect();
        assert!(compare(&all).is_empty());
        all[2].set("WEFT_ALGO", "ring", Must);
        all[1].set("WEFT_TIMEOUT", "5s", Should);
        all[3].set("WEFT_TRACE_DUMP_DIR", "/b", Own);
        let found = compare(&all);
        assert_eq!(found.len(), 2, "{found:?}");
        assert_eq!(found[0].what, "WEFT_ALGO");
        assert_eq!(found[0].agreement, Must);
        assert_eq!(
            found[0].values,
            vec![("unset".into(), vec![0, 1, 3]), ("ring".into(), vec![2])]
        );
        assert_eq!(found[0].odd_ranks(), vec![2]);
        assert_eq!(
            found[0].to_string(),
            "WEFT_ALGO: \"unset\" on ranks 0-1, 3; \"ring\" on rank 2"
        );
        assert_eq!(found[1].agreement, Should);
        // An older rank that does not announce a setting, or calls it less strict, still
        // disagrees as strictly as the others say.
        all[1].items.retain(|i| i.what != "WEFT_ALGO");
        all[3].set("WEFT_TIMEOUT", "unset", Own);
        let found = compare(&all);
        assert_eq!(found[0].values.len(), 3);
        assert_eq!(found[1].agreement, Should);
        let round = Announcement::decode(&all[0].encode()).expect("decodes");
        assert_eq!(round, all[0]);
    }

    #[test]
    fn rank_lists_are_runs() {
        assert_eq!(rank_list(&[0, 1, 2, 5, 7, 8]), "0-2, 5, 7-8");
        let many: Vec<usize> = (0..40).step_by(2).collect();
        assert_eq!(rank_list(&many), "0, 2, 4, 6, 8, 10, 12, 14, and 12 more");
    }
}
