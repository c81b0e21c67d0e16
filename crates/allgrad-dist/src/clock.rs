//! Wall-clock names: the UTC stamp that names a run (`YYYYmmdd-HHMMSS`), shared by the
//! trainer's run directories and the launcher's default run id, so that a job restarted by
//! `launch --max-restarts` writes where a plain run of the same moment would.

/// Seconds since the UNIX epoch now (0 if the clock is before it).
pub fn now_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// `YYYYmmdd-HHMMSS` in UTC (days to civil date after Howard Hinnant's algorithm); the
/// names sort in time order.
pub fn utc_stamp(secs: u64) -> String {
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}{month:02}{day:02}-{:02}{:02}{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_stamps_match_the_calendar() {
        assert_eq!(utc_stamp(0), "19700101-000000");
        // 2000-02-29 01:02:03: a leap day of a century divisible by 400.
        assert_eq!(utc_stamp(951_782_400 + 3_723), "20000229-010203");
        // 2100 is not a leap year: the day after 2100-02-28 is 2100-03-01.
        assert_eq!(utc_stamp(4_107_456_000), "21000228-000000");
        assert_eq!(utc_stamp(4_107_456_000 + 86_400), "21000301-000000");
        assert_eq!(utc_stamp(1_767_225_599), "20251231-235959");
        assert_eq!(utc_stamp(1_767_225_600), "20260101-000000");
    }
}
