//! The reasoning split of chat output: text inside `<think>...</think>` (Qwen3, DeepSeek-R1
//! style) is reasoning (`reasoning_content`), the rest is the answer (`content`).
//! Invariant: fed any split of the same text, [`ReasoningSplit`] yields the same reasoning and
//! content (a tag cut across chunks is held back until it is whole), and no output byte is
//! lost except the tags themselves and whitespace around them.

/// Opens a reasoning block.
pub const THINK_OPEN: &str = "<think>";
/// Closes a reasoning block.
pub const THINK_CLOSE: &str = "</think>";

/// `--reasoning-format` / the request's `reasoning_format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReasoningFormat {
    /// Split when the chat template mentions `<think>`.
    #[default]
    Auto,
    /// Always split `<think>` blocks into `reasoning_content` (llama-server's `deepseek`).
    Deepseek,
    /// Never split: the think block stays in `content`.
    None,
}

impl ReasoningFormat {
    /// The value of its name (`auto`, `deepseek`, `none`).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "auto" => Some(Self::Auto),
            "deepseek" => Some(Self::Deepseek),
            "none" => Some(Self::None),
            _ => None,
        }
    }

    /// Whether output is split, given whether the template mentions `<think>`.
    pub fn splits(self, template_thinks: bool) -> bool {
        match self {
            Self::Auto => template_thinks,
            Self::Deepseek => true,
            Self::None => false,
        }
    }
}

/// A piece of output, by kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace seen: the output may still open a think block.
    Start,
    Think,
    Content,
}

/// Length of the longest proper prefix of `tag` that `s` ends with (0 when none).
pub(crate) fn partial_tag(s: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&k| s.ends_with(&tag[..k]))
        .unwrap_or(0)
}

/// Incremental splitter of one choice's output.
#[derive(Debug, Clone)]
pub struct ReasoningSplit {
    state: State,
    buf: String,
    /// Leading whitespace of the current block is still to be dropped.
    fresh: bool,
}

impl ReasoningSplit {
    /// `opened`: the prompt already opened the think block (a template whose generation
    /// prompt ends with `<think>`), so output starts as reasoning.
    pub fn new(opened: bool) -> Self {
        Self {
            state: if opened { State::Think } else { State::Start },
            buf: String::new(),
            fresh: true,
        }
    }

    /// Whether the output so far is inside the think block.
    pub fn thinking(&self) -> bool {
        self.state == State::Think
    }

    /// Take more output; pieces that are certain go to `out`.
    pub fn push(&mut self, text: &str, out: &mut Vec<Piece>) {
        self.buf.push_str(text);
        loop {
            if self.fresh {
                let t = self.buf.trim_start();
                if t.is_empty() {
                    self.buf.clear();
                    return;
                }
                if t.len() != self.buf.len() {
                    self.buf = t.to_string();
                }
            }
            match self.state {
                State::Start => {
                    if let Some(rest) = self.buf.strip_prefix(THINK_OPEN) {
                        self.buf = rest.to_string();
                        self.state = State::Think;
                        self.fresh = true;
                        continue;
                    }
                    if THINK_OPEN.starts_with(self.buf.as_str()) {
                        return;
                    }
                    self.state = State::Content;
                    self.fresh = false;
                }
                State::Think => {
                    self.fresh = false;
                    if let Some(i) = self.buf.find(THINK_CLOSE) {
                        let r = self.buf[..i].trim_end();
                        if !r.is_empty() {
                            out.push(Piece::Reasoning(r.to_string()));
                        }
                        self.buf = self.buf[i + THINK_CLOSE.len()..].to_string();
                        self.state = State::Content;
                        self.fresh = true;
                        continue;
                    }
                    // Hold a possible start of the closing tag and the whitespace before it.
                    let p = partial_tag(&self.buf, THINK_CLOSE);
                    let cut = self.buf[..self.buf.len() - p].trim_end().len();
                    if cut > 0 {
                        out.push(Piece::Reasoning(self.buf[..cut].to_string()));
                        self.buf.drain(..cut);
                    }
                    return;
                }
                State::Content => {
                    self.fresh = false;
                    if !self.buf.is_empty() {
                        out.push(Piece::Content(std::mem::take(&mut self.buf)));
                    }
                    return;
                }
            }
        }
    }

