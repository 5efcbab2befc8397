//! Error types. Every error names what was wrong with the input; none of the
//! code paths that produce them panic.

use std::path::PathBuf;

/// TLS alert descriptions we send or recognise (RFC 8446 §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alert {
    CloseNotify,
    UnexpectedMessage,
    BadRecordMac,
    RecordOverflow,
    HandshakeFailure,
    DecodeError,
    InternalError,
    UserCanceled,
    /// Any other description code, as received.
    Other(u8),
}

impl Alert {
    pub fn code(self) -> u8 {
        match self {
            Alert::CloseNotify => 0,
            Alert::UnexpectedMessage => 10,
            Alert::BadRecordMac => 20,
            Alert::RecordOverflow => 22,
            Alert::HandshakeFailure => 40,
            Alert::DecodeError => 50,
            Alert::InternalError => 80,
            Alert::UserCanceled => 90,
            Alert::Other(c) => c,
        }
    }

    pub fn from_code(code: u8) -> Alert {
        match code {
            0 => Alert::CloseNotify,
            10 => Alert::UnexpectedMessage,
            20 => Alert::BadRecordMac,
            22 => Alert::RecordOverflow,
            40 => Alert::HandshakeFailure,
            50 => Alert::DecodeError,
            80 => Alert::InternalError,
            90 => Alert::UserCanceled,
            c => Alert::Other(c),
        }
    }
}

/// A fatal error of a TLS session. After it the session is dead: the caller
/// sends what `take_ciphertext_to_send` returns (the alert we queued, if any)
/// and closes the TCP connection.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("TLS handshake failed: {0}")]
    Handshake(rustls::Error),
    #[error(
        "the handshake negotiated {0:?}, which the migratable record layer does not implement"
    )]
    UnsupportedSuite(String),
    #[error("could not take over the record layer from rustls: {0}")]
    SecretExtraction(rustls::Error),
    #[error("record from the client failed authentication (bad MAC, wrong key or sequence number {seq})")]
    BadRecordMac { seq: u64 },
    #[error("record of {len} bytes exceeds the limit of {limit}")]
    RecordOverflow { len: usize, limit: usize },
    #[error("unexpected TLS message: {0}")]
    UnexpectedMessage(&'static str),
    #[error("malformed TLS message: {0}")]
    Decode(&'static str),
    #[error("client sent fatal alert {alert:?} (code {code})", alert = .0, code = .0.code())]
    PeerAlert(Alert),
    #[error("client sent KeyUpdate but this session has no traffic secrets to derive new keys")]
    KeyUpdateUnsupported,
    #[error(
        "the traffic secret does not derive the keys in use (corrupted or mismatched snapshot)"
    )]
    SecretMismatch,
    #[error("record limit for this key reached (RFC 8446 §5.5) and no KeyUpdate possible")]
    SequenceExhausted,
    #[error("the TLS handshake is not complete yet")]
    Handshaking,
    #[error("close_notify already sent: no more application data can be written")]
    WriteAfterClose,
    #[error("the session failed earlier ({0}); it cannot be used any more")]
    Failed(&'static str),
    #[error("the session cannot be exported now: {0}")]
    NotExportable(&'static str),
}

impl TlsError {
    /// The alert we send to the client for this error, if any.
    pub(crate) fn alert(&self) -> Option<Alert> {
        match self {
            TlsError::Handshake(_) => None, // rustls queued its own alert
            TlsError::UnsupportedSuite(_) | TlsError::SecretExtraction(_) => {
                Some(Alert::InternalError)
            }
            TlsError::BadRecordMac { .. } => Some(Alert::BadRecordMac),
            TlsError::RecordOverflow { .. } => Some(Alert::RecordOverflow),
            TlsError::UnexpectedMessage(_) => Some(Alert::UnexpectedMessage),
            TlsError::Decode(_) => Some(Alert::DecodeError),
            TlsError::PeerAlert(_) => None,
            TlsError::KeyUpdateUnsupported
            | TlsError::SecretMismatch
            | TlsError::SequenceExhausted => Some(Alert::InternalError),
            TlsError::Handshaking
            | TlsError::WriteAfterClose
            | TlsError::Failed(_)
            | TlsError::NotExportable(_) => None,
        }
    }

    /// Short static name used to report later calls on a failed session.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            TlsError::Handshake(_) => "handshake failed",
            TlsError::UnsupportedSuite(_) => "unsupported cipher suite",
            TlsError::SecretExtraction(_) => "secret extraction failed",
            TlsError::BadRecordMac { .. } => "bad record MAC",
            TlsError::RecordOverflow { .. } => "record overflow",
            TlsError::UnexpectedMessage(_) => "unexpected message",
            TlsError::Decode(_) => "malformed message",
            TlsError::PeerAlert(_) => "client sent a fatal alert",
            TlsError::KeyUpdateUnsupported => "KeyUpdate without traffic secrets",
            TlsError::SequenceExhausted => "sequence numbers exhausted",
            TlsError::SecretMismatch => "traffic secret mismatch",
            TlsError::Handshaking => "handshaking",
            TlsError::WriteAfterClose => "write after close",
            TlsError::Failed(k) => k,
            TlsError::NotExportable(_) => "not exportable",
        }
    }
}

/// Why a TLS snapshot (untrusted bytes from the migration channel) was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    #[error("TLS snapshot truncated: {field} needs {need} bytes at offset {at}, only {have} left")]
    Truncated {
        field: &'static str,
        at: usize,
        need: usize,
        have: usize,
    },
    #[error("TLS snapshot version {0} is not supported (this build reads version 1)")]
    Version(u8),
    #[error("TLS snapshot field {field} is invalid: {why}")]
    Invalid {
        field: &'static str,
        why: &'static str,
    },
    #[error("TLS snapshot has {0} trailing bytes after its last field")]
    Trailing(usize),
}

/// Loading a certificate chain and private key failed.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {what} file {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what}: not valid PEM: {why}")]
    Pem { what: String, why: String },
    #[error("{0}: no CERTIFICATE block found")]
    NoCertificate(String),
    #[error("{0}: no private key block found (PKCS#8, PKCS#1 RSA or SEC1 EC PEM expected)")]
    NoKey(String),
    /// A passphrase-protected key (`ENCRYPTED PRIVATE KEY`, or a legacy
    /// `Proc-Type: 4,ENCRYPTED` block): nothing can ask for the passphrase.
    #[error("{0}: the private key is encrypted (passphrase-protected), which is not supported: decrypt it (`openssl pkey -in KEY -out PLAIN_KEY`) and protect the file by its permissions")]
    EncryptedKey(String),
    #[error("certificate and key rejected by rustls: {0}")]
    Rustls(rustls::Error),
}
