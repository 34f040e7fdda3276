//! When a generation ends, and how much of its text may be streamed before it does.

use std::collections::HashSet;

use crate::params::SamplingParams;

/// Why a generation ended: the one finish reason of the server, from the engine's token-level
/// stop through the stop strings to the HTTP responses.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// End-of-sequence token or a stop token.
    Stop,
    /// One of the `stop` strings matched (the string itself).
    StopSequence(String),
    /// `max_tokens` or the context limit.
    Length,
    /// Ended by the server (shutdown, cancelled) before a stop or the limit.
    Abort,
}

impl FinishReason {
    /// The OpenAI spelling (a stop string is `stop`).
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Stop | FinishReason::StopSequence(_) => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

impl std::fmt::Display for FinishReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What exactly stopped a generation with [`FinishReason::Stop`] or
/// [`FinishReason::StopSequence`] (vLLM's `stop_reason`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// The end-of-sequence token or one of `stop_token_ids`.
    Token(u32),
    /// One of the `stop` strings.
    Text(String),
}

/// Verdict on a freshly sampled token, before its text is looked at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenVerdict {
    /// Detokenize the token and pass its text to [`StopChecker::push_text`].
    Continue,
    /// An eos / stop token: the generation ends with `stop`. Its text belongs to the output only when
    /// `emit_text` (`include_stop_str_in_output`); either way call [`StopChecker::flush`] afterwards.
    StopToken { emit_text: bool },
    /// The token limit is reached: push this token's text (it may still complete a stop string,
    /// which then wins), then [`StopChecker::flush`]; the generation ends with `length` unless a
    /// stop string matched.
    LastToken,
}

/// Text released by one [`StopChecker::push_text`] call.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TextStep {
    /// Safe to stream now.
    pub text: String,
    /// A stop string matched: the generation is over and `text` is its last piece.
    pub stopped: bool,
}

/// Stop-token, token-limit and stop-string logic of one request.
///
/// Text arrives in arbitrary deltas. A suffix that could still turn into a stop string is held
/// back; the result is the same for every chunking of the same text: the output ends right before
/// the stop string whose end comes first (or right after it with `include_stop_str_in_output`).
#[derive(Debug, Clone)]
pub struct StopChecker {
    stop_strings: Vec<String>,
    stop_tokens: HashSet<u32>,
    include_stop_str: bool,
    max_tokens: Option<usize>,
    generated: usize,
    /// Received text not yet released: always a (possibly empty) proper prefix of some stop string
    /// between calls.
    held: String,
    finish: Option<FinishReason>,
    stop_reason: Option<StopReason>,
}

impl StopChecker {
    /// `eos_token_ids` stop the generation unless `ignore_eos`; `stop_token_ids` always do.
    pub fn new(params: &SamplingParams, eos_token_ids: &[u32]) -> Self {
        let mut stop_tokens: HashSet<u32> = params.stop_token_ids.iter().copied().collect();
        if !params.ignore_eos {
            stop_tokens.extend(eos_token_ids.iter().copied());
        }
        Self {
            stop_strings: params
                .stop
                .iter()
                .filter(|s| !s.is_empty())
                .cloned()
                .collect(),
            stop_tokens,
            include_stop_str: params.include_stop_str_in_output,
            max_tokens: params.max_tokens.map(|m| m as usize),
            generated: 0,
            held: String::new(),
            finish: None,
            stop_reason: None,
        }
    }

    /// Counts a sampled token and says what to do with it. Stop tokens take precedence over the
    /// token limit (a natural end on the last allowed token is `stop`).
    pub fn on_token(&mut self, token: u32) -> TokenVerdict {
        if self.finish.is_some() {
            return TokenVerdict::StopToken { emit_text: false };
        }
        self.generated += 1;
        if self.stop_tokens.contains(&token) {
            self.finish = Some(FinishReason::Stop);
            self.stop_reason = Some(StopReason::Token(token));
            return TokenVerdict::StopToken {
                emit_text: self.include_stop_str,
            };
        }
        if self.max_tokens.is_some_and(|m| self.generated >= m) {
            self.finish = Some(FinishReason::Length);
            return TokenVerdict::LastToken;
        }
        TokenVerdict::Continue
    }

    /// Feeds newly detokenized text; returns what may be streamed now. After a stop string matched,
    /// further text is ignored.
    pub fn push_text(&mut self, delta: &str) -> TextStep {
        if self.stop_reason.is_some() {
            return TextStep {
                text: String::new(),
                stopped: true,
            };
        }
        if self.stop_strings.is_empty() {
            return TextStep {
                text: delta.to_string(),
                stopped: false,
            };
        }
        self.held.push_str(delta);
        if let Some((start, end, which)) = self.first_match() {
            let cut = if self.include_stop_str { end } else { start };
            let text = self.held[..cut].to_string();
            self.stop_reason = Some(StopReason::Text(self.stop_strings[which].clone()));
            self.finish = Some(FinishReason::Stop);
            self.held.clear();
            return TextStep {
                text,
                stopped: true,
            };
        }
        let keep = self.longest_stop_prefix_suffix();
        let release = self.held.len() - keep;
        let text = self.held[..release].to_string();
        self.held.drain(..release);
        TextStep {
            text,
            stopped: false,
        }
    }

