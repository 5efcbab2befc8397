//! What the configuration files of hostagent, switchd and the appliance
//! share: explaining their parse errors. It works on the message serde
//! (through toml) writes; [`parse_error`] makes it one line naming the line
//! of the file it is about, with a hint where the cause is a known slip
//! ([`list_hint`]: `[services]` written for `[[services]]`). Only
//! [`int_in`] (a `deserialize_with` for integer keys whose valid range is
//! narrower than their type) needs serde itself.
//!
//! TOML puts every key written after a `[table]` or `[[array]]` header into
//! that table, so a top-level key appended at the end of a file (after
//! `[[services]]`, say) is reported as an "unknown field" of that table,
//! which names the table's fields but not the cause. [`misplaced_key_hint`]
//! says when the unknown field is a key of an enclosing level.
//!
//! Also what `--check` says of a file the daemon will create:
//! [`missing_dir_reason`].

/// The field a serde "unknown field `x`, expected ..." message names.
pub fn unknown_field(message: &str) -> Option<&str> {
    message
        .split("unknown field `")
        .nth(1)
        .and_then(|rest| rest.split('`').next())
}

/// Where a key belongs, for [`misplaced_key_hint`].
#[derive(Debug, Clone, Copy)]
pub enum Level<'a> {
    /// The file's top level.
    TopLevel,
    /// A `[section]` (e.g. the appliance's `switchd`) whose keys a
    /// subsection (`[[switchd.services]]`) swallows when written after it.
    Section(&'a str),
}

/// When the unknown field of an error `message` is one of `keys` (the keys
/// of `level`), the sentence that explains it: the key was written after a
/// header and so belongs to that header's table. `None` when the message
/// names no unknown field or the field is not one of `keys`.
pub fn misplaced_key_hint(message: &str, keys: &[&str], level: Level) -> Option<String> {
    let field = unknown_field(message).filter(|f| keys.contains(f))?;
    let (what, fix) = match level {
        Level::TopLevel => (
            "a top-level key".to_string(),
            format!("move `{field}` above the first one"),
        ),
        Level::Section(s) => (
            format!("a key of [{s}]"),
            format!("move `{field}` into [{s}], above its first [{s}.*] or [[{s}.*]] header"),
        ),
    };
    Some(format!(
        "`{field}` is {what}: a key written after a [section] or [[section]] header belongs to that section; {fix}"
    ))
}

/// The line of `text` that byte `at` is on: its number (from 1) and its
/// text, trimmed.
pub fn line_at(text: &str, at: usize) -> (usize, &str) {
    let mut at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    let n = text[..at].matches('\n').count() + 1;
    (n, text.lines().nth(n - 1).unwrap_or("").trim())
}

/// When a TOML value that must be a list (an array, or an array of tables)
/// was written as something else, the sentence that names the fix: a
/// `[services]` header is one table where `[[services]]` (one per entry)
/// is meant; `services = { ... }` or `pool = 1` needs brackets. `line` is
/// the file's line the error is about ([`line_at`]); `None` when `message`
/// is not about a missing list or the line is neither a header nor a key.
pub fn list_hint(message: &str, line: &str) -> Option<String> {
    if !(message.contains("expected a sequence") || message.contains("expected an array")) {
        return None;
    }
    let line = line.split(" #").next().unwrap_or(line).trim();
    if let Some(header) = line.strip_prefix('[') {
        // `[[x]]` already is an array of tables: the error is elsewhere.
        if header.starts_with('[') {
            return None;
        }
        let name = header.split(']').next().unwrap_or("").trim();
        return (!name.is_empty()).then(|| {
            format!("`{name}` is a list: write each entry as a [[{name}]] table, not one [{name}]")
        });
    }
    let key = line
        .split('=')
        .next()
        .filter(|_| line.contains('='))?
        .trim();
    (!key.is_empty())
        .then(|| format!("`{key}` is a list: write its value in brackets, {key} = [...]"))
}

/// A TOML parse error as one line: serde's `message` in words
/// ([`plain_types`]), then the line of `text` it is about when toml gives
/// its position `at` (`(line 5: [services])`), then the hint of
/// [`list_hint`] if any (`; ...`). The caller adds hints that need to know
/// its file's keys ([`misplaced_key_hint`]).
pub fn parse_error(message: &str, text: &str, at: Option<usize>) -> String {
    let mut out = plain_types(message, "a table")
        .trim_end()
        .replace('\n', " ");
    if let Some(at) = at {
        let (n, line) = line_at(text, at);
        out.push_str(&format!(" (line {n}: {line})"));
        if let Some(hint) = list_hint(message, line) {
            out.push_str("; ");
            out.push_str(&hint);
        }
    }
    out
}

