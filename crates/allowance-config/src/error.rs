//! Problems with a configuration file, each naming the file, line and key.

use std::fmt;

/// One problem found in a configuration file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// 1-based line of the offending key (`None`: the file as a whole,
    /// e.g. it cannot be read).
    pub line: Option<usize>,
    /// Dotted path of the offending key (`plans.free.limits[2].window`);
    /// `None` for a TOML syntax error or an I/O error.
    pub key: Option<String>,
    /// What is wrong, for a human (`expected one of …`).
    pub message: String,
}

/// Every problem found in a configuration file, in line order. Display
/// prints one line per problem, the shape CONFIG.md asks for:
///
/// ```text
/// error: allowance.toml:12: key `plans.free.limits[2].window`: expected one of "sliding", …
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct ConfigErrors {
    /// The file's path as given (or `<built-in starter>`).
    pub file: String,
    /// The problems, sorted by line; never empty.
    pub problems: Vec<Problem>,
}

impl ConfigErrors {
    /// A single problem about the file as a whole (it cannot be read, it is
    /// too large, it is not UTF-8).
    pub(crate) fn whole_file(source: &str, message: impl Into<String>) -> ConfigErrors {
        ConfigErrors {
            file: source.to_string(),
            problems: vec![Problem {
                line: None,
                key: None,
                message: message.into(),
            }],
        }
    }
}

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.problems.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "error: {}", self.file)?;
            if let Some(line) = p.line {
                write!(f, ":{line}")?;
            }
            match &p.key {
                Some(key) => write!(f, ": key `{key}`: {}", p.message)?,
                None => write!(f, ": {}", p.message)?,
            }
        }
        Ok(())
    }
}
