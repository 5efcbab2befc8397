//! The API's own small SQLite file: API tokens and drain modes, which the
//! `Store` trait does not hold (yet).
//!
//! Tokens are `capy_` + 64 hex digits (256 random bits). Only their SHA-256
//! is stored; a presented token is hashed and compared in constant time
//! against every active hash, so neither the stored hashes nor timing reveal
//! a token. Lookups go through an in-memory copy reloaded after every write
//! of this process and at most every `CACHE_TTL` (writes by other processes).

use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock};
use std::time::{Duration, Instant};

use capybara_proto::flow::ServerId;
use capybara_store::unix_ms_now;
use rusqlite::{params, Connection, OptionalExtension};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

const CACHE_TTL: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Viewer,
    Operator,
    Admin,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "viewer" => Some(Role::Viewer),
            "operator" => Some(Role::Operator),
            "admin" => Some(Role::Admin),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DrainMode {
    Migrate,
    Force,
}

impl DrainMode {
    pub fn as_str(self) -> &'static str {
        match self {
            DrainMode::Migrate => "migrate",
            DrainMode::Force => "force",
        }
    }
}

/// A token as listed (never with its secret).
#[derive(Debug, Clone, Serialize)]
pub struct TokenInfo {
    pub id: String,
    pub name: String,
    pub role: Role,
    pub created_unix_ms: u64,
    pub created_by: String,
    pub revoked: bool,
    pub revoked_unix_ms: Option<u64>,
}

#[derive(Debug, Clone)]
struct CachedToken {
    hash: [u8; 32],
    info: TokenInfo,
}

#[derive(Debug, thiserror::Error)]
pub enum ApiDbError {
    #[error("API database {path}: {source}")]
    Sqlite {
        path: String,
        #[source]
        source: rusqlite::Error,
    },
    #[error("an active token named {0:?} already exists")]
    DuplicateName(String),
    #[error("token {0} not found")]
    NotFound(String),
    #[error("refusing to revoke the last active admin token")]
    LastAdmin,
    #[error("admin token file {path}: {reason}")]
    TokenFile { path: String, reason: String },
    #[error("random number generator failed: {0}")]
    Random(String),
}

pub struct ApiDb {
    path: PathBuf,
    conn: Mutex<Connection>,
    cache: RwLock<(Instant, Vec<CachedToken>)>,
}

fn random_hex(bytes: usize) -> Result<String, ApiDbError> {
    let mut buf = vec![0u8; bytes];
    getrandom::fill(&mut buf).map_err(|e| ApiDbError::Random(e.to_string()))?;
    Ok(hex::encode(buf))
}

