//! Chat templates: the model's own Jinja template (from `tokenizer_config.json` or the
//! GGUF's `tokenizer.chat_template`) rendered with minijinja and Python-compatible string
//! methods, so `message.content.strip()` and `raise_exception(...)` work as in transformers.
//! Invariant: a template is compiled once at start-up; rendering never pastes strings by
//! hand, and a template error is a 400 for that request, never a crash.

use super::openai::ChatMessage;
use minijinja::{context, Environment, Error, ErrorKind};

/// ChatML, used only when the model ships no template but its vocabulary has `<|im_start|>`.
pub const CHATML: &str = "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// A compiled chat template with the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

fn raise_exception(msg: String) -> Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

fn strftime_now(fmt: String) -> String {
    // Templates use it for "today's date" lines; a fixed UTC rendering of the common
    // formats keeps prompts deterministic enough and needs no time-zone database.
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let days = (secs / 86_400) as i64;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    fmt.replace("%d", &format!("{d:02}"))
        .replace("%m", &format!("{m:02}"))
        .replace("%Y", &y.to_string())
        .replace("%B", MONTHS[(m - 1) as usize])
        .replace("%b", &MONTHS[(m - 1) as usize][..3])
}

impl ChatTemplate {
    /// Compile `source`; `bos`/`eos` are exposed to it as `bos_token`/`eos_token`.
    pub fn new(source: &str, bos: Option<String>, eos: Option<String>) -> Result<Self, String> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| format!("the chat template does not compile: {e}"))?;
        Ok(Self {
            env,
            bos: bos.unwrap_or_default(),
            eos: eos.unwrap_or_default(),
        })
    }

    /// The prompt for `messages`, ending with the assistant's turn opener when
    /// `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| format!("chat template: {e}"))?;
        t.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos,
            eos_token => self.eos,
        })
        .map_err(|e| match e.kind() {
            ErrorKind::InvalidOperation => format!(
                "the model's chat template refused these messages: {}",
                e.detail().unwrap_or("no reason given")
            ),
            _ => format!("the model's chat template failed on these messages: {e}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            name: None,
        }
    }

    #[test]
    fn fixture_template_renders_chatml_with_default_system() {
        let cfg: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../tests/data/tiny-chat/tokenizer_config.json"
            ))
            .unwrap(),
        )
        .unwrap();
        let t = ChatTemplate::new(
            cfg["chat_template"].as_str().unwrap(),
            None,
            Some("<|im_end|>".into()),
        )
        .unwrap();
        let out = t.render(&[msg("user", "  Hi there \n")], true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
        );
        let out = t
            .render(&[msg("system", "S"), msg("user", "U")], false)
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
        );
    }

    #[test]
    fn template_errors_are_messages_not_panics() {
        let t = ChatTemplate::new(
            "{% if messages[0].role == 'assistant' %}{{ raise_exception('first message must be user') }}{% endif %}{{ bos_token }}x",
            Some("<s>".into()),
            None,
        )
        .unwrap();
        let e = t.render(&[msg("assistant", "a")], true).unwrap_err();
        assert!(e.contains("first message must be user"), "{e}");
        assert_eq!(t.render(&[msg("user", "a")], true).unwrap(), "<s>x");
        assert!(ChatTemplate::new("{% for %}", None, None).is_err());
        let d = strftime_now("%d %B %Y".into());
        assert!(d.len() >= 10 && d.contains("20"), "{d}");
    }
}
