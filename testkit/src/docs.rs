//! The complete programs of the documentation: fenced blocks whose info string is a language
//! followed by the word `program` (```` ```c program ````, ```` ```rust program ````,
//! ```` ```python program ````). The tests of each language compile and run every one, so an
//! example that no longer builds or runs fails the tests.

use std::path::{Path, PathBuf};

/// The documents searched: README.md, docs/*.md and python/README.md.
pub fn documents(repo: &Path) -> Vec<PathBuf> {
    let mut docs: Vec<PathBuf> = std::fs::read_dir(repo.join("docs"))
        .map(|dir| {
            dir.flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "md"))
                .collect()
        })
        .unwrap_or_default();
    docs.sort();
    docs.insert(0, repo.join("README.md"));
    docs.push(repo.join("python/README.md"));
    docs
}

/// One fenced block of a document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// The document.
    pub file: PathBuf,
    /// Line of the opening fence (1-based).
    pub line: usize,
    /// The info string's words (`["c", "program"]`).
    pub info: Vec<String>,
    /// The text between the fences, each line ending in a newline.
    pub text: String,
}

impl Block {
    /// Whether this block is a complete program in `lang`.
    pub fn is_program(&self, lang: &str) -> bool {
        self.info.first().is_some_and(|l| l == lang) && self.info.iter().any(|w| w == "program")
    }

    /// `file:line`, for messages.
    pub fn place(&self) -> String {
        format!("{}:{}", self.file.display(), self.line)
    }
}

/// The fenced blocks of `markdown` (from `file`), in order.
pub fn blocks(file: &Path, markdown: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut open: Option<Block> = None;
    for (i, line) in markdown.lines().enumerate() {
        let fence = line.trim_start().starts_with("```");
        match open.take() {
            Some(block) if fence => out.push(block),
            Some(mut block) => {
                block.text.push_str(line);
                block.text.push('\n');
                open = Some(block);
            }
            None if fence => {
                let info = line.trim_start().trim_start_matches('`');
                open = Some(Block {
                    file: file.to_path_buf(),
                    line: i + 1,
                    info: info.split_whitespace().map(str::to_string).collect(),
                    text: String::new(),
                });
            }
            None => {}
        }
    }
    out
}

/// Every block of every document under `repo` (see [`documents`]).
pub fn all_blocks(repo: &Path) -> Vec<Block> {
    documents(repo)
        .iter()
        .flat_map(|file| {
            let text = std::fs::read_to_string(file)
                .unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
            blocks(file, &text)
        })
        .collect()
}

/// The complete programs in `lang` of the documents under `repo`.
pub fn programs(repo: &Path, lang: &str) -> Vec<Block> {
    all_blocks(repo)
        .into_iter()
        .filter(|b| b.is_program(lang))
        .collect()
}

/// The first line of a later block of the same document that starts with `command` (the
/// documented way to build a program: `cc `, …).
pub fn command_after(repo: &Path, program: &Block, command: &str) -> Option<String> {
    all_blocks(repo)
        .into_iter()
        .filter(|b| b.file == program.file && b.line > program.line)
        .flat_map(|b| b.text.lines().map(str::to_string).collect::<Vec<_>>())
        .find(|l| l.starts_with(command))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_and_their_info_words() {
        let md = "text\n```c program\nint main(void) { return 0; }\n```\n\n```sh\ncc x.c\n```\n";
        let b = blocks(Path::new("x.md"), md);
        assert_eq!(b.len(), 2);
        assert!(b[0].is_program("c"));
        assert!(!b[0].is_program("rust"));
        assert!(!b[1].is_program("sh"));
        assert_eq!(b[0].line, 2);
        assert_eq!(b[0].text, "int main(void) { return 0; }\n");
        assert_eq!(b[1].text, "cc x.c\n");
    }
}
