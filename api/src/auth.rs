//! Bearer-token authentication and role checks.

use actix_web::http::header;
use actix_web::HttpRequest;

use crate::apidb::{Role, TokenInfo};
use crate::problem::{ApiResult, Problem};
use crate::server::AppState;

/// The authenticated caller.
#[derive(Debug, Clone)]
pub struct Principal {
    pub token: TokenInfo,
}

impl Principal {
    /// The audit log's "who".
    pub fn actor(&self) -> String {
        format!("{} ({})", self.token.name, self.token.id)
    }
}

/// Authenticates the request, checks that its role is at least `min`, then
/// that its query names only parameters the route takes
/// ([`crate::server::TakesQuery`]; 400 naming the first other one), each
/// at most once (400 naming one given twice).
/// `allow_query` also accepts `?access_token=` (only for the event stream,
/// whose browser client cannot set headers).
pub fn authorize(
    req: &HttpRequest,
    state: &AppState,
    min: Role,
    allow_query: bool,
) -> ApiResult<Principal> {
    let presented = match req.headers().get(header::AUTHORIZATION) {
        Some(v) => {
            let v = v
                .to_str()
                .map_err(|_| Problem::unauthorized("Authorization header is not ASCII"))?;
            let (scheme, token) = v.split_once(' ').unwrap_or((v, ""));
            if !scheme.eq_ignore_ascii_case("bearer") || token.trim().is_empty() {
                return Err(Problem::unauthorized(
                    "Authorization must be `Bearer <token>`",
                ));
            }
            token.trim().to_string()
        }
        None if allow_query => {
            let q = crate::problem::Query::parse(req)
                .map_err(|_| Problem::unauthorized("missing bearer token"))?;
            match q.get("access_token") {
                Some(t) if !t.is_empty() => t.to_string(),
                _ => {
                    return Err(Problem::unauthorized(
                        "missing bearer token (Authorization header or access_token)",
                    ))
                }
            }
        }
        None => {
            return Err(Problem::unauthorized(
                "missing bearer token in the Authorization header",
            ))
        }
    };
    let Some(token) = state.db.authenticate(&presented) else {
        return Err(Problem::unauthorized("unknown or revoked token"));
    };
    if token.role < min {
        return Err(Problem::forbidden(format!(
            "token {:?} has role {}; this operation needs {}",
            token.name,
            token.role.as_str(),
            min.as_str()
        )));
    }
    // Only now (an anonymous caller learns nothing from validation
    // errors), and here, where every /v1 handler starts.
    crate::server::check_query(req)?;
    Ok(Principal { token })
}
