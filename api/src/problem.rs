//! RFC 9457 problem responses and the parsing of untrusted request input.
//!
//! Invariant: every error the API returns is a `Problem` serialized as
//! `application/problem+json`; bad input never becomes a 5xx. A 5xx only
//! comes from a store or control-plane failure, never from request content.

use std::fmt;

use actix_web::http::header::{self, HeaderValue};
use actix_web::http::StatusCode;
use actix_web::{HttpRequest, HttpResponse, ResponseError};
use capybara_store::StoreError;
use futures::StreamExt;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

/// Largest accepted request body.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

#[derive(Debug, Clone)]
pub struct Problem {
    pub status: StatusCode,
    /// Short machine-readable kind, used in the `type` URI.
    pub kind: &'static str,
    pub title: &'static str,
    pub detail: String,
    /// The request field (422) or parameter (400) at fault.
    pub field: Option<String>,
    pub www_authenticate: bool,
    pub allow: Option<&'static str>,
}

impl Problem {
    fn new(
        status: StatusCode,
        kind: &'static str,
        title: &'static str,
        detail: impl Into<String>,
    ) -> Self {
        Problem {
            status,
            kind,
            title,
            detail: detail.into(),
            field: None,
            www_authenticate: false,
            allow: None,
        }
    }
    pub fn with_field(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }
    pub fn bad_request(detail: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "bad-request",
            "Bad request",
            detail,
        )
    }
    pub fn bad_param(param: &str, detail: impl Into<String>) -> Self {
        Self::bad_request(detail).with_field(param)
    }
    pub fn unauthorized(detail: impl Into<String>) -> Self {
        let mut p = Self::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "Unauthorized",
            detail,
        );
        p.www_authenticate = true;
        p
    }
    pub fn forbidden(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "forbidden", "Forbidden", detail)
    }
    pub fn not_found(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not-found", "Not found", detail)
    }
    pub fn method_not_allowed(allow: &'static str) -> Self {
        let mut p = Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method-not-allowed",
            "Method not allowed",
            format!("allowed methods: {allow}"),
        );
        p.allow = Some(allow);
        p
    }
    pub fn conflict(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "conflict", "Conflict", detail)
    }
    pub fn too_large() -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload-too-large",
            "Payload too large",
            format!("request body exceeds {MAX_BODY_BYTES} bytes"),
        )
    }
    pub fn unsupported_media(detail: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported-media-type",
            "Unsupported media type",
            detail,
        )
    }
    pub fn invalid(field: impl Into<String>, detail: impl Into<String>) -> Self {
        let field = field.into();
        let detail = format!("`{field}`: {}", readable_numbers(&detail.into()));
        Self::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "validation",
            "Validation failed",
            detail,
        )
        .with_field(field)
    }
    pub fn internal(detail: impl Into<String>) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "Internal error",
            detail,
        )
    }
    pub fn unavailable(detail: impl Into<String>) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "Service unavailable",
            detail,
        )
    }

    pub fn body(&self) -> Value {
        let mut v = json!({
            "type": format!("urn:capybara:problem:{}", self.kind),
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
        });
        if let Some(f) = &self.field {
            v["field"] = json!(f);
        }
        v
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.status.as_u16(),
            self.title,
            self.detail
        )
    }
}

impl ResponseError for Problem {
    fn status_code(&self) -> StatusCode {
        self.status
    }
    fn error_response(&self) -> HttpResponse {
        let mut b = HttpResponse::build(self.status);
        b.insert_header((
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        ));
        if self.www_authenticate {
            b.insert_header((
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"capybara\""),
            ));
        }
        if let Some(allow) = self.allow {
            b.insert_header((header::ALLOW, HeaderValue::from_static(allow)));
        }
        b.body(self.body().to_string())
    }
}

impl From<StoreError> for Problem {
    fn from(e: StoreError) -> Self {
        match &e {
            StoreError::NotFound { .. } => Problem::not_found(e.to_string()),
            StoreError::InvalidPolicy(p) => Problem::invalid(p.field, p.reason.clone()),
            StoreError::Invalid { what, reason } => Problem::invalid(*what, reason.clone()),
            _ if e.is_transient() => Problem::unavailable(format!("store unavailable: {e}")),
            _ => {
                tracing::error!(error = %e, "store error");
                Problem::internal(format!("store error: {e}"))
            }
        }
    }
}