/// serde `deserialize_with` for an integer key whose valid values are
/// `LO..=HI`, narrower than its type `T` (`server_id`: a `u32`, but 0 is
/// reserved). A value of the wrong kind, or one `T` cannot hold, is
/// refused with `expected an integer from LO to HI`, the range the key's
/// validation states, not the type's (`expected u32` read `expected an
/// integer from 0 to 4294967295`, and 0 was then refused). Values `T`
/// holds are returned as they are: the validation refuses those outside
/// the range, naming the key and why.
pub fn int_in<'de, D, T, const LO: i128, const HI: i128>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: TryFrom<i64> + TryFrom<u64>,
{
    use serde::de::{Error, Unexpected, Visitor};
    struct Range<T, const LO: i128, const HI: i128>(std::marker::PhantomData<T>);
    impl<'de, T, const LO: i128, const HI: i128> Visitor<'de> for Range<T, LO, HI>
    where
        T: TryFrom<i64> + TryFrom<u64>,
    {
        type Value = T;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            write!(f, "an integer from {LO} to {HI}")
        }
        fn visit_i64<E: Error>(self, v: i64) -> Result<T, E> {
            T::try_from(v).map_err(|_| E::invalid_value(Unexpected::Signed(v), &self))
        }
        fn visit_u64<E: Error>(self, v: u64) -> Result<T, E> {
            T::try_from(v).map_err(|_| E::invalid_value(Unexpected::Unsigned(v), &self))
        }
    }
    d.deserialize_any(Range::<T, LO, HI>(std::marker::PhantomData))
}