    /// Releases held-back text when the generation ends for a reason other than a stop string
    /// (stop token, token limit, abort): that text can no longer become a stop string.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Ends the generation from outside (abort, context limit) unless it already ended.
    pub fn finish_with(&mut self, reason: FinishReason) {
        self.finish.get_or_insert(reason);
    }

    /// `Some` once the generation is over. A stop string that matches on the last allowed token
    /// turns `length` into `stop`.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        match &self.stop_reason {
            Some(StopReason::Text(s)) => Some(FinishReason::StopSequence(s.clone())),
            Some(StopReason::Token(_)) => Some(FinishReason::Stop),
            None => self.finish.clone(),
        }
    }

    pub fn stop_reason(&self) -> Option<&StopReason> {
        self.stop_reason.as_ref()
    }

    pub fn is_finished(&self) -> bool {
        self.finish_reason().is_some()
    }

    /// Tokens counted so far.
    pub fn generated_tokens(&self) -> usize {
        self.generated
    }

    /// The stop-string match in `held` that ends first (ties: the longer one, which starts first).
    /// Earliest end is what a character-by-character stream would see first, hence chunking-invariant.
    fn first_match(&self) -> Option<(usize, usize, usize)> {
        let mut best: Option<(usize, usize, usize)> = None;
        for (i, s) in self.stop_strings.iter().enumerate() {
            if let Some(start) = self.held.find(s.as_str()) {
                let end = start + s.len();
                let better = match best {
                    None => true,
                    Some((bs, be, _)) => end < be || (end == be && start < bs),
                };
                if better {
                    best = Some((start, end, i));
                }
            }
        }
        best
    }

    /// Length of the longest suffix of `held` that is a proper prefix of some stop string.
    fn longest_stop_prefix_suffix(&self) -> usize {
        let held = self.held.as_bytes();
        let mut longest = 0;
        for s in &self.stop_strings {
            let s = s.as_bytes();
            let max = (s.len() - 1).min(held.len());
            for len in (longest + 1..=max).rev() {
                if held[held.len() - len..] == s[..len]
                    && self.held.is_char_boundary(self.held.len() - len)
                {
                    longest = len;
                    break;
                }
            }
        }
        longest
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn checker(stop: &[&str], include: bool) -> StopChecker {
        let params = SamplingParams {
            stop: stop.iter().map(|s| s.to_string()).collect(),
            include_stop_str_in_output: include,
            ..Default::default()
        };
        StopChecker::new(&params, &[])
    }

    /// Streams `text` in the given chunk sizes (cycled); returns the output and whether it stopped.
    fn stream(c: &mut StopChecker, text: &str, sizes: &[usize]) -> (String, bool) {
        let chars: Vec<char> = text.chars().collect();
        let mut out = String::new();
        let mut i = 0;
        let mut k = 0;
        while i < chars.len() {
            let n = sizes[k % sizes.len()].max(1).min(chars.len() - i);
            k += 1;
            let piece: String = chars[i..i + n].iter().collect();
            i += n;
            let step = c.push_text(&piece);
            out.push_str(&step.text);
            if step.stopped {
                return (out, true);
            }
        }
        out.push_str(&c.flush());
        (out, false)
    }

    /// What the output must be: the text up to the stop string that ends first.
    fn reference(text: &str, stops: &[&str], include: bool) -> (String, bool) {
        let mut best: Option<(usize, usize)> = None;
        for s in stops {
            if let Some(start) = text.find(s) {
                let end = start + s.len();
                if best.is_none_or(|(bs, be)| end < be || (end == be && start < bs)) {
                    best = Some((start, end));
                }
            }
        }
        match best {
            Some((start, end)) => (text[..if include { end } else { start }].to_string(), true),
            None => (text.to_string(), false),
        }
    }

    #[test]
    fn holds_back_possible_stop_prefixes() {
        let mut c = checker(&["STOP"], false);
        assert_eq!(c.push_text("abc ST").text, "abc ");
        assert_eq!(c.push_text("O").text, "");
        let step = c.push_text("Px");
        assert_eq!(
            step,
            TextStep {
                text: String::new(),
                stopped: true
            }
        );
        assert_eq!(
            c.finish_reason(),
            Some(FinishReason::StopSequence("STOP".into()))
        );
        assert_eq!(c.stop_reason(), Some(&StopReason::Text("STOP".into())));
        assert!(c.push_text("more").text.is_empty());

        let mut c = checker(&["STOP"], false);
        assert_eq!(c.push_text("ST").text, "");
        assert_eq!(c.push_text("ay").text, "STay", "false alarm is released");
    }

    #[test]
    fn include_stop_str_keeps_the_match() {
        let mut c = checker(&["</s>"], true);
        let (out, stopped) = stream(&mut c, "hello</s> world", &[2]);
        assert_eq!((out.as_str(), stopped), ("hello</s>", true));
    }

    #[test]
    fn overlapping_stops_pick_the_earliest_end() {
        for sizes in [[1usize], [2], [4], [100]] {
            let mut c = checker(&["abcd", "bc"], false);
            assert_eq!(stream(&mut c, "xabcd", &sizes), ("xa".to_string(), true));
        }
    }

    #[test]
    fn multibyte_stops_and_text() {
        let mut c = checker(&["停止"], false);
        assert_eq!(
            stream(&mut c, "héllo 停 停止 more", &[1, 2]),
            ("héllo 停 ".to_string(), true)
        );
    }

    #[test]
    fn stop_tokens_eos_and_length() {
        let params = SamplingParams {
            stop_token_ids: vec![7],
            max_tokens: Some(3),
            ..Default::default()
        };
        let mut c = StopChecker::new(&params, &[2]);
        assert_eq!(c.on_token(5), TokenVerdict::Continue);
        assert_eq!(c.on_token(2), TokenVerdict::StopToken { emit_text: false });
        assert_eq!(c.finish_reason(), Some(FinishReason::Stop));
        assert_eq!(c.stop_reason(), Some(&StopReason::Token(2)));

        let ignore = SamplingParams {
            ignore_eos: true,
            include_stop_str_in_output: true,
            ..params.clone()
        };
        let mut c = StopChecker::new(&ignore, &[2]);
        assert_eq!(c.on_token(2), TokenVerdict::Continue, "eos ignored");
        assert_eq!(c.on_token(7), TokenVerdict::StopToken { emit_text: true });

        let mut c = StopChecker::new(&params, &[2]);
        c.on_token(1);
        c.on_token(1);
        assert_eq!(
            c.on_token(7),
            TokenVerdict::StopToken { emit_text: false },
            "stop token beats length"
        );

        let mut c = StopChecker::new(&params, &[2]);
        c.on_token(1);
        c.on_token(1);
        assert_eq!(c.on_token(1), TokenVerdict::LastToken);
        assert_eq!(c.finish_reason(), Some(FinishReason::Length));
        assert_eq!(c.generated_tokens(), 3);
    }

    #[test]
    fn stop_string_on_the_last_token_turns_length_into_stop() {
        let params = SamplingParams {
            stop: vec!["END".into()],
            max_tokens: Some(2),
            ..Default::default()
        };
        let mut c = StopChecker::new(&params, &[]);
        c.on_token(1);
        assert_eq!(c.push_text("ok E").text, "ok ");
        assert_eq!(c.on_token(1), TokenVerdict::LastToken);
        assert!(c.push_text("ND").stopped);
        assert_eq!(
            c.finish_reason(),
            Some(FinishReason::StopSequence("END".into()))
        );

        let mut c = StopChecker::new(&params, &[]);
        c.on_token(1);
        c.push_text("ok E");
        c.on_token(1);
        assert_eq!(
            c.push_text("N"),
            TextStep {
                text: String::new(),
                stopped: false
            }
        );
        assert_eq!(c.flush(), "EN", "held text is released at the end");
        assert_eq!(c.finish_reason(), Some(FinishReason::Length));
    }

    #[test]
    fn finish_reason_strings() {
        let all = [
            (FinishReason::Stop, "stop"),
            (FinishReason::StopSequence("END".into()), "stop"),
            (FinishReason::Length, "length"),
            (FinishReason::Abort, "abort"),
        ];
        for (r, s) in all {
            assert_eq!(r.as_str(), s);
            assert_eq!(r.to_string(), s);
        }
        let mut c = checker(&[], false);
        c.finish_with(FinishReason::Abort);
        c.finish_with(FinishReason::Length);
        assert_eq!(c.finish_reason(), Some(FinishReason::Abort));
    }

    fn text_strategy() -> impl Strategy<Value = String> {
        // A small alphabet (with a multi-byte char) makes stop strings and near-misses frequent.
        prop::collection::vec(
            prop::sample::select(vec!['a', 'b', 'c', 'é', '<', '|', '>']),
            0..40,
        )
        .prop_map(|v| v.into_iter().collect())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn every_chunking_gives_the_same_result(
            text in text_strategy(),
            stops in prop::collection::vec(text_strategy().prop_filter("non-empty", |s| !s.is_empty() && s.chars().count() <= 4), 1..4),
            include in any::<bool>(),
            sizes in prop::collection::vec(1usize..8, 1..6),
        ) {
            let stops: Vec<&str> = stops.iter().map(String::as_str).collect();
            let expected = reference(&text, &stops, include);
            prop_assert_eq!(&stream(&mut checker(&stops, include), &text, &sizes), &expected);
            prop_assert_eq!(&stream(&mut checker(&stops, include), &text, &[1]), &expected);
            prop_assert_eq!(&stream(&mut checker(&stops, include), &text, &[usize::MAX]), &expected);
        }
    }
}
