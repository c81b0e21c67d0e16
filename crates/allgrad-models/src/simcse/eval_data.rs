//! Readers of the sentence-embedding benchmarks SimCSE is evaluated on: the held-out WordNet
//! retrieval split, the Lee et al. (2005) document-similarity set, word-similarity lists
//! (SimLex-999, WordSim-353) and the STS-B TSV format. Errors name the file and the line.

use std::path::Path;

use candle_core::Result;

/// A set of text pairs with human similarity ratings (Spearman is computed against `score`).
#[derive(Clone, Debug, PartialEq)]
pub struct RatedPairs {
    /// The distinct texts.
    pub texts: Vec<String>,
    /// `(i, j, score)`: texts `i` and `j` of [`RatedPairs::texts`] and their rating.
    pub pairs: Vec<(usize, usize, f64)>,
}

impl RatedPairs {
    /// Pairs from `(text a, text b, score)`, texts deduplicated in order of appearance.
    pub fn from_triples(triples: Vec<(String, String, f64)>) -> Self {
        let mut texts: Vec<String> = Vec::new();
        let mut index = std::collections::HashMap::new();
        let mut id = |t: String| {
            *index.entry(t.clone()).or_insert_with(|| {
                texts.push(t);
                texts.len() - 1
            })
        };
        let pairs = triples.into_iter().map(|(a, b, s)| (id(a), id(b), s)).collect();
        RatedPairs { texts, pairs }
    }
}

/// The held-out retrieval split: `sentences[i]` should retrieve `glosses[i]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Retrieval {
    /// Queries (example sentences).
    pub sentences: Vec<String>,
    /// Candidates (one gloss per query, in the same order).
    pub glosses: Vec<String>,
}

/// The file as text: UTF-8, or else Latin-1 (gensim's `lee.cor` is Latin-1).
fn read(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(|e| candle_core::Error::Msg(format!("reading {}: {e}", path.display())))?;
    Ok(String::from_utf8(bytes).unwrap_or_else(|e| e.into_bytes().into_iter().map(char::from).collect()))
}

fn bad(path: &Path, line: usize, what: String) -> candle_core::Error {
    candle_core::Error::Msg(format!("{} line {line}: {what}", path.display()))
}

fn number(path: &Path, line: usize, field: &str) -> Result<f64> {
    field.trim().parse::<f64>().map_err(|_| bad(path, line, format!("{field:?} is not a number")))
}

/// Non-empty lines with their (1-based) numbers, `\r` removed.
fn lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines().enumerate().map(|(i, l)| (i + 1, l.trim_end_matches('\r'))).filter(|(_, l)| !l.trim().is_empty())
}

/// `retrieval.tsv` (`scripts/data/build_wordnet_text.py`): a header `synset<TAB>sentence<TAB>gloss`
/// (columns found by name), one held-out synset a line.
pub fn read_retrieval(path: &Path) -> Result<Retrieval> {
    let text = read(path)?;
    let mut it = lines(&text);
    let Some((_, header)) = it.next() else { candle_core::bail!("{}: empty file", path.display()) };
    let cols: Vec<&str> = header.split('\t').collect();
    let col = |name: &str| {
        cols.iter()
            .position(|c| c.trim() == name)
            .ok_or_else(|| candle_core::Error::Msg(format!("{}: the header {cols:?} has no column {name}", path.display())))
    };
    let (s, g) = (col("sentence")?, col("gloss")?);
    let mut out = Retrieval { sentences: Vec::new(), glosses: Vec::new() };
    for (n, l) in it {
        let f: Vec<&str> = l.split('\t').collect();
        if f.len() != cols.len() {
            return Err(bad(path, n, format!("{} fields, the header has {}", f.len(), cols.len())));
        }
        out.sentences.push(f[s].to_string());
        out.glosses.push(f[g].to_string());
    }
    if out.sentences.len() < 2 {
        candle_core::bail!("{}: retrieval needs at least 2 items, found {}", path.display(), out.sentences.len());
    }
    Ok(out)
}