/// serde's messages name Rust types (`expected u64`, `expected struct
/// PoolMember`, `invalid type: map`); the operator who wrote the value
/// reads the kind of value instead: `a non-negative integer`, `a number`,
/// `an array`, and `object` for a struct or map (`a table` in TOML, `an
/// object` in JSON). The rest of the message is kept as it is.
pub fn plain_types(message: &str, object: &str) -> String {
    fn plain(word: &str) -> Option<&'static str> {
        Some(match word {
            "u8" => "an integer from 0 to 255",
            "u16" => "an integer from 0 to 65535",
            "u32" => "an integer from 0 to 4294967295",
            "u64" | "u128" | "usize" => "a non-negative integer",
            "i8" | "i16" | "i32" | "i64" | "i128" | "isize" => "an integer",
            "f32" | "f64" => "a number",
            "a sequence" => "an array",
            _ => return None,
        })
    }
    let is_word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = String::with_capacity(message.len() + 16);
    let mut rest = message;
    while let Some(i) = rest.find("expected ") {
        let (head, tail) = rest.split_at(i + "expected ".len());
        out.push_str(head);
        if let Some(t) = tail
            .strip_prefix("struct ")
            .or_else(|| tail.strip_prefix("a map"))
        {
            out.push_str(object);
            rest = &t[t.find(|c| !is_word(c)).unwrap_or(t.len())..];
            continue;
        }
        let t = tail.strip_prefix("a ").unwrap_or(tail);
        let n = t.find(|c| !is_word(c)).unwrap_or(t.len());
        let word = &tail[..tail.len() - t.len() + n];
        match plain(word) {
            Some(p) => {
                out.push_str(p);
                rest = &tail[word.len()..];
            }
            None => rest = tail,
        }
    }
    out.push_str(rest);
    out.replace(
        "invalid type: map,",
        &format!(
            "invalid type: {},",
            object.trim_start_matches("a ").trim_start_matches("an ")
        ),
    )
    .replace("invalid type: sequence,", "invalid type: array,")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rust_types_read_as_kinds_of_values() {
        for (m, want) in [
            (
                "invalid type: string \"abc\", expected u64",
                "invalid type: string \"abc\", expected a non-negative integer",
            ),
            (
                "invalid value: integer `70000`, expected u16",
                "invalid value: integer `70000`, expected an integer from 0 to 65535",
            ),
            (
                "invalid type: string \"x\", expected f64",
                "invalid type: string \"x\", expected a number",
            ),
            (
                "invalid type: string \"4\", expected usize",
                "invalid type: string \"4\", expected a non-negative integer",
            ),
            (
                "invalid value: integer `-1`, expected u32",
                "invalid value: integer `-1`, expected an integer from 0 to 4294967295",
            ),
            (
                "invalid type: integer `1`, expected struct PoolMember",
                "invalid type: integer `1`, expected a table",
            ),
            (
                "invalid type: map, expected a sequence",
                "invalid type: table, expected an array",
            ),
            (
                "invalid type: sequence, expected a map",
                "invalid type: array, expected a table",
            ),
            // Already plain: unchanged.
            (
                "invalid type: string \"yes\", expected a boolean",
                "invalid type: string \"yes\", expected a boolean",
            ),
            (
                "unknown variant `x`, expected `client` or `server`",
                "unknown variant `x`, expected `client` or `server`",
            ),
            ("missing field `vip`", "missing field `vip`"),
            ("expected u64x", "expected u64x"),
            ("", ""),
        ] {
            assert_eq!(plain_types(m, "a table"), want, "{m}");
        }
        assert_eq!(
            plain_types(
                "invalid type: integer `1`, expected struct Service",
                "an object"
            ),
            "invalid type: integer `1`, expected an object"
        );
    }

    #[test]
    fn a_table_for_a_list_names_the_fix() {
        let m = "invalid type: map, expected a sequence";
        assert_eq!(
            list_hint(m, "[services]").as_deref(),
            Some("`services` is a list: write each entry as a [[services]] table, not one [services]")
        );
        // Nested (the appliance's [switchd] section), a comment, and the
        // message already in words.
        assert_eq!(
            list_hint("invalid type: table, expected an array", "[switchd.services]  # web").as_deref(),
            Some("`switchd.services` is a list: write each entry as a [[switchd.services]] table, not one [switchd.services]")
        );
        assert_eq!(
            list_hint("invalid type: integer `1`, expected a sequence", "pool = 1").as_deref(),
            Some("`pool` is a list: write its value in brackets, pool = [...]")
        );
        // Not about a list, or the line already is an array of tables.
        assert_eq!(
            list_hint("invalid type: map, expected a string", "[services]"),
            None
        );
        assert_eq!(list_hint(m, "[[services]]"), None);
        assert_eq!(list_hint(m, ""), None);
    }

    #[test]
    fn parse_errors_are_one_line_naming_the_line() {
        let text = "a = 1\n\n[services]\nname = \"web\"\n";
        let at = text.find("[services]").unwrap();
        assert_eq!(line_at(text, at), (3, "[services]"));
        assert_eq!(
            parse_error("invalid type: map, expected a sequence\n", text, Some(at)),
            "invalid type: table, expected an array (line 3: [services]); \
             `services` is a list: write each entry as a [[services]] table, not one [services]"
        );
        assert_eq!(
            parse_error(
                "invalid type: string \"x\", expected u16",
                "p = \"x\"",
                Some(4)
            ),
            "invalid type: string \"x\", expected an integer from 0 to 65535 (line 1: p = \"x\")"
        );
        assert_eq!(
            parse_error("missing field `vip`", text, None),
            "missing field `vip`"
        );
        // A position past the end (or inside a character) still names a line.
        assert_eq!(line_at("é", 1), (1, "é"));
        assert_eq!(line_at("x\n", 99), (2, ""));
    }

    #[test]
    fn ranged_integers_name_their_range() {
        #[derive(Debug, serde::Deserialize)]
        struct Control {
            #[serde(deserialize_with = "int_in::<_, _, 1, 4294967295>")]
            server_id: u32,
            #[serde(default, deserialize_with = "int_in::<_, _, 1, 100>")]
            fall: u8,
        }
        let parse = |t: &str| {
            toml::from_str::<Control>(t)
                .map(|c| (c.server_id, c.fall))
                .map_err(|e| e.message().to_string())
        };
        assert_eq!(parse("server_id = 7\nfall = 3"), Ok((7, 3)));
        // 0 fits the type: the key's validation refuses it, by name.
        assert_eq!(parse("server_id = 0\nfall = 0"), Ok((0, 0)));
        for (t, e) in [
            (
                "server_id = \"1\"",
                "invalid type: string \"1\", expected an integer from 1 to 4294967295",
            ),
            (
                "server_id = -1",
                "invalid value: integer `-1`, expected an integer from 1 to 4294967295",
            ),
            (
                "server_id = 5000000000",
                "invalid value: integer `5000000000`, expected an integer from 1 to 4294967295",
            ),
            (
                "server_id = 1.5",
                "invalid type: floating point `1.5`, expected an integer from 1 to 4294967295",
            ),
            (
                "server_id = 1\nfall = 256",
                "invalid value: integer `256`, expected an integer from 1 to 100",
            ),
        ] {
            assert_eq!(parse(t), Err(e.to_string()), "{t}");
        }
    }

    const KEYS: &[&str] = &["name", "placement"];

    #[test]
    fn names_the_unknown_field() {
        let m = "unknown field `name`, expected one of `vip`, `port`";
        assert_eq!(unknown_field(m), Some("name"));
        assert_eq!(
            unknown_field("invalid type: string \"x\", expected u16"),
            None
        );
        assert_eq!(unknown_field("unknown field `"), Some(""));
    }

    #[test]
    fn a_top_level_key_after_a_table_is_explained() {
        let m = "unknown field `name`, expected one of `vip`, `port`";
        let h = misplaced_key_hint(m, KEYS, Level::TopLevel).unwrap();
        assert_eq!(
            h,
            "`name` is a top-level key: a key written after a [section] or [[section]] \
             header belongs to that section; move `name` above the first one"
        );
    }

    #[test]
    fn a_section_key_after_a_subsection_is_explained() {
        let m = "unknown field `placement`, expected one of `name`, `vip`";
        let h = misplaced_key_hint(m, KEYS, Level::Section("switchd")).unwrap();
        assert!(h.starts_with("`placement` is a key of [switchd]: "), "{h}");
        assert!(
            h.ends_with("move `placement` into [switchd], above its first [switchd.*] or [[switchd.*]] header"),
            "{h}"
        );
    }

    #[test]
    fn other_errors_get_no_hint() {
        // A key unknown at every level, and errors that are not about keys.
        for m in [
            "unknown field `nme`, expected one of `vip`",
            "invalid type: integer `5`, expected a string",
            "missing field `vip`",
            "",
        ] {
            assert_eq!(misplaced_key_hint(m, KEYS, Level::TopLevel), None, "{m}");
        }
    }
}

