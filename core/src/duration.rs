//! Durations as people type them on a command line: `90s`, `30m`, `12h`, `30d`, or bare seconds.
//! One parser for every binary, so `--lease-ttl 6s` and `--drain-grace 6s` read alike.

use std::time::Duration;

/// Parses `90s`, `30m`, `12h`, `30d` or bare seconds; the error names the text and the units.
pub fn parse(text: &str) -> Result<Duration, String> {
    let (number, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let n: u64 = number.parse().map_err(|_| format!("{text:?} is not a duration like 90s, 30m, 12h or 30d"))?;
    let scale = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3_600,
        "d" => 86_400,
        _ => return Err(format!("{text:?}: the unit must be s, m, h or d")),
    };
    n.checked_mul(scale).map(Duration::from_secs).ok_or_else(|| format!("{text:?} is too long a duration"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_unit_scales_its_number() {
        assert_eq!(parse("90").unwrap(), Duration::from_secs(90));
        assert_eq!(parse("90s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse("30m").unwrap(), Duration::from_secs(1_800));
        assert_eq!(parse("12h").unwrap(), Duration::from_secs(43_200));
        assert_eq!(parse("2d").unwrap(), Duration::from_secs(172_800));
    }

    #[test]
    fn what_is_no_duration_is_refused_naming_the_text() {
        for bad in ["", "s", "1.5s", "10w", "-3s", "18446744073709551615d"] {
            let err = parse(bad).unwrap_err();
            assert!(err.contains(&format!("{bad:?}")), "{bad}: {err}");
        }
    }
}