fn hash_token(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// Whether `s` has the shape of a token (`capy_` + 64 lowercase hex).
pub fn is_token_shaped(s: &str) -> bool {
    s.len() == 69
        && s.starts_with("capy_")
        && s[5..]
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl ApiDb {
    pub fn open(path: &Path) -> Result<Self, ApiDbError> {
        let err = |source| ApiDbError::Sqlite {
            path: path.display().to_string(),
            source,
        };
        let conn = Connection::open(path).map_err(err)?;
        conn.busy_timeout(Duration::from_secs(5)).map_err(err)?;
        conn.execute_batch(
            "PRAGMA journal_mode=WAL;
             CREATE TABLE IF NOT EXISTS tokens (
                 id TEXT PRIMARY KEY, name TEXT NOT NULL, role TEXT NOT NULL,
                 hash BLOB NOT NULL UNIQUE, created_unix_ms INTEGER NOT NULL,
                 created_by TEXT NOT NULL, revoked_unix_ms INTEGER);
             CREATE TABLE IF NOT EXISTS drain_modes (server INTEGER PRIMARY KEY, mode TEXT NOT NULL);",
        )
        .map_err(err)?;
        let db = ApiDb {
            path: path.to_path_buf(),
            conn: Mutex::new(conn),
            cache: RwLock::new((Instant::now(), Vec::new())),
        };
        db.reload()?;
        Ok(db)
    }

    fn err(&self) -> impl Fn(rusqlite::Error) -> ApiDbError + '_ {
        move |source| ApiDbError::Sqlite {
            path: self.path.display().to_string(),
            source,
        }
    }

    fn load_all(&self) -> Result<Vec<CachedToken>, ApiDbError> {
        let conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let mut stmt = conn
            .prepare("SELECT id, name, role, hash, created_unix_ms, created_by, revoked_unix_ms FROM tokens ORDER BY created_unix_ms, id")
            .map_err(self.err())?;
        let rows = stmt
            .query_map([], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, Vec<u8>>(3)?,
                    r.get::<_, i64>(4)?,
                    r.get::<_, String>(5)?,
                    r.get::<_, Option<i64>>(6)?,
                ))
            })
            .map_err(self.err())?;
        let mut out = Vec::new();
        for row in rows {
            let (id, name, role, hash, created, created_by, revoked) = row.map_err(self.err())?;
            // A row we cannot read (edited by hand) grants nothing.
            let (Some(role), Ok(hash)) =
                (Role::parse(&role), <[u8; 32]>::try_from(hash.as_slice()))
            else {
                tracing::warn!(token = %id, "ignoring malformed token row");
                continue;
            };
            out.push(CachedToken {
                hash,
                info: TokenInfo {
                    id,
                    name,
                    role,
                    created_unix_ms: created as u64,
                    created_by,
                    revoked: revoked.is_some(),
                    revoked_unix_ms: revoked.map(|r| r as u64),
                },
            });
        }
        Ok(out)
    }

    fn reload(&self) -> Result<(), ApiDbError> {
        let all = self.load_all()?;
        *self.cache.write().unwrap_or_else(|p| p.into_inner()) = (Instant::now(), all);
        Ok(())
    }

    /// The active token matching `presented`, compared in constant time.
    pub fn authenticate(&self, presented: &str) -> Option<TokenInfo> {
        let stale = self
            .cache
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .elapsed()
            > CACHE_TTL;
        if stale {
            if let Err(e) = self.reload() {
                tracing::warn!(error = %e, "reloading tokens failed; using the cached copy");
            }
        }
        let h = hash_token(presented);
        let cache = self.cache.read().unwrap_or_else(|p| p.into_inner());
        let mut found = None;
        for t in cache.1.iter() {
            // Visit every entry so the time does not depend on which matched.
            if bool::from(t.hash.ct_eq(&h)) && !t.info.revoked {
                found = Some(t.info.clone());
            }
        }
        found
    }

    pub fn list(&self) -> Result<Vec<TokenInfo>, ApiDbError> {
        self.reload()?;
        Ok(self
            .cache
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .iter()
            .map(|t| t.info.clone())
            .collect())
    }

    fn insert(
        &self,
        name: &str,
        role: Role,
        created_by: &str,
        secret: &str,
    ) -> Result<TokenInfo, ApiDbError> {
        let id = format!("t_{}", random_hex(8)?);
        let now = unix_ms_now();
        {
            let conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
            let exists: Option<String> = conn
                .query_row(
                    "SELECT id FROM tokens WHERE name = ?1 AND revoked_unix_ms IS NULL",
                    params![name],
                    |r| r.get(0),
                )
                .optional()
                .map_err(self.err())?;
            if exists.is_some() {
                return Err(ApiDbError::DuplicateName(name.to_string()));
            }
            conn.execute(
                "INSERT INTO tokens (id, name, role, hash, created_unix_ms, created_by) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                params![id, name, role.as_str(), hash_token(secret).to_vec(), now as i64, created_by],
            )
            .map_err(self.err())?;
        }
        self.reload()?;
        Ok(TokenInfo {
            id,
            name: name.to_string(),
            role,
            created_unix_ms: now,
            created_by: created_by.to_string(),
            revoked: false,
            revoked_unix_ms: None,
        })
    }

    /// Creates a token; returns it with its secret (shown once).
    pub fn create(
        &self,
        name: &str,
        role: Role,
        created_by: &str,
    ) -> Result<(TokenInfo, String), ApiDbError> {
        let secret = format!("capy_{}", random_hex(32)?);
        let info = self.insert(name, role, created_by, &secret)?;
        Ok((info, secret))
    }

    /// Revokes a token; already revoked is fine. The last active admin
    /// cannot be revoked (nobody could manage tokens any more).
    pub fn revoke(&self, id: &str) -> Result<TokenInfo, ApiDbError> {
        let all = self.list()?;
        let Some(t) = all.iter().find(|t| t.info_id() == id) else {
            return Err(ApiDbError::NotFound(id.to_string()));
        };
        if t.revoked {
            return Ok(t.clone());
        }
        let admins = all
            .iter()
            .filter(|t| t.role == Role::Admin && !t.revoked)
            .count();
        if t.role == Role::Admin && admins <= 1 {
            return Err(ApiDbError::LastAdmin);
        }
        {
            let conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
            conn.execute(
                "UPDATE tokens SET revoked_unix_ms = ?2 WHERE id = ?1",
                params![id, unix_ms_now() as i64],
            )
            .map_err(self.err())?;
        }
        self.reload()?;
        let mut t = t.clone();
        t.revoked = true;
        Ok(t)
    }

    /// Makes sure an admin can log in. With `token_file`: the token in the
    /// file is registered as admin `bootstrap` (the file is created with a
    /// new token, mode 0600, if missing). Without: if no active admin token
    /// exists, one named `admin` is created. Returns a newly created secret
    /// for the caller to print once.
    pub fn bootstrap_admin(&self, token_file: Option<&Path>) -> Result<Option<String>, ApiDbError> {
        if let Some(path) = token_file {
            let ferr = |reason: String| ApiDbError::TokenFile {
                path: path.display().to_string(),
                reason,
            };
            let (secret, created) = if path.exists() {
                let s = std::fs::read_to_string(path).map_err(|e| ferr(e.to_string()))?;
                let s = s.trim().to_string();
                if !is_token_shaped(&s) {
                    return Err(ferr(
                        "must hold one token: `capy_` followed by 64 lowercase hex digits".into(),
                    ));
                }
                (s, false)
            } else {
                let s = format!("capy_{}", random_hex(32)?);
                write_private(path, &s).map_err(|e| ferr(e.to_string()))?;
                (s, true)
            };
            let h = hash_token(&secret);
            let known = self
                .cache
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .1
                .iter()
                .any(|t| t.hash == h);
            if !known {
                let mut name = "bootstrap".to_string();
                let mut n = 1;
                while self.list()?.iter().any(|t| t.name == name && !t.revoked) {
                    n += 1;
                    name = format!("bootstrap-{n}");
                }
                self.insert(&name, Role::Admin, "system", &secret)?;
            }
            return Ok(created.then_some(secret));
        }
        if self
            .list()?
            .iter()
            .any(|t| t.role == Role::Admin && !t.revoked)
        {
            return Ok(None);
        }
        let (_, secret) = self.create("admin", Role::Admin, "system")?;
        Ok(Some(secret))
    }

    pub fn set_drain_mode(&self, server: ServerId, mode: DrainMode) -> Result<(), ApiDbError> {
        let conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        conn.execute(
            "INSERT INTO drain_modes (server, mode) VALUES (?1, ?2) ON CONFLICT(server) DO UPDATE SET mode = ?2",
            params![server.0, mode.as_str()],
        )
        .map_err(self.err())?;
        Ok(())
    }

    /// The mode of the server's drain; `migrate` (never breaks anything)
    /// when unknown, e.g. for a drain started by another component.
    pub fn drain_mode(&self, server: ServerId) -> DrainMode {
        let conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let m: Option<String> = conn
            .query_row(
                "SELECT mode FROM drain_modes WHERE server = ?1",
                params![server.0],
                |r| r.get(0),
            )
            .optional()
            .unwrap_or(None);
        if m.as_deref() == Some("force") {
            DrainMode::Force
        } else {
            DrainMode::Migrate
        }
    }
}