/// Why a file cannot be created in `dir` (the daemons create files, not
/// directories): `None` when `dir` is a directory, else `directory DIR
/// does not exist` or `DIR is not a directory`.
pub fn missing_dir_reason(dir: &std::path::Path) -> Option<String> {
    if dir.is_dir() {
        None
    } else if dir.exists() {
        Some(format!("{} is not a directory", dir.display()))
    } else {
        Some(format!("directory {} does not exist", dir.display()))
    }
}

#[cfg(test)]
mod dir_tests {
    use super::missing_dir_reason;

    #[test]
    fn missing_dir_reason_says_what_is_there() {
        let tmp = std::env::temp_dir();
        assert_eq!(missing_dir_reason(&tmp), None);
        let file = tmp.join(format!("confkit-file-{}", std::process::id()));
        std::fs::write(&file, "").unwrap();
        assert_eq!(
            missing_dir_reason(&file),
            Some(format!("{} is not a directory", file.display()))
        );
        let _ = std::fs::remove_file(&file);
        let gone = tmp.join("confkit-no-such-dir/sub");
        assert_eq!(
            missing_dir_reason(&gone),
            Some(format!("directory {} does not exist", gone.display()))
        );
    }
}

/// The warning a daemon logs for a deployment key file that group or
/// others may read (like ssh for a private key): one line naming the file,
/// its mode and the fix. `None` when only the owner has access, or when the
/// file's mode cannot be read (reading the key reports that). Not a
/// refusal: existing deployments with a 0644 key keep running.
pub fn key_file_mode_warning(path: &std::path::Path) -> Option<String> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(path).ok()?.permissions().mode() & 0o777;
        (mode & 0o077 != 0).then(|| {
            format!(
                "warning: deployment key file {} is readable by group/others (mode {mode:04o}): \
                 anyone who reads it can forge migrations; run chmod 600 {}",
                path.display(),
                path.display()
            )
        })
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        None
    }
}

#[cfg(all(test, unix))]
mod key_mode_tests {
    use super::key_file_mode_warning;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_key_file_others_may_read_is_named_with_its_mode() {
        let f = std::env::temp_dir().join(format!("confkit-key-{}", std::process::id()));
        std::fs::write(&f, "00112233445566778899aabbccddeeff").unwrap();
        let set = |m| std::fs::set_permissions(&f, std::fs::Permissions::from_mode(m)).unwrap();
        set(0o644);
        let w = key_file_mode_warning(&f).expect("0644 warns");
        assert!(w.contains(&f.display().to_string()), "{w}");
        assert!(w.contains("mode 0644"), "{w}");
        assert!(w.contains("chmod 600"), "{w}");
        set(0o640);
        assert!(key_file_mode_warning(&f).unwrap().contains("mode 0640"));
        for quiet in [0o600, 0o400] {
            set(quiet);
            assert_eq!(key_file_mode_warning(&f), None, "{quiet:o}");
        }
        assert_eq!(key_file_mode_warning(&f.with_extension("gone")), None);
        let _ = std::fs::remove_file(&f);
    }
}
