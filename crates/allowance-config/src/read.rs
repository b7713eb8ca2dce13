//! Walking the spanned TOML document: typed reads that report a problem at
//! the offending key's line and carry on, so one run lists every problem.
//!
//! Every read returns `Err(Bad)` when the value was present but wrong (the
//! problem is already recorded) and `Ok(None)` when it is absent, so callers
//! fall back to a default only for keys that were not written.

use toml::Spanned;
use toml::de::{DeTable, DeValue};

use crate::error::Problem;

/// A problem was found and recorded; the value is unusable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Bad;

/// What a read gives: absent, a value, or [`Bad`] (already reported).
pub(crate) type Read<T> = Result<Option<T>, Bad>;

/// The document's text positions and the problems found so far.
pub(crate) struct Doc {
    line_starts: Vec<usize>,
    pub(crate) problems: Vec<Problem>,
}

impl Doc {
    pub(crate) fn new(text: &str) -> Doc {
        let mut line_starts = vec![0];
        line_starts.extend(text.match_indices('\n').map(|(i, _)| i + 1));
        Doc {
            line_starts,
            problems: Vec::new(),
        }
    }

    /// The 1-based line of a byte offset.
    pub(crate) fn line(&self, offset: usize) -> usize {
        self.line_starts.partition_point(|&start| start <= offset)
    }

    /// Records a problem with `key`, found at `offset`.
    pub(crate) fn error(&mut self, offset: usize, key: &str, message: impl Into<String>) {
        self.problems.push(Problem {
            line: Some(self.line(offset)),
            key: Some(key.to_string()),
            message: message.into(),
        });
    }

    /// Records a problem that names no key (a TOML syntax error).
    pub(crate) fn syntax(&mut self, offset: usize, message: impl Into<String>) {
        self.problems.push(Problem {
            line: Some(self.line(offset)),
            key: None,
            message: message.into(),
        });
    }
}

/// `parent.key`, quoting keys that are not bare TOML keys
/// (`models."gpt-4.1".input_per_million`).
pub(crate) fn child_path(parent: &str, key: &str) -> String {
    let bare = !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    let key = if bare {
        key.to_string()
    } else {
        format!("{key:?}")
    };
    if parent.is_empty() {
        key
    } else {
        format!("{parent}.{key}")
    }
}