    /// The output ended: whatever is held goes out.
    pub fn finish(&mut self, out: &mut Vec<Piece>) {
        let rest = std::mem::take(&mut self.buf);
        match self.state {
            State::Think => {
                let r = rest.trim_end();
                if !r.is_empty() {
                    out.push(Piece::Reasoning(r.to_string()));
                }
            }
            State::Start | State::Content => {
                if !rest.is_empty() {
                    out.push(Piece::Content(rest));
                }
            }
        }
    }
}

/// Whether a whole output should be read as already inside a think block: the prompt opened
/// it, or the output does not open one but closes one (a template that opened it in a way
/// not recognised).
pub fn opened_in_whole(text: &str, prompt_opened: bool) -> bool {
    prompt_opened || (!text.trim_start().starts_with(THINK_OPEN) && text.contains(THINK_CLOSE))
}

/// Whether a rendered prompt ends inside an open think block.
pub fn prompt_opens_think(prompt: &str) -> bool {
    let t = prompt.trim_end();
    t.ends_with(THINK_OPEN)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (reasoning, content) of `text` fed in the given chunks.
    fn run(chunks: &[&str], opened: bool) -> (String, String) {
        let mut s = ReasoningSplit::new(opened);
        let mut out = Vec::new();
        for c in chunks {
            s.push(c, &mut out);
        }
        s.finish(&mut out);
        let (mut r, mut c) = (String::new(), String::new());
        for p in out {
            match p {
                Piece::Reasoning(t) => r.push_str(&t),
                Piece::Content(t) => c.push_str(&t),
            }
        }
        (r, c)
    }

    /// Every split of `text` into three chunks gives `want`.
    fn all_splits(text: &str, opened: bool, want: (&str, &str)) {
        let idx: Vec<usize> = (0..=text.len())
            .filter(|&i| text.is_char_boundary(i))
            .collect();
        for &a in &idx {
            for &b in idx.iter().filter(|&&b| b >= a) {
                let got = run(&[&text[..a], &text[a..b], &text[b..]], opened);
                assert_eq!(
                    (got.0.as_str(), got.1.as_str()),
                    want,
                    "{text:?} split at {a},{b}"
                );
            }
        }
        // One byte... one character at a time.
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
        let got = run(&refs, opened);
        assert_eq!((got.0.as_str(), got.1.as_str()), want, "{text:?} by chars");
    }

    #[test]
    fn think_block_splits_at_any_chunking() {
        all_splits(
            "<think>\nLet me see: 2+2.\n</think>\n\nIt is 4.",
            false,
            ("Let me see: 2+2.", "It is 4."),
        );
        all_splits("  <think>a</think>b", false, ("a", "b"));
        all_splits("plain answer", false, ("", "plain answer"));
        all_splits("<thin", false, ("", "<thin"));
        all_splits(
            "<think>unfinished thought",
            false,
            ("unfinished thought", ""),
        );
        all_splits("a <think>b</think>", false, ("", "a <think>b</think>"));
        // Multi-byte text near the tags.
        all_splits("<think>é…ü</think>ß", false, ("é…ü", "ß"));
    }

    #[test]
    fn prompt_opened_block_reads_as_reasoning_until_the_close() {
        all_splits(
            "step one\nstep two\n</think>\n\nanswer",
            true,
            ("step one\nstep two", "answer"),
        );
        all_splits("<< not a tag </think>x", true, ("<< not a tag", "x"));
        all_splits("no close at all", true, ("no close at all", ""));
        assert!(prompt_opens_think("<|im_start|>assistant\n<think>\n"));
        assert!(!prompt_opens_think(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        ));
        assert!(opened_in_whole("thought</think>answer", false));
        assert!(!opened_in_whole("<think>t</think>a", false));
        assert!(!opened_in_whole("just text", false));
    }

    #[test]
    fn streaming_releases_reasoning_before_the_block_ends() {
        let mut s = ReasoningSplit::new(false);
        let mut out = Vec::new();
        s.push("<think>\nfirst", &mut out);
        assert_eq!(out, vec![Piece::Reasoning("first".into())]);
        assert!(s.thinking());
        out.clear();
        s.push(" words </th", &mut out);
        assert_eq!(out, vec![Piece::Reasoning(" words".into())]);
        out.clear();
        s.push("ink>\n\nHi", &mut out);
        assert_eq!(out, vec![Piece::Content("Hi".into())]);
        assert_eq!(
            ReasoningFormat::parse("deepseek"),
            Some(ReasoningFormat::Deepseek)
        );
        assert!(ReasoningFormat::Auto.splits(true) && !ReasoningFormat::Auto.splits(false));
        assert!(!ReasoningFormat::None.splits(true));
    }
}
