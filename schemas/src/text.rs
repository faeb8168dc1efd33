//! Untrusted text on the terminal: names read from model files, probes and plans (tensor
//! names, device names, model names) may hold control bytes — an escape sequence that
//! recolours or clears the terminal, a carriage return that overwrites a line, a bidi
//! override that reorders it. [`for_terminal`] is the one function every human-readable
//! message and report passes through before it is printed.
//! Invariant: its output holds no control character other than `\n` and `\t`, no bidi
//! control, and reads the same as its input when the input had none of them.

use std::borrow::Cow;
use std::fmt::Write;

/// Characters that are shown escaped: C0 controls (but `\n` and `\t`), DEL, C1 controls and
/// the bidirectional-text controls.
fn hidden(c: char) -> bool {
    (c.is_control() && c != '\n' && c != '\t')
        || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `s` with every control character except newline and tab (and every bidi control)
/// written as an escape (`\x1b`, `\r`, `\u{202e}`), so printing it cannot drive the
/// terminal. Borrowed when there is nothing to escape.
pub fn for_terminal(s: &str) -> Cow<'_, str> {
    if !s.chars().any(hidden) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if !hidden(c) {
            out.push(c);
            continue;
        }
        match c {
            '\r' => out.push_str("\\r"),
            '\0' => out.push_str("\\0"),
            c if (c as u32) < 0x100 => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
        }
    }
    Cow::Owned(out)
}

/// A single-line name (tensor, device, model) for a message: [`for_terminal`] plus escaped
/// newlines and tabs, so a name cannot start a line of its own.
pub fn name(s: &str) -> Cow<'_, str> {
    if !s.contains(['\n', '\t']) {
        return for_terminal(s);
    }
    Cow::Owned(for_terminal(s).replace('\n', "\\n").replace('\t', "\\t"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn control_bytes_are_escaped_and_plain_text_is_untouched() {
        assert!(matches!(
            for_terminal("blk.0.attn_q.weight"),
            Cow::Borrowed(_)
        ));
        assert_eq!(for_terminal("a\nb\tc"), "a\nb\tc");
        assert_eq!(for_terminal("\x1b[2Jgpu\r\x07"), "\\x1b[2Jgpu\\r\\x07");
        assert_eq!(for_terminal("x\u{202e}y\u{9b}z\0"), "x\\u{202e}y\\x9bz\\0");
        assert_eq!(for_terminal("Ünïcode ✓ 日本"), "Ünïcode ✓ 日本");
        assert_eq!(name("two\nlines\tx\x1b"), "two\\nlines\\tx\\x1b");
    }

    proptest! {
        #[test]
        fn output_never_holds_a_hidden_character(s in any::<String>()) {
            let t = for_terminal(&s);
            prop_assert!(!t.chars().any(hidden));
            let n = name(&s);
            prop_assert!(!n.chars().any(|c| hidden(c) || c == '\n' || c == '\t'));
            if !s.chars().any(hidden) {
                prop_assert_eq!(t.as_ref(), s.as_str());
            }
        }
    }
}