impl TokenInfo {
    fn info_id(&self) -> &str {
        &self.id
    }
}

fn write_private(path: &Path, content: &str) -> std::io::Result<()> {
    use std::io::Write;
    #[cfg(unix)]
    use std::os::unix::fs::OpenOptionsExt;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    opts.mode(0o600);
    let mut f = opts.open(path)?;
    writeln!(f, "{content}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_revoke() {
        let dir = tempfile::tempdir().unwrap();
        let db = ApiDb::open(&dir.path().join("api.db")).unwrap();
        let admin = db.bootstrap_admin(None).unwrap().unwrap();
        assert!(db.bootstrap_admin(None).unwrap().is_none());
        assert_eq!(db.authenticate(&admin).unwrap().role, Role::Admin);
        let (info, secret) = db.create("ops", Role::Operator, "admin").unwrap();
        assert!(is_token_shaped(&secret));
        assert_eq!(db.authenticate(&secret).unwrap().name, "ops");
        assert!(matches!(
            db.create("ops", Role::Viewer, "admin"),
            Err(ApiDbError::DuplicateName(_))
        ));
        db.revoke(&info.id).unwrap();
        assert!(db.authenticate(&secret).is_none());
        let admin_id = db
            .list()
            .unwrap()
            .into_iter()
            .find(|t| t.name == "admin")
            .unwrap()
            .id;
        assert!(matches!(db.revoke(&admin_id), Err(ApiDbError::LastAdmin)));
        assert!(db.authenticate("capy_00").is_none());
    }

    #[test]
    fn token_file_is_created_then_reused() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("admin.token");
        let db = ApiDb::open(&dir.path().join("api.db")).unwrap();
        let s = db.bootstrap_admin(Some(&file)).unwrap().unwrap();
        assert!(db.bootstrap_admin(Some(&file)).unwrap().is_none());
        assert_eq!(std::fs::read_to_string(&file).unwrap().trim(), s);
        assert_eq!(db.authenticate(&s).unwrap().role, Role::Admin);
        assert_eq!(db.list().unwrap().len(), 1);
    }
}
