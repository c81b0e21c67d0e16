//! Where ranks started by `srun` meet when MASTER_ADDR/MASTER_PORT are not set: the first
//! host of the step's (else the job's) node list, and a port derived from the job id.
//!
//! SLURM writes node lists in a compressed form: comma-separated entries, each a host name
//! with bracketed sets of numbers or ranges, `node[01-04,07]`, `a1,b[2-3]`,
//! `rack[1-2]-n[08-10]`. Ranges keep the zero padding of their lower bound (`[08-10]` is
//! `08 09 10`). With the default block distribution rank 0 runs on the first host.

use crate::error::{DistError, DistResult};

/// Lowest port [`port_from_job_id`] gives.
pub const SLURM_PORT_BASE: u16 = 15_000;
/// Number of ports [`port_from_job_id`] cycles through.
pub const SLURM_PORT_SPAN: u16 = 10_000;
/// Most hosts [`expand_nodelist`] returns (a guard against `n[0-999999999]`).
pub const MAX_HOSTS: usize = 1 << 20;

/// The rendezvous port of SLURM job `job_id`: `15000 + job_id % 10000`, so 15000-24999.
/// That range lies below Linux's ephemeral ports (32768-60999, which outgoing connections
/// take) and above the well-known ones; two jobs whose first hosts coincide collide only if
/// their ids are equal modulo 10000 (set MASTER_PORT then).
pub fn port_from_job_id(job_id: &str) -> DistResult<u16> {
    let id: u64 =
        job_id.trim().parse().map_err(|_| DistError::Env(format!("SLURM_JOB_ID={job_id:?} is not a non-negative integer")))?;
    Ok(SLURM_PORT_BASE + (id % u64::from(SLURM_PORT_SPAN)) as u16)
}

/// The first host of a compressed node list.
pub fn first_host(nodelist: &str) -> DistResult<String> {
    let entries = parse(nodelist)?;
    let first = &entries[0];
    Ok(first
        .iter()
        .map(|p| match p {
            Part::Lit(s) => s.clone(),
            Part::Set(ranges) => ranges[0].label(ranges[0].lo),
        })
        .collect())
}

/// Every host of a compressed node list, in SLURM's order (at most [`MAX_HOSTS`]).
pub fn expand_nodelist(nodelist: &str) -> DistResult<Vec<String>> {
    let mut hosts = Vec::new();
    for entry in parse(nodelist)? {
        let mut names = vec![String::new()];
        for part in &entry {
            names = match part {
                Part::Lit(s) => names.into_iter().map(|n| n + s).collect(),
                Part::Set(ranges) => {
                    let count: u64 = ranges.iter().map(|r| r.hi - r.lo + 1).sum();
                    if (names.len() as u64).saturating_mul(count) + hosts.len() as u64 > MAX_HOSTS as u64 {
                        return Err(bad(nodelist, format!("names more than {MAX_HOSTS} hosts")));
                    }
                    let mut next = Vec::new();
                    for n in &names {
                        for r in ranges {
                            next.extend((r.lo..=r.hi).map(|i| format!("{n}{}", r.label(i))));
                        }
                    }
                    next
                }
            };
        }
        hosts.extend(names);
    }
    Ok(hosts)
}

#[derive(Debug)]
enum Part {
    Lit(String),
    Set(Vec<Range>),
}

#[derive(Debug)]
struct Range {
    lo: u64,
    hi: u64,
    width: usize,
}

impl Range {
    fn label(&self, i: u64) -> String {
        format!("{i:0w$}", w = self.width)
    }
}

fn bad(nodelist: &str, why: impl std::fmt::Display) -> DistError {
    DistError::Env(format!("SLURM node list {nodelist:?} {why}"))
}

/// Splits the list into entries (top-level commas), each a sequence of literal parts and
/// bracketed number sets.
fn parse(nodelist: &str) -> DistResult<Vec<Vec<Part>>> {
    let s = nodelist.trim();
    if s.is_empty() {
        return Err(bad(nodelist, "is empty"));
    }
    let mut entries = Vec::new();
    let mut parts: Vec<Part> = Vec::new();
    let mut lit = String::new();
    let mut chars = s.char_indices();
    while let Some((at, c)) = chars.next() {
        match c {
            ',' => {
                if !lit.is_empty() {
                    parts.push(Part::Lit(std::mem::take(&mut lit)));
                }
                if parts.is_empty() {
                    return Err(bad(nodelist, format!("has an empty entry at byte {at}")));
                }
                entries.push(std::mem::take(&mut parts));
            }
            '[' => {
                let body: String = chars.by_ref().map(|(_, c)| c).take_while(|c| *c != ']').collect();
                if !s[at..].contains(']') {
                    return Err(bad(nodelist, format!("opens a bracket at byte {at} that is never closed")));
                }
                if !lit.is_empty() {
                    parts.push(Part::Lit(std::mem::take(&mut lit)));
                }
                parts.push(Part::Set(parse_set(nodelist, &body)?));
            }
            ']' => return Err(bad(nodelist, format!("closes a bracket at byte {at} that was never opened"))),
            c if c.is_whitespace() => return Err(bad(nodelist, format!("has white space at byte {at}"))),
            c => lit.push(c),
        }
    }
    if !lit.is_empty() {
        parts.push(Part::Lit(lit));
    }
    if parts.is_empty() {
        return Err(bad(nodelist, "ends with an empty entry"));
    }
    entries.push(parts);
    Ok(entries)
}

