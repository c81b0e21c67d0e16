//! Readers for SimCSE's training files, so a user with the real files uses them unchanged:
//! `wiki1m_for_simcse.txt` (one sentence a line) and `nli_for_simcse.csv` (a header naming
//! `sent0,sent1,hard_neg`, RFC 4180 quoting).

use std::path::Path;

use candle_core::Result;

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| candle_core::Error::Msg(format!("reading {}: {e}", path.display())))
}

/// Sentences of a text file, one per line (line endings `\n` or `\r\n`); blank lines are
/// skipped. An empty result is an error naming the file.
pub fn read_sentences(path: &Path) -> Result<Vec<String>> {
    let out: Vec<String> =
        read(path)?.lines().map(|l| l.trim_end_matches('\r')).filter(|l| !l.trim().is_empty()).map(String::from).collect();
    if out.is_empty() {
        candle_core::bail!("{}: no sentences", path.display());
    }
    Ok(out)
}

/// The records of a CSV text (RFC 4180: fields optionally in double quotes, `""` for a quote
/// inside, quoted fields may span lines), each with the line where it starts.
fn csv_records(text: &str) -> std::result::Result<Vec<(usize, Vec<String>)>, String> {
    let mut records = Vec::new();
    let (mut record, mut field) = (Vec::new(), String::new());
    let (mut line, mut start, mut quoted, mut was_quoted) = (1usize, 1usize, false, false);
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match (quoted, c) {
            (true, '"') if chars.peek() == Some(&'"') => {
                chars.next();
                field.push('"');
            }
            (true, '"') => quoted = false,
            (true, c) => {
                line += (c == '\n') as usize;
                field.push(c);
            }
            (false, '"') if field.is_empty() && !was_quoted => (quoted, was_quoted) = (true, true),
            (false, '"') => return Err(format!("line {line}: a quote inside an unquoted field")),
            (false, ',') => {
                record.push(std::mem::take(&mut field));
                was_quoted = false;
            }
            (false, '\r') if chars.peek() == Some(&'\n') => {}
            (false, '\n') => {
                record.push(std::mem::take(&mut field));
                was_quoted = false;
                if !(record.len() == 1 && record[0].is_empty()) {
                    records.push((start, std::mem::take(&mut record)));
                }
                record.clear();
                line += 1;
                start = line;
            }
            (false, c) => field.push(c),
        }
    }
    if quoted {
        return Err(format!("line {start}: a quoted field is not closed"));
    }
    if !field.is_empty() || !record.is_empty() || was_quoted {
        record.push(field);
        records.push((start, record));
    }
    Ok(records)
}

/// (anchor, positive, hard negative) triplets of an `nli_for_simcse.csv`-style file: the
/// header names the columns `sent0`, `sent1` and `hard_neg` (in any order, other columns
/// ignored). Errors name the file and the line.
pub fn read_nli_triplets(path: &Path) -> Result<Vec<[String; 3]>> {
    let text = read(path)?;
    let records = csv_records(text.trim_start_matches('\u{feff}'))
        .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", path.display())))?;
    let Some(((_, header), rows)) = records.split_first() else {
        candle_core::bail!("{}: empty file (expected a header sent0,sent1,hard_neg)", path.display());
    };
    let col = |name: &str| {
        header
            .iter()
            .position(|h| h.trim() == name)
            .ok_or_else(|| candle_core::Error::Msg(format!("{}: the header {header:?} has no column {name}", path.display())))
    };
    let cols = [col("sent0")?, col("sent1")?, col("hard_neg")?];
    let mut out = Vec::with_capacity(rows.len());
    for (line, r) in rows {
        if r.len() != header.len() {
            candle_core::bail!("{}: line {line} has {} fields, the header {}", path.display(), r.len(), header.len());
        }
        out.push(cols.map(|c| r[c].clone()));
    }
    if out.is_empty() {
        candle_core::bail!("{}: no triplets after the header", path.display());
    }
    Ok(out)
}
