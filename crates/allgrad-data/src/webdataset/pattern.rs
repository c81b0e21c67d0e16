//! Shard lists written as brace patterns, as webdataset and OpenCLIP write them:
//! `train-{000000..000127}.tar` is 128 names with six-digit zero-padded numbers,
//! `{a,b}-{0..3}.tar` is 8 names; several braces multiply out, left to right.

use crate::error::{DataError, DataResult};

/// The names a pattern stands for, in order. A range `{A..B}` counts from A to B inclusive
/// (upwards only), zero-padded to A's width when A is written with a leading zero or both
/// ends have the same width; a list `{x,y,z}` takes each item. A brace that does not close,
/// an empty list item or a range that runs backwards is an error naming the pattern.
pub fn expand(pattern: &str) -> DataResult<Vec<String>> {
    let bad = |reason: String| DataError::Config { field: "webdataset shards", reason: format!("pattern `{pattern}`: {reason}") };
    let Some(open) = pattern.find('{') else {
        if pattern.contains('}') {
            return Err(bad("`}` without `{`".into()));
        }
        return Ok(vec![pattern.to_string()]);
    };
    let close = pattern[open..].find('}').map(|i| open + i).ok_or_else(|| bad("`{` without `}`".into()))?;
    let (head, body, tail) = (&pattern[..open], &pattern[open + 1..close], &pattern[close + 1..]);
    if body.contains('{') {
        return Err(bad("nested braces are not supported".into()));
    }
    let items: Vec<String> = if let Some((a, b)) = body.split_once("..") {
        let parse = |s: &str| s.parse::<u64>().map_err(|_| bad(format!("`{s}` in `{{{body}}}` is not a number")));
        let (lo, hi) = (parse(a)?, parse(b)?);
        if lo > hi {
            return Err(bad(format!("the range `{{{body}}}` runs backwards")));
        }
        if hi - lo >= 10_000_000 {
            return Err(bad(format!("the range `{{{body}}}` has more than 10 million names")));
        }
        let width = if a.len() == b.len() || a.starts_with('0') { a.len() } else { 0 };
        (lo..=hi).map(|n| format!("{n:0width$}")).collect()
    } else {
        let items: Vec<String> = body.split(',').map(str::to_string).collect();
        if items.iter().any(String::is_empty) {
            return Err(bad(format!("`{{{body}}}` has an empty item")));
        }
        items
    };
    let tails = expand(tail).map_err(|_| bad("in the part after a brace".into()))?;
    Ok(items.iter().flat_map(|i| tails.iter().map(move |t| format!("{head}{i}{t}"))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_lists_and_padding() {
        assert_eq!(expand("a.tar").unwrap(), ["a.tar"]);
        assert_eq!(expand("train-{000000..000002}.tar").unwrap(), ["train-000000.tar", "train-000001.tar", "train-000002.tar"]);
        assert_eq!(expand("s{8..11}").unwrap(), ["s8", "s9", "s10", "s11"]);
        assert_eq!(expand("s{08..11}").unwrap(), ["s08", "s09", "s10", "s11"]);
        assert_eq!(expand("{a,b}-{0..1}.tar").unwrap(), ["a-0.tar", "a-1.tar", "b-0.tar", "b-1.tar"]);
        assert_eq!(expand("x{5..5}").unwrap(), ["x5"]);
        for bad in ["a{1..3", "a}1", "a{3..1}", "a{x..3}", "a{,b}", "a{{1..2}}"] {
            let err = expand(bad).unwrap_err().to_string();
            assert!(err.contains(bad), "{err}");
        }
    }
}
