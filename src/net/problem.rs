//! RFC 9457 problem details: how fencegate's own endpoints (admin API, leases and
//! registrations, the API gateway) answer an error. The S3 front answers in S3's XML instead.

use http::StatusCode;

/// `type` is this followed by the error's code.
pub const TYPE_BASE: &str = "urn:fencegate:problem:";
pub const CONTENT_TYPE: &str = "application/problem+json";

/// The problem document of an error: `type`, `title` (the code), `status`, `detail`. Callers
/// add their own members (`holder`, `fencing_token_current`...).
pub fn document(status: StatusCode, code: &str, detail: &str) -> serde_json::Value {
    serde_json::json!({
        "type": format!("{TYPE_BASE}{code}"),
        "title": code,
        "status": status.as_u16(),
        "detail": detail,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_problem_names_its_code_in_type_and_title() {
        let doc = document(StatusCode::CONFLICT, "LeaseHeld", "held by a");
        assert_eq!(doc["type"], "urn:fencegate:problem:LeaseHeld");
        assert_eq!((doc["title"].as_str(), doc["status"].as_u64()), (Some("LeaseHeld"), Some(409)));
        assert_eq!(doc["detail"], "held by a");
    }
}