pub type ApiResult<T> = Result<T, Problem>;

/// Numbers longer than any 64-bit integer (Rust prints a float with all
/// its digits: `1e300` is 301 of them) in exponent form, `1e300`,
/// `-2.5e-300`; what the client wrote in quotes is left as written.
pub fn readable_numbers(msg: &str) -> String {
    let b = msg.as_bytes();
    let mut out = String::with_capacity(msg.len());
    let (mut i, mut quoted, mut done) = (0, false, 0);
    while i < b.len() {
        match b[i] {
            b'\\' if quoted => i += 1,
            b'"' => quoted = !quoted,
            c if !quoted && (c.is_ascii_digit() || c == b'-') => {
                let start = i;
                let mut j = i + usize::from(c == b'-');
                // Not inside a word or after another number's dot.
                let alone =
                    start == 0 || !(b[start - 1].is_ascii_alphanumeric() || b[start - 1] == b'.');
                while j < b.len() && (b[j].is_ascii_digit() || b[j] == b'.') {
                    j += 1;
                }
                let tok = &msg[start..j];
                let tok = tok.strip_suffix('.').unwrap_or(tok);
                let end = start + tok.len();
                if alone && tok.len() > 20 {
                    if let Ok(f) = tok.parse::<f64>() {
                        out.push_str(&msg[done..start]);
                        out.push_str(&format!("{f:e}"));
                        done = end;
                    }
                }
                i = end.max(i + 1);
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    out.push_str(&msg[done..]);
    out
}

/// Reads a JSON body of at most `MAX_BODY_BYTES`. `Ok(None)` when the body
/// is empty and `required` is false.
pub async fn read_json(
    req: &HttpRequest,
    mut payload: actix_web::web::Payload,
    required: bool,
) -> ApiResult<Option<Value>> {
    if let Some(len) = req.headers().get(header::CONTENT_LENGTH) {
        if let Some(n) = len.to_str().ok().and_then(|s| s.parse::<u64>().ok()) {
            if n > MAX_BODY_BYTES as u64 {
                return Err(Problem::too_large());
            }
        }
    }
    let mut buf = bytes::BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| Problem::bad_request(format!("reading body: {e}")))?;
        if buf.len() + chunk.len() > MAX_BODY_BYTES {
            return Err(Problem::too_large());
        }
        buf.extend_from_slice(&chunk);
    }
    if buf.is_empty() {
        return if required {
            Err(Problem::bad_request("a JSON request body is required"))
        } else {
            Ok(None)
        };
    }
    let ct = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let mime = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    if mime != "application/json" && !(mime.starts_with("application/") && mime.ends_with("+json"))
    {
        return Err(Problem::unsupported_media(format!(
            "Content-Type must be application/json, got {ct:?}"
        )));
    }
    let v: Value = serde_json::from_slice(&buf)
        .map_err(|e| Problem::bad_request(format!("body is not valid JSON: {e}")))?;
    Ok(Some(v))
}

/// Parses an untrusted JSON object into `T`; the 422 names the bad field.
/// None of our request schemas is nullable, so a `null` member is refused
/// (serde would otherwise read it as "absent").
pub fn parse_body<T: DeserializeOwned>(v: Value) -> ApiResult<T> {
    let Value::Object(map) = &v else {
        return Err(Problem::invalid("body", "must be a JSON object"));
    };
    if let Some((k, _)) = map.iter().find(|(_, v)| v.is_null()) {
        return Err(Problem::invalid(k.clone(), "must not be null"));
    }
    serde_path_to_error::deserialize::<_, T>(v).map_err(|e| {
        // `expected u64` -> `expected a non-negative integer`.
        let raw = e.inner().to_string();
        let msg =
            out_of_range(&raw).unwrap_or_else(|| capybara_confkit::plain_types(&raw, "an object"));
        let path = e.path().to_string();
        let field = field_from_message(&msg).map(|f| {
            if path == "." {
                f.clone()
            } else {
                format!("{path}.{f}")
            }
        });
        let field = field.unwrap_or_else(|| {
            if path == "." {
                "body".to_string()
            } else {
                path.clone()
            }
        });
        Problem::invalid(field, msg)
    })
}

/// An integer too large for 64 bits (`"weight": 99999999999999999999999`)
/// reaches serde as a float: `invalid type: floating point `1e+23`,
/// expected u32`. A whole number outside the field's integer type reads as
/// out of range instead: `1e23 is out of range: expected an integer from 0
/// to 4294967295`. Fractions and other messages are left to serde's words.
fn out_of_range(raw: &str) -> Option<String> {
    let (x, ty) = raw
        .strip_prefix("invalid type: floating point `")?
        .split_once("`, expected ")?;
    let (lo, hi): (i128, i128) = match ty {
        "u8" => (0, u8::MAX.into()),
        "u16" => (0, u16::MAX.into()),
        "u32" => (0, u32::MAX.into()),
        "u64" | "usize" => (0, u64::MAX.into()),
        "i8" => (i8::MIN.into(), i8::MAX.into()),
        "i16" => (i16::MIN.into(), i16::MAX.into()),
        "i32" => (i32::MIN.into(), i32::MAX.into()),
        "i64" | "isize" => (i64::MIN.into(), i64::MAX.into()),
        _ => return None,
    };
    let f: f64 = x.parse().ok()?;
    // `as` saturates: 1e300 compares as i128::MAX.
    if !f.is_finite() || f.fract() != 0.0 || (lo..=hi).contains(&(f as i128)) {
        return None;
    }
    Some(format!(
        "{f:e} is out of range: expected an integer from {lo} to {hi}"
    ))
}

/// serde names the field itself in "missing field `x`" messages, where the
/// path still points at the enclosing object.
fn field_from_message(msg: &str) -> Option<String> {
    // (For unknown fields the path already ends with the field.)
    msg.strip_prefix("missing field `")
        .and_then(|rest| rest.split('`').next())
        .map(str::to_string)
}

/// `[A-Za-z0-9_.-]{1,64}`: names of servers, services and tokens.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

/// Query parameters, last occurrence wins.
pub struct Query(Vec<(String, String)>);

impl Query {
    pub fn parse(req: &HttpRequest) -> ApiResult<Self> {
        actix_web::web::Query::<Vec<(String, String)>>::from_query(req.query_string())
            .map(|q| Query(q.into_inner()))
            .map_err(|e| Problem::bad_request(format!("malformed query string: {e}")))
    }
    /// Refuses a parameter the endpoint does not take (400 naming it):
    /// a misspelt filter (`?servr=2`, `?services=web`) would otherwise be
    /// ignored and list everything, as if the filter matched it all. A
    /// parameter it takes given twice (`?limit=1&limit=2`) is refused too
    /// (400 naming it), rather than silently taking one of the two. The
    /// first offending parameter, in the order given, is the one named.
    pub fn only(&self, known: &[&str]) -> ApiResult<&Self> {
        for (i, (k, _)) in self.0.iter().enumerate() {
            if !known.contains(&k.as_str()) {
                let takes = if known.is_empty() {
                    "no query parameters".to_string()
                } else {
                    known
                        .iter()
                        .map(|k| format!("`{k}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                return Err(Problem::bad_param(
                    k,
                    format!("unknown query parameter `{k}`; this endpoint takes {takes}"),
                ));
            }
            if self.0[..i].iter().any(|(seen, _)| seen == k) {
                return Err(Problem::bad_param(
                    k,
                    format!("query parameter `{k}` given twice; give it once"),
                ));
            }
        }
        Ok(self)
    }
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
    /// `order`: `asc` (the default) or `desc` (true: newest first).
    pub fn newest_first(&self) -> ApiResult<bool> {
        match self.get("order") {
            None | Some("asc") => Ok(false),
            Some("desc") => Ok(true),
            Some(o) => Err(Problem::bad_param(
                "order",
                format!("query parameter `order` must be `asc` or `desc`, got {o:?}"),
            )),
        }
    }
    pub fn u64_in(&self, key: &str, min: u64, max: u64) -> ApiResult<Option<u64>> {
        match self.get(key) {
            None => Ok(None),
            Some(s) => match s.parse::<u64>() {
                Ok(n) if (min..=max).contains(&n) => Ok(Some(n)),
                _ => Err(Problem::bad_param(
                    key,
                    format!(
                        "query parameter `{key}` must be an integer in [{min}, {max}], got {s:?}"
                    ),
                )),
            },
        }
    }
}

/// A server id from the path: an integer in [1, 2^32-1].
pub fn parse_server_id(raw: &str) -> ApiResult<capybara_proto::flow::ServerId> {
    match raw.parse::<u64>() {
        Ok(n) if (1..=u32::MAX as u64).contains(&n) => Ok(capybara_proto::flow::ServerId(n as u32)),
        _ => Err(Problem::bad_param(
            "server_id",
            format!("server id must be an integer in [1, 4294967295], got {raw:?}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct T {
        a: u32,
        b: Option<Vec<u64>>,
    }

    #[test]
    fn parse_errors_name_the_field() {
        let f = |v: Value| parse_body::<T>(v).unwrap_err().field.unwrap();
        assert_eq!(f(json!({})), "a");
        assert_eq!(f(json!({"a": 1, "zz": 2})), "zz");
        assert_eq!(f(json!({"a": "x"})), "a");
        assert_eq!(f(json!({"a": 1, "b": [1, -2]})), "b[1]");
        assert_eq!(f(json!({"a": null})), "a");
        assert_eq!(f(json!([1])), "body");
    }

    /// A huge or tiny float reads as `1e300`, not its 301 digits; integers
    /// up to 64 bits and quoted input stay as they are.
    #[test]
    fn huge_floats_are_printed_readably() {
        let d = |v: Value| parse_body::<T>(v).unwrap_err().detail;
        // A whole number too large for the field, in words.
        assert_eq!(
            d(json!({"a": 1e300})),
            "`a`: 1e300 is out of range: expected an integer from 0 to 4294967295"
        );
        assert_eq!(
            d(json!({"a": -1e20})),
            "`a`: -1e20 is out of range: expected an integer from 0 to 4294967295"
        );
        assert_eq!(
            d(json!({"a": 1, "b": [1, 1e20]})),
            "`b[1]`: 1e20 is out of range: expected an integer from 0 to 18446744073709551615"
        );
        // A fraction, or a whole number in range written as a float, keeps
        // serde's own wording.
        for (v, shown) in [(1.5, "1.5"), (5.0, "5.0")] {
            assert_eq!(
                d(json!({ "a": v })),
                format!("`a`: invalid type: floating point `{shown}`, expected an integer from 0 to 4294967295")
            );
        }
        // Messages that print an f64 with `{}` (the store's policy checks).
        let p = Problem::invalid("x", format!("must be in (0, 1000], got {}", 1e300_f64));
        assert_eq!(p.detail, "`x`: must be in (0, 1000], got 1e300");
        let p = Problem::invalid("x", format!("got {}, max {}", 1.5e22_f64, 1e-30_f64));
        assert_eq!(p.detail, "`x`: got 1.5e22, max 1e-30");
        for kept in [
            "got 18446744073709551615",
            "got -9223372036854775808",
            "got 0.30000000000000004",
            "got \"100000000000000000000000\"",
            "got \"a\\\"100000000000000000000000\"",
            "id 4294967295.",
            "v1.100000000000000000000000",
        ] {
            assert_eq!(Problem::invalid("x", kept).detail, format!("`x`: {kept}"));
        }
    }

    /// The detail names the kind of value wanted, not a Rust type.
    #[test]
    fn parse_errors_name_kinds_of_values() {
        let d = |v: Value| parse_body::<T>(v).unwrap_err().detail;
        assert_eq!(
            d(json!({"a": "x"})),
            "`a`: invalid type: string \"x\", expected an integer from 0 to 4294967295"
        );
        assert_eq!(
            d(json!({"a": 1, "b": [1, -2]})),
            "`b[1]`: invalid value: integer `-2`, expected a non-negative integer"
        );
        assert_eq!(
            d(json!({"a": 1, "b": {"c": 1}})),
            "`b`: invalid type: object, expected an array"
        );
    }
}
