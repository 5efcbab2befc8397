//! What the configuration files of hostagent, switchd and the appliance
//! share: explaining their parse errors. No dependencies: it works on the
//! message serde (through toml) writes.
//!
//! TOML puts every key written after a `[table]` or `[[array]]` header into
//! that table, so a top-level key appended at the end of a file (after
//! `[[services]]`, say) is reported as an "unknown field" of that table,
//! which names the table's fields but not the cause. [`misplaced_key_hint`]
//! says when the unknown field is a key of an enclosing level.

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

#[cfg(test)]
mod tests {
    use super::*;

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
