//! README.md's configuration table and the declarations agree: every declared variable is
//! documented there, and every variable documented there is declared.

use std::collections::BTreeSet;

/// The `WEFT_*` names in backticks in the first column of the rows of README's
/// "## Configuration" table (a row may name several: `WEFT_SPIN_US`, `WEFT_YIELD_US`).
fn documented(readme: &str) -> BTreeSet<String> {
    let section = readme
        .split("\n## Configuration")
        .nth(1)
        .expect("README has a Configuration section");
    let section = section.split("\n## ").next().unwrap_or(section);
    let mut names = BTreeSet::new();
    for row in section.lines().filter(|l| l.starts_with("| `WEFT_")) {
        let first = row.split('|').nth(1).unwrap_or("");
        for quoted in first.split('`').skip(1).step_by(2) {
            let name: String = quoted
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            if name.starts_with("WEFT_") {
                names.insert(name);
            }
        }
    }
    names
}

#[test]
fn the_readme_documents_exactly_the_declared_settings() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md");
    let readme = std::fs::read_to_string(path).expect("README.md");
    let documented = documented(&readme);
    let declared: BTreeSet<String> = weftcc_settings::ALL
        .iter()
        .map(|s| s.name.to_string())
        .collect();
    let undocumented: Vec<_> = declared.difference(&documented).collect();
    let undeclared: Vec<_> = documented.difference(&declared).collect();
    assert!(
        undocumented.is_empty() && undeclared.is_empty(),
        "declared but not in README's configuration table: {undocumented:?}; \
         in the table but not declared: {undeclared:?}"
    );
    println!("{} settings, each declared and documented", declared.len());
}

#[test]
fn the_table_reader_finds_every_name_of_a_row() {
    let readme = "x\n## Configuration\n\n| variable | meaning |\n|---|---|\n\
                  | `WEFT_A=1` | a |\n| `WEFT_B`, `WEFT_C_2` | b, c |\n| other | `WEFT_D` |\n\
                  \n## Errors\n| `WEFT_E` | e |\n";
    let names: Vec<_> = documented(readme).into_iter().collect();
    assert_eq!(names, ["WEFT_A", "WEFT_B", "WEFT_C_2"]);
}

/// docs/nccl-dropin.md's table of `NCCL_*` twins is `NCCL_TWINS`, row for row.
#[test]
fn the_nccl_guide_lists_exactly_the_twins() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/nccl-dropin.md");
    let guide = std::fs::read_to_string(path).expect("docs/nccl-dropin.md");
    let documented: BTreeSet<(String, String)> = guide
        .lines()
        .filter(|l| l.starts_with("| `NCCL_"))
        .filter_map(|l| {
            let mut names = l.split('`').skip(1).step_by(2);
            Some((names.next()?.to_string(), names.next()?.to_string()))
        })
        .collect();
    let declared: BTreeSet<(String, String)> = weftcc_settings::NCCL_TWINS
        .iter()
        .map(|(s, twin)| (twin.to_string(), s.name.to_string()))
        .collect();
    assert_eq!(
        documented, declared,
        "docs/nccl-dropin.md's twins table (left) is not NCCL_TWINS"
    );
    for (s, _) in weftcc_settings::NCCL_TWINS {
        assert_eq!(
            weftcc_settings::nccl_twin(s).map(|t| t.replace("NCCL_", "WEFT_")),
            Some(s.name.to_string())
        );
    }
}
