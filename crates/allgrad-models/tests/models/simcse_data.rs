//! Readers of SimCSE's file formats on files the test writes, and Spearman's correlation
//! against a plain computation.

use std::io::Write;

use allgrad_models::simcse::{ranks, read_nli_triplets, read_sentences, spearman};

fn file(text: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f
}

#[test]
fn sentences_are_read_one_per_line_skipping_blank_lines() {
    let f = file("First sentence.\r\nSecond, with a comma\n\n  \nthird\n");
    assert_eq!(read_sentences(f.path()).unwrap(), ["First sentence.", "Second, with a comma", "third"]);
    let err = read_sentences(file("\n\n").path()).unwrap_err().to_string();
    assert!(err.contains("no sentences"), "{err}");
}

#[test]
fn nli_csv_reads_quoted_fields_and_columns_by_name() {
    let text = "\u{feff}hard_neg,sent0,sent1\n\
                \"A man sleeps.\",\"A man, outdoors, runs.\",A person moves.\n\
                \"She said \"\"no\"\".\",\"line one\nline two\",plain\r\n";
    let t = read_nli_triplets(file(text).path()).unwrap();
    assert_eq!(t.len(), 2);
    assert_eq!(t[0], ["A man, outdoors, runs.".to_string(), "A person moves.".into(), "A man sleeps.".into()]);
    assert_eq!(t[1], ["line one\nline two".to_string(), "plain".into(), "She said \"no\".".into()]);
}

#[test]
fn nli_csv_errors_name_the_column_or_the_line() {
    let err = read_nli_triplets(file("sent0,sent1\na,b\n").path()).unwrap_err().to_string();
    assert!(err.contains("no column hard_neg"), "{err}");
    let err = read_nli_triplets(file("sent0,sent1,hard_neg\na,b,c\nd,e\n").path()).unwrap_err().to_string();
    assert!(err.contains("line 3 has 2 fields"), "{err}");
    let err = read_nli_triplets(file("sent0,sent1,hard_neg\n\"a,b,c\n").path()).unwrap_err().to_string();
    assert!(err.contains("not closed"), "{err}");
}

/// Spearman from its textbook formula for data without ties: 1 - 6 Σ d² / (n (n² - 1)).
fn spearman_no_ties(x: &[f64], y: &[f64]) -> f64 {
    let rank = |v: &[f64]| -> Vec<f64> { v.iter().map(|a| 1.0 + v.iter().filter(|b| *b < a).count() as f64).collect() };
    let (rx, ry) = (rank(x), rank(y));
    let n = x.len() as f64;
    let d2: f64 = rx.iter().zip(&ry).map(|(a, b)| (a - b) * (a - b)).sum();
    1.0 - 6.0 * d2 / (n * (n * n - 1.0))
}

#[test]
fn spearman_matches_the_textbook_formula_and_handles_ties() {
    let x: Vec<f64> = (0..40).map(|i| ((i * 7919) % 101) as f64 + 0.5 * (i as f64).sin()).collect();
    let y: Vec<f64> = (0..40).map(|i| (i as f64 * 0.3).cos() * 10.0 + x[i] * 0.2).collect();
    let (got, want) = (spearman(&x, &y).unwrap(), spearman_no_ties(&x, &y));
    assert!((got - want).abs() < 1e-12, "{got} vs {want}");
    // Ties share the mean rank (scipy.stats.rankdata([3, 1, 3, 2]) = [3.5, 1, 3.5, 2]).
    assert_eq!(ranks(&[3.0, 1.0, 3.0, 2.0]), [3.5, 1.0, 3.5, 2.0]);
    // By hand: ranks [1, 2.5, 2.5, 4] and [1, 3, 2, 4] correlate 4.5 / sqrt(4.5 * 5) = 3 / sqrt(10).
    assert!((spearman(&[1.0, 2.0, 2.0, 3.0], &[1.0, 3.0, 2.0, 4.0]).unwrap() - 3.0 / 10f64.sqrt()).abs() < 1e-12);
    assert!((spearman(&x, &x.iter().map(|v| -v * v * v).collect::<Vec<_>>()).unwrap() + 1.0).abs() < 1e-12);
    assert_eq!(spearman(&[1.0, 1.0], &[1.0, 2.0]), None);
    assert_eq!(spearman(&[1.0], &[1.0]), None);
}