/// "a string", "an integer": a value's type for messages.
fn type_name(value: &DeValue<'_>) -> &'static str {
    match value {
        DeValue::String(_) => "a string",
        DeValue::Integer(_) => "an integer",
        DeValue::Float(_) => "a float",
        DeValue::Boolean(_) => "a boolean",
        DeValue::Datetime(_) => "a date-time",
        DeValue::Array(_) => "an array",
        DeValue::Table(_) => "a table",
    }
}

/// Quotes the accepted names for "expected one of …".
pub(crate) fn one_of(names: &[&str]) -> String {
    names
        .iter()
        .map(|n| format!("{n:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A table of the document with its dotted path.
#[derive(Clone)]
pub(crate) struct Table<'a, 'i> {
    map: &'a DeTable<'i>,
    /// Where the table starts (its header, or its first key).
    pub(crate) offset: usize,
    pub(crate) path: String,
}

/// One `key = value` of a table.
#[derive(Clone)]
pub(crate) struct Item<'a, 'i> {
    pub(crate) key: &'a str,
    /// Where the key is written: problems are reported on its line.
    pub(crate) offset: usize,
    pub(crate) value: &'a Spanned<DeValue<'i>>,
    pub(crate) path: String,
}

impl<'a, 'i> Table<'a, 'i> {
    pub(crate) fn root(map: &'a DeTable<'i>) -> Table<'a, 'i> {
        Table {
            map,
            offset: 0,
            path: String::new(),
        }
    }

    /// The table's entries, in file order.
    pub(crate) fn items(&self) -> Vec<Item<'a, 'i>> {
        let mut items: Vec<Item<'a, 'i>> = self
            .map
            .iter()
            .map(|(k, v)| Item {
                key: k.get_ref().as_ref(),
                offset: k.span().start,
                value: v,
                path: child_path(&self.path, k.get_ref()),
            })
            .collect();
        items.sort_by_key(|i| i.offset);
        items
    }

    /// The entry named `key`, if written.
    pub(crate) fn get(&self, key: &str) -> Option<Item<'a, 'i>> {
        self.map
            .iter()
            .find(|(k, _)| k.get_ref().as_ref() == key)
            .map(|(k, v)| Item {
                key: k.get_ref().as_ref(),
                offset: k.span().start,
                value: v,
                path: child_path(&self.path, key),
            })
    }

    /// Reports every key not in `allowed`: a typo is an error, never ignored.
    pub(crate) fn check_keys(&self, doc: &mut Doc, allowed: &[&str]) {
        for item in self.items() {
            if !allowed.contains(&item.key) {
                doc.error(
                    item.offset,
                    &item.path,
                    format!("unknown key; expected one of {}", one_of(allowed)),
                );
            }
        }
    }

    /// A section: absent, a table, or [`Bad`].
    pub(crate) fn table(&self, doc: &mut Doc, key: &str) -> Read<Table<'a, 'i>> {
        self.get(key).map(|i| i.table(doc)).transpose()
    }

    /// A duration written `NAME = "90s"` or `NAME_ms = 90000`, between
    /// `lo_ms` and `hi_ms`. Returns the value and the key it was written
    /// under (for later messages about it).
    pub(crate) fn duration_ms(
        &self,
        doc: &mut Doc,
        name: &str,
        lo_ms: u64,
        hi_ms: u64,
    ) -> Read<(u64, Item<'a, 'i>)> {
        let ms_name = format!("{name}_ms");
        let (text, ms) = (self.get(name), self.get(&ms_name));
        let item = match (text, ms) {
            (None, None) => return Ok(None),
            (Some(a), Some(b)) => {
                let later = if a.offset > b.offset { a } else { b };
                doc.error(
                    later.offset,
                    &later.path,
                    format!(
                        "give either `{name}` (a string such as \"90s\") or `{ms_name}`, not both"
                    ),
                );
                return Err(Bad);
            }
            (Some(item), None) => {
                let Some(text) = item.value.get_ref().as_str() else {
                    doc.error(
                        item.offset,
                        &item.path,
                        format!(
                            "expected a duration string such as \"90s\", \"1m\" or \"24h\", got {} \
                             (an integer goes under `{ms_name}`, in milliseconds)",
                            type_name(item.value.get_ref())
                        ),
                    );
                    return Err(Bad);
                };
                match crate::duration::parse_duration_ms(text) {
                    Ok(ms) => (ms, item),
                    Err(message) => {
                        doc.error(item.offset, &item.path, message);
                        return Err(Bad);
                    }
                }
            }
            (None, Some(item)) => {
                if !matches!(item.value.get_ref(), DeValue::Integer(_)) {
                    doc.error(
                        item.offset,
                        &item.path,
                        format!(
                            "expected an integer number of milliseconds, got {} \
                             (a string such as \"90s\" goes under `{name}`)",
                            type_name(item.value.get_ref())
                        ),
                    );
                    return Err(Bad);
                }
                match item.u64_in(doc, lo_ms, hi_ms)? {
                    Some(ms) => return Ok(Some((ms, item))),
                    None => return Err(Bad),
                }
            }
        };
        let (ms, item) = item;
        if ms < lo_ms || ms > hi_ms {
            doc.error(
                item.offset,
                &item.path,
                format!(
                    "must be between {} and {}, got {}",
                    crate::duration::format_duration_ms(lo_ms),
                    crate::duration::format_duration_ms(hi_ms),
                    crate::duration::format_duration_ms(ms),
                ),
            );
            return Err(Bad);
        }
        Ok(Some((ms, item)))
    }
}

impl<'a, 'i> Item<'a, 'i> {
    fn expected(&self, doc: &mut Doc, what: &str) -> Bad {
        doc.error(
            self.offset,
            &self.path,
            format!("expected {what}, got {}", type_name(self.value.get_ref())),
        );
        Bad
    }

    /// The value as a table.
    pub(crate) fn table(&self, doc: &mut Doc) -> Result<Table<'a, 'i>, Bad> {
        match self.value.get_ref() {
            DeValue::Table(map) => Ok(Table {
                map,
                offset: self.offset,
                path: self.path.clone(),
            }),
            _ => Err(self.expected(doc, "a table")),
        }
    }

    /// The value as an array.
    pub(crate) fn array(&self, doc: &mut Doc) -> Result<&'a [Spanned<DeValue<'i>>], Bad> {
        match self.value.get_ref() {
            DeValue::Array(a) => Ok(a),
            _ => Err(self.expected(doc, "an array")),
        }
    }

    /// The value as a string.
    pub(crate) fn str(&self, doc: &mut Doc) -> Result<&'a str, Bad> {
        match self.value.get_ref() {
            DeValue::String(s) => Ok(s.as_ref()),
            _ => Err(self.expected(doc, "a string")),
        }
    }

    /// The value as a boolean.
    pub(crate) fn bool(&self, doc: &mut Doc) -> Result<bool, Bad> {
        match self.value.get_ref() {
            DeValue::Boolean(b) => Ok(*b),
            _ => Err(self.expected(doc, "true or false")),
        }
    }

    /// The value as an integer between `lo` and `hi` (wrapped in `Some`, so
    /// `?` on a [`Read`] works at call sites).
    pub(crate) fn u64_in(&self, doc: &mut Doc, lo: u64, hi: u64) -> Read<u64> {
        let range = format!("an integer between {} and {}", show(lo), show(hi));
        let DeValue::Integer(int) = self.value.get_ref() else {
            return Err(self.expected(doc, &range));
        };
        let value = i128::from_str_radix(int.as_str(), int.radix()).ok();
        match value {
            Some(v) if v >= i128::from(lo) && v <= i128::from(hi) => Ok(u64::try_from(v).ok()),
            _ => {
                doc.error(
                    self.offset,
                    &self.path,
                    format!("expected {range}, got {int}"),
                );
                Err(Bad)
            }
        }
    }

    /// The value as a number (integer or float).
    pub(crate) fn number(&self, doc: &mut Doc) -> Result<f64, Bad> {
        let parsed = match self.value.get_ref() {
            DeValue::Float(f) => f.as_str().parse::<f64>().ok(),
            DeValue::Integer(i) => i128::from_str_radix(i.as_str(), i.radix())
                .ok()
                .map(|v| v as f64),
            _ => return Err(self.expected(doc, "a number")),
        };
        parsed.ok_or_else(|| self.expected(doc, "a finite number"))
    }

    /// The value as one of `names`, mapped to its `T`.
    pub(crate) fn one_of<T: Copy>(&self, doc: &mut Doc, choices: &[(&str, T)]) -> Result<T, Bad> {
        let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
        let text = match self.value.get_ref() {
            DeValue::String(s) => s.as_ref(),
            _ => return Err(self.expected(doc, &format!("one of {}", one_of(&names)))),
        };
        match choices.iter().find(|(n, _)| *n == text) {
            Some((_, v)) => Ok(*v),
            None => {
                doc.error(
                    self.offset,
                    &self.path,
                    format!("expected one of {}, got {text:?}", one_of(&names)),
                );
                Err(Bad)
            }
        }
    }

    /// The value as an array of strings.
    pub(crate) fn strings(&self, doc: &mut Doc) -> Result<Vec<String>, Bad> {
        let mut out = Vec::new();
        let mut bad = false;
        for (i, v) in self.array(doc)?.iter().enumerate() {
            match v.get_ref() {
                DeValue::String(s) => out.push(s.to_string()),
                other => {
                    doc.error(
                        self.offset,
                        &format!("{}[{i}]", self.path),
                        format!("expected a string, got {}", type_name(other)),
                    );
                    bad = true;
                }
            }
        }
        if bad { Err(Bad) } else { Ok(out) }
    }
}

/// Numbers in messages: 2^53 by its name, others as written.
fn show(n: u64) -> String {
    if n == allowance_core::MAX_AMOUNT {
        "2^53".to_string()
    } else {
        n.to_string()
    }
}

/// The elements of an array of tables (`[[tokens]]`, or `limits = [{…}]`),
/// each with its path `NAME[i]`; non-tables are reported.
pub(crate) fn tables_of<'a, 'i>(
    doc: &mut Doc,
    item: &Item<'a, 'i>,
) -> Result<Vec<Result<Table<'a, 'i>, Bad>>, Bad> {
    let array = item.array(doc)?;
    Ok(array
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let path = format!("{}[{i}]", item.path);
            match v.get_ref() {
                DeValue::Table(map) => Ok(Table {
                    map,
                    offset: v.span().start,
                    path,
                }),
                other => {
                    doc.error(
                        v.span().start,
                        &path,
                        format!("expected a table, got {}", type_name(other)),
                    );
                    Err(Bad)
                }
            }
        })
        .collect())
}
