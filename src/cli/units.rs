//! The one grammar of sizes and durations that every flag accepts, so `--cache-size 1.5GiB`,
//! `--memory 512M`, `--every 10m` and `--read-timeout 300` mean the same thing wherever they
//! appear. Sizes are powers of 1024; durations are seconds when bare (fractions allowed) or
//! `humantime` text (`90s`, `10m`, `1h 30m`).

use std::time::Duration;

/// Parses a byte size: `1073741824`, `512M`, `1G`, `1.5GiB`, `64k`, `2T`, `500B`.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let digits = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("'{text}' is not a size (e.g. 512M, 1G)"))?;
    let scale = match unit
        .trim()
        .to_ascii_uppercase()
        .trim_end_matches("IB")
        .trim_end_matches('B')
    {
        "" => 1u64,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        "T" => 1 << 40,
        _ => return Err(format!("'{text}': unknown unit (use K, M, G or T)")),
    };
    let bytes = value * scale as f64;
    if !(bytes.is_finite() && bytes < u64::MAX as f64) {
        return Err(format!("'{text}' is too large"));
    }
    Ok(bytes as u64)
}

/// Parses a duration: `300` or `0.5` (seconds), or `90s`, `10m`, `1h 30m`; zero allowed.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    if let Ok(secs) = t.parse::<f64>() {
        return if secs.is_finite() && (0.0..1e9).contains(&secs) {
            Ok(Duration::from_secs_f64(secs))
        } else {
            Err(format!(
                "'{text}': give a number of seconds from 0 to 10^9, or e.g. 10m"
            ))
        };
    }
    humantime::parse_duration(t)
        .map_err(|e| format!("'{text}' is not a duration (e.g. 300, 90s, 10m, 1h): {e}"))
}

/// [`parse_duration`], longer than zero.
pub fn parse_positive_duration(text: &str) -> Result<Duration, String> {
    let d = parse_duration(text)?;
    if d.is_zero() {
        return Err(format!("'{text}': give a duration longer than 0"));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_size("100").unwrap(), 100);
        assert_eq!(parse_size("64K").unwrap(), 64 << 10);
        assert_eq!(parse_size("64k").unwrap(), 64 << 10);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size("512MB").unwrap(), 512 << 20);
        assert_eq!(parse_size("2t").unwrap(), 2 << 40);
        assert_eq!(parse_size("500B").unwrap(), 500);
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("lots").is_err());
        assert!(parse_size("-1G").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn durations_are_seconds_or_humantime() {
        assert_eq!(parse_duration("300").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("0.5").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("10m").unwrap(), Duration::from_secs(600));
        assert_eq!(parse_duration("1h 30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        assert!(parse_duration("-1").is_err());
        assert!(parse_duration("soon").is_err());
        assert!(parse_positive_duration("0s").is_err());
        assert_eq!(
            parse_positive_duration("2").unwrap(),
            Duration::from_secs(2)
        );
    }
}