/// `01-04,07` → ranges 1..=4 (width 2) and 7..=7 (width 2).
fn parse_set(nodelist: &str, body: &str) -> DistResult<Vec<Range>> {
    let number = |t: &str| -> DistResult<u64> {
        if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad(nodelist, format!("has {t:?} in brackets where a number belongs")));
        }
        t.parse().map_err(|_| bad(nodelist, format!("has the number {t} in brackets, which is too large")))
    };
    body.split(',')
        .map(|item| {
            let (lo_s, hi_s) = item.split_once('-').unwrap_or((item, item));
            let (lo, hi) = (number(lo_s)?, number(hi_s)?);
            if lo > hi {
                return Err(bad(nodelist, format!("has the decreasing range {item:?}")));
            }
            Ok(Range { lo, hi, width: lo_s.len() })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_hosts_of_many_forms() {
        let cases = [
            ("node01", "node01"),
            ("node[01-04,07]", "node01"),
            ("a1,b[2-3]", "a1"),
            ("b[2-3],a1", "b2"),
            ("n[007-012]", "n007"),
            ("n[8-10]", "n8"),
            ("rack[1-2]-n[08-10]", "rack1-n08"),
            ("gpu-[5,3]", "gpu-5"),
            ("host.example.org", "host.example.org"),
            ("[3-4]x", "3x"),
            ("  c[10-11]  ", "c10"),
        ];
        for (list, want) in cases {
            assert_eq!(first_host(list).unwrap(), want, "{list}");
        }
    }

    #[test]
    fn expansions_keep_order_and_padding() {
        assert_eq!(expand_nodelist("node[01-04,07]").unwrap(), ["node01", "node02", "node03", "node04", "node07"]);
        assert_eq!(expand_nodelist("a1,b[2-3]").unwrap(), ["a1", "b2", "b3"]);
        assert_eq!(expand_nodelist("n[8-10]").unwrap(), ["n8", "n9", "n10"]);
        assert_eq!(expand_nodelist("n[098-100]").unwrap(), ["n098", "n099", "n100"]);
        assert_eq!(expand_nodelist("r[1-2]-n[1-2]").unwrap(), ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]);
        assert_eq!(expand_nodelist("x,y[1],z").unwrap(), ["x", "y1", "z"]);
    }

    #[test]
    fn bad_node_lists_say_what_is_wrong() {
        let cases = [
            ("", "is empty"),
            ("node[01-04", "never closed"),
            ("node01]", "never opened"),
            ("a,,b", "empty entry"),
            ("a,", "ends with an empty entry"),
            ("n[4-2]", "decreasing range"),
            ("n[a-b]", "where a number belongs"),
            ("n[1,,2]", "where a number belongs"),
            ("n[]", "where a number belongs"),
            ("n[1-2-3]", "where a number belongs"),
            ("n[99999999999999999999]", "too large"),
            ("a b", "white space"),
        ];
        for (list, needle) in cases {
            let err = first_host(list).unwrap_err().to_string();
            assert!(err.contains(needle) && err.contains("SLURM node list"), "{list:?}: {err}");
        }
        let err = expand_nodelist("n[0-99999999]").unwrap_err().to_string();
        assert!(err.contains("more than"), "{err}");
    }

    fn slurm_vars(extra: &[(&str, &str)]) -> std::collections::HashMap<String, String> {
        let base = [("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2"), ("SLURM_JOB_ID", "4242"), ("SLURM_JOB_NODELIST", "cn[07-09]")];
        base.iter().chain(extra).map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn srun_without_master_variables_meets_at_the_first_host() {
        let w = crate::WorldInfo::from_vars(&slurm_vars(&[])).unwrap();
        assert_eq!((w.master_addr.as_str(), w.master_port), ("cn07", 15_000 + 4242));
        assert!(w.token.contains("4242"), "token {:?} is not derived from the job id", w.token);
        let step = crate::WorldInfo::from_vars(&slurm_vars(&[("SLURM_STEP_NODELIST", "cn[08-09]")])).unwrap();
        assert_eq!(step.master_addr, "cn08");
    }

    #[test]
    fn explicit_master_variables_win_over_slurm() {
        let w = crate::WorldInfo::from_vars(&slurm_vars(&[("MASTER_ADDR", "10.1.2.3"), ("MASTER_PORT", "2345")])).unwrap();
        assert_eq!((w.master_addr.as_str(), w.master_port), ("10.1.2.3", 2345));
        let bad = crate::WorldInfo::from_vars(&slurm_vars(&[("SLURM_JOB_NODELIST", "cn[9-7]")])).unwrap_err().to_string();
        assert!(bad.contains("cn[9-7]") && bad.contains("decreasing"), "{bad}");
    }

    #[test]
    fn ports_from_job_ids() {
        assert_eq!(port_from_job_id("0").unwrap(), 15_000);
        assert_eq!(port_from_job_id("123456").unwrap(), 18_456);
        assert_eq!(port_from_job_id("9999").unwrap(), 24_999);
        assert_eq!(port_from_job_id("10000").unwrap(), 15_000);
        let err = port_from_job_id("12_3").unwrap_err().to_string();
        assert!(err.contains("SLURM_JOB_ID=\"12_3\""), "{err}");
    }
}