/// The Lee et al. (2005) set as gensim ships it: `lee.cor` (one document a line) and
/// `similarities0-1.txt` (an `n x n` matrix of mean ratings, whitespace-separated); the pairs
/// are the upper triangle above the diagonal (1,225 for 50 documents).
pub fn read_lee(corpus: &Path, similarities: &Path) -> Result<RatedPairs> {
    let docs: Vec<String> = lines(&read(corpus)?).map(|(_, l)| l.trim().to_string()).collect();
    let text = read(similarities)?;
    let rows: Vec<(usize, Vec<f64>)> = lines(&text)
        .map(|(n, l)| Ok((n, l.split_whitespace().map(|f| number(similarities, n, f)).collect::<Result<Vec<_>>>()?)))
        .collect::<Result<_>>()?;
    if rows.len() != docs.len() || docs.len() < 2 {
        candle_core::bail!(
            "{} has {} rows but {} has {} documents (need the same number, at least 2)",
            similarities.display(),
            rows.len(),
            corpus.display(),
            docs.len()
        );
    }
    let mut pairs = Vec::new();
    for (i, (n, row)) in rows.iter().enumerate() {
        if row.len() != docs.len() {
            return Err(bad(similarities, *n, format!("{} values, expected {}", row.len(), docs.len())));
        }
        pairs.extend((i + 1..docs.len()).map(|j| (i, j, row[j])));
    }
    Ok(RatedPairs { texts: docs, pairs })
}

/// A word-similarity list (gensim's `simlex999.txt`, `wordsim353.tsv`): `word<TAB>word<TAB>score`
/// lines; lines starting with `#` are comments.
pub fn read_word_pairs(path: &Path) -> Result<RatedPairs> {
    let text = read(path)?;
    let mut triples = Vec::new();
    for (n, l) in lines(&text).filter(|(_, l)| !l.starts_with('#')) {
        let f: Vec<&str> = l.split('\t').collect();
        if f.len() < 3 {
            return Err(bad(path, n, format!("expected word<TAB>word<TAB>score, got {l:?}")));
        }
        triples.push((f[0].trim().to_string(), f[1].trim().to_string(), number(path, n, f[2])?));
    }
    if triples.len() < 2 {
        candle_core::bail!("{}: need at least 2 rated pairs, found {}", path.display(), triples.len());
    }
    Ok(RatedPairs::from_triples(triples))
}

/// STS-B as TSV, in either layout: GLUE's (a header naming `sentence1`, `sentence2` and
/// `score`, other columns ignored) or the original `sts-*.csv` one without a header
/// (`genre, file, year, id, score, sentence1, sentence2`, extra columns ignored).
pub fn read_sts_tsv(path: &Path) -> Result<RatedPairs> {
    let text = read(path)?;
    let all: Vec<(usize, &str)> = lines(&text).collect();
    let first: Vec<&str> = all.first().map(|(_, l)| l.split('\t').collect()).unwrap_or_default();
    let (cols, width, skip) = match ["sentence1", "sentence2", "score"].map(|c| first.iter().position(|h| h.trim() == c)) {
        [Some(a), Some(b), Some(s)] => ([a, b, s], first.len(), 1),
        _ => ([5, 6, 4], 7, 0),
    };
    let mut triples = Vec::new();
    for &(n, l) in &all[skip..] {
        let f: Vec<&str> = l.split('\t').collect();
        if f.len() < width {
            return Err(bad(path, n, format!("{} fields, expected at least {width}", f.len())));
        }
        triples.push((f[cols[0]].to_string(), f[cols[1]].to_string(), number(path, n, f[cols[2]])?));
    }
    if triples.len() < 2 {
        candle_core::bail!("{}: need at least 2 rated pairs, found {}", path.display(), triples.len());
    }
    Ok(RatedPairs::from_triples(triples))
}
